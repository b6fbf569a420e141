"""What `planner suggest` gives back: the ranked table, the JSON, and the plan file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.cost.fit import feature_validation, step_validation
from planner.fidelity.estimator import family_text
from planner.plan import Plan
from planner.render import table
from planner.search.reproduction import JobScale, split_text
from planner.search.suggest import OFFLOADS, Option, Suggestion, calibration_files, figures, reduction
from planner.stats.store import plan_key
from planner.summary import feature_validation_lines, validation_text
from planner.units import gib

__all__ = ["render_suggestion", "suggestion_json", "plan_of", "fidelity_text"]


def fidelity_text(f: dict) -> str:
    """One table cell for a fidelity block: P with its interval only where it is calibrated."""
    if f["status"] == "original":
        return "1 (original)"
    if f["status"] == "calibrated":
        basis = "" if f.get("basis", "plan statistics") == "plan statistics" else f" ({f['basis']})"
        return f"{f['p_reproduced']:.2f} [{f['interval'][0]:.2f}, {f['interval'][1]:.2f}], shift {f['shift_log2']:+.2f}{basis}"
    if f["status"] == "no-skill" and f.get("measured_by_k"):
        m = f["measured_by_k"]
        return f"no skill; measured shift {m['shift_mean']:+.2f} +- {m['shift_sd']:.2f} (noise {m['noise_log2']:.2f})"
    return {"no-skill": "no skill", "uncalibrated": "uncalibrated", "not-applicable": "not applicable"}[f["status"]]


def _row(o: Option, baseline, job) -> list[Any]:
    c = o.cost
    peak = c.peak_memory_bytes
    r = reduction(o, baseline)
    return [
        "original" if o.experts == c.original_experts else o.experts,
        o.method if o.experts != c.original_experts else "-",
        c.num_devices,
        f"{c.train_layout.describe()} / {c.rollout_layout.describe()}",
        f"{o.recompute}, pools {c.pools['rollout_devices']}+{c.pools['train_devices']}" if c.pools else f"{o.recompute}, offload {o.offload}",
        f"{gib(peak, suffix=False)} ({gib(c.usable_bytes_per_device - peak, suffix=False)})",
        o.scale.describe(job) if not o.scale.production else "production",
        f"{c.step_time_s:,.0f}",
        f"{c.device_hours_per_step:,.2f}",
        o.steps,
        f"{o.reproduction_hours:,.1f}",
        _times(r["cards"], 1),
        _times(r["reproduction_hours"], 2),
        fidelity_text(o.fidelity),
    ]


def _custom_profile(s: Suggestion) -> Path | None:
    """The user's profile file the accelerator came from (None: a catalog accelerator)."""
    from planner.catalog import catalog_accelerators

    return None if s.request.hardware.strip().lower() in catalog_accelerators() else Path(s.request.hardware).expanduser().resolve()


def _accelerator_text(s: Suggestion) -> str:
    """A catalog id, or a user's profile by the name it gives and its file."""
    profile = _custom_profile(s)
    return s.accelerator.id if profile is None else f"{s.accelerator.name} (profile {profile})"


def _times(ratio: float | None, digits: int) -> str:
    """A reduction as the table shows it: '4.0x' fewer, or '2.0x more' where the point needs more."""
    if not ratio:
        return "-"
    return f"{ratio:.{digits}f}x" if ratio >= 1 else f"{1 / ratio:.{digits}f}x more"


def _settings(c) -> str:
    if c.pools:
        return (f"recompute {c.job.recompute}, separate pools ({c.pools['rollout_devices']} rollout + {c.pools['train_devices']} training, "
                f"staleness {c.pools['max_staleness']})")  # fmt: skip
    offload = next((name for name, value in OFFLOADS.items() if c.job and c.job.offload == value), "?")
    return f"recompute {c.job.recompute if c.job else '?'}, offload {offload}"


