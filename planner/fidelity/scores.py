"""Scores of held-out shift predictions: MAE against the noise floor, coverage, Spearman within K,
AUC and Brier score of P(reproduced), and the paired MAE difference over held-out groups.
planner.fidelity.validate (the plan models) and planner.fidelity.job_validate (the job rows) score
with these; this module imports neither."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy.stats import spearmanr
from sklearn.metrics import roc_auc_score

__all__ = ["LEVEL", "paired_difference", "score_predictions"]

LEVEL = 0.90  # the paired interval of the MAE difference over held-out originals


def _rank_corr(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 3 or np.ptp(y) == 0:
        return float("nan")
    if np.ptp(x) == 0:
        return 0.0
    return float(spearmanr(x, y).statistic)


def _within_k(rows: list[dict], pred: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((r["original"], r["experts"]), []).append(i)
    values = [_rank_corr(pred[idx], y[idx]) for idx in groups.values() if len(idx) >= 3]
    values = [v for v in values if math.isfinite(v)]
    return (float(np.mean(values)) if values else float("nan")), len(values)


def paired_difference(full: dict[str, float], base: dict[str, float], level: float = LEVEL) -> tuple[float, float, float]:
    """Mean over held-out originals of (full MAE - baseline MAE) and its `level` interval: Student's
    t over the originals' paired differences (with few originals, the honest width)."""
    from scipy.stats import t

    groups = sorted(set(full) & set(base))
    d = np.array([full[g] - base[g] for g in groups])
    if d.size < 2:
        return (float(d.mean()) if d.size else math.nan), math.nan, math.nan
    half = float(t.ppf((1 + level) / 2, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size))
    return float(d.mean()), float(d.mean() - half), float(d.mean() + half)


def score_predictions(h: dict) -> dict[str, Any]:
    """Scores of held-out predictions `h` ({rows, key, pred, low, high, p, base}): see the module's docstring."""
    rows = h["rows"]
    ok = np.isfinite(h["pred"])
    if ok.sum() < 5:
        return {}
    kept = [r for r, o in zip(rows, ok) if o]
    y = np.array([r["shift_log2"] for r in kept])
    se = np.array([r.get("shift_se", np.nan) for r in kept], dtype=float)
    pred, low, high, p, base = (h[k][ok] for k in ("pred", "low", "high", "p", "base"))
    within, n_groups = _within_k(kept, pred, y)
    err = np.abs(pred - y)
    groups = np.array([str(r[h["key"]]) for r in kept])
    out: dict[str, Any] = {
        "n": int(ok.sum()),
        "mae": float(np.mean(err)),
        "mae_by_group": {g: float(err[groups == g].mean()) for g in sorted(set(groups))},
        "noise_mae": float(np.nanmean(se) * math.sqrt(2 / math.pi)),
        "rmse": float(np.sqrt(np.mean((pred - y) ** 2))),
        "spearman_within_k": within,
        "within_k_groups": n_groups,
        "coverage": float(np.mean((y >= low) & (y <= high))),
        "interval_width": float(np.mean(high - low)),
        "shift_mean": float(y.mean()),
        "shift_sd": float(y.std()),
    }
    outcome = np.array([r.get("reproduced", np.nan) for r in kept], dtype=float)
    decided = np.isfinite(outcome) & np.isfinite(base)
    out.update(decided=int(decided.sum()), positive_rate=float(outcome[decided].mean()) if decided.any() else float("nan"))
    if decided.sum() >= 5:
        t, pd, bd = outcome[decided], p[decided], base[decided]
        out.update(auc=float(roc_auc_score(t, pd)) if len(np.unique(t)) == 2 else float("nan"), brier=float(np.mean((pd - t) ** 2)),
                   brier_base_rate=float(np.mean((bd - t) ** 2)))  # fmt: skip
    return out
