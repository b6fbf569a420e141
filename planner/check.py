"""`planner check`: build the planned proxy, run it on the device at hand, compare with predictions.

1. The proxy: built from the original checkpoint by the plan (a deferred plan chooses its experts
   now), unless the checkpoint given already is that proxy.
2. N steps of the RL harness on cpu, cuda or npu: the settings of the reference run when one is
   given (so the fidelity labels compare like with like), else the recipe and knob asked for.
3. Peak memory, predicted (planner.rl.memory: the exact parameter count and the cost model's
   activation accounting) and measured on the device; step time measured. The plan's own
   predictions for its target cluster are shown beside them.
4. With the original's run (`--reference-metrics`, a `planner rl run` directory), the fidelity
   labels of DESIGN.md section 7; `--add-to DATASET` appends them to the calibration data.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from planner.errors import SpecError

__all__ = ["CheckReport", "run_check", "render_check"]


@dataclass
class CheckReport:
    proxy_dir: str
    built: bool
    device: str
    steps: int
    config: dict
    measured_peak_bytes: float
    predicted_peak: dict[str, float]
    step_time_s: float
    cluster: dict[str, Any]  # the plan's deployment predictions, if any
    labels: dict[str, Any] | None
    run_dir: str
    onset: int | None

    @property
    def memory_ratio(self) -> float:
        return self.predicted_peak["total"] / self.measured_peak_bytes

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "memory_predicted_over_measured": self.memory_ratio}


def _proxy(plan, checkpoint: Path, out: Path, stats_path, progress) -> tuple[Path, bool]:
    from planner.checkpoint import Checkpoint, build
    from planner.stats.compute import resolve_plan

    ckpt = Checkpoint(checkpoint)
    e = ckpt.arch.original_num_experts
    if e == plan.experts and plan.experts != plan.original_experts:
        return checkpoint, False  # already the proxy
    if e != plan.original_experts:
        raise SpecError(f"{checkpoint} has {e} experts per layer; the plan is for a model with {plan.original_experts} (or its K={plan.experts} proxy)")
    target = out / "proxy"
    if (target / "expert_map.json").is_file():
        return target, False
    build(ckpt, resolve_plan(ckpt, plan, stats_path=stats_path), target, verify="auto", progress=progress)
    return target, True


def run_check(plan_path: str | Path, checkpoint: str | Path, out_dir: str | Path, *, device: str = "cpu", steps: int = 20,
              reference: str | Path | None = None, replica: str | Path | None = None, recipe_name: str | None = None,
              knob: float | None = None, seed: int = 0, stats_path=None, force: bool = False,
              progress: Callable[[str, int, int], None] | None = None) -> CheckReport:  # fmt: skip
    from planner.checkpoint import Checkpoint
    from planner.fidelity.calibrate import measure_pair
    from planner.plan import load_plan
    from planner.rl.grpo import GRPO, RLConfig, write_metrics
    from planner.rl.memory import measure_step_peak, predict_peak
    from planner.rl.recipes import recipe

    plan = load_plan(plan_path)
    out = Path(out_dir)
    run_dir = out / "run"
    if (run_dir / "metrics.csv").exists() and not force:
        raise SpecError(f"{run_dir} already holds a run; pass --force to replace it")
    if steps < 2:
        raise SpecError(f"--steps must be at least 2 (one warm-up step, one measured), got {steps}")
    out.mkdir(parents=True, exist_ok=True)
    proxy_dir, built = _proxy(plan, Path(checkpoint), out, stats_path, progress and (lambda d, t: progress("build", d, t)))

    info: dict[str, Any] = {}
    if reference is not None:
        ref_info = json.loads((Path(reference) / "run.json").read_text()) if (Path(reference) / "run.json").is_file() else None
        if not ref_info or "config" not in ref_info:
            raise SpecError(f"{reference}: not a `planner rl run` directory (no run.json with a config)")
        fields = RLConfig.__dataclass_fields__
        config = RLConfig(**{**{k: v for k, v in ref_info["config"].items() if k in fields}, "device": device})
        steps = config.steps
        info.update(recipe=ref_info.get("recipe"), knob=ref_info.get("knob"))
    else:
        r = recipe(recipe_name) if recipe_name else None
        if knob is not None and r is None:
            raise SpecError("--knob sets a fault recipe's knob; pass --recipe too")
        if r is None:
            config = RLConfig(steps=steps, seed=seed, device=device)
        elif knob is None:
            config = RLConfig(**{**r.base, "steps": steps, "seed": seed, "device": device})
        else:
            config = r.config(knob, seed=seed, steps=steps, device=device)
        info.update(recipe=recipe_name, knob=knob)

    trainer = GRPO(proxy_dir, config)
    peak = 0.0
    for t in range(config.steps):
        if t == 1:  # the first step allocates Adam's moments; measure the next one
            peak = measure_step_peak(trainer, t)
        else:
            trainer.step(t)
        if progress:
            progress("steps", t + 1, config.steps)
    rows = trainer.rows
    timed = [r["wall_s"] for i, r in enumerate(rows) if i >= 2] or [rows[-1]["wall_s"]]
    onset = recipe(info["recipe"]).onset(rows) if info.get("recipe") else None
    info.update(model=str(Path(proxy_dir).resolve()), onset=onset, measured_peak_bytes=peak)
    write_metrics(rows, run_dir, config, info)

    labels = None
    if reference is not None:
        labels = measure_pair(Path(reference), run_dir, plan, replica_dir=Path(replica) if replica else None,
                              recipe_name=info.get("recipe"))  # fmt: skip
    return CheckReport(
        proxy_dir=str(proxy_dir), built=built, device=device, steps=config.steps, config=asdict(config), measured_peak_bytes=peak,
        predicted_peak=predict_peak(Checkpoint(proxy_dir).arch, config), step_time_s=statistics.median(timed),
        cluster=dict((plan.deployment or {}).get("predicted", {})), labels=labels, run_dir=str(run_dir), onset=onset,
    )  # fmt: skip


def render_check(r: CheckReport) -> str:
    from planner.render import table
    from planner.units import human_bytes

    lines = [f"proxy {r.proxy_dir}" + (" (built now)" if r.built else ""), ""]
    rows = [[k, human_bytes(v)] for k, v in r.predicted_peak.items() if k != "total" and v]
    rows.append(["predicted peak", human_bytes(r.predicted_peak["total"])])
    rows.append([f"measured peak on {r.device}", human_bytes(r.measured_peak_bytes)])
    rows.append(["predicted / measured", f"{r.memory_ratio:.3f}"])
    lines.append(table(["harness memory (one device)", "bytes"], rows))
    lines.append("")
    lines.append(f"step time on {r.device}: {r.step_time_s:.3f} s (median of {max(r.steps - 2, 1)} steps), {1 / r.step_time_s:.2f} steps/s")
    if r.cluster:
        c = r.cluster
        lines.append(f"the plan's target cluster (predicted): {human_bytes(c.get('memory_per_card_bytes', 0))} per card, "
                     f"{c.get('step_time_s', float('nan')):,.0f} s/step, {c.get('accelerator_hours_per_step', float('nan')):,.2f} "
                     f"accelerator-hours/step")  # fmt: skip
    if r.labels:
        keys = ("margin_ratio", "curve_agreement", "spearman_grad_norm", "onset_original", "onset_proxy", "fault_reproduced")
        lines.append("")
        lines.append(table(["label", "value"], [[k, "-" if r.labels.get(k) is None or r.labels.get(k) != r.labels.get(k) else f"{r.labels[k]:.3g}"]
                                                for k in keys]))  # fmt: skip
    lines.append(f"metrics in {r.run_dir}/metrics.csv")
    return "\n".join(lines)