def render_suggestion(s: Suggestion, top: int = 5) -> str:
    req, unit = s.request, s.accelerator.device_unit
    head = (f"{req.model} on {_accelerator_text(s)}, budget {s.budget.describe(s.accelerator)}, fault {req.fault} "
            f"(recipe {s.recipe}), calibrated P >= {req.min_fidelity} ({'plan statistics' if s.fidelity_source == 'stats' else 'no plan statistics: P from K/E and the routing shape, basis per row'})")  # fmt: skip
    if req.settle_bias:
        head += "; proxies with their correction bias settled again (build with --settle-bias)"
    lines = [head]
    lines.extend(f"WARNING: {w}" for w in s.warnings)
    if s.baseline is not None and s.baseline.named:
        b = s.baseline.minimum
        lines.append(f"baseline: {s.baseline.named}: {b.device_hours_per_step:,.2f} {unit}-hours/step ({b.step_time_s:,.0f} s on "
                     f"{b.num_devices} {unit}s, {b.train_layout.describe()} / {b.rollout_layout.describe()}). Reductions against it.")  # fmt: skip
    elif s.baseline is not None:
        m, c = s.baseline.minimum, s.baseline.cheapest
        lines.append(f"original, with the same {req.memory_margin:.0%} memory margin: {m.num_devices} {unit}s minimum "
                     f"({m.device_hours_per_step:,.2f} {unit}-hours/step there); cheapest {c.device_hours_per_step:,.2f} {unit}-hours/step "
                     f"on {c.num_devices} {unit}s ({_settings(c)}). Reductions: {unit}s against the minimum, hours against the cheapest.")  # fmt: skip
    if s.budget.max_devices is not None and s.device_counts[-1] < s.budget.max_devices:
        lines.append(f"note: {s.budget.max_devices} {unit}s is not an allocation size of {s.accelerator.id} (whole cards below a node of "
                     f"{s.accelerator.devices_per_node}, whole nodes above); searched up to {s.device_counts[-1]}")  # fmt: skip
    headers = ["K", "method", unit + "s", "layout train / rollout", "recompute, offload", f"peak GiB/{unit} (headroom)", "job", "step s",
               f"{unit}-h/step", "steps", f"{unit}-h to fault", f"fewer {unit}s", "fewer hours to fault",
               "fidelity: P(reproduced) [interval] or status"]  # fmt: skip
    if s.ranked:
        lines.append("")
        shown = s.ranked[:top]
        title = ("cheapest proxies that clear the threshold" if any(o.p_reproduced is not None for o in shown)
                 else "cheapest proxies that pass the hard rules (none has a calibrated P)")  # fmt: skip
        lines.append(table(headers, [_row(o, s.baseline, req.job) for o in shown], title=title))
        best = s.best
        lines.append("")
        f = best.fidelity
        if f["status"] != "original":
            lines.append(f"fidelity of the best: {f['status']}: {f['reason']}")
            if f.get("family"):
                lines.append("  rests on " + family_text(f["family"]))
            if f["status"] != "calibrated":
                lines.append("  no calibrated P: ranked by cost among plans that pass the hard rules (see `planner calibrate report`)")
        if f.get("job_translation"):
            lines.append("knob at this job: " + f["job_translation"]["text"])
        if f.get("knob_translation"):
            lines.append("knob: " + f["knob_translation"]["text"])
        lines.extend(reproduction_lines(s, best))
        lines.append("kept for the fault: " + "; ".join(s.factors))
        if best.placement:
            lines.append("placement: " + best.placement)
        lines.extend(f"note: {n}" for n in best.cost.notes)
    else:
        lines.append("")
        lines.append("no proxy clears every constraint (no plan is written):")
        lines.extend(f"  - {d}" for d in s.diagnosis)
        rests = next((o.fidelity["family"] for o in s.pareto if o.fidelity.get("family")), None)
        if rests:  # what the predicted P above rests on
            lines.append("  the predicted P rests on " + family_text(rests))
    if any(o.experts != o.cost.original_experts for o in s.pareto):  # a front of the original alone says nothing
        lines.append("")
        front = [["original" if o.experts == o.cost.original_experts else o.experts, o.method if o.experts != o.cost.original_experts else "-",
                  o.cost.num_devices, "production" if o.scale.production else o.scale.describe(req.job), f"{o.cost.device_hours_per_step:,.2f}",
                  f"{o.reproduction_hours:,.1f}", fidelity_text(o.fidelity)] for o in s.pareto]  # fmt: skip
        lines.append(table(["K", "method", unit + "s", "job", f"{unit}-h/step", f"{unit}-h to fault", "fidelity"], front,
                           title="Pareto set: cost to the fault vs predicted fidelity"))  # fmt: skip
    lines.append("")
    how = (f"the whole space of {s.space_points} points enumerated" if s.enumerated
           else f"NSGA-II over a space of {s.space_points} points, too large to enumerate")  # fmt: skip
    lines.append(f"{s.trials} trials, {len(s.options)} distinct points evaluated ({how}), {s.seconds:.1f} s"
                 + (f"; the best first appeared at trial {s.best_trial}" if s.best_trial is not None else ""))  # fmt: skip
    lines.append(calibration_line(s.accelerator))
    lines.extend(feature_validation_lines(best_features(s)))
    return "\n".join(lines)


def best_features(s: Suggestion) -> list[dict[str, Any]]:
    """What backs the best plan's step where its job has what no fitted run has (separate pools,
    speculative decoding, an FP8 rollout): planner.cost.fit.feature_validation."""
    job = s.best.cost.job if s.best else None
    return feature_validation(job, s.accelerator.family) if job is not None else []


