"""Validation of the fidelity estimator on held-out originals and held-out families.

For each recipe and each scheme (leave one original out; leave one family out) every fold refits
the full shift model and its baselines (K/E alone; the recipe's mean shift; where the full model
knows the routing type, K/E with the routing type) on the other groups and predicts the held-out
group's rows. Scores, per recipe and variant:

shift        MAE of the signed shift (log2 units), next to the noise floor: the MAE that measurement
             noise alone would give, sqrt(2/pi) x the rows' standard error of the shift; RMSE;
             Spearman within K (over the plans of one original and K: does the predicted order match
             the measured one? a prediction constant within K ranks nothing: 0); the coverage of
             the nominal 80% interval and its mean width.
reproduced   AUC and Brier score of P(reproduced) on rows whose equivalence decision was made
             (reproduced or not; undetermined rows are left out), against the Brier score of the
             training folds' base rate.

The skill gate (skill_gate) reads the leave-one-original-out scores: the full model has skill on a
recipe when, against K/E alone and against K/E with the routing type where that baseline exists, its
shift MAE is at least 10% lower overall and lower on a majority of the held-out originals, and its
AUC is not lower where both are defined: the skill is then the plan's, not the routing type's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy.stats import spearmanr
from sklearn.metrics import roc_auc_score

from planner.fidelity.estimator import baselines, design, fit_shift, recipe_features, training_rows

__all__ = ["variants", "SCHEMES", "cross_validate", "skill_gate", "render_report", "score_predictions"]

MIN_GAIN = 0.10  # the skill gate asks for a shift MAE at least 10% below K/E alone's
SCHEMES = {"original": "original", "family": "family"}  # scheme -> the row key that names a held-out group


def variants(recipe: str) -> dict[str, tuple[str, ...]]:
    """The full model and its baselines: variant -> feature names."""
    return {"full": recipe_features(recipe), **baselines(recipe)}


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


def _held_out(rows: list[dict], recipe: str, names: tuple[str, ...], key: str, tolerance: float) -> dict[str, np.ndarray]:
    """Held-out predictions for every row of the recipe (those with the full model's features, so that
    every variant scores the same rows), one fold per group."""
    used = training_rows(rows, recipe, recipe_features(recipe))
    n = len(used)
    out = {k: np.full(n, np.nan) for k in ("pred", "low", "high", "p", "base")}
    keys = np.array([str(r[key]) for r in used])
    for group in sorted(set(keys)):
        test = keys == group
        train = [r for r, t in zip(used, test) if not t]
        model = fit_shift(train, recipe, names)
        if model is None:
            continue
        x = design([r for r, t in zip(used, test) if t], names)
        out["pred"][test] = model.predict(x)
        out["low"][test], out["high"][test] = model.predict_interval(x)
        out["p"][test] = model.p_within(x, tolerance)[0]
        decided = [r["reproduced"] for r in train if math.isfinite(r.get("reproduced", math.nan))]
        out["base"][test] = np.mean(decided) if decided else np.nan
    out["rows"], out["key"] = used, key
    return out


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


def cross_validate(rows: list[dict], schemes: tuple[str, ...] = tuple(SCHEMES), tolerance: float | None = None) -> dict[str, Any]:
    """{rows, recipes: {recipe: {scheme: {variant: scores}}}} (see the module's docstring)."""
    from planner.fidelity.labels import TOLERANCE_LOG2

    tolerance = TOLERANCE_LOG2 if tolerance is None else tolerance
    report: dict[str, Any] = {"rows": len(rows), "tolerance_log2": tolerance, "recipes": {}}
    for recipe in sorted({r["recipe"] for r in rows}):
        entry: dict[str, Any] = {}
        used = training_rows(rows, recipe, recipe_features(recipe))
        for scheme in schemes:
            key = SCHEMES[scheme]
            groups = {str(r[key]) for r in used}
            if len(groups) < 2:
                entry[scheme] = {"groups": len(groups)}
                continue
            entry[scheme] = {"groups": len(groups), "variants": {v: score_predictions(_held_out(rows, recipe, names, key, tolerance))
                                                                 for v, names in variants(recipe).items()}}  # fmt: skip
        outcomes = [r.get("outcome") for r in rows if r["recipe"] == recipe]
        entry["outcomes"] = {o: outcomes.count(o) for o in sorted({str(o) for o in outcomes})}
        report["recipes"][recipe] = entry
    return report


def skill_gate(report: dict[str, Any], recipe: str) -> dict[str, Any]:
    """Does the full model beat K/E alone (and K/E with the routing type, where that baseline is
    scored) on held-out originals? Against each, its shift MAE must be at least MIN_GAIN lower
    overall and lower on a majority of the held-out originals (so that one original does not carry
    it), and its AUC not lower where both are defined."""
    scores = report["recipes"].get(recipe, {}).get("original", {}).get("variants")
    if not scores or not scores.get("full") or not scores.get("K/E only"):
        return {"skill": False, "reason": f"{recipe}: too few originals or rows to validate on held-out originals"}
    full = scores["full"]
    auc_full = full.get("auc", math.nan)
    skill, figures = True, []
    for name, label in (("K/E only", "K/E alone"), ("K/E + routing", "K/E with the routing type")):
        base = scores.get(name)
        if not base:
            continue
        auc_base = base.get("auc", math.nan)
        wins = sum(full["mae_by_group"][g] < base["mae_by_group"][g] for g in full["mae_by_group"])
        better_mae = full["mae"] < (1 - MIN_GAIN) * base["mae"] and wins > len(full["mae_by_group"]) / 2
        auc_ok = not (math.isfinite(auc_full) and math.isfinite(auc_base)) or auc_full >= auc_base
        skill = skill and better_mae and auc_ok
        figures.append(f"shift MAE {full['mae']:.3f} vs {label} {base['mae']:.3f} (lower on {wins} of {len(full['mae_by_group'])} "
                       f"originals), AUC {_fmt(auc_full)} vs {_fmt(auc_base)}")  # fmt: skip
    ke = scores["K/E only"]
    reason = f"held-out originals (noise floor {full['noise_mae']:.3f}): " + "; ".join(figures)
    return {"skill": bool(skill), "reason": ("plan-level skill: " if skill else "no plan-level skill: ") + reason,
            "mae": full["mae"], "mae_ke": ke["mae"], "noise_mae": full["noise_mae"], "auc": _finite_or_none(auc_full),
            "auc_ke": _finite_or_none(ke.get("auc", math.nan))}  # fmt: skip


def _finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None  # JSON has no NaN


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "-" if not math.isfinite(v) else f"{v:.3f}"
    return str(v)


def render_report(report: dict[str, Any]) -> str:
    from planner.render import table

    keys = ("n", "mae", "noise_mae", "rmse", "spearman_within_k", "coverage", "interval_width", "decided", "positive_rate", "auc",
            "brier", "brier_base_rate")  # fmt: skip
    lines = [f"held-out validation of the signed shift (log2 units) and P(reproduced), tolerance +-{report['tolerance_log2']:g}: "
             f"{report['rows']} rows"]  # fmt: skip
    for recipe, entry in report["recipes"].items():
        counts = ", ".join(f"{k} {v}" for k, v in entry.get("outcomes", {}).items())
        lines.append(f"\n{recipe} ({counts})")
        for scheme, result in entry.items():
            if scheme == "outcomes":
                continue
            if "variants" not in result:
                lines.append(f"  leave one {scheme} out: {result['groups']} group(s), nothing to hold out")
                continue
            lines.append(f"  leave one {scheme} out ({result['groups']} groups)")
            body = [[v, *(_fmt(s.get(k, math.nan)) for k in keys)] for v, s in result["variants"].items() if s]
            lines.append(table(["variant", *keys], body))
        gate = skill_gate(report, recipe)
        lines.append(f"  gate: {gate['reason']}")
    return "\n".join(lines)
