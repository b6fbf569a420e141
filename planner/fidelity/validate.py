"""Validation of the fidelity estimator on held-out originals and held-out families.

For each recipe and each scheme (leave one original out; leave one family out, with its twin of
the same shape trained the other way) every fold refits the full shift model and its baselines
(K/E alone; the recipe's mean shift; where the full model knows the routing type, K/E with the
routing type) on the other groups and predicts the held-out group's rows. Scores, per recipe and variant:

shift        MAE of the signed shift (log2 units), next to the noise floor: the MAE that measurement
             noise alone would give, sqrt(2/pi) x the rows' standard error of the shift; RMSE;
             Spearman within K (over the plans of one original and K: does the predicted order match
             the measured one? a prediction constant within K ranks nothing: 0); the coverage of
             the nominal 80% interval and its mean width.
reproduced   AUC and Brier score of P(reproduced) on rows whose equivalence decision was made
             (reproduced or not; undetermined rows are left out), against the Brier score of the
             training folds' base rate.

The leave-one-original-out scores are also given per calibration family (`by_family`): a family
with LOCAL_ORIGINALS originals or more has models of its own, so it is validated on its own rows
(one of its originals held out at a time, the models fitted on its others); another family's rows
are predicted by models fitted on every other original, of that family and others.

The rows a job grid measured at smaller jobs are validated apart (planner.fidelity.job_validate),
per recipe and family, under `job_holdout`.

The skill gate (skill_gate) reads them, per family or pooled: the full model has skill on a recipe
when, against K/E alone and against K/E with the routing type where that baseline exists, the
paired difference of shift MAE over held-out originals (full minus baseline, one value per
original) has a 90% t interval below zero with the MAE at least 10% lower, and, where
P(reproduced) can be scored (decided
rows of both outcomes), its AUC is at least AUC_MIN and not below the baseline's: the skill is then
the plan's, not the routing type's, and not one original's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from planner.families import how_built, how_trained
from planner.fidelity.learners import fit_shift
from planner.fidelity.model import LOCAL_ORIGINALS, baselines, design, recipe_features, training_rows
from planner.fidelity.scores import LEVEL, paired_difference, score_predictions
from planner.fidelity.transfer import BASE_HIDDEN, fit_build, fit_key, fit_transfer, load_points, plural, slopes_text

__all__ = ["variants", "SCHEMES", "cross_validate", "skill_gate", "ke_gate", "render_report", "score_predictions", "paired_difference"]

MIN_GAIN = 0.10  # and a shift MAE at least 10% below the baseline's (a gain inside the noise floor is not skill)
AUC_MIN = 0.85  # the skill gate's floor for P(reproduced)'s AUC, where it is defined
MIN_COVERAGE = 0.7  # a K/E-level P stands where its nominal 80% interval covers at least this share of held-out shifts
SCHEMES = {"original": "original", "family": "family"}  # scheme -> the row key that names a held-out group


def variants(recipe: str) -> dict[str, tuple[str, ...]]:
    """The full model and its baselines: variant -> feature names."""
    return {"full": recipe_features(recipe), **baselines(recipe)}


def _held_out(rows: list[dict], recipe: str, names: tuple[str, ...], key: str, tolerance: float) -> dict[str, np.ndarray]:
    """Held-out predictions for every row of the recipe (those with the full model's features, so that
    every variant scores the same rows), one fold per group."""
    used = training_rows(rows, recipe, recipe_features(recipe))
    n = len(used)
    out = {k: np.full(n, np.nan) for k in ("pred", "low", "high", "p", "base")}
    keys = np.array([_group(r, key) for r in used])
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


def _group(row: dict, key: str) -> str:
    """The held-out group of a row: its original, or its family, which leaves out the family of the
    same shape trained the other way with it (planner.families.trained_name: one shape's originals)."""
    return how_trained(str(row[key]))[0] if key == "family" else str(row[key])


def _of_family(h: dict, family: str) -> dict:
    """The held-out predictions `h` restricted to one family's rows."""
    mask = np.array([str(r["family"]) == family for r in h["rows"]], dtype=bool)
    out = {k: v[mask] for k, v in h.items() if isinstance(v, np.ndarray)}
    out["rows"], out["key"] = [r for r, m in zip(h["rows"], mask) if m], h["key"]
    return out


def cross_validate(rows: list[dict], schemes: tuple[str, ...] = tuple(SCHEMES), tolerance: float | None = None) -> dict[str, Any]:
    """{rows, recipes: {recipe: {scheme: {variant: scores}}}} (see the module's docstring)."""
    from planner.fidelity.dataset import production_rows
    from planner.fidelity.labels import TOLERANCE_LOG2

    from planner.fidelity.job_validate import job_holdout

    tolerance = TOLERANCE_LOG2 if tolerance is None else tolerance
    every, rows = rows, production_rows(rows)  # the plan models are validated on the family grids' rows; the job rows apart
    report: dict[str, Any] = {"rows": len(rows), "tolerance_log2": tolerance, "recipes": {}}
    for recipe in sorted({r["recipe"] for r in rows}):
        entry: dict[str, Any] = {}
        used = training_rows(rows, recipe, recipe_features(recipe))
        for scheme in schemes:
            key = SCHEMES[scheme]
            groups = {_group(r, key) for r in used}
            if len(groups) < 2:
                entry[scheme] = {"groups": len(groups)}
                continue
            held = {v: _held_out(rows, recipe, names, key, tolerance) for v, names in variants(recipe).items()}
            entry[scheme] = {"groups": len(groups), "variants": {v: score_predictions(h) for v, h in held.items()}}
            if scheme == "original":
                # a family with originals enough is validated as it is fitted: on its own rows, one
                # original held out at a time; the others by the models fitted on every family
                families = sorted({str(r["family"]) for r in used})
                entry[scheme]["by_family"], entry[scheme]["local"] = {}, []
                for f in families:
                    mine = [r for r in rows if str(r.get("family")) == f]
                    if len({str(r["original"]) for r in used if str(r["family"]) == f}) >= LOCAL_ORIGINALS:
                        entry[scheme]["by_family"][f] = {v: score_predictions(_held_out(mine, recipe, names, key, tolerance))
                                                         for v, names in variants(recipe).items()}  # fmt: skip
                        entry[scheme]["local"].append(f)
                    else:
                        entry[scheme]["by_family"][f] = {v: score_predictions(_of_family(h, f)) for v, h in held.items()}
        outcomes = [r.get("outcome") for r in rows if r["recipe"] == recipe]
        entry["outcomes"] = {o: outcomes.count(o) for o in sorted({str(o) for o in outcomes})}
        entry["shapes"] = {str(r["family"]): str(r.get("routing_shape") or "") for r in used}
        entry["spread"] = {f: spread(used, recipe, f) for f in sorted({str(r["family"]) for r in used})}
        entry["controls"] = _controls(rows, recipe)
        entry["job_holdout"] = job_holdout(every, recipe, tolerance)
        report["recipes"][recipe] = entry
    points = load_points()
    report["transfer"] = fit_transfer(points) if points else {}
    return report


def spread(rows: list[dict], recipe: str, family: str) -> dict[str, float] | None:
    """Which target varies less from one original to the next: the SD across originals of their own
    critical knob; and, over the cells of one K and plan rule measured on 3 originals or more, the
    mean SD across originals of the proxy's absolute knob and of the shift (log2 units). A shift SD
    below the proxy knob's says the shift cancels the original's own level; above it, that the
    proxies agree where their originals do not."""
    from planner.fidelity.labels import knob_scale
    from planner.plan import CONTROL_METHODS

    at = [r for r in rows if str(r["family"]) == family and r["recipe"] == recipe and r.get("method") not in CONTROL_METHODS
          and r.get("censored") != 1 and all(math.isfinite(r.get(k, math.nan)) for k in ("critical_original", "critical_proxy", "shift_log2"))]  # fmt: skip
    originals = {str(r["original"]): float(r["critical_original"]) for r in at if math.isfinite(r.get("critical_original", math.nan))}
    if len(originals) < 3:
        return None
    scale = knob_scale(recipe)
    cells: dict[tuple, list[dict]] = {}
    for r in at:
        cells.setdefault((r["experts"], "random" if str(r["method"]).startswith("random-") else str(r["method"])), []).append(r)
    proxy, shift = [], []
    for members in cells.values():
        if len({str(r["original"]) for r in members}) >= 3:
            proxy.append(np.std([r["critical_proxy"] * scale for r in members], ddof=1))
            shift.append(np.std([r["shift_log2"] for r in members], ddof=1))
    if not proxy:
        return None
    return {"originals": len(originals), "original_knob_sd": float(np.std(np.array(list(originals.values())) * scale, ddof=1)),
            "proxy_knob_sd": float(np.mean(proxy)), "shift_sd": float(np.mean(shift)), "cells": len(proxy)}  # fmt: skip


def _controls(rows: list[dict], recipe: str) -> dict[str, dict[str, int]]:
    """The negative controls' outcomes per family (planner.plan.CONTROL_METHODS): a label that can
    fail says "not reproduced" for them."""
    from planner.plan import CONTROL_METHODS

    out: dict[str, dict[str, int]] = {}
    for r in rows:
        if r.get("recipe") == recipe and r.get("method") in CONTROL_METHODS:
            counts = out.setdefault(str(r["family"]), {})
            counts[str(r.get("outcome"))] = counts.get(str(r.get("outcome")), 0) + 1
    return out


def skill_gate(report: dict[str, Any], recipe: str, family: str | None = None) -> dict[str, Any]:
    """Does the full model beat K/E alone (and K/E with the routing type, where that baseline is
    scored) on held-out originals, of one family or pooled? See the module's docstring."""
    where = report["recipes"].get(recipe, {}).get("original", {})
    scores = where.get("by_family", {}).get(family) if family else where.get("variants")
    label = f"{recipe} on {family}" if family else recipe
    if not scores or not scores.get("full") or not scores.get("K/E only") or len(scores["full"]["mae_by_group"]) < 2:
        return {"skill": False, "reason": f"{label}: too few originals or rows to validate on held-out originals", "family": family}
    full = scores["full"]
    auc_full = full.get("auc", math.nan)
    low_auc = math.isfinite(auc_full) and auc_full < AUC_MIN
    skill, figures, differences = not low_auc, [], {}
    for name, text in (("K/E only", "K/E alone"), ("K/E + routing", "K/E with the routing type")):
        base = scores.get(name)
        if not base:
            continue
        auc_base = base.get("auc", math.nan)
        mean, low, high = paired_difference(full["mae_by_group"], base["mae_by_group"])
        differences[name] = [mean, low, high]
        auc_ok = not (math.isfinite(auc_full) and math.isfinite(auc_base)) or auc_full >= auc_base
        skill = skill and high < 0 and full["mae"] < (1 - MIN_GAIN) * base["mae"] and auc_ok
        figures.append(f"shift MAE {full['mae']:.3f} vs {text} {base['mae']:.3f} (difference {mean:+.3f}, {LEVEL:.0%} interval "
                       f"[{low:+.3f}, {high:+.3f}] over {len(full['mae_by_group'])} originals), AUC {_fmt(auc_full)} vs {_fmt(auc_base)}")  # fmt: skip
    ke = scores["K/E only"]
    reason = f"held-out originals (noise floor {full['noise_mae']:.3f}): " + "; ".join(figures)
    if low_auc:
        reason += f"; AUC below {AUC_MIN}"
    return {"skill": bool(skill), "reason": ("plan-level skill: " if skill else "no plan-level skill: ") + reason, "family": family,
            "originals": len(full["mae_by_group"]), "rows": full["n"], "mae": full["mae"], "mae_ke": ke["mae"],
            "mae_ke_routing": scores.get("K/E + routing", {}).get("mae"), "difference": differences, "noise_mae": full["noise_mae"],
            "coverage": full["coverage"], "auc": _finite_or_none(auc_full), "auc_ke": _finite_or_none(ke.get("auc", math.nan))}  # fmt: skip


def ke_gate(report: dict[str, Any], recipe: str, family: str) -> dict[str, Any]:
    """Is the K/E-level variant (K/E with the routing type where the recipe has one, else K/E alone)
    validated on the family's held-out originals, so that its P may stand where no plan statistics
    are given or the plan-level model has no skill? Its 80% interval must cover at least
    MIN_COVERAGE of the held-out shifts, from 2 or more originals, and P(reproduced)'s AUC, where it
    is defined, be at least AUC_MIN."""
    variant = "K/E + routing" if "K/E + routing" in baselines(recipe) else "K/E only"
    scores = report["recipes"].get(recipe, {}).get("original", {}).get("by_family", {}).get(family, {})
    s, mean = scores.get(variant), scores.get("recipe mean") or {}
    if not s or len(s["mae_by_group"]) < 2:
        return {"ok": False, "variant": variant, "reason": f"{variant} on {family}: too few originals or rows to validate"}
    auc = s.get("auc", math.nan)
    ok = s["coverage"] >= MIN_COVERAGE and not (math.isfinite(auc) and auc < AUC_MIN)
    figures = (f"{variant} on {len(s['mae_by_group'])} held-out originals of {family}: shift MAE {s['mae']:.3f} (recipe mean "
               f"{_fmt(mean.get('mae', math.nan))}, noise floor {s['noise_mae']:.3f}), interval coverage {s['coverage']:.2f}, AUC {_fmt(auc)}")  # fmt: skip
    return {"ok": bool(ok), "variant": variant, "reason": ("P from " if ok else "not validated: ") + figures, "mae": s["mae"],
            "mae_mean": mean.get("mae"), "noise_mae": s["noise_mae"], "coverage": s["coverage"], "auc": _finite_or_none(auc),
            "originals": len(s["mae_by_group"])}  # fmt: skip


def _transfer_text(fit: dict | None) -> str:
    if not fit:
        return "not measured (calibrated at hidden 64, 3 layers only)"
    if not fit.get("fitted"):
        return f"{plural(fit['points'], 'point')} at hidden {fit['hidden']}, layers {fit['layers']}: not fitted ({fit['reason']})"
    parts = slopes_text(fit)
    held = fit.get("holdout")
    test = (f"; each point off the calibration scale fitted without it: MAE {held['mae_moved']:.3f} along the trend, {held['mae_base']:.3f} at "
            f"hidden {BASE_HIDDEN}'s label, over {plural(held['points'], 'point')}" if held else "")  # fmt: skip
    bounds = f" ({fit['bounds']} of them censored, as bounds)" if fit.get("bounds") else ""
    return (f"{'; '.join(parts)} (90% intervals; {fit['points']} points{bounds}, hidden {fit['hidden']}, layers {fit['layers']}, "
            f"steps {fit['steps']}; between-original SD {fit.get('tau', 0.0):.2f} log2{test})")


def _finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None  # JSON has no NaN


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "-" if not math.isfinite(v) else f"{v:.3f}"
    return str(v)


def render_report(report: dict[str, Any]) -> str:
    from planner.fidelity.job_validate import render_job_holdout
    from planner.render import table

    keys = ("n", "mae", "noise_mae", "rmse", "spearman_within_k", "coverage", "interval_width", "decided", "positive_rate", "auc",
            "brier", "brier_base_rate")  # fmt: skip
    lines = [f"held-out validation of the signed shift (log2 units) and P(reproduced), tolerance +-{report['tolerance_log2']:g}: "
             f"{report['rows']} rows"]  # fmt: skip
    for recipe, entry in report["recipes"].items():
        counts = ", ".join(f"{k} {v}" for k, v in entry.get("outcomes", {}).items())
        lines.append(f"\n{recipe} ({counts})")
        for family, c in entry.get("controls", {}).items():
            lines.append(f"  negative controls (mis-sliced routers), {family}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
        for scheme, result in entry.items():
            if scheme not in SCHEMES:
                continue
            if "variants" not in result:
                lines.append(f"  leave one {scheme} out: {result['groups']} group(s), nothing to hold out")
                continue
            lines.append(f"  leave one {scheme} out ({result['groups']} groups)")
            body = [[v, *(_fmt(s.get(k, math.nan)) for k in keys)] for v, s in result["variants"].items() if s]
            lines.append(table(["variant", *keys], body))
        gate = skill_gate(report, recipe)
        lines.append(f"  gate, pooled: {gate['reason']}")
        for family, scores in entry.get("original", {}).get("by_family", {}).items():
            local = family in entry.get("original", {}).get("local", [])
            lines.append(f"  {family}, leave one original out ({'models of its own, fitted on its rows' if local else 'models fitted on every family'})")
            body = [[v, *(_fmt(s.get(k, math.nan)) for k in keys)] for v, s in scores.items() if s]
            if body:
                lines.append(table(["variant", *keys], body))
            lines.append(f"  gate, {family}: {skill_gate(report, recipe, family)['reason']}")
            lines.append(f"  K/E-level P, {family}: {ke_gate(report, recipe, family)['reason']}")
            sp = entry.get("spread", {}).get(family)
            if sp:
                lines.append(f"  across {sp['originals']} originals, {family}: their own knob SD {sp['original_knob_sd']:.3f}; per (K, plan rule), "
                             f"{sp['cells']} cells: proxy knob SD {sp['proxy_knob_sd']:.3f}, shift SD {sp['shift_sd']:.3f} (log2)")  # fmt: skip
            fits, shape, made, built = report.get("transfer", {}), entry.get("shapes", {}).get(family, ""), how_trained(family)[1], how_built(family)[1]
            read = fit_build(fits, recipe, shape, made, built)
            transfer = fits.get(fit_key(recipe, shape, made, read))
            sliced = " (measured with sliced proxies)" if read != built else ""
            lines.append(f"  scale transfer, {family}{sliced}: {_transfer_text(transfer)}")
        lines += render_job_holdout(recipe, entry.get("job_holdout", {}))
    return "\n".join(lines)