def job_search_text(s: Suggestion) -> str:
    """Which job dimensions the search shrank, and why each other one stays at the production value."""
    req = s.request
    free = [dim for dim, v in s.job_support.items() if v.get("ok")]
    if free and len(s.job_scales) > 1:
        head = f"job searched: {len(s.job_scales)} reproduction jobs ({', '.join(free)} shrunk within {req.job_bounds.describe()})"
    else:
        head = f"job: the production job ({JobScale().describe(req.job)})" + (", held there by --job-bounds" if free else "")
    why: dict[str, list[str]] = {}  # dimensions held for the same reason, named together
    for v in s.job_support.values():
        if not v.get("ok"):
            what, _, reason = v["reason"].partition(": ")
            why.setdefault(reason, []).append(what)
    held = [f"{', '.join(whats)}: {reason}" for reason, whats in why.items()]
    text = head + (f"; held at the production value, since the fidelity of a smaller job is not known ({'; '.join(held)})" if held else "")
    if len(free) >= 2 and len(s.job_scales) > 1:
        text += "; " + joint_text(s.job_joint)
    if free and len(s.job_scales) > 1 and s.job_holdout and "variants" in s.job_holdout:
        text += "; " + holdout_text(s.job_holdout)
    moved = [v["reason"] for v in s.job_support.values() if v.get("ok") and v.get("translated")]
    if moved and len(s.job_scales) > 1:
        text += "; --translate-knob: " + "; ".join(moved)
    borrowed = next((v["transferred"] for v in s.job_support.values() if v.get("ok") and v.get("transferred")), None)
    if borrowed and len(s.job_scales) > 1:
        text += "; " + borrowed
    return text


def holdout_text(h: dict[str, Any]) -> str:
    """The smaller jobs' held-out validation on the family, in words."""
    v = h["variants"]
    full, production = v["plan + job"], v["production job"]
    return (f"held out one original at a time ({h['originals']} originals of {h['family']}, {h['rows']} proxy rows at smaller jobs), "
            f"the predicted shift errs by {full['mae']:.2f} log2 (interval coverage {full['coverage']:.2f}) against "
            f"{production['mae']:.2f} ({production['coverage']:.2f}) ignoring the job, noise floor {h['noise_mae']:.2f}")  # fmt: skip


def joint_text(joint: list[dict[str, Any]]) -> str:
    """How dimensions shrunk together are priced: the measured joint jobs against the summed
    single-dimension shifts, or that the sum is not measured."""
    if not joint:
        return "shrunk together, the dimensions' measured extra shifts are added (no joint job measured)"
    parts = []
    for level in joint:
        lo, hi = level["delta_interval"]
        at = " x ".join(f"{dim} {share:g}" for dim, share in level["shares"].items() if share < 1)
        on = f" on {level['family']}" if level.get("family") else ""
        parts.append(f"at {at}{on}: {level['delta_mean']:+.2f} [{lo:+.2f}, {hi:+.2f}] measured, {level['summed']:+.2f} summed")
    if all(level["ok"] for level in joint):
        return "dimensions shrunk together add their extra shifts, a sum the jointly measured jobs bear out (" + "; ".join(parts) + ")"
    return ("one dimension shrinks at a time, since at a jointly measured job the summed extra shifts differ from the measured one by "
            "more than +-0.5 log2, or the job rests on fewer than 2 originals (" + "; ".join(parts) + ")")  # fmt: skip


def reproduction_lines(s: Suggestion, best: Option) -> list[str]:
    """The best plan's reproduction: its job, the onset, hours and wall time to the fault, and the
    reduction split by mechanism."""
    unit = s.accelerator.device_unit
    lines = [job_search_text(s)]
    o = best.onset
    if o is not None:
        cost = f"{best.reproduction_hours:,.1f} {unit}-hours and {best.cost.step_time_s * o.steps / 3600:,.1f} h of wall time"
        if o.original is not None:
            lines.append(f"onset: the original showed the fault at step {o.original}; the proxy's is predicted at step {o.proxy:,.1f} "
                         f"[{o.interval[0]:,.1f}, {o.interval[1]:,.1f}] ({o.basis}); the reproduction runs {o.steps} steps: {cost} to the fault")  # fmt: skip
        else:
            lines.append(f"onset: {o.basis}: {cost}")
    split = split_text(reduction(best, s.baseline), unit)
    if split:
        lines.append("reduction of the best: " + split)
    return lines


def calibration_line(accelerator=None) -> str:
    """The calibration files in use and what backs the step times: over every published run, or over
    the runs of `accelerator`'s family (saying whether any ran on it)."""
    files = calibration_files()
    return f"calibration files: knobs {files['knobs']}; fidelity estimator {files['estimator']}\n{validation_text(_step_validation(accelerator))}"


