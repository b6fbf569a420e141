"""Fit the efficiency knobs to the published RL runs, and say how well they predict a run left out.

Free parameters, fewer than the runs of each family: per accelerator family the achieved compute
fraction in the update and in forward-only passes, attention's rate relative to theirs (long
sequences separate it: the 32K runs against the 3K ones) and the decode bandwidth fraction, which
belong to the chip and its kernels; shared by both families the knobs that belong to the RL
software rather than the chip (the inference engine's per-step overhead, the per-tensor and fixed
switch costs). The all-to-all efficiency and the expert imbalance of real routers stay at their
priors: no published pair of runs separates them from the compute fraction (the one
balanced-routing run, ds-r1-a3-random, also differs in recompute and data dispatch). Everything else is a
mechanism with sourced inputs (accelerator profiles: bandwidths, collective latencies, eager launch
cost per layer, host Adam rate).

The objective is the sum of squared log-ratios predicted/published over every published phase
(rollout, reference, old log-prob, update, switch) and the step total of every run, plus a weak
pull of each knob towards its prior (log-ratio, weight `PRIOR_WEIGHT`) so knobs no run constrains
stay at literature values. Coordinate descent on log(knob) with shrinking steps, inside
`KNOB_BOUNDS`; deterministic. `leave_one_out` refits without each run in turn and predicts it: the
out-of-sample error. Results (knobs, residuals, leave-one-out) go to calibration/knobs.json.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from planner.catalog import load_accelerator, load_model
from planner.cost.evaluate import CostResult, evaluate
from planner.cost.knobs import KNOB_BOUNDS, PRIOR, Knobs, knobs_path
from planner.errors import PlannerError, SpecError
from planner.files import read_yaml
from planner.specs import Job

__all__ = ["PublishedRun", "load_runs", "predict", "fit", "fit_all", "leave_one_out", "residual_table", "validation_effects", "update_mfu_checks", "weight_sync_checks", "effect_checks", "exposed_generation_s", "loo_summary", "step_validation", "feature_validation", "JOB_FEATURES", "PHASES"]

PHASES = ("rollout", "reference", "old_logprob", "update", "switch", "step")
PRIOR_WEIGHT = 0.05
FAMILY_KNOBS = ("train_mfu", "logprob_mfu", "decode_mbu", "attention_efficiency")
SHARED_KNOBS = ("decode_step_overhead_s", "switch_tensor_s", "switch_fixed_s")
SHARED = "shared"


@dataclass(frozen=True)
class PublishedRun:
    id: str
    title: str
    model: str
    hardware: str
    devices: int
    job: Job
    published: dict[str, float]
    sources: list[str]
    assumed: dict[str, str]
    switch_in: str = "step"  # where the published times count the switch: one of SWITCH_IN
    base: str | None = None  # a validation row: the fitted run it varies (its effect is the ratio of the two)
    not_modelled: str = ""  # an `expressed` row: the part of its step the cost model has no term for

    @property
    def family(self) -> str:
        return load_accelerator(self.hardware).family


def runs_path() -> Path:
    return Path(str(resources.files("planner._calibration"))) / "published_runs.yaml"


def load_runs(path: str | Path | None = None, section: str = "runs") -> list[PublishedRun]:
    """The published runs the knobs are fitted to (`runs`), the rows that only check them
    (`validation`), or those the cost model accepts as jobs but cannot predict (`expressed`: part of
    their step has no term in the model, named in `not_modelled`)."""
    where = Path(path or runs_path())
    data = read_yaml(where, "published runs")
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or not data["runs"]:
        raise SpecError(f"{where}: not a published-runs file (a 'runs:' list of runs; see calibration/published_runs.yaml)")
    required = ("id", "title", "model", "hardware", "devices", "job", "published")
    out = []
    for n, r in enumerate(data.get(section) or []):
        missing = [k for k in required if not isinstance(r, dict) or k not in r]
        if missing:
            raise SpecError(f"{where}: run {n + 1} ({r.get('id', '?') if isinstance(r, dict) else r!r}) lacks {', '.join(missing)}")
        out.append(
            PublishedRun(
                id=r["id"],
                title=r["title"],
                model=r["model"],
                hardware=r["hardware"],
                devices=int(r["devices"]),
                job=Job.from_dict(r["job"], where=f"published run {r['id']}"),
                published={k: float(v) for k, v in r["published"].items()},
                sources=list(r.get("sources", [])),
                assumed=dict(r.get("assumed", {})),
                switch_in=_switch_in(r, where),
                base=r.get("base"),
                not_modelled=str(r.get("not_modelled", "")),
            )
        )
    return out


def update_mfu_checks(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Predicted vs published actor-update MFU (not fitted; a check of the update model)."""
    from planner.cost.layouts import TrainCandidates
    from planner.cost.model import CostModel

    data = read_yaml(path or runs_path(), "published runs")
    rows = []
    for check in data.get("mfu_checks", []):
        arch, accel = load_model(check["model"]), load_accelerator(check["hardware"])
        job = Job.from_dict(check["job"], where=f"mfu check {check['id']}")
        if job.train_layout is None:
            raise SpecError(f"mfu check {check['id']}: the job needs the train_layout the MFU was measured with")
        model = CostModel(arch, accel, job)
        for devices, published in zip(check["devices"], check["published_mfu"]):
            update_s = float(model.train(TrainCandidates.single(devices, job.train_layout)).update_s[0])
            predicted = model.update_model_flops() / (update_s * devices * model.train_peak_flops())
            rows.append({"check": check["id"], "devices": devices, "published_mfu": published,
                         "predicted_mfu": round(predicted, 3), "ratio": round(predicted / published, 3)})
    return rows


