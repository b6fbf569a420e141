"""The fidelity estimator: from a plan's statistics, how far does the proxy move the fault, and
does it still reproduce it?

Per fault recipe, sign-constrained ridge models (planner.fidelity.learners, on planner.fidelity.model's
features) predict the signed shift of the critical knob (planner.fidelity.labels): the full model
from the plan's statistics, and its baselines from K/E (with the routing type for router collapse)
and the recipe's mean. A calibration family with 3 originals or more has models of its own; the
others use those fitted on every family. Held-out residuals (leave one original out), widened to the
original-to-original variance component where that is wider, give the conformal interval of the
shift and its predictive distribution; P(reproduced) is the share of that distribution within the
equivalence tolerance, and the measured scale transfer (planner.fidelity.transfer) widens both at
the target's width and depth.

A target is matched to the family of its routing shape (planner.arch.routing); a shape never
calibrated is "uncalibrated", as is a recipe not in the data or a statistic outside the family's
calibrated range. The family's gates, decided on its held-out originals when fitting, choose the
basis: the plan's statistics where the full model beats K/E on them (planner.fidelity.validate:
skill_gate), else K/E where that variant's interval is validated (ke_gate), else "no-skill" with
the measured shift at the nearest K; a fault that cannot occur at this K is "not-applicable". The
fitted estimator is JSON (never pickle) and predicts with numpy alone, so `planner suggest` imports
neither scikit-learn nor scipy nor statsmodels.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from planner.errors import SpecError
from planner.families import BUILT, how_built, how_trained
from planner.fidelity.jobs import (JOB_DIMENSIONS, JOB_TOLERANCE_LOG2, _job_joint, _job_onsets, _job_rows, _job_support, _job_transfer,
                                   _token_mixer, job_offset, job_onset)
from planner.fidelity.model import (FULL_FEATURES, LOCAL_ORIGINALS, ROUTING_FEATURES, SHIFT_FEATURES, SIGNS, ShiftModel, _finite,
                                    baselines, design, features_of, recipe_features, training_rows)  # fmt: skip
from planner.fidelity.starts import start_text

__all__ = ["ShiftModel", "FidelityEstimator", "FULL_FEATURES", "SHIFT_FEATURES", "ROUTING_FEATURES", "SIGNS", "features_of",
           "recipe_features", "baselines", "default_estimator_path", "training_rows", "knob_translation", "design", "family_text"]

SCHEMA = "planner.fidelity/4"  # 4: gates per calibration family, keyed by routing shape

_CHOSEN: list[Path] = []  # a user's own fit (`--estimator FILE`); else the packaged one


def default_estimator_path() -> Path:
    """The estimator in use: the user's (use_estimator_file) or the one fitted on the committed
    calibration dataset (ships inside the wheel)."""
    from importlib import resources

    return _CHOSEN[0] if _CHOSEN else Path(str(resources.files("planner._calibration"))) / "fidelity.json"


def use_estimator_file(path: str | Path) -> None:
    """Use a `planner calibrate fit` output instead of the packaged estimator (checked by loading it)."""
    FidelityEstimator.load(path)
    _CHOSEN[:] = [Path(path).resolve()]


@contextmanager
def using_estimator_file(path: str | Path | None):
    """The user's estimator for the duration (None: the packaged one), restored afterwards."""
    saved = list(_CHOSEN)
    try:
        if path is not None:
            use_estimator_file(path)
        yield
    finally:
        _CHOSEN[:] = saved


def _measured_by_k(rows: list[dict], recipe: str) -> list[dict]:
    """The measured shift at each calibrated (family, K/E): mean and SD over plans and originals, the
    mean noise floor (originals' seed SD) and the reproduced share among decided rows (negative
    controls aside)."""
    from planner.plan import CONTROL_METHODS

    out = []
    used = [r for r in rows if r.get("recipe") == recipe and _finite(r.get("shift_log2")) and r.get("method") not in CONTROL_METHODS]
    for family, kf in sorted({(str(r["family"]), round(float(r["kept_fraction"]), 4)) for r in used}):
        at = [r for r in used if str(r["family"]) == family and round(float(r["kept_fraction"]), 4) == kf]
        shifts = np.array([r["shift_log2"] for r in at])
        decided = [r["reproduced"] for r in at if _finite(r.get("reproduced"))]
        out.append({"family": family, "kept_fraction": kf, "n": len(at), "shift_mean": float(shifts.mean()), "shift_sd": float(shifts.std()),
                    "noise_log2": float(np.nanmean([r.get("noise_log2", np.nan) for r in at])),
                    "reproduced_share": float(np.mean(decided)) if decided else None})  # fmt: skip
    return out