def _step_validation(accelerator=None) -> dict | None:
    return step_validation(accelerator.family, accelerator=accelerator.id) if accelerator is not None else step_validation()


def suggestion_json(s: Suggestion, top: int = 10) -> dict[str, Any]:
    b = s.baseline
    return {
        "request": {"model": s.request.model, "hardware": s.request.hardware, "budget": s.request.budget, "fault": s.request.fault,
                    "recipe": s.recipe, "min_fidelity": s.request.min_fidelity, "trials": s.request.trials, "seed": s.request.seed,
                    "fidelity_source": s.fidelity_source, "steps": s.request.steps, "fault_step": s.request.fault_step,
                    "job_bounds": {"batch": s.request.job_bounds.batch, "length": s.request.job_bounds.length},
                    "memory_margin": s.request.memory_margin, "proxy_build": "settled" if s.request.settle_bias else "sliced"},  # fmt: skip
        "job_search": {"dimensions": s.job_support, "joint": s.job_joint, "jobs": [j.to_json(s.request.job) for j in s.job_scales],
                       "held_out": s.job_holdout, "text": job_search_text(s)},  # fmt: skip
        "original": {**figures(b.minimum), "memory_breakdown_bytes": b.minimum.memory_per_device_bytes,
                     "cheapest": {**figures(b.cheapest), "settings": _settings(b.cheapest)}, "baseline": b.named or "default",
                     "steps": b.steps, "reproduction_hours": b.cheapest.device_hours_per_step * b.steps,
                     "layout_factor": b.layout_factor} if b else None,  # fmt: skip
        "plans": [o.to_json(b, s.request.job) for o in s.ranked[:top]],
        "pareto": [o.to_json(b, s.request.job) for o in s.pareto],
        "diagnosis": s.diagnosis,
        "warnings": s.warnings,
        "calibration_files": calibration_files(),
        "step_time_validation": _step_validation(s.accelerator),
        "feature_validation": best_features(s),
        "fault_relevant_factors": s.factors,
        "device_counts": s.device_counts,
        "trials": s.trials,
        "search": {"space_points": s.space_points, "enumerated": s.enumerated},
        "evaluated_points": len(s.options),
        "best_trial": s.best_trial,
        "seconds": s.seconds,
    }


def plan_of(s: Suggestion, o: Option) -> Plan:
    """The plan file of one option: kept sets from the stats file when there is one, else deferred
    to build time (the method chooses them from the checkpoint); the deployment and predictions."""
    from planner.stats.compute import plan_from_stats

    c = o.cost
    target_ep = tuple(sorted({c.train_layout.ep, c.rollout_layout.ep}))
    deployment = {
        "hardware": s.accelerator.id if _custom_profile(s) is None else str(_custom_profile(s)),  # what load_accelerator reads back
        "num_cards": c.num_devices,
        "device_unit": c.device_unit,
        "train_layout": c.train_layout.to_dict(),
        "rollout_layout": vars(c.rollout_layout),
        "recompute": o.recompute,
        "offload": o.offload,
        "job": c.job.to_dict() if c.job else None,
        "production_job": s.request.job.to_dict(),  # the job the reproduction's job was shrunk from (preflight compares them)
        "fault": s.request.fault,
        "recipe": s.recipe,
        "budget": s.request.budget,
        "min_fidelity": s.request.min_fidelity,
        "predicted": {
            "memory_per_card_bytes": c.peak_memory_bytes,
            "usable_bytes_per_card": c.usable_bytes_per_device,
            "step_time_s": c.step_time_s,
            "accelerator_hours_per_step": c.device_hours_per_step,
            "steps": o.steps,
            "onset": o.onset.to_json() if o.onset else None,
            "reproduction_hours": o.reproduction_hours,
            "fidelity": dict(o.fidelity),
        },
    }
    deployment = json.loads(json.dumps(deployment, default=lambda v: v.item()))  # numpy scalars -> YAML-safe numbers
    stats = s.request.stats
    settle = s.request.settle_bias
    if stats and plan_key(o.experts, o.method) in stats.get("plans", {}):
        chosen = plan_from_stats(stats, o.experts, o.method, model=s.request.model, target_ep=target_ep, seed=stats.get("seed", 0),
                                 settle_bias=settle)  # fmt: skip
        return Plan(**{**chosen.__dict__, "deployment": deployment})
    if settle:  # resolved at build time: `planner build --plan` settles it from the stats file it is given
        deployment["settle_bias"] = True
    return Plan(model=s.request.model, experts=o.experts, original_experts=c.original_experts, layers={}, method=o.method,
                target_ep=target_ep, seed=s.request.seed, deployment=deployment)  # fmt: skip
