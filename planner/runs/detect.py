"""Fault signatures in a run's step metrics: which fault, from which step, on what evidence.

The detectors read canonical metrics (planner/runs/metrics.yaml), so one rule serves the calibration
recipes (planner.rl.recipes calls them on the harness's runs) and any trainer's logs. Rules and
thresholds, fixed before any proxy ran and never tuned per model:

| fault | metric | fires at the first step where |
|---|---|---|
| fp16-overflow | overflow | an fp16 gradient overflowed (the step was skipped), or the loss scale dropped |
| non-finite | grad_norm, loss, nonfinite | the grad norm or the loss was logged as NaN or infinite (a step that did not log it is not; a null in verl's file logger or an empty cell in a pandas CSV at a training step is a NaN written that way), or the trainer flagged a skipped non-finite update |
| grad-blowup | grad_norm | after its first 5 finite values, the grad norm exceeds 5 x their median |
| entropy-collapse | entropy | the entropy falls below 0.2 x its first logged value |
| rollout-mismatch | mismatch_k3; else mismatch_prob_ratio; else mismatch_prob_diff | the k3 KL(rollout ‖ train) per token exceeds 0.01; NeMo RL's multiplicative token probability error exceeds 1.05 (its documented line); verl's mean probability difference (no absolute scale): after its first 5 finite values, it exceeds 5 x their median |
| kl-blowup | kl_ref | after step 5, the KL to the reference jumps above 10 x the median of the 5 steps before it (and above 0.001) |
| reward-collapse | reward_mean | after the first 5 steps, the 3-step rolling mean falls below its running peak minus half of max(abs(peak), peak - median of the first 5 steps) |
| router-collapse | collapse_max | the normalised top-k share of some MoE layer exceeds 0.9 (90% of the way from balanced to collapsed) |

A detector whose metric the run did not log says so ("not logged") rather than "no fault".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

__all__ = ["Finding", "DETECTORS", "detect", "first_fault", "onset_of", "signals_of", "THRESHOLDS"]

THRESHOLDS = {
    "rollout-mismatch": 0.01,  # k3 KL per token
    "entropy-collapse": 0.2,  # share of the first step's entropy
    "grad-blowup": 5.0,  # x the median of the first BASE_STEPS steps
    "router-collapse": 0.9,  # normalised top-k share
    "kl-blowup": 10.0,  # x the median of the preceding BASE_STEPS steps
    "mismatch-blowup": 5.0,  # x the median of the first BASE_STEPS steps (mismatch metrics without a scale)
    # NeMo RL's token_mult_prob_error: "when this metric exceeds 1.05, we consider it indicative of a potential
    # framework issue" (NeMo RL docs/guides/dtensor-tp-accuracy.md; nemo_rl/algorithms/grpo.py flags > 1.05)
    "mismatch-ratio": 1.05,
    "reward-collapse": 0.5,  # share of the peak's scale lost
}
BASE_STEPS = 5
KL_FLOOR = 0.1  # nats per token: below it a jump is sampling noise of a near-zero KL (seen: 100x swings under 0.01)
EVIDENCE = (3, 2)  # steps shown before and after the onset

Signals = Mapping[str, np.ndarray]  # canonical metric -> values aligned with `steps`


@dataclass(frozen=True)
class Finding:
    fault: str
    onset: int | None  # the step (as logged); None: not found
    metric: str | None = None  # the canonical metric that showed it
    rule: str = ""
    threshold: float | None = None
    baseline: float | None = None
    evidence: list[tuple[int, float]] = field(default_factory=list)  # (step, value) around the onset
    logged: bool = True  # False: none of the detector's metrics was in the run

    def to_json(self) -> dict:
        clean = lambda v: None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v  # noqa: E731
        return {"fault": self.fault, "onset_step": self.onset, "metric": self.metric, "rule": self.rule, "logged": self.logged,
                "threshold": clean(self.threshold), "baseline": clean(self.baseline),
                "evidence": [{"step": s, "value": v if math.isfinite(v) else str(v)} for s, v in self.evidence]}  # fmt: skip


def _has(m: Signals, name: str) -> bool:
    return name in m and bool(np.isfinite(np.asarray(m[name], dtype=float)).any() or np.isinf(np.asarray(m[name], dtype=float)).any())


def _found(fault, steps, values, i, metric, rule, threshold=None, baseline=None) -> Finding:
    lo, hi = max(0, i - EVIDENCE[0]), min(len(steps), i + EVIDENCE[1] + 1)
    ev = [(int(steps[j]), float(values[j])) for j in range(lo, hi)]
    return Finding(fault, int(steps[i]), metric, rule, threshold, baseline, ev)


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _missing(fault: str, metrics: str) -> Finding:
    return Finding(fault, None, None, f"needs {metrics}", logged=False)


def _none(fault: str, metric: str, rule: str, threshold=None, baseline=None) -> Finding:
    return Finding(fault, None, metric, rule, threshold, baseline)


def overflow(steps: np.ndarray, m: Signals) -> Finding:
    if _has(m, "overflow"):
        v = np.asarray(m["overflow"], dtype=float)
        i = _first(v > 0)
        rule = "an fp16 overflow skipped the step"
        return _none("fp16-overflow", "overflow", rule) if i is None else _found("fp16-overflow", steps, v, i, "overflow", rule)
    if _has(m, "loss_scale_log2"):
        v = np.asarray(m["loss_scale_log2"], dtype=float)
        drop = np.r_[False, np.diff(v) < 0]
        i = _first(drop)
        rule = "the fp16 loss scale dropped (a dynamic scaler halves it on overflow)"
        return _none("fp16-overflow", "loss_scale_log2", rule) if i is None else _found("fp16-overflow", steps, v, i, "loss_scale_log2", rule)
    return _missing("fp16-overflow", "overflow or loss_scale_log2")


def _logged_nonfinite(m: Signals, name: str) -> bool:
    """The reader saw NAME logged as NaN/inf at some step (a metric NaN from its first step is there)."""
    flags = m.get(f"{name}:logged_nonfinite")
    return flags is not None and bool(np.asarray(flags, dtype=bool).any())


def nonfinite(steps: np.ndarray, m: Signals) -> Finding:
    names = [n for n in ("grad_norm", "loss", "nonfinite") if _has(m, n) or _logged_nonfinite(m, n)]
    if not names:
        return _missing("non-finite", "grad_norm, loss or nonfinite")
    hits = []
    for n in names:
        v = np.asarray(m[n], dtype=float)
        # a reader that knows which values were logged (not merely missing) passes NAME:logged_nonfinite
        bad = v > 0 if n == "nonfinite" else np.asarray(m.get(f"{n}:logged_nonfinite", ~np.isfinite(v)), dtype=bool)
        i = _first(bad)
        if i is not None:
            hits.append((i, n, v))
    rule = "the grad norm or loss is NaN/inf, or an update was skipped as non-finite"
    if not hits:
        return _none("non-finite", ", ".join(names), rule)
    i, n, v = min(hits, key=lambda h: h[0])
    return _found("non-finite", steps, v, i, n, rule)


def grad_blowup(steps: np.ndarray, m: Signals, threshold: float | None = None) -> Finding:
    threshold = THRESHOLDS["grad-blowup"] if threshold is None else threshold
    if not _has(m, "grad_norm"):
        return _missing("grad-blowup", "grad_norm")
    v = np.asarray(m["grad_norm"], dtype=float)
    rule = f"grad norm above {threshold:g} x the median of its first {BASE_STEPS} finite values, after them"
    base, after = _baseline(v, v)
    if base is None:
        return _none("grad-blowup", "grad_norm", f"needs more than {BASE_STEPS} finite values")
    i = _first(np.r_[np.zeros(after, bool), v[after:] > threshold * base])
    if i is None:
        return _none("grad-blowup", "grad_norm", rule, threshold * base, base)
    return _found("grad-blowup", steps, v, i, "grad_norm", rule, threshold * base, base)


def _baseline(values: np.ndarray, dist: np.ndarray) -> tuple[float | None, int]:
    """The median of `dist` over the first BASE_STEPS steps where `values` is finite, and the index
    after them (None where there are not more finite values than that): a step logged without the
    metric, or as NaN, is no part of a baseline."""
    finite = np.flatnonzero(np.isfinite(values))
    if len(finite) <= BASE_STEPS:
        return None, len(values)
    return float(np.median(dist[finite[:BASE_STEPS]])), int(finite[BASE_STEPS - 1]) + 1


def entropy_collapse(steps: np.ndarray, m: Signals, threshold: float | None = None) -> Finding:
    threshold = THRESHOLDS["entropy-collapse"] if threshold is None else threshold
    if not _has(m, "entropy"):
        return _missing("entropy-collapse", "entropy")
    v = np.asarray(m["entropy"], dtype=float)
    start = float(v[np.flatnonzero(np.isfinite(v))[0]])
    rule = f"entropy below {threshold:g} x its first value"
    i = _first(v < threshold * start)
    if i is None:
        return _none("entropy-collapse", "entropy", rule, threshold * start, start)
    return _found("entropy-collapse", steps, v, i, "entropy", rule, threshold * start, start)


def rollout_mismatch(steps: np.ndarray, m: Signals, threshold: float | None = None, ideal: Mapping[str, float] | None = None) -> Finding:
    threshold = THRESHOLDS["rollout-mismatch"] if threshold is None else threshold
    if _has(m, "mismatch_k3"):
        v = np.asarray(m["mismatch_k3"], dtype=float)
        rule = f"k3 KL(rollout || train) per token above {threshold:g}"
        i = _first(v > threshold)
        return _none("rollout-mismatch", "mismatch_k3", rule, threshold) if i is None else \
            _found("rollout-mismatch", steps, v, i, "mismatch_k3", rule, threshold)  # fmt: skip
    if _has(m, "mismatch_prob_ratio"):  # NeMo RL's token_mult_prob_error: 1 is a perfect match, it documents 1.05 as the line
        v = np.asarray(m["mismatch_prob_ratio"], dtype=float)
        limit = THRESHOLDS["mismatch-ratio"]
        rule = f"multiplicative token probability error above {limit:g} (NeMo RL's documented line)"
        i = _first(v > limit)
        return _none("rollout-mismatch", "mismatch_prob_ratio", rule, limit) if i is None else \
            _found("rollout-mismatch", steps, v, i, "mismatch_prob_ratio", rule, limit)  # fmt: skip
    if _has(m, "mismatch_prob_diff"):
        v = np.asarray(m["mismatch_prob_diff"], dtype=float)
        dist = np.abs(v - (ideal or {}).get("mismatch_prob_diff", 0.0))
        return _blowup("rollout-mismatch", steps, v, dist, "mismatch_prob_diff", THRESHOLDS["mismatch-blowup"])
    return _missing("rollout-mismatch", "mismatch_k3, mismatch_prob_diff or mismatch_prob_ratio")


def _blowup(fault, steps, values, dist, name, factor) -> Finding:
    base, after = _baseline(values, dist)
    if base is None:
        return _none(fault, name, f"needs more than {BASE_STEPS} finite values")
    rule = f"distance from ideal above {factor:g} x its median over its first {BASE_STEPS} finite values"
    i = _first(np.r_[np.zeros(after, bool), dist[after:] > factor * base])
    return _none(fault, name, rule, factor * base, base) if i is None else _found(fault, steps, values, i, name, rule, factor * base, base)


def kl_blowup(steps: np.ndarray, m: Signals) -> Finding:
    if not _has(m, "kl_ref"):
        return _missing("kl-blowup", "kl_ref")
    v = np.asarray(m["kl_ref"], dtype=float)
    factor = THRESHOLDS["kl-blowup"]
    rule = f"KL to the reference above {factor:g} x the median of the {BASE_STEPS} steps before (and above {KL_FLOOR:g})"
    for i in range(BASE_STEPS, len(v)):
        base = float(np.nanmedian(v[i - BASE_STEPS:i]))
        if np.isfinite(v[i]) and v[i] > max(factor * base, KL_FLOOR):
            return _found("kl-blowup", steps, v, i, "kl_ref", rule, max(factor * base, KL_FLOOR), base)
    return _none("kl-blowup", "kl_ref", rule)


def reward_collapse(steps: np.ndarray, m: Signals) -> Finding:
    if not _has(m, "reward_mean"):
        return _missing("reward-collapse", "reward_mean")
    v = np.asarray(m["reward_mean"], dtype=float)
    share = THRESHOLDS["reward-collapse"]
    rule = f"3-step mean below its running peak minus {share:g} x max(|peak|, peak - start)"
    if len(v) <= BASE_STEPS:
        return _none("reward-collapse", "reward_mean", f"needs more than {BASE_STEPS} steps")
    start = float(np.nanmedian(v[:BASE_STEPS]))
    rolling = np.array([np.nanmean(v[max(0, i - 2):i + 1]) for i in range(len(v))])
    peak = -math.inf
    for i in range(len(v)):
        peak = max(peak, rolling[i]) if np.isfinite(rolling[i]) else peak
        if i < BASE_STEPS or not np.isfinite(rolling[i]):
            continue
        floor = peak - share * max(abs(peak), peak - start)
        if rolling[i] < floor:
            return _found("reward-collapse", steps, v, i, "reward_mean", rule, floor, peak)
    return _none("reward-collapse", "reward_mean", rule, baseline=start)


def router_collapse(steps: np.ndarray, m: Signals, threshold: float | None = None) -> Finding:
    threshold = THRESHOLDS["router-collapse"] if threshold is None else threshold
    if not _has(m, "collapse_max"):
        return _missing("router-collapse", "collapse_max (routing statistics per MoE layer)")
    v = np.asarray(m["collapse_max"], dtype=float)
    rule = f"normalised top-k share of some MoE layer above {threshold:g}"
    i = _first(v > threshold)
    return _none("router-collapse", "collapse_max", rule, threshold) if i is None else \
        _found("router-collapse", steps, v, i, "collapse_max", rule, threshold)  # fmt: skip


# in order of precedence when two fire at the same step (the more specific cause first)
DETECTORS: dict[str, Callable[..., Finding]] = {
    "fp16-overflow": overflow,
    "non-finite": nonfinite,
    "router-collapse": router_collapse,
    "rollout-mismatch": rollout_mismatch,
    "entropy-collapse": entropy_collapse,
    "grad-blowup": grad_blowup,
    "kl-blowup": kl_blowup,
    "reward-collapse": reward_collapse,
}


def signals_of(rows: list[dict]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(steps, canonical metric -> values) of rows of canonical metrics (a harness run's rows)."""
    keys = {k for r in rows for k in r}
    steps = np.array([r.get("step", i) for i, r in enumerate(rows)], dtype=float).astype(int)
    return steps, {k: np.array([r.get(k, math.nan) for r in rows], dtype=float) for k in keys if k != "step"}


def onset_of(fault: str, rows: list[dict], **kwargs) -> int | None:
    """The onset step of one detector on rows of canonical metrics (the recipes' harness runs)."""
    if not rows:
        return None
    steps, m = signals_of(rows)
    return DETECTORS[fault](steps, m, **kwargs).onset


def detect(steps: np.ndarray, signals: Signals, ideal: Mapping[str, float] | None = None) -> list[Finding]:
    """Every detector's finding, in DETECTORS order."""
    steps = np.asarray(steps).astype(int)
    out = []
    for name, fn in DETECTORS.items():
        out.append(fn(steps, signals, ideal=ideal) if name == "rollout-mismatch" else fn(steps, signals))
    return out


def first_fault(findings: list[Finding]) -> Finding | None:
    """The fault that showed first (ties: DETECTORS order), or None."""
    fired = [f for f in findings if f.onset is not None]
    order = list(DETECTORS)
    return min(fired, key=lambda f: (f.onset, order.index(f.fault))) if fired else None