def _checks(path: str | Path | None, section: str) -> tuple[list[dict[str, Any]], dict[str, PublishedRun]]:
    """A checks section of the published-runs file and the published runs (fitted and validation rows) its checks name."""
    data = read_yaml(path or runs_path(), "published runs")
    checks = data.get(section) or []
    if not isinstance(checks, list):
        raise SpecError(f"{path or runs_path()}: {section} is a list of checks, got {type(checks).__name__}")
    return checks, {run.id: run for part in ("runs", "validation") for run in load_runs(path, section=part)}


def weight_sync_checks(path: str | Path | None = None, knobs: dict[str, Knobs] | None = None) -> list[dict[str, Any]]:
    """Predicted vs published weight sync between separate pools (not fitted; a check of
    `CostModel.pool_sync_seconds`): each check names the published run whose layouts it was measured
    at. `knobs`: per family (default: the stored fit)."""
    from planner.cost.knobs import load_knobs

    checks, runs = _checks(path, "sync_checks")
    rows = []
    for check in checks:
        run = runs.get(check["run"])
        if run is None or run.job.colocated:
            raise SpecError(f"sync check {check['id']}: {check['run']!r} is not a published run on separate pools")
        result = predict(run, knobs[run.family] if knobs and run.family in knobs else load_knobs(run.family))
        predicted = result.pools["weight_sync_s"]
        rows.append({"check": check["id"], "run": run.id, "published_s": check["published_s"], "predicted_s": round(predicted, 2),
                     "ratio": round(predicted / check["published_s"], 3)})  # fmt: skip
    return rows


def exposed_generation_s(result: CostResult) -> float:
    """Between separate pools, the training pool's wait for generation each step: the step less the
    training passes and the weight sync (NeMo RL's `exposed_generation` timer); 0 where training
    bounds the step (float noise aside)."""
    p = result.pools
    return max(0.0, result.step_time_s * (1.0 - p["train_busy"]) - p["weight_sync_s"])


EFFECT_QUANTITIES = ("step_s", "tokens_per_s_per_gpu", "exposed_generation_s")


