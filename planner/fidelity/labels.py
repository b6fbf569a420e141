"""Fidelity labels from measured runs (DESIGN.md section 7), in order of weight.

margin ratio      |log2(critical_proxy / critical_original)| of the recipe's knob, the primary label:
                  how far pruning moved the point at which the fault appears. Knobs on a log10 scale
                  (learning rates, coefficients) convert with log2(10); knobs already in log2 or in
                  mantissa bits are log2 ratios as they stand. The original's spread over seeds is
                  the noise floor.
curve agreement   on per-step curves (log grad norm, entropy, log KL to the reference, reward, router
                  load CV) standardised by the original's own mean and spread over steps, the
                  proxy's RMS deviation from the original (same seed, same prompts) divided by a
                  replica's deviation (same prompts, other sampling seed): <= 1 tracks the original
                  within its own noise. Also the Spearman correlation of grad-norm curves.
fault reproduced  at the original's critical knob plus an offset, where the fault fires on the
                  original, does it fire on the proxy too. Static recipes read it off the proxy's
                  own critical knob (their probes are monotone in the knob); dynamic ones from the
                  proxy's curve run at that knob (only where the original's curve run faulted).
onset agreement   not labelled: it needs about 8 seeds per cell to beat the original's own onset
                  spread (the pilot), and the grid runs one curve seed and one replica.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["CURVES", "knob_scale", "margin_ratio", "curve_deviation", "curve_agreement", "spearman", "fault_reproduced"]

LOG10_KNOBS = {"entropy-collapse", "grad-blowup", "router-collapse"}
CURVES = (("grad_norm", True), ("entropy", False), ("kl_ref", True), ("reward_mean", False), ("load_cv_max", False))


def knob_scale(recipe: str) -> float:
    """log2 units per unit of the recipe's knob."""
    return math.log2(10) if recipe in LOG10_KNOBS else 1.0


def margin_ratio(recipe: str, critical_proxy: float, critical_original: float) -> float:
    return abs(critical_proxy - critical_original) * knob_scale(recipe)


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


def curve_agreement(proxy: list[dict], original: list[dict], replica: list[dict]) -> float:
    """Deviation of the proxy from the original over the replica's (noise floor) deviation."""
    noise = curve_deviation(replica, original, original)
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


def fault_reproduced(proxy_faults: bool, original_faults: bool) -> float:
    """Where the fault fires on the original, does it fire on the proxy too? NaN where the
    original does not fault (the question does not arise)."""
    return float(proxy_faults) if original_faults else float("nan")
