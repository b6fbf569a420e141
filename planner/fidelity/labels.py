"""Fidelity labels from measured runs (docs/fidelity-labels.md section "Labels"), in order of weight.

shift             the primary label: the proxy's critical knob minus the original's, both the mean
                  over at least 4 seeds, in log2 units of the knob (log10 knobs x log2 10; loss
                  scales already log2; mantissa bits as they are). Signed: a proxy that faults
                  earlier than the original has a negative shift. Also divided by the original's
                  seed SD (`shift_sd`), which is the noise floor of one (original, recipe).
reproduced        a two-sided equivalence decision (two one-sided tests, each at 5%): the 90%
                  interval of the shift (Welch, the original's and the proxy's seed spreads) inside
                  +-TOLERANCE_LOG2 is "reproduced", entirely outside it "not reproduced", anything
                  else "undetermined" (the seeds are too noisy to say). TOLERANCE_LOG2 = 1: the
                  proxy faults within a factor of two of the original's knob.
not applicable    a (recipe, K) where the fault cannot occur at all: router collapse when every token
                  already uses every kept expert (K <= top_k).
curve agreement   on per-step curves (log grad norm, entropy, log KL to the reference, reward, router
                  load CV) standardised by the original's own spread over steps, the proxy's RMS
                  deviation from the original (same seed, same prompts) over the mean deviation of
                  the original's replicas (same prompts, other sampling seeds): <= 1 tracks the
                  original within its own noise. Also the Spearman correlation of grad-norm curves.
onset agreement   not labelled: it needs about 8 seeds per cell to beat the original's own onset
                  spread (the pilot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CURVES", "TOLERANCE_LOG2", "CONFIDENCE", "OUTCOMES", "knob_scale", "applicable", "Shift", "knob_shift",
    "curve_deviation", "curve_agreement", "spearman",
]  # fmt: skip

LOG10_KNOBS = {"entropy-collapse", "grad-blowup", "router-collapse"}
CURVES = (("grad_norm", True), ("entropy", False), ("kl_ref", True), ("reward_mean", False), ("load_cv_max", False))
TOLERANCE_LOG2 = 1.0  # equivalence margin: the proxy's critical knob within a factor of two of the original's
CONFIDENCE = 0.90  # two one-sided tests at 5% each
OUTCOMES = ("reproduced", "not reproduced", "undetermined", "not applicable")


def knob_scale(recipe: str) -> float:
    """log2 units per unit of the recipe's knob."""
    return math.log2(10) if recipe in LOG10_KNOBS else 1.0


def applicable(recipe: str, experts: int, top_k: int) -> bool:
    """Can the recipe's fault occur at all on a proxy with `experts` routed experts per layer?
    Router collapse needs a choice of experts: with K <= top_k every token uses every expert."""
    return not (recipe == "router-collapse" and experts <= top_k)


@dataclass(frozen=True)
class Shift:
    """The signed shift of the critical knob, proxy minus original, in log2 units, and its decision."""

    shift: float  # log2 units
    noise: float  # the original's seed SD, log2 units (the noise floor)
    se: float  # standard error of the shift (Welch), log2 units
    low: float  # CONFIDENCE interval of the shift
    high: float
    outcome: str  # one of OUTCOMES
    censored: bool  # some seed found no crossing inside the bracket: the mean is a bound

    @property
    def shift_sd(self) -> float:
        return self.shift / self.noise if self.noise > 0 else float("nan")

    def to_row(self) -> dict:
        return {"shift_log2": self.shift, "shift_sd": self.shift_sd, "noise_log2": self.noise, "shift_se": self.se,
                "shift_low": self.low, "shift_high": self.high, "outcome": self.outcome, "censored": int(self.censored),
                "reproduced": {"reproduced": 1.0, "not reproduced": 0.0}.get(self.outcome, float("nan"))}  # fmt: skip


def _decide(low: float, high: float, tolerance: float) -> str:
    if -tolerance < low and high < tolerance:
        return "reproduced"
    if low > tolerance or high < -tolerance:
        return "not reproduced"
    return "undetermined"