def effect_checks(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Predicted vs published effect of one change (`change`: job keys) to a published run's job,
    which the trainer's authors measured as a pair of runs with the same code (not fitted). The
    pair's absolute times belong to its code, not to the run's release, so only what the pair
    itself shows is compared, each published as [before, after]: the step's ratio after/before
    (`step_s`), the throughput's (`tokens_per_s_per_gpu`) and, between separate pools, the training
    pool's wait for generation before and after (`exposed_generation_s`)."""
    from planner.cost.knobs import load_knobs
    from planner.specs import check_keys

    checks, runs = _checks(path, "effect_checks")
    rows = []
    for n, check in enumerate(checks, 1):
        where = f"effect check {check.get('id', n) if isinstance(check, dict) else n}"
        if not isinstance(check, dict):
            raise SpecError(f"{where}: expected a mapping, got {check!r}")
        check_keys(check, ["id", "title", "run", "change", "published", "assumed", "sources"], where, required=("id", "run", "change", "published"))
        run = runs.get(check["run"])
        if run is None:
            raise SpecError(f"{where}: {check['run']!r} is not a published run (runs: {', '.join(sorted(runs))})")
        if not isinstance(check["change"], dict) or not check["change"]:
            raise SpecError(f"{where}: change names the job keys the pair changed (a mapping), got {check['change']!r}")
        published = check["published"]
        if not isinstance(published, dict) or not published or not set(published) <= set(EFFECT_QUANTITIES):
            raise SpecError(f"{where}: published maps {', '.join(EFFECT_QUANTITIES)} to [before, after], got {published!r}")
        for name, pair in published.items():
            least = 0.0 if name == "exposed_generation_s" else math.ulp(0.0)
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= least for v in pair)):
                raise SpecError(f"{where}: published.{name} is [before, after], two finite numbers{' of at least 0' if least == 0 else ' above 0'}, "
                                f"got {pair!r}")  # fmt: skip
        if "exposed_generation_s" in published and run.job.colocated:
            raise SpecError(f"{where}: exposed_generation_s is the training pool's wait between separate pools; {run.id} is colocated")
        changed = replace(run, job=Job.from_dict({**run.job.to_dict(), **check["change"]}, where=f"{where}.change"))
        knobs = load_knobs(run.family)
        before, after = predict(run, knobs), predict(changed, knobs)
        for label, result in (("before", before), ("after", after)):
            if not result.feasible:
                raise SpecError(f"{where}: the model finds the job {label} the change infeasible: {'; '.join(result.reasons[:3])}")

        def row(quantity: str, pair: list[float], predicted: float, ratio_of_pair: bool) -> dict[str, Any]:
            value = pair[1] / pair[0] if ratio_of_pair else pair[0 if "before" in quantity else 1]
            return {"check": check["id"], "run": run.id, "quantity": quantity, "published": round(value, 3), "predicted": round(predicted, 3),
                    "ratio": round(predicted / value, 3) if value else None}  # fmt: skip

        if "step_s" in published:
            rows.append(row("step after / before", published["step_s"], after.step_time_s / before.step_time_s, True))
        if "tokens_per_s_per_gpu" in published:
            rows.append(row("tokens/s after / before", published["tokens_per_s_per_gpu"],
                            after.tokens_per_s_per_device / before.tokens_per_s_per_device, True))  # fmt: skip
        if "exposed_generation_s" in published:
            rows.append(row("exposed generation before s", published["exposed_generation_s"], exposed_generation_s(before), False))
            rows.append(row("exposed generation after s", published["exposed_generation_s"], exposed_generation_s(after), False))
    return rows


def predict(run: PublishedRun, knobs: Knobs) -> CostResult:
    arch = load_model(run.model)
    accel = load_accelerator(run.hardware)
    return evaluate(arch, accel, run.job, run.devices, knobs=knobs, memory_margin=0.0)  # as the run ran: nothing kept free


# step: the total counts the switch (a phase of its own when published); rollout: the published
# rollout counts it (verl syncs weights inside generate_sequences); none: the total leaves it out
SWITCH_IN = ("step", "rollout", "none")


def _switch_in(r: dict, where) -> str:
    value = r.get("switch_in", "step")
    if value not in SWITCH_IN:
        raise SpecError(f"{where}: run {r['id']}: switch_in {value!r} is not one of {', '.join(SWITCH_IN)}")
    return value


def _predicted_phases(run: PublishedRun, result: CostResult) -> dict[str, float]:
    """The prediction in the published run's own bookkeeping (where its switch is counted)."""
    p = dict(result.phase_times_s)
    if not result.feasible:
        return {k: math.inf for k in PHASES}
    step = result.step_time_s  # the phases less what separate pools overlap
    if run.switch_in == "none":
        step -= p.get("switch", 0.0)
    elif run.switch_in == "rollout":
        p["rollout"] += p.get("switch", 0.0)
    p["step"] = step
    return p


def _run_loss(run: PublishedRun, knobs: Knobs) -> float:
    pred = _predicted_phases(run, predict(run, knobs))
    return sum(math.log(max(pred[phase], 1e-9) / value) ** 2 for phase, value in run.published.items() if value > 0)


def _knobs_of(params: dict[tuple[str, str], float], family: str) -> Knobs:
    values = {name: params[(family, name)] for name in FAMILY_KNOBS}
    values.update({name: params[(SHARED, name)] for name in SHARED_KNOBS})
    return replace(PRIOR[family], **values)