def _transfer(points: list[dict] | None) -> dict[str, dict]:
    """The scale-transfer fits of the measured points (the packaged ones where none are given)."""
    from planner.fidelity.transfer import fit_transfer, load_points

    points = load_points() if points is None else points
    return fit_transfer(points) if points else {}


def _starts(rows: list[dict] | None) -> dict[str, dict]:
    """Per family, where its originals' routing starts (planner.fidelity.starts; the packaged rows
    where none are given)."""
    from planner.fidelity.starts import load_starts, summarise

    return summarise(load_starts() if rows is None else rows)


def _every_plan_reproduced(rows: list[dict], recipe: str) -> dict[str, dict]:
    """Per family: where no legal plan's row is "not reproduced" (negative controls aside) and some
    are decided, how many rows, decided rows and reproduced ones, over which K/E."""
    from planner.plan import CONTROL_METHODS

    out: dict[str, dict] = {}
    legal = [r for r in rows if r.get("recipe") == recipe and r.get("method") not in CONTROL_METHODS and r.get("outcome") != "not applicable"
             and _finite(r.get("shift_log2"))]  # fmt: skip
    for family in sorted({str(r["family"]) for r in legal}):
        at = [r for r in legal if str(r["family"]) == family]
        decided = [r["reproduced"] for r in at if _finite(r.get("reproduced"))]
        if decided and all(d == 1 for d in decided):
            kf = [float(r["kept_fraction"]) for r in at]
            out[family] = {"rows": len(at), "decided": len(decided), "reproduced": int(sum(decided)), "kept_fraction": [min(kf), max(kf)]}
    return out


def _onsets(rows: list[dict], recipe: str) -> dict[str, list[dict]]:
    """Per family and K/E: the proxy/original onset ratio on the calibration curves (both run at the
    original's critical knob plus the grid's offset, same seed and prompts), median and 10-90% range
    over plans and originals; a proxy whose curve showed no fault counts as never (the range is then
    open). Negative controls and added pairs aside."""
    from planner.plan import CONTROL_METHODS

    used = [r for r in rows if r.get("recipe") == recipe and r.get("method") not in CONTROL_METHODS and str(r.get("source", "grid")) == "grid"
            and _finite(r.get("onset_original")) and float(r["onset_original"]) > 0]  # fmt: skip
    out: dict[str, list[dict]] = {}
    for family, kf in sorted({(str(r["family"]), round(float(r["kept_fraction"]), 4)) for r in used}):
        at = [r for r in used if str(r["family"]) == family and round(float(r["kept_fraction"]), 4) == kf]
        ratios = np.array([float(r["onset_proxy"]) / float(r["onset_original"]) if _finite(r.get("onset_proxy")) else np.inf for r in at])
        low, median, high = (float(v) for v in np.quantile(ratios, [0.1, 0.5, 0.9], method="inverted_cdf"))
        out.setdefault(family, []).append({"kept_fraction": kf, "rows": len(at), "never": int(np.isinf(ratios).sum()), "low": low,
                                           "median": median, "high": high})  # fmt: skip
    return out


def knob_translation(recipe: str, block: Mapping[str, Any]) -> dict[str, Any] | None:
    """Where the shift is systematic (its interval, or the measured spread, excludes 0): the knob
    value at which the proxy should reproduce the original's failure, as the original's critical
    value moved by the shift, in the knob's own units."""
    from planner.fidelity.labels import knob_scale
    from planner.rl.recipes import RECIPES

    if recipe not in RECIPES:
        return None
    if block.get("shift_log2") is not None:
        shift, (low, high), source = block["shift_log2"], block["shift_interval"], "predicted"
    elif block.get("measured_by_k"):
        m = block["measured_by_k"]
        shift, low, high, source = m["shift_mean"], m["shift_mean"] - m["shift_sd"], m["shift_mean"] + m["shift_sd"], "measured at K/E " + f"{m['kept_fraction']:g}"
    else:
        return None
    if low <= 0.0 <= high:
        return None
    scale = knob_scale(recipe)
    knob = RECIPES[recipe].knob
    text = (f"{source} shift {shift:+.2f} log2 units [{low:+.2f}, {high:+.2f}]: where the original fails at {knob} = X, "
            f"run the proxy at X {shift / scale:+.2f} [{low / scale:+.2f}, {high / scale:+.2f}]")  # fmt: skip
    return {"knob": knob, "shift_knob_units": shift / scale, "interval_knob_units": [low / scale, high / scale], "source": source, "text": text}