def knob_shift(recipe: str, original: list[float], proxy: list[float], *, original_censored=(), proxy_censored=(),
               resolution: float = 0.0, tolerance: float = TOLERANCE_LOG2) -> Shift:  # fmt: skip
    """The shift label from per-seed critical knobs (knob units) of the original and the proxy.

    Seed SDs below the bisection resolution (knob units) are raised to it: a spread the bisection
    cannot see is not zero noise. A censored side is a bound: its decision stands only where the
    bound itself settles it (a proxy that never faults inside the bracket while the original does
    is "not reproduced" once that bound is beyond the tolerance); otherwise "undetermined"."""
    from scipy.stats import t as student_t

    scale = knob_scale(recipe)
    o, p = np.asarray(original, dtype=float) * scale, np.asarray(proxy, dtype=float) * scale
    censored = any(original_censored) or any(proxy_censored)
    if len(o) < 2 or len(p) < 2:  # one seed measures no noise: the shift stands, nothing can be decided
        nan = float("nan")
        return Shift(float(p.mean() - o.mean()), nan, nan, nan, nan, "undetermined", censored)
    floor = resolution * scale
    so, sp = max(float(np.std(o, ddof=1)), floor), max(float(np.std(p, ddof=1)), floor)
    vo, vp = so**2 / len(o), sp**2 / len(p)
    se = math.sqrt(vo + vp)
    df = (vo + vp) ** 2 / (vo**2 / (len(o) - 1) + vp**2 / (len(p) - 1)) if se > 0 else len(o) + len(p) - 2
    half = float(student_t.ppf(0.5 + CONFIDENCE / 2, df)) * se
    shift = float(p.mean() - o.mean())
    low, high = shift - half, shift + half
    outcome = _decide(low, high, tolerance)
    # the original's value as a bound settles nothing; a censored proxy sits at the bracket's end, on
    # the side its bound points to, so a "not reproduced" read off the bound holds for the truth
    if any(original_censored) or (censored and outcome != "not reproduced"):
        outcome = "undetermined"
    return Shift(shift, so, se, low, high, outcome, censored)


def _series(rows: list[dict], key: str, log: bool) -> np.ndarray:
    values = np.array([r.get(key, np.nan) for r in rows], dtype=float)
    if log:
        values = np.log(np.clip(values, 1e-12, None))
    return values


def curve_deviation(a: list[dict], b: list[dict], reference: list[dict]) -> float:
    """RMS difference of standardised curves of runs a and b, averaged over the curves; the
    standardisation (mean and std over steps) is the reference run's."""
    n = min(len(a), len(b), len(reference))
    devs = []
    for key, log in CURVES:
        ref = _series(reference[:n], key, log)
        x, y = _series(a[:n], key, log), _series(b[:n], key, log)
        ok = np.isfinite(x) & np.isfinite(y) & np.isfinite(ref)
        if ok.sum() < 3:
            continue
        scale = np.std(ref[ok]) or 1.0
        devs.append(float(np.sqrt(np.mean(((x[ok] - y[ok]) / scale) ** 2))))
    return float(np.mean(devs)) if devs else float("nan")


def curve_agreement(proxy: list[dict], original: list[dict], replicas: list[list[dict]]) -> float:
    """Deviation of the proxy from the original over the replicas' mean deviation (the noise floor)."""
    if not replicas:
        raise ValueError("curve agreement needs at least one replica of the original")
    noise = float(np.mean([curve_deviation(r, original, original) for r in replicas]))
    return curve_deviation(proxy, original, original) / max(noise, 1e-9)


def spearman(a: list[dict], b: list[dict], key: str = "grad_norm") -> float:
    """Spearman correlation of two runs' curves (ties ranked by their average); NaN when either
    curve is constant or fewer than 3 steps are finite in both."""
    from scipy.stats import spearmanr

    n = min(len(a), len(b))
    x = np.array([r[key] for r in a[:n]], dtype=float)
    y = np.array([r[key] for r in b[:n]], dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return float("nan")
    return float(spearmanr(x[ok], y[ok]).statistic)