def _prior_of(key: tuple[str, str], families: list[str]) -> float:
    scope, name = key
    if scope != SHARED:
        return getattr(PRIOR[scope], name)
    return math.exp(sum(math.log(getattr(PRIOR[f], name)) for f in families) / len(families))


def fit(runs: list[PublishedRun], *, rounds: int = 6) -> tuple[dict[str, Knobs], float]:
    """Knobs per family (family knobs free per family, shared knobs once for all) minimising the
    objective over `runs`. Families without runs get their prior."""
    families = sorted({r.family for r in runs})
    keys = [(f, n) for f in families for n in FAMILY_KNOBS] + [(SHARED, n) for n in SHARED_KNOBS]
    params = {k: _prior_of(k, families) for k in keys}
    priors = dict(params)
    by_family = {f: [r for r in runs if r.family == f] for f in families}

    def family_loss(f: str, p: dict) -> float:
        knobs = _knobs_of(p, f)
        return sum(_run_loss(r, knobs) for r in by_family[f])

    def penalty(p: dict) -> float:
        return PRIOR_WEIGHT * sum(math.log(p[k] / max(priors[k], 1e-12)) ** 2 for k in keys)

    parts = {f: family_loss(f, params) for f in families}
    best = sum(parts.values()) + penalty(params)
    step = 1.0  # in natural-log units of the knob
    for _ in range(rounds):
        improved = True
        while improved:
            improved = False
            for key in keys:
                lo, hi = KNOB_BOUNDS[key[1]]
                value = params[key]
                for direction in (1.0, -1.0):
                    trial_value = min(hi, max(lo, value * math.exp(direction * step)))
                    if trial_value == value:
                        continue
                    trial = {**params, key: trial_value}
                    touched = families if key[0] == SHARED else [key[0]]
                    trial_parts = {**parts, **{f: family_loss(f, trial) for f in touched}}
                    loss = sum(trial_parts.values()) + penalty(trial)
                    if loss < best - 1e-12:
                        params, parts, best, improved = trial, trial_parts, loss, True
                        break
        step /= 2.0
    fitted = {f: _knobs_of(params, f) for f in families}
    return fitted, best


def validation_effects(rows: list[PublishedRun], runs: list[PublishedRun] | None = None) -> list[dict[str, Any]]:
    """Each validation row's effect against the fitted run it varies: its phase time over the base
    run's, published and predicted (the stored knobs), where both publish the phase."""
    from planner.cost.knobs import load_knobs

    bases = {r.id: r for r in (runs if runs is not None else load_runs())}
    out = []
    for row in rows:
        base = bases.get(row.base) if row.base else None
        if base is None:
            continue
        knobs = load_knobs(row.family)
        pred_row, pred_base = _predicted_phases(row, predict(row, knobs)), _predicted_phases(base, predict(base, knobs))
        for phase in PHASES:
            if phase in row.published and phase in base.published:
                out.append({"run": row.id, "base": base.id, "phase": phase, "published": row.published[phase] / base.published[phase],
                            "predicted": pred_row[phase] / pred_base[phase]})  # fmt: skip
    return out


def memory_headroom(runs: list[PublishedRun]) -> list[dict[str, Any]]:
    """How far each published run, at its own layout and device count, clears the memory checks:
    the training phases' peak against usable device memory (the share left free, which must be at
    least the margin for the run to be accepted), the rollout's engine share, and host memory per
    node against its limit."""
    from planner.cost.knobs import load_knobs

    rows = []
    for run in runs:
        result = predict(run, load_knobs(run.family))
        memory = result.memory_per_device_bytes
        train = max(parts["total"] for phase, parts in memory.items() if phase != "rollout")
        usable = result.usable_bytes_per_device
        rows.append({
            "run": run.id, "hardware": run.hardware, "devices": run.devices, "train_peak_bytes": train, "usable_bytes": usable,
            "train_free": 1.0 - train / usable,
            "rollout_bytes": memory["rollout"]["total"], "host_bytes_per_node": result.host_memory_bytes_per_node,
            "host_limit_bytes_per_node": result.host_memory_limit_bytes_per_node,
        })  # fmt: skip
    return rows


TRAINING_PHASES = ("reference", "old_logprob", "update")


