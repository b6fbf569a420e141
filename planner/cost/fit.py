"""Fit the efficiency knobs, once per accelerator family, to the published RL runs.

The objective is the sum of squared log-ratios predicted/published over every published phase
(rollout, reference, old log-prob, update, switch) and the step total of every run of the family,
plus a weak pull of each knob towards its prior (log-ratio, weight `PRIOR_WEIGHT`) so knobs no run
constrains stay at literature values. Coordinate descent on log(knob) with shrinking steps, inside
`KNOB_BOUNDS`; deterministic. Results (knobs and every residual) go to calibration/knobs.json.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from planner.catalog import load_accelerator, load_model
from planner.cost.evaluate import CostResult, evaluate
from planner.cost.knobs import KNOB_BOUNDS, PRIOR, Knobs
from planner.errors import SpecError
from planner.specs import Job

__all__ = ["PublishedRun", "load_runs", "predict", "fit_family", "fit_all", "residual_table", "update_mfu_checks", "PHASES"]

PHASES = ("rollout", "reference", "old_logprob", "update", "switch", "step")
PRIOR_WEIGHT = 0.05
FITTED = ("train_mfu", "logprob_mfu", "decode_mbu", "decode_step_overhead_s", "decode_layer_overhead_s",
          "a2a_efficiency", "switch_fixed_s", "expert_imbalance")


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

    @property
    def family(self) -> str:
        return load_accelerator(self.hardware).family


def runs_path() -> Path:
    return Path(str(resources.files("planner._calibration"))) / "published_runs.yaml"


def load_runs(path: str | Path | None = None) -> list[PublishedRun]:
    from planner.errors import SpecError
    from planner.files import read_yaml

    where = Path(path or runs_path())
    data = read_yaml(where, "published runs")
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or not data["runs"]:
        raise SpecError(f"{where}: not a published-runs file (a 'runs:' list of runs; see calibration/published_runs.yaml)")
    required = ("id", "title", "model", "hardware", "devices", "job", "published")
    out = []
    for n, r in enumerate(data["runs"]):
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
            )
        )
    return out


def update_mfu_checks(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Predicted vs published actor-update MFU (not fitted; a check of the update model)."""
    from planner.cost.layouts import TrainCandidates
    from planner.cost.model import CostModel

    data = yaml.safe_load(Path(path or runs_path()).read_text())
    rows = []
    for check in data.get("mfu_checks", []):
        arch, accel = load_model(check["model"]), load_accelerator(check["hardware"])
        job = Job.from_dict(check["job"], where=f"mfu check {check['id']}")
        if job.train_layout is None:
            raise SpecError(f"mfu check {check['id']}: the job needs the train_layout the MFU was measured with")
        model = CostModel(arch, accel, job)
        for devices, published in zip(check["devices"], check["published_mfu"]):
            update_s = float(model.train(TrainCandidates.single(devices, job.train_layout)).update_s[0])
            predicted = model.update_model_flops() / (update_s * devices * accel.peak_flops(job.precision))
            rows.append({"check": check["id"], "devices": devices, "published_mfu": published,
                         "predicted_mfu": round(predicted, 3), "ratio": round(predicted / published, 3)})
    return rows


def predict(run: PublishedRun, knobs: Knobs) -> CostResult:
    arch = load_model(run.model)
    accel = load_accelerator(run.hardware)
    return evaluate(arch, accel, run.job, run.devices, knobs=knobs, memory_margin=0.0)  # as the run ran: nothing kept free


def _predicted_phases(run: PublishedRun, result: CostResult) -> dict[str, float]:
    p = dict(result.phase_times_s)
    if not result.feasible:
        return {k: math.inf for k in PHASES}
    step = sum(p.values())
    if "switch" not in run.published:  # the published step leaves the switch out
        step -= p.get("switch", 0.0)
    p["step"] = step
    return p


def _loss(runs: list[PublishedRun], knobs: Knobs, prior: Knobs) -> float:
    total = 0.0
    for run in runs:
        pred = _predicted_phases(run, predict(run, knobs))
        for phase, value in run.published.items():
            if value <= 0:
                continue
            total += math.log(max(pred[phase], 1e-9) / value) ** 2
    for name in FITTED:
        total += PRIOR_WEIGHT * math.log(getattr(knobs, name) / max(getattr(prior, name), 1e-12)) ** 2
    return total


def fit_family(family: str, runs: list[PublishedRun], *, rounds: int = 6) -> tuple[Knobs, float]:
    prior = PRIOR[family]
    mine = [r for r in runs if r.family == family]
    knobs = prior
    best = _loss(mine, knobs, prior)
    step = 1.0  # in natural-log units of the knob
    for _ in range(rounds):
        improved = True
        while improved:
            improved = False
            for name in FITTED:
                lo, hi = KNOB_BOUNDS[name]
                value = getattr(knobs, name)
                if value <= 0:
                    value = lo if lo > 0 else 1e-3
                for direction in (1.0, -1.0):
                    trial_value = min(hi, max(lo, value * math.exp(direction * step)))
                    if trial_value == getattr(knobs, name):
                        continue
                    trial = replace(knobs, **{name: trial_value})
                    loss = _loss(mine, trial, prior)
                    if loss < best - 1e-12:
                        knobs, best, improved = trial, loss, True
                        break
        step /= 2.0
    return knobs, best


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


def fit_all(runs: list[PublishedRun] | None = None) -> dict[str, Any]:
    runs = runs or load_runs()
    families = sorted({r.family for r in runs})
    fitted, losses = {}, {}
    for fam in families:
        fitted[fam], losses[fam] = fit_family(fam, runs)
    names = [f.name for f in fields(Knobs)]
    return {
        "description": "Efficiency knobs fitted once per accelerator family to calibration/published_runs.yaml "
        "(planner.cost.fit; regenerate with `planner fit-knobs -o calibration/knobs.json --force`).",
        "objective": "sum over runs and published phases of log(predicted/published)^2 "
        f"+ {PRIOR_WEIGHT} * sum over knobs of log(knob/prior)^2",
        "knobs": {fam: {n: round(getattr(k, n), 6) for n in names} for fam, k in fitted.items()},
        "priors": {fam: {n: getattr(PRIOR[fam], n) for n in names} for fam in families},
        "loss": {fam: round(v, 6) for fam, v in losses.items()},
        "residuals": residual_table(runs, fitted),
    }


def write_fit(path: str | Path, result: dict[str, Any]) -> None:
    from planner.files import write_text_atomic

    write_text_atomic(path, json.dumps(result, indent=2) + "\n")