def family_text(family: dict) -> str:
    """The calibration family a fidelity block rests on: its data, held-out score and scale."""
    h = family["held_out"]
    against = f"{h['baseline']} {h['baseline_mae']:.3f}, " if h.get("baseline_mae") is not None else ""
    model = "the plan-level model" if h.get("variant") == "full" else h.get("variant", "")
    score = (f"held-out shift MAE of {model} {h['mae']:.3f} ({against}noise floor {h['noise_mae']:.3f}), interval coverage "
             f"{h['coverage']:.2f}" if h.get("mae") is not None else "no held-out score")  # fmt: skip
    auc = f", AUC {h['auc']:.3f}" if h.get("auc") is not None else ""
    start = start_text(family.get("start"), family.get("balancing", "none"))
    return (f"family {family['name']} ({family['routing_shape']}): {family['originals']} originals, {family['rows']} rows; {score}{auc}; "
            f"{family['scale']}" + (f"; {start}" if start else ""))  # fmt: skip



@dataclass
class FidelityEstimator:
    """Per recipe: the shift models fitted on every family and each large family's own, their
    baselines, the gates per family (plan-level and K/E-level), the calibrated domains, the routing
    shapes and families calibrated, and the measured shift by family and K/E."""

    recipes: dict[str, dict[str, Any]]  # recipe -> {"models": {variant: ShiftModel}, "gate", "domain", "experts", "measured_by_k"}
    info: dict[str, Any]
    tolerance: float = 1.0

    @classmethod
    def fit(cls, rows: list[dict], *, info: dict | None = None, validate: bool = True,
            transfer_points: list[dict] | None = None, report: dict | None = None, starts: list[dict] | None = None) -> "FidelityEstimator":  # fmt: skip
        """Fit on `rows`; with `validate`, the gates come from leaving one original out
        (planner.fidelity.validate.cross_validate), or from `report`, such a report of the same rows
        made already."""
        from planner.fidelity.dataset import production_rows
        from planner.fidelity.labels import TOLERANCE_LOG2
        from planner.fidelity.learners import fit_shift

        every, rows = rows, production_rows(rows)  # the plan models are the production job's; the job rows count apart
        recipes: dict[str, dict[str, Any]] = {}
        for recipe in sorted({r["recipe"] for r in rows}):
            names = recipe_features(recipe)
            full = fit_shift(rows, recipe, names)
            if full is None:
                continue
            models = {"full": full}
            for name, base in baselines(recipe).items():
                models[name] = fit_shift(rows, recipe, base)
            used = training_rows(rows, recipe, names)
            domain = {n: (float(min(r[n] for r in used)), float(max(r[n] for r in used))) for n in names}
            families: dict[str, dict[str, Any]] = {}
            for r in used:
                f = families.setdefault(str(r["family"]), {"originals": set(), "rows": 0, "routing_shape": str(r.get("routing_shape") or "")})
                f["originals"].add(str(r["original"]))
                f["rows"] += 1
            families = {name: {**f, "originals": len(f["originals"])} for name, f in sorted(families.items())}
            shapes: dict[str, list[str]] = {}
            for name, f in families.items():
                if f["routing_shape"]:
                    shapes.setdefault(f["routing_shape"], []).append(name)
            local = {}
            for name, f in families.items():
                if f["originals"] < LOCAL_ORIGINALS:
                    continue
                mine = [r for r in rows if str(r.get("family")) == name]
                fitted = {"full": fit_shift(mine, recipe, names), **{v: fit_shift(mine, recipe, b) for v, b in baselines(recipe).items()}}
                if fitted["full"] is not None:
                    at = training_rows(mine, recipe, names)
                    local[name] = {"models": fitted, "domain": {n: (float(min(r[n] for r in at)), float(max(r[n] for r in at))) for n in names}}
            recipes[recipe] = {"models": models, "local": local, "features": list(names), "domain": domain, "shapes": shapes, "families": families,
                               "experts": sorted({int(r["original_experts"]) for r in used}),
                               "originals": sorted({str(r["original"]) for r in used}), "measured_by_k": _measured_by_k(rows, recipe),
                               "every_plan_reproduced": _every_plan_reproduced(rows, recipe),
                               "onsets": _onsets(rows, recipe), "job_onsets": _job_onsets(every, recipe), "job": (job := _job_support(every, recipe)), "job_joint": (joint := _job_joint(every, recipe, job)),
                               "job_transfer": _job_transfer(every, recipe, job, joint),
                               "gate": {"skill": False, "reason": "not validated"},
                               "gates": {name: {"skill": False, "reason": "not validated"} for name in families},
                               "ke_gates": {name: {"ok": False, "reason": "not validated"} for name in families}}  # fmt: skip
        estimator = cls(recipes, dict(info or {}, rows=len(rows), transfer=_transfer(transfer_points), starts=_starts(starts)), TOLERANCE_LOG2)
        if validate:
            from planner.fidelity.validate import cross_validate, ke_gate, skill_gate

            report = report if report is not None else cross_validate(every, schemes=("original",))
            for recipe, entry in recipes.items():
                entry["job_holdout"] = report["recipes"][recipe]["job_holdout"]
                entry["gate"] = skill_gate(report, recipe)
                entry["gates"] = {name: skill_gate(report, recipe, name) for name in entry["families"]}
                entry["ke_gates"] = {name: ke_gate(report, recipe, name) for name in entry["families"]}
        return estimator

    def family(self, row: Mapping[str, Any], recipe: str) -> str | None:
        """The calibration family whose routing shape `row`'s model has, with proxies built as `row`'s
        (its "proxy_build": sliced unless said), for `recipe`, or None. Where the shape has a family
        of originals trained with its published load balancing, as the real model was, with
        LOCAL_ORIGINALS or more, that one; else the family trained without."""
        entry = self.recipes.get(recipe) or {}
        build = str(row.get("proxy_build") or "sliced")
        found = [f for f in entry.get("shapes", {}).get(str(row.get("routing_shape") or "")) or [] if how_built(f)[1] == build]
        families = entry.get("families", {})
        balanced = [f for f in found if how_trained(f)[1] == "published" and families.get(f, {}).get("originals", 0) >= LOCAL_ORIGINALS]
        return (balanced or [f for f in found if how_trained(f)[1] == "none"] or found or [None])[0]

    def status(self, row: Mapping[str, Any], recipe: str) -> tuple[str, str, str | None]:
        """(status, reason, variant) of a prediction for `row` under `recipe`: the gates of the family
        of its routing shape decide. "calibrated" with variant "full" where the plan's statistics
        are given and the plan-level gate passes; else with the K/E-level variant where its held-out
        interval is validated on the family (a P from K/E and the routing shape alone, which ranks no
        plan within a K); else "no-skill"."""
        from planner.fidelity.labels import applicable

        experts, top_k = row.get("experts"), row.get("top_k")
        if _finite(experts) and _finite(top_k) and not applicable(recipe, int(experts), int(top_k)):
            return "not-applicable", f"the fault cannot occur with K={int(experts)} <= top_k={int(top_k)}: every token uses every kept expert", None
        entry = self.recipes.get(recipe)
        if entry is None:
            return "uncalibrated", f"{recipe} is not in the calibration data (calibrated: {', '.join(self.recipes) or 'none'})", None
        shape = str(row.get("routing_shape") or "")
        family = self.family(row, recipe)
        if family is None:
            known = ", ".join(f"{k} ({', '.join(v)})" for k, v in sorted(entry["shapes"].items())) or "none"
            what = f"routing shape {shape}" if shape else f"a model of unknown routing shape (E={row.get('original_experts')})"
            if shape in entry["shapes"]:  # calibrated, with proxies built the other way
                return "uncalibrated", (f"{what} was calibrated for {recipe} with proxies built otherwise ({', '.join(entry['shapes'][shape])}), "
                                        f"none {BUILT[str(row.get('proxy_build') or 'sliced')]}"), None  # fmt: skip
            return "uncalibrated", f"{what} was never calibrated for {recipe} (calibrated shapes: {known})", None
        outside = self.outside(row, recipe)
        if outside:
            return "uncalibrated", "outside the calibrated range: " + "; ".join(outside), None
        gate, ke = entry["gates"][family], entry["ke_gates"][family]
        has_stats = all(_finite(row.get(n)) for n in self.features(recipe))
        if has_stats and gate["skill"]:
            return "calibrated", gate["reason"], "full"
        why = "no plan statistics (run `planner stats` and pass --stats)" if not has_stats else gate["reason"]
        every = (entry.get("every_plan_reproduced") or {}).get(family)
        if every:
            why += (f"; every legal plan reproduces this fault on the calibration data of {family} ({every['reproduced']} of "
                    f"{every['decided']} decided rows, {every['rows']} rows, K/E {every['kept_fraction'][0]:g} to "
                    f"{every['kept_fraction'][1]:g})")  # fmt: skip
        if ke["ok"]:
            return "calibrated", f"{ke['reason']}; {why}", ke["variant"]
        return "no-skill", f"{why}; {ke['reason']}", None

    def scale(self, row: Mapping[str, Any], recipe: str) -> dict[str, Any]:
        """How far the target lies from the calibration models in width and depth, and how much the
        measured scale transfer (planner.fidelity.transfer) widens its interval."""
        from planner.fidelity.transfer import BASE_HIDDEN, fit_build, widening

        hidden = int(row["hidden_size"]) if _finite(row.get("hidden_size")) else None
        layers = int(row["num_layers"]) if _finite(row.get("num_layers")) else None
        kept = float(row["kept_fraction"]) if _finite(row.get("kept_fraction")) else None
        family = self.family(row, recipe)
        made = how_trained(family)[1] if family else "none"  # the trend measured on originals trained as the family's were ...
        built = how_built(family)[1] if family else "sliced"  # ... and proxies built as its were, where one is fitted
        fits, shape = self.info.get("transfer", {}), str(row.get("routing_shape") or "")
        read = fit_build(fits, recipe, shape, made, built)
        out = widening(fits, recipe, shape, hidden, layers, kept, made, read)
        if read != built:  # no trend of its own build: the sliced proxies' stands in, and the output says so
            out = {**out, "text": out["text"] + f"; the transfer was measured with sliced proxies, {built} ones at hidden {BASE_HIDDEN} only"}
        return out

    def features(self, recipe: str) -> tuple[str, ...]:
        """The features the recipe's full model was fitted on (older files: SHIFT_FEATURES)."""
        return tuple(self.recipes[recipe].get("features", SHIFT_FEATURES))

    def _fitted(self, row: Mapping[str, Any], recipe: str) -> dict[str, Any]:
        """The models and domain a prediction for `row` uses: its family's own where it has them,
        else those fitted on every family."""
        entry = self.recipes[recipe]
        family = self.family(row, recipe)
        return entry.get("local", {}).get(family) or {"models": entry["models"], "domain": entry["domain"]}

    def outside(self, row: Mapping[str, Any], recipe: str) -> list[str]:
        """The features of `row` outside the range the calibration data its models were fitted on covered."""
        out = []
        for name, (lo, hi) in self._fitted(row, recipe)["domain"].items():
            value = row.get(name)
            if _finite(value) and not lo - 1e-9 <= float(value) <= hi + 1e-9:
                out.append(f"{name} {float(value):.4g} (calibrated {lo:.4g} to {hi:.4g})")
        return out

    def onset(self, row: Mapping[str, Any], recipe: str) -> dict[str, Any]:
        """The proxy/original onset ratio measured on the calibration curves of `row`'s family at the
        nearest calibrated K/E: {ok, reason, median, low, high, rows, where, job}. At a smaller job
        (`row`'s job columns) the ratio is multiplied by the factor the family's job grid measured
        for that job (`job_onset`); without one the ratio is not known there, and the reason says so."""
        from planner.rl.recipes import RECIPES

        entry = self.recipes.get(recipe)
        family = self.family(row, recipe) if entry is not None else None
        if family is None:
            return {"ok": False, "reason": f"{recipe} was never calibrated on this routing shape"}
        if recipe in RECIPES and RECIPES[recipe].kind == "static":
            return {"ok": False, "reason": f"{recipe} is a static recipe, probed at the initial weights: the calibration measures no onset"}
        measured = (entry.get("onsets") or {}).get(family)
        if not measured or not _finite(row.get("kept_fraction")):
            return {"ok": False, "reason": f"no calibration curves of {family} show the fault's onset"}
        m = min(measured, key=lambda m: abs(m["kept_fraction"] - float(row["kept_fraction"])))
        where = f"{family}, K/E {m['kept_fraction']:g}"
        if not math.isfinite(m["high"]):
            return {"ok": False, "reason": f"{m['never']} of {m['rows']} proxies' calibration curves ({where}) never showed the fault: the onset has "
                                           "no upper bound"}  # fmt: skip
        out = {"ok": True, "reason": f"measured on {m['rows']} calibration curves ({where})", "where": where, "job": "at the production job",
               **{k: m[k] for k in ("median", "low", "high", "rows")}}  # fmt: skip
        factor = job_onset(((entry.get("job_onsets") or {}).get(family) or {}), row)
        if factor is None:
            return out
        if not factor["ok"] or not math.isfinite(factor["high"]):
            why = factor.get("reason") or f"some of the job grid's curves ({factor['job']}) never showed the fault: the onset has no upper bound"
            return {"ok": False, "reason": f"the onset at this smaller job is not known: {why}"}
        return {**out, **{k: out[k] * factor[k] for k in ("median", "low", "high")}, "rows": out["rows"] + factor["rows"],
                "job": f"at the smaller job, the production job's ratio x the onset factor measured on {family}'s job grid at {factor['job']}: "
                       f"{factor['median']:.2f} [{factor['low']:.2f}, {factor['high']:.2f}]"}  # fmt: skip

    def job_support(self, row: Mapping[str, Any], recipe: str, *, translate: bool = False) -> dict[str, dict[str, Any]]:
        """Per job dimension (prompts, samples, length): may the reproduction shrink it for this fault
        on `row`'s family ({ok, min_share, rows, reason})? Only where the family's calibration data
        measured the fault at a smaller job and the estimator validated it; else it is held at the
        production value, and the reason says why. With `translate`, a dimension that moves the label
        by more than the tolerance is shrunk too, down to its smallest share measured on 2 originals
        or more, where the family's job term is validated (`_translatable`): the proxy then runs at the
        knob moved by the measured extra shift ({translated: True})."""
        entry = self.recipes.get(recipe)
        family = self.family(row, recipe) if entry is not None else None
        measured = ((entry or {}).get("job") or {}).get(family) or {}
        where = f"of {family}" if family else "of this routing shape"
        transfer = self._job_transfer(family, recipe)
        mixer = (_token_mixer(family) or "unknown") if transfer is not None else None
        if transfer is not None and mixer not in transfer.get("mixers", []):
            other = (f"its token mixer ({mixer}) differs from theirs ({', '.join(transfer.get('mixers', []))}), so their job "
                     f"support is not borrowed")  # fmt: skip
            transfer = None
        else:
            other = ""
        if transfer is not None:
            held = "; ".join(f"{f}'s from {', '.join(h['from'])}: {h['mae']:.2f} log2 against {h['mae_zero']:.2f} for no term ({h['rows']} rows)"
                             for f, h in transfer["held_out"].items())  # fmt: skip
        out = {}
        for dim, what in JOB_DIMENSIONS.items():
            m = dict(measured.get(dim) or {"ok": False, "rows": 0})
            if other:
                m["reason"] = f"{what}: no job grid measured {recipe} on {family}, only on other families, and {other}"
            elif transfer is not None and transfer["dims"].get(dim, {}).get("ok"):
                m = dict(transfer["dims"][dim])
                m["reason"] = (f"{what}: down to {m['min_share']:g} of the production value the label of {recipe} moves by less than "
                               f"+-{JOB_TOLERANCE_LOG2} log2 on every family a job grid measured ({', '.join(m['families'])}, {m['rows']} rows), "
                               f"not on {family} itself")  # fmt: skip
                m["transferred"] = (f"no job grid measured {family}: its job support is borrowed from the families one did "
                                    f"({', '.join(m['families'])}); held out a family at a time, the others' measured job term predicts {held}")  # fmt: skip
            elif transfer is not None and dim in transfer["dims"]:
                m["reason"] = (f"{what}: no job grid measured {recipe} on {family}, and the label moves by more than +-{JOB_TOLERANCE_LOG2} "
                               f"log2 at a smaller value on the families one did: {transfer['dims'][dim]['reason']}")  # fmt: skip
            elif m.get("ok"):
                m["reason"] = (f"{what}: down to {m['min_share']:g} of the production value the label of {recipe} moves by less than "
                               f"+-{JOB_TOLERANCE_LOG2} log2 on the calibration data {where} ({m['rows']} rows)")  # fmt: skip
            elif m.get("reason"):
                m["reason"] = f"{what}: {m['reason']}"
            else:
                m["reason"] = f"{what}: no calibration rows {where} measured {recipe} at a smaller value"
            out[dim] = m
        validated = self._translatable(family, recipe) if translate and transfer is None and not other else None
        for dim, m in out.items():
            levels = [lv for lv in m.get("levels") or [] if lv["originals"] >= 2]
            if validated and not m.get("ok") and levels:
                low = min(levels, key=lambda lv: lv["share"])
                moves = ", ".join(f"{lv['delta_mean']:+.2f} at {lv['share']:g}" for lv in levels)
                out[dim] = {**m, "ok": True, "translated": True, "min_share": low["share"], "levels": [{**lv, "ok": True} for lv in levels],
                            "reason": f"{JOB_DIMENSIONS[dim]}: the label moves by {moves} log2 on the calibration data {where}, beyond "
                                      f"+-{JOB_TOLERANCE_LOG2}; shrunk with the knob translated by that move ({validated})"}  # fmt: skip
        return out

    def _translatable(self, family: str | None, recipe: str) -> str | None:
        """Why the job term of `family` may translate the knob (its held-out job validation: plan + job
        beats the production job on held-out originals, the difference's interval below 0), or None."""
        found = ((self.recipes.get(recipe) or {}).get("job_holdout") or {}).get(family) if family else None
        if not found or "difference" not in found:
            return None
        mean, low, high = found["difference"]
        if not high < 0:
            return None
        term = found.get("job_term") or {}
        return (f"held out one original at a time over {found['originals']}, plan + job beats the production job by {mean:+.2f} log2 "
                f"[{low:+.2f}, {high:+.2f}]" + (f"; the job term alone errs by {term['mae']:.2f} log2 against {term['mae_zero']:.2f} for none"
                                               if term.get("mae") is not None else ""))  # fmt: skip

    def _job_transfer(self, family: str | None, recipe: str) -> dict[str, Any] | None:
        """The borrowed job support (`_job_transfer`) for a calibrated family that no job grid
        measured for this fault, or None."""
        entry = self.recipes.get(recipe) or {}
        transfer = entry.get("job_transfer")
        if family is None or not transfer or not transfer.get("dims"):
            return None
        mine = (entry.get("job") or {}).get(family) or {}
        return None if any(e.get("rows") for e in mine.values()) else transfer

    def job_holdout(self, row: Mapping[str, Any], recipe: str) -> dict[str, Any] | None:
        """The held-out validation of `row`'s family's job rows for this fault
        (planner.fidelity.job_validate), or None where no job grid measured it."""
        entry = self.recipes.get(recipe)
        family = self.family(row, recipe) if entry is not None else None
        found = ((entry or {}).get("job_holdout") or {}).get(family)
        return {"family": family, **found} if found else None

    def job_joint(self, row: Mapping[str, Any], recipe: str) -> list[dict[str, Any]]:
        """The joint-shrink checks of `row`'s family for this fault (`_job_joint`): each job measured
        with several dimensions shrunk together, its extra shift beside the summed single-dimension
        ones; empty where none was measured."""
        entry = self.recipes.get(recipe)
        family = self.family(row, recipe) if entry is not None else None
        transfer = self._job_transfer(family, recipe)
        if transfer is not None:
            return list(transfer["joint"])
        return list(((entry or {}).get("job_joint") or {}).get(family) or [])

    def predict(self, row: Mapping[str, Any], recipe: str, *, translate: bool = False) -> dict[str, Any]:
        """The `fidelity` block of one plan: {status, reason, p_reproduced, interval, shift_log2,
        shift_interval, measured_by_k}. P and the shift are numbers only when calibrated; with no
        skill the measured shift at the nearest calibrated K/E stands in for the prediction. With
        `translate`, the extra shift of job dimensions shrunk beyond the tolerance (`job_support`) is
        a knob translation ({job_translation}): P is that of the proxy run at the translated knob,
        the shift stays the one at the original's knob."""
        status, reason, variant = self.status(row, recipe)
        out: dict[str, Any] = {"status": status, "reason": reason, "recipe": recipe, "p_reproduced": None, "interval": None,
                               "shift_log2": None, "shift_interval": None, "tolerance_log2": self.tolerance}  # fmt: skip
        entry = self.recipes.get(recipe)
        support = self.job_support(row, recipe, translate=translate) if entry is not None else {}
        moved_by = job_offset({d: e for d, e in support.items() if e.get("translated")}, row)[0]  # what the knob translation absorbs
        if moved_by:
            out["job_translation"] = self._job_translation(recipe, moved_by)
        if status == "calibrated":
            model = self._fitted(row, recipe)["models"][variant]
            out["fitted_on"] = "its family" if self.family(row, recipe) in entry.get("local", {}) else "every family"
            out["basis"] = "plan statistics" if variant == "full" else variant
            x = design([row], self.features(recipe) if variant == "full" else baselines(recipe)[variant])
            p, low, high = model.p_within(x, self.tolerance)
            shift_low, shift_high = model.predict_interval(x)
            scale = self.scale(row, recipe)
            job_shift, wj = job_offset(support, row)  # a smaller job: its measured extra shift and spread
            if job_shift or wj:
                out["job_shift_log2"] = [job_shift - wj, job_shift + wj]
            shift = job_shift + (scale.get("shift") or 0.0)  # and the label's measured trend with width and depth, where followed
            at = shift - moved_by  # the shift the proxy sees at the knob it runs at
            if at or wj:
                p, low, high = model.p_within(x, self.tolerance, offset=at)
            w = (scale.get("halfwidth") or 0.0) + wj
            if w:  # the label may move by up to w at the target's scale and job: P over that move
                lowest, highest = model.p_range(x, self.tolerance, at - w, at + w)
                low, high = np.minimum(low, lowest), np.maximum(high, highest)
            out.update(p_reproduced=float(p[0]), interval=[float(low[0]), float(high[0])], shift_log2=float(model.predict(x)[0]) + shift,
                       shift_interval=[float(shift_low[0]) + shift - w, float(shift_high[0]) + shift + w])  # fmt: skip
        elif status == "no-skill" and entry is not None and _finite(row.get("kept_fraction")) and entry["measured_by_k"]:
            family = self.family(row, recipe)
            measured = [m for m in entry["measured_by_k"] if m.get("family", family) == family] or entry["measured_by_k"]
            out["measured_by_k"] = min(measured, key=lambda m: abs(m["kept_fraction"] - float(row["kept_fraction"])))
        family = self.family(row, recipe) if entry is not None else None
        if family is not None:
            if variant in (None, "full"):  # the plan-level model's held-out figures against K/E alone
                g = entry["gates"][family]
                held = {"variant": "full", "mae": g.get("mae"), "baseline": "K/E alone", "baseline_mae": g.get("mae_ke")}
            else:  # the K/E-level model's against the recipe's mean shift
                g = entry["ke_gates"][family]
                held = {"variant": variant, "mae": g.get("mae"), "baseline": "the recipe mean", "baseline_mae": g.get("mae_mean")}
            held.update({k: g.get(k) for k in ("noise_mae", "coverage", "auc")})
            shape_family, made = how_trained(family)
            out["family"] = {"name": family, "balancing": made, "build": how_built(family)[1], "routing_shape": entry["families"][family]["routing_shape"],
                             "originals": entry["families"][family]["originals"], "rows": entry["families"][family]["rows"],
                             "held_out": held, "scale": self.scale(row, recipe)["text"]}  # fmt: skip
            # the label is read against where they start (measured for sliced proxies)
            if recipe == "router-collapse" and self.info.get("starts", {}).get(shape_family) and out["family"]["build"] == "sliced":
                out["family"]["start"] = self.info["starts"][shape_family]
        translation = knob_translation(recipe, out)
        if translation:
            out["knob_translation"] = translation
        return out

    @staticmethod
    def _job_translation(recipe: str, moved_by: float) -> dict[str, Any]:
        """The knob move a translated smaller job asks for, in log2 units and the knob's own."""
        from planner.fidelity.labels import knob_scale
        from planner.rl.recipes import RECIPES

        knob = RECIPES[recipe].knob if recipe in RECIPES else "the knob"
        value = moved_by / knob_scale(recipe)
        return {"log2": moved_by, "knob": value,
                "text": f"the job grid measured the fault moving by {moved_by:+.2f} log2 at this job: where the original fails at {knob} = X, "
                        f"run the proxy at X {value:+.2f} (P is the proxy's there; the plan's own shift comes on top)"}  # fmt: skip

    def to_json(self) -> dict:
        recipes = {}
        for name, entry in self.recipes.items():
            models = lambda ms: {v: (m.to_json() if m is not None else None) for v, m in ms.items()}  # noqa: E731
            recipes[name] = {**{k: v for k, v in entry.items() if k not in ("models", "local")}, "models": models(entry["models"]),
                             "domain": {k: list(v) for k, v in entry["domain"].items()},
                             "local": {f: {"models": models(lo["models"]), "domain": {k: list(v) for k, v in lo["domain"].items()}}
                                       for f, lo in entry.get("local", {}).items()}}  # fmt: skip
        return {"schema": SCHEMA, "tolerance_log2": self.tolerance, "recipes": recipes,
                "info": self.info}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict) -> "FidelityEstimator":
        if not isinstance(data, dict):
            raise ValueError(f"not a fidelity estimator file (a JSON {type(data).__name__}, not an object); fit one with `planner calibrate fit`")
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a fidelity estimator file of this version (schema {data.get('schema')!r}, want {SCHEMA}; refit it "
                             "with `planner calibrate fit`)")  # fmt: skip
        recipes = {}
        models = lambda ms: {v: (ShiftModel.from_json(m) if m is not None else None) for v, m in ms.items()}  # noqa: E731
        domain = lambda d: {k: (float(v[0]), float(v[1])) for k, v in d.items()}  # noqa: E731
        for name, entry in data["recipes"].items():
            recipes[name] = {**entry, "models": models(entry["models"]), "domain": domain(entry["domain"]),
                             "local": {f: {"models": models(lo["models"]), "domain": domain(lo["domain"])} for f, lo in entry.get("local", {}).items()}}  # fmt: skip
        return cls(recipes, data.get("info", {}), float(data.get("tolerance_log2", 1.0)))

    def save(self, path: str | Path) -> None:
        from planner.files import rounded_floats, write_text_atomic

        write_text_atomic(path, json.dumps(rounded_floats(self.to_json()), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "FidelityEstimator":
        from planner.files import read_json

        p = Path(path)
        data = read_json(p, "fidelity estimator", "; fit one with `planner calibrate fit`")
        try:
            return cls.from_json(data)
        except (ValueError, KeyError, TypeError) as exc:
            raise SpecError(f"{p}: {exc}") from None