def expressed_rows(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The `expressed` rows: each job at its published layout and device count, the training
    phases the model predicts for it and their share of the published step (the rest is what the
    row's `not_modelled` names), never a predicted step."""
    from planner.cost.knobs import load_knobs

    rows = []
    for run in load_runs(path, section="expressed"):
        result = predict(run, load_knobs(run.family))
        training = sum(result.phase_times_s.get(p, 0.0) for p in TRAINING_PHASES) if result.feasible else math.inf
        rows.append({"run": run.id, "published_step_s": run.published["step"], "feasible": result.feasible,
                     "training_s": round(training, 2), "training_share": round(training / run.published["step"], 4),
                     "not_modelled": run.not_modelled})  # fmt: skip
    return rows


def residual_table(runs: list[PublishedRun], knobs_by_family: dict[str, Knobs]) -> list[dict[str, Any]]:
    rows = []
    for run in runs:
        result = predict(run, knobs_by_family[run.family])
        pred = _predicted_phases(run, result)
        for phase in PHASES:
            if phase not in run.published:
                continue
            pub = run.published[phase]
            rows.append(
                {
                    "run": run.id,
                    "family": run.family,
                    "phase": phase,
                    "published_s": pub,
                    "predicted_s": round(pred.get(phase, float("nan")), 2),
                    "ratio": round(pred.get(phase, float("nan")) / pub, 3) if pub > 0 else None,
                }
            )
    return rows


def _held_out(runs: list[PublishedRun], n: int) -> tuple[int, list[dict[str, Any]]]:
    held = runs[n]
    knobs, _ = fit(runs[:n] + runs[n + 1:])
    if held.family not in knobs:  # its family's only run: its own priors, the shared knobs as fitted
        shared = {name: getattr(next(iter(knobs.values())), name) for name in SHARED_KNOBS} if knobs else {}
        knobs[held.family] = replace(PRIOR[held.family], **shared)
    return n, residual_table([held], {held.family: knobs[held.family]})


def _worker_signals() -> None:
    """A refit worker leaves Ctrl-C to the parent (which stops the pool) and dies on SIGTERM, instead
    of the parent's handler turning either into an exception it would report and carry on after;
    the signals the parent blocked while forking it are let through once these are set."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def leave_one_out(runs: list[PublishedRun], progress=None, *, only: list[str] | None = None) -> list[dict[str, Any]]:
    """For each run (or each run whose id is in `only`): refit without it, predict it. One row per
    run and published phase. The refits are independent: one process per CPU runs them. An
    interrupted parent terminates them instead of waiting for the queue; a worker that dies (killed,
    out of memory) fails the whole call (BrokenProcessPool) instead of leaving its refit undone."""
    import os
    import signal
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    held = [n for n, r in enumerate(runs) if only is None or r.id in only]
    results: dict[int, list] = {}
    pool = ProcessPoolExecutor(max_workers=max(1, min(os.cpu_count() or 1, len(held))), initializer=_worker_signals)
    try:
        # no signal while the workers are forked (a fork would inherit it half-handled); one that
        # comes meanwhile is raised at the unmask, inside this block
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            futures = {pool.submit(_held_out, runs, n): n for n in held}
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for done, future in enumerate(as_completed(futures)):
            n, rows = future.result()
            results[n] = rows
            if progress:
                progress(done, len(held), runs[n].id)
    except BaseException as exc:
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.terminate()  # the executor has no public terminate before Python 3.14
        pool.shutdown(wait=False, cancel_futures=True)
        if isinstance(exc, BrokenProcessPool):
            raise PlannerError(f"a leave-one-out refit worker died ({exc}; killed, or out of memory?): nothing was written; "
                               "run the command again") from None  # fmt: skip
        raise
    pool.shutdown()
    return [row for n in held for row in results[n]]


def fit_all(runs: list[PublishedRun] | None = None, *, progress=None, path: str | Path | None = None) -> dict[str, Any]:
    """The fit to `runs` (default: those of `path`, the published runs YAML), its residuals, the
    leave-one-run-out check and the weight-sync checks of the same file, with the fitted knobs."""
    runs = runs or load_runs(path)
    fitted, loss = fit(runs)
    names = [f.name for f in fields(Knobs)]
    families = sorted(fitted)
    return {
        "description": "Efficiency knobs fitted to calibration/published_runs.yaml (planner.cost.fit; regenerate "
        "with `planner fit-knobs -o calibration/knobs.json --force`). Per family: "
        + ", ".join(FAMILY_KNOBS) + "; shared by the families: "
        + ", ".join(SHARED_KNOBS) + ".",
        "objective": "sum over runs and published phases of log(predicted/published)^2 "
        f"+ {PRIOR_WEIGHT} * sum over free knobs of log(knob/prior)^2",
        "free_parameters": len(FAMILY_KNOBS) * len(families) + len(SHARED_KNOBS),
        "runs": {f: sum(r.family == f for r in runs) for f in families},
        "knobs": {fam: {n: round(getattr(k, n), 6) for n in names} for fam, k in fitted.items()},
        "priors": {fam: {n: _prior_of((SHARED if n in SHARED_KNOBS else fam, n), families) for n in names} for fam in families},
        "loss": round(loss, 6),
        "residuals": residual_table(runs, fitted),
        "leave_one_out": leave_one_out(runs, progress),
        "sync_checks": weight_sync_checks(path, fitted),
    }


def loo_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Worst out-of-sample error per run on its step total, and over every published phase."""
    step = {r["run"]: abs(r["ratio"] - 1) for r in rows if r["phase"] == "step" and r["ratio"] is not None}
    phases = [abs(r["ratio"] - 1) for r in rows if r["ratio"] is not None]
    return {"worst_step": max(step.values(), default=math.nan), "runs_within_25": sum(v <= 0.25 for v in step.values()),
            "runs": len(step), "worst_phase": max(phases, default=math.nan)}


def step_validation(family: str | None = None, path: str | Path | None = None, accelerator: str | None = None) -> dict | None:
    """What backs the step times: the knobs file's leave-one-run-out check (each published run's step
    total predicted by a fit without that run), over every run or one accelerator family's. None
    when the file holds no such check. With `accelerator`, also the accelerators those runs ran on
    (as the packaged published runs name them) and whether it is one of them."""
    rows = [r for r in _leave_one_out(str(path or knobs_path())) if family is None or r.get("family") == family]
    if not any(r.get("phase") == "step" and r.get("ratio") is not None for r in rows):
        return None
    out = {"family": family, **loo_summary(rows)}
    ran_on = _packaged_hardware() if accelerator is not None else {}
    if ran_on and {r["run"] for r in rows} <= set(ran_on):  # a user's fit of other runs: where they ran is not known here
        chips = sorted({ran_on[r["run"]] for r in rows})
        out.update(accelerator=accelerator, accelerators=chips, accelerator_measured=accelerator in chips)
    return out


# What a job may have that no fitted run has: a step with one of these rests only on the published
# validation rows that have it too (none of them in the fit, so each is an out-of-sample check)
JOB_FEATURES = {
    "separate pools": lambda job: not job.colocated,
    "speculative decoding": lambda job: job.speculative is not None,
    "FP8 rollout": lambda job: job.rollout_precision == "fp8",
}


def feature_validation(job: Job, family: str, path: str | Path | None = None) -> list[dict[str, Any]]:
    """For each of JOB_FEATURES that `job` has, the published validation rows of `family` that have
    it, their step predicted with the knobs in use against the published one: how many within 25%,
    the worst, and every row outside."""
    from planner.cost.knobs import load_knobs

    wanted = [name for name, has in JOB_FEATURES.items() if has(job)]
    if not wanted:
        return []
    rows = [r for r in load_runs(path, section="validation") if r.family == family and r.published.get("step", 0) > 0]
    knobs = load_knobs(family) if rows else None
    out = []
    for name in wanted:
        ratios = {r.id: predict(r, knobs).step_time_s / r.published["step"] for r in rows if JOB_FEATURES[name](r.job)}
        out.append({"feature": name, "family": family, "runs": len(ratios), "runs_within_25": sum(abs(v - 1) <= 0.25 for v in ratios.values()),
                    "worst_step": max((abs(v - 1) for v in ratios.values()), default=None),
                    "outside": {rid: round(v, 3) for rid, v in ratios.items() if abs(v - 1) > 0.25}})  # fmt: skip
    return out


@lru_cache(maxsize=1)
def _packaged_hardware() -> dict[str, str]:
    """The accelerator each packaged fitted run ran on, by run id."""
    return {run.id: run.hardware for run in load_runs()}


@lru_cache(maxsize=4)
def _leave_one_out(path: str) -> tuple[dict, ...]:
    from planner.files import read_json

    p = Path(path)
    return tuple(read_json(p, "knobs file").get("leave_one_out") or []) if p.is_file() else ()


def write_fit(path: str | Path, result: dict[str, Any]) -> None:
    from planner.files import write_text_atomic

    write_text_atomic(path, json.dumps(result, indent=2) + "\n")
