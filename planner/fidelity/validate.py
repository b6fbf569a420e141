"""Grouped cross-validation of the fidelity estimator.

Folds leave out one whole (family, recipe) group: the estimator must predict a recipe on a family
it was not fitted on for that recipe. Every label is scored for three feature sets: the full
variant (plan statistics + architecture + recipe), the prior variant (architecture + recipe, no
checkpoint) and a baseline that sees K/E alone. Scores:

regression   MAE, RMSE, Spearman over all held-out rows, the empirical coverage of the nominal
             80% intervals and their mean width, and Spearman within fixed K: over the plans of
             one (family, recipe, K), does the predicted order match the measured one? (A
             prediction constant within K, like the baseline's, ranks nothing: 0.)
classifier   AUC, Brier score (and the Brier score of the training base rate), accuracy, and the
             coverage of the interval on P(reproduced): the share of held-out groups whose observed
             reproduction rate lies within the group's mean interval.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy.stats import spearmanr
from sklearn.metrics import roc_auc_score

from planner.fidelity.estimator import FULL_FEATURES, LABELS, PRIOR_FEATURES, training_set
from planner.fidelity.learners import new_model

__all__ = ["VARIANTS", "cross_validate", "render_report"]

VARIANTS = {"full": FULL_FEATURES, "prior": PRIOR_FEATURES, "K/E only": ("kept_fraction",)}


def _rank_corr(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 3 or np.ptp(y) == 0:
        return float("nan")
    if np.ptp(x) == 0:
        return 0.0
    return float(spearmanr(x, y).statistic)


def _within_k(rows: list[dict], pred: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((r["family"], r["recipe"], r["experts"]), []).append(i)
    values = [_rank_corr(pred[idx], y[idx]) for idx in groups.values() if len(idx) >= 3]
    values = [v for v in values if math.isfinite(v)]
    return (float(np.mean(values)) if values else float("nan")), len(values)


def _folds(x: np.ndarray, y: np.ndarray, groups: list[str], label: str):
    """Held-out predictions (value, low, high) for every row, one fold per (family, recipe) group;
    each fold's model sees only the other groups' rows (and their groups, for its intervals)."""
    n = len(y)
    pred, low, high = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    base = np.full(n, np.nan)
    keys = np.array(groups)
    for group in sorted(set(groups)):
        test = keys == group
        train = ~test
        if train.sum() < 5 or (label == "fault_reproduced" and len(np.unique(y[train])) < 2):
            continue
        model = new_model(label).fit(x[train], y[train], groups=list(keys[train]))
        if label == "fault_reproduced":
            pred[test] = model.predict_proba(x[test])[:, 1]
            base[test] = y[train].mean()
        else:
            pred[test] = model.predict(x[test])
        low[test], high[test] = model.predict_interval(x[test])
    return pred, low, high, base


def _group_coverage(groups: list[str], y: np.ndarray, low: np.ndarray, high: np.ndarray) -> float:
    """For P(reproduced): share of held-out groups whose observed rate lies in their mean interval."""
    keys = np.array(groups)
    hits = [float(low[keys == g].mean() <= y[keys == g].mean() <= high[keys == g].mean()) for g in sorted(set(groups))]
    return float(np.mean(hits)) if hits else float("nan")


def cross_validate(rows: list[dict], variants: dict[str, tuple[str, ...]] = VARIANTS) -> dict[str, Any]:
    report: dict[str, Any] = {"rows": len(rows), "groups": sorted({f"{r['family']}/{r['recipe']}" for r in rows}), "labels": {}}
    for label in LABELS:
        report["labels"][label] = {}
        for variant, names in variants.items():
            used, x, y, groups = training_set(rows, label, names)
            if len(y) < 10:
                continue
            pred, low, high, base = _folds(x, y, groups, label)
            ok = np.isfinite(pred)
            if ok.sum() < 5:
                continue
            kept = [r for r, o in zip(used, ok) if o]
            kept_groups = [g for g, o in zip(groups, ok) if o]
            y, pred, low, high, base = y[ok], pred[ok], low[ok], high[ok], base[ok]
            within, n_groups = _within_k(kept, pred, y)
            scores: dict[str, Any] = {"n": int(ok.sum()), "spearman_within_k": within, "within_k_groups": n_groups,
                                      "interval_width": float(np.mean(high - low))}  # fmt: skip
            if label == "fault_reproduced":
                scores.update(
                    auc=float(roc_auc_score(y, pred)) if len(np.unique(y)) == 2 else float("nan"),
                    brier=float(np.mean((pred - y) ** 2)),
                    brier_base_rate=float(np.mean((base - y) ** 2)),
                    accuracy=float(np.mean((pred >= 0.5) == (y == 1))),
                    positive_rate=float(y.mean()),
                    coverage=_group_coverage(kept_groups, y, low, high),
                )
            else:
                scores.update(
                    mae=float(np.mean(np.abs(pred - y))),
                    rmse=float(np.sqrt(np.mean((pred - y) ** 2))),
                    spearman=_rank_corr(pred, y),
                    coverage=float(np.mean((y >= low) & (y <= high))),
                    label_mean=float(y.mean()),
                    label_std=float(y.std()),
                )
            report["labels"][label][variant] = scores
    return report


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "-" if not math.isfinite(v) else f"{v:.3f}"
    return str(v)


def render_report(report: dict[str, Any]) -> str:
    from planner.render import table

    lines = [f"grouped CV, leave one (family, recipe) group out: {report['rows']} rows, {len(report['groups'])} groups"]
    for label, by_variant in report["labels"].items():
        if not by_variant:
            lines.append(f"\n{label}: too few labelled rows")
            continue
        if label == "fault_reproduced":
            keys = ("n", "auc", "brier", "brier_base_rate", "accuracy", "positive_rate", "spearman_within_k", "coverage",
                    "interval_width")  # fmt: skip
        else:
            keys = ("n", "mae", "rmse", "spearman", "spearman_within_k", "coverage", "interval_width", "label_std")
        lines.append(f"\n{label}")
        lines.append(table(["variant", *keys], [[v, *(_fmt(s.get(k)) for k in keys)] for v, s in by_variant.items()]))
    return "\n".join(lines)
