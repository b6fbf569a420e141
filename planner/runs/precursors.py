"""Precursors: signals that the literature and the trainers' own documentation report before a
collapse, read from the same canonical metrics as the faults (planner/runs/metrics.yaml). A
precursor is not a fault: `planner detect` lists them next to the fault, each with the trainer key it
read, its rule and its threshold, so a user sees what was building up before the step that failed.

| precursor | metric | fires at the first step where | threshold's source |
|---|---|---|---|
| is-weight-spread | is_weight_std, is_ess | the importance weights' SD exceeds 1.0, or their effective sample size falls below 0.3 | verl docs/algo/rollout_corr.md (troubleshooting: "High spread in IS weights") |
| is-weight-mean | is_weight_mean | the mean importance weight leaves [0.5, 2.0] | verl docs/algo/rollout_corr.md ("Mean IS weight far from 1.0") |
| chi2-divergence | chi2_token | the token-level chi-squared divergence of the weights exceeds 1.0 | verl docs/algo/rollout_corr.md (its health check) |
| clip-burst | clip_frac | after its first 5 finite values, the clipped share exceeds 3 x their median and 0.1 | planner's own (no trainer documents one) |
| entropy-slope | entropy | the entropy has fallen by 30% or more over the last 5 logged steps | planner's own: a steady fall before entropy-collapse's 0.2 x start |
| mismatch-growth | mismatch_k3 | the k3 mismatch has grown 3 steps running and passed a tenth of the rollout-mismatch fault's 0.01 | planner's own: the approach to that fault's line |
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from planner.runs.detect import BASE_STEPS, THRESHOLDS, Finding, Signals, _baseline, _first, _found, _has, _missing, _none

__all__ = ["PRECURSORS", "PRECURSOR_THRESHOLDS", "precursors"]

PRECURSOR_THRESHOLDS = {
    "is-weight-std": 1.0,  # verl docs/algo/rollout_corr.md
    "is-ess": 0.3,  # verl docs/algo/rollout_corr.md
    "is-weight-mean": (0.5, 2.0),  # verl docs/algo/rollout_corr.md
    "chi2-token": 1.0,  # verl docs/algo/rollout_corr.md
    "clip-burst": 3.0,  # x the median of the first BASE_STEPS finite values (planner's own)
    "clip-floor": 0.1,  # and at least this share of tokens clipped (planner's own)
    "entropy-drop": 0.3,  # share of the entropy lost over ENTROPY_WINDOW steps (planner's own)
    "mismatch-rise": 3,  # consecutive rising steps (planner's own)
}
ENTROPY_WINDOW = 5


def is_weight_spread(steps: np.ndarray, m: Signals) -> Finding:
    std_limit, ess_limit = PRECURSOR_THRESHOLDS["is-weight-std"], PRECURSOR_THRESHOLDS["is-ess"]
    hits = []
    if _has(m, "is_weight_std"):
        v = np.asarray(m["is_weight_std"], dtype=float)
        hits.append((_first(v > std_limit), "is_weight_std", v, std_limit))
    if _has(m, "is_ess"):
        v = np.asarray(m["is_ess"], dtype=float)
        hits.append((_first(v < ess_limit), "is_ess", v, ess_limit))
    if not hits:
        return _missing("is-weight-spread", "is_weight_std or is_ess")
    rule = f"importance-weight SD above {std_limit:g}, or effective sample size below {ess_limit:g} of the tokens"
    fired = [h for h in hits if h[0] is not None]
    if not fired:
        return _none("is-weight-spread", ", ".join(h[1] for h in hits), rule)
    i, name, v, limit = min(fired, key=lambda h: h[0])
    return _found("is-weight-spread", steps, v, i, name, rule, limit)


def is_weight_mean(steps: np.ndarray, m: Signals) -> Finding:
    if not _has(m, "is_weight_mean"):
        return _missing("is-weight-mean", "is_weight_mean")
    lo, hi = PRECURSOR_THRESHOLDS["is-weight-mean"]
    v = np.asarray(m["is_weight_mean"], dtype=float)
    rule = f"mean importance weight outside [{lo:g}, {hi:g}]"
    i = _first((v < lo) | (v > hi))
    return _none("is-weight-mean", "is_weight_mean", rule) if i is None else _found("is-weight-mean", steps, v, i, "is_weight_mean", rule)


def chi2_divergence(steps: np.ndarray, m: Signals) -> Finding:
    if not _has(m, "chi2_token"):
        return _missing("chi2-divergence", "chi2_token")
    limit = PRECURSOR_THRESHOLDS["chi2-token"]
    v = np.asarray(m["chi2_token"], dtype=float)
    rule = f"token-level chi-squared divergence of the importance weights above {limit:g}"
    i = _first(v > limit)
    return _none("chi2-divergence", "chi2_token", rule, limit) if i is None else _found("chi2-divergence", steps, v, i, "chi2_token", rule, limit)


def clip_burst(steps: np.ndarray, m: Signals) -> Finding:
    if not _has(m, "clip_frac"):
        return _missing("clip-burst", "clip_frac")
    factor, floor = PRECURSOR_THRESHOLDS["clip-burst"], PRECURSOR_THRESHOLDS["clip-floor"]
    v = np.asarray(m["clip_frac"], dtype=float)
    base, after = _baseline(v, v)
    if base is None:
        return _none("clip-burst", "clip_frac", f"needs more than {BASE_STEPS} finite values")
    limit = max(factor * base, floor)
    rule = f"clipped share above {factor:g} x its median over its first {BASE_STEPS} finite values and above {floor:g}"
    i = _first(np.r_[np.zeros(after, bool), v[after:] > limit])
    return _none("clip-burst", "clip_frac", rule, limit, base) if i is None else _found("clip-burst", steps, v, i, "clip_frac", rule, limit, base)


def entropy_slope(steps: np.ndarray, m: Signals) -> Finding:
    if not _has(m, "entropy"):
        return _missing("entropy-slope", "entropy")
    drop = PRECURSOR_THRESHOLDS["entropy-drop"]
    v = np.asarray(m["entropy"], dtype=float)
    rule = f"entropy down {drop:.0%} or more over the last {ENTROPY_WINDOW} logged steps"
    finite = np.flatnonzero(np.isfinite(v))
    for n in range(ENTROPY_WINDOW, len(finite)):
        i, j = finite[n], finite[n - ENTROPY_WINDOW]
        if v[j] > 0 and v[i] <= (1.0 - drop) * v[j]:
            return _found("entropy-slope", steps, v, int(i), "entropy", rule, (1.0 - drop) * float(v[j]), float(v[j]))
    return _none("entropy-slope", "entropy", rule)


def mismatch_growth(steps: np.ndarray, m: Signals) -> Finding:
    if not _has(m, "mismatch_k3"):
        return _missing("mismatch-growth", "mismatch_k3")
    runs, floor = PRECURSOR_THRESHOLDS["mismatch-rise"], 0.1 * THRESHOLDS["rollout-mismatch"]
    v = np.asarray(m["mismatch_k3"], dtype=float)
    rule = f"k3 mismatch rising {runs} steps running and above {floor:g} (a tenth of the rollout-mismatch fault's line)"
    rising = 0
    for i in range(1, len(v)):
        rising = rising + 1 if np.isfinite(v[i]) and np.isfinite(v[i - 1]) and v[i] > v[i - 1] else 0
        if rising >= runs and v[i] > floor:
            return _found("mismatch-growth", steps, v, i, "mismatch_k3", rule, floor)
    return _none("mismatch-growth", "mismatch_k3", rule, floor)


PRECURSORS: dict[str, Callable[[np.ndarray, Signals], Finding]] = {
    "is-weight-spread": is_weight_spread,
    "is-weight-mean": is_weight_mean,
    "chi2-divergence": chi2_divergence,
    "clip-burst": clip_burst,
    "entropy-slope": entropy_slope,
    "mismatch-growth": mismatch_growth,
}


def precursors(steps: np.ndarray, signals: Signals, ideal: Mapping[str, float] | None = None) -> list[Finding]:
    """Every precursor's finding, in PRECURSORS order."""
    steps = np.asarray(steps).astype(int)
    return [fn(steps, signals) for fn in PRECURSORS.values()]
