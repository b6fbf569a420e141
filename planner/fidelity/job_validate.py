"""Held-out validation of the reproduction job's dimensions, scored as the plan models are.

For each recipe and each family a job grid measured (rows with `job_grid`), one original at a time is
held out: the family's plan models are refitted on the family grids' rows of its other originals (the
family's own rows where it has LOCAL_ORIGINALS of them, else every family's), the job term on the
job grids' rows of its other originals (planner.fidelity.estimator._job_support), and every held-out
proxy row at a smaller job is predicted three ways:

plan + job       the plan-level model's shift at the production job moved by the measured extra
                 shift of the row's job (every measured level, supported or not; jobs shrunk in
                 several dimensions add their single-dimension terms), its 80% interval widened by
                 that term's spread: what `suggest` predicts for a proxy at a smaller job;
production job   the same model without the job term (the job changes nothing);
K/E + job        the K/E-only model moved by the same job term.

Scores (planner.fidelity.validate.score_predictions) per variant: MAE against the noise floor,
coverage of the interval, Spearman within K, and the paired difference of MAE over held-out
originals between plan + job and production job. The job term alone is scored too, on every row
(the original's own among them): the row's extra shift against the same model at its grid's
production job, predicted by the other originals' mean extra shift at that job, against predicting 0.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["job_holdout", "render_job_holdout"]

VARIANTS = ("plan + job", "production job", "K/E + job")


def _plan_model(rows: list[dict], recipe: str, family: str, held: str, names: tuple[str, ...]):
    from planner.fidelity.dataset import production_rows
    from planner.fidelity.learners import fit_shift
    from planner.fidelity.model import LOCAL_ORIGINALS

    production = [r for r in production_rows(rows) if str(r["original"]) != held]
    mine = [r for r in production if str(r.get("family")) == family]
    originals = {str(r["original"]) for r in mine if r.get("recipe") == recipe}
    return fit_shift(mine if len(originals) + 1 >= LOCAL_ORIGINALS else production, recipe, names)


def job_holdout(rows: list[dict], recipe: str, tolerance: float = 1.0) -> dict[str, dict[str, Any]]:
    """Per family with job rows of `recipe`: {originals, rows, variants: {variant: scores},
    difference: [mean, low, high] (plan + job minus production job, MAE per held-out original),
    job_term: {rows, mae, mae_zero, noise_mae}} (see the module's docstring)."""
    from planner.fidelity.dataset import JOB_COLUMNS, JOB_GRID, job_share
    from planner.fidelity.jobs import _job_rows, _job_support, job_offset
    from planner.fidelity.model import baselines, design, recipe_features, training_rows
    from planner.fidelity.scores import paired_difference, score_predictions

    mine, _ = _job_rows(rows, recipe)
    smaller = [r for r in mine if any(job_share(r, c) < 1.0 for c in JOB_COLUMNS.values())]
    out: dict[str, dict[str, Any]] = {}
    for family in sorted({str(r["family"]) for r in smaller}):
        held_rows = [r for r in smaller if str(r["family"]) == family]
        originals = sorted({str(r["original"]) for r in held_rows})
        if len(originals) < 3:  # the job term of the others needs 2 originals
            out[family] = {"originals": len(originals), "reason": f"{len(originals)} originals measured at smaller jobs: 3 or more needed"}
            continue
        proxies = [r for r in held_rows if r["model"] != "original"]
        names = {"plan + job": recipe_features(recipe), "production job": recipe_features(recipe), "K/E + job": baselines(recipe)["K/E only"]}
        used = training_rows(proxies, recipe, names["plan + job"])  # every variant scores the same rows
        h = {v: {k: np.full(len(used), np.nan) for k in ("pred", "low", "high", "p", "base")} for v in VARIANTS}
        term: list[tuple[float, float, float]] = []  # (measured extra shift, predicted, its noise SE)
        for held in originals:
            others = [r for r in rows if not (r.get(JOB_GRID) and str(r["original"]) == held)]
            support = _job_support(others, recipe).get(family) or {}
            _, extra = _job_rows([r for r in rows if str(r["original"]) == held], recipe)
            production_se = {(r[JOB_GRID], str(r["model"])): float(r.get("shift_se", math.nan)) for r in mine
                             if str(r["original"]) == held and all(job_share(r, c) == 1.0 for c in JOB_COLUMNS.values())}  # fmt: skip
            for r in (r for r in held_rows if str(r["original"]) == held):
                delta = extra(r)
                if delta is not None:
                    se = math.hypot(float(r.get("shift_se", math.nan)), production_se.get((r[JOB_GRID], str(r["model"])), 0.0))
                    term.append((delta, job_offset(support, r, every_level=True)[0], se))
            decided = [r["reproduced"] for r in rows if r.get("recipe") == recipe and str(r["original"]) != held
                       and math.isfinite(r.get("reproduced", math.nan))]  # fmt: skip
            idx = np.array([i for i, r in enumerate(used) if str(r["original"]) == held], dtype=int)
            if not idx.size:
                continue
            term_of = np.array([job_offset(support, used[i], every_level=True) for i in idx]).reshape(-1, 2)  # (shift, width) per row
            for variant in VARIANTS:
                model = _plan_model(rows, recipe, family, held, names[variant])
                if model is None:
                    continue
                x = design([used[i] for i in idx], names[variant])
                shift, width = (np.zeros(idx.size), np.zeros(idx.size)) if variant == "production job" else term_of.T
                low, high = model.predict_interval(x)
                h[variant]["pred"][idx] = model.predict(x) + shift
                h[variant]["low"][idx], h[variant]["high"][idx] = low + shift - width, high + shift + width
                h[variant]["p"][idx] = [model.p_within(x[j : j + 1], tolerance, offset=shift[j])[0][0] for j in range(idx.size)]
                h[variant]["base"][idx] = np.mean(decided) if decided else np.nan
        scores = {v: score_predictions({**h[v], "rows": used, "key": "original"}) for v in VARIANTS}
        measured, predicted, se = (np.array(c, dtype=float) for c in zip(*term)) if term else (np.array([]),) * 3
        out[family] = {"originals": len(originals), "rows": len(used), "noise_mae": scores["plan + job"].get("noise_mae", math.nan),
                       "variants": {v: {k: s[k] for k in ("n", "mae", "coverage", "interval_width")} for v, s in scores.items() if s},
                       "difference": list(paired_difference(scores["plan + job"].get("mae_by_group", {}),
                                                            scores["production job"].get("mae_by_group", {}))),
                       "job_term": {"rows": int(measured.size), "mae": float(np.mean(np.abs(measured - predicted))) if term else math.nan,
                                    "mae_zero": float(np.mean(np.abs(measured))) if term else math.nan,
                                    "noise_mae": float(np.nanmean(se) * math.sqrt(2 / math.pi)) if term else math.nan}}  # fmt: skip
    return out


def render_job_holdout(recipe: str, result: dict[str, dict[str, Any]]) -> list[str]:
    """Lines for `planner calibrate report`: per family, the job term's held-out MAE against 0 and
    the full prediction's against the production-job and K/E baselines."""
    lines = []
    for family, e in result.items():
        if "variants" not in e:
            lines.append(f"  smaller jobs, {family}: {e['reason']}")
            continue
        t, s = e["job_term"], e["variants"]
        figures = "; ".join(f"{v} MAE {s[v]['mae']:.3f}, coverage {s[v]['coverage']:.2f}" for v in VARIANTS if s.get(v))
        mean, low, high = e["difference"]
        lines.append(f"  smaller jobs, {family}, leave one original out ({e['originals']} originals, {e['rows']} proxy rows): {figures} "
                     f"(noise floor {e['noise_mae']:.3f}; plan + job minus production job {mean:+.3f} [{low:+.3f}, {high:+.3f}]); "
                     f"the job term alone on {t['rows']} rows: MAE {t['mae']:.3f} against {t['mae_zero']:.3f} for no term "
                     f"(noise floor {t['noise_mae']:.3f})")  # fmt: skip
    return lines
