"""`planner check`: build the planned proxy, run it on the device at hand, compare with predictions.

1. The proxy: built from the original checkpoint by the plan (a deferred plan chooses its experts
   now), unless the checkpoint given already is that proxy.
2. N steps of the RL harness on cpu, cuda or npu: the settings of the reference run when one is
   given (so the fidelity labels compare like with like), else the recipe and knob asked for.
3. Peak memory, predicted (planner.rl.memory: the exact parameter count and the cost model's
   activation accounting) and measured on the device; step time measured. The plan's own
   predictions for its target cluster are shown beside them.
4. With the original's run (`--reference-metrics`, a `planner rl run` directory), the fidelity
   labels of docs/fidelity-labels.md ("Labels"); `--add-to DATASET` appends them to the calibration data. A
   reference run in a trainer's format (verl, MindSpeed-RL, NeMo RL, wandb, TensorBoard) carries no
   settings for the harness to repeat: the labels then compare it with the proxy's run in the same
   trainer (`--proxy-metrics`), and the harness run measures memory and time only. Given the two
   trainer logs and no checkpoint, the labels come from the logs alone and nothing runs.
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from planner.errors import SpecError
from planner.units import plural

__all__ = ["CheckReport", "run_check", "label_logs", "render_check"]


@dataclass
class CheckReport:
    proxy_dir: str | None  # None: labels from two trainer logs alone, no harness run
    built: bool
    device: str
    steps: int
    config: dict
    measured_peak_bytes: float | None
    predicted_peak: dict[str, float] | None
    step_time_s: float | None
    cluster: dict[str, Any]  # the plan's deployment predictions, if any
    labels: dict[str, Any] | None
    run_dir: str | None
    onset: int | None

    @property
    def memory_ratio(self) -> float | None:
        if not self.predicted_peak or not self.measured_peak_bytes:
            return None
        return self.predicted_peak["total"] / self.measured_peak_bytes

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "memory_predicted_over_measured": self.memory_ratio}


def _built_from_other_plan(proxy: Path, plan) -> str | None:
    """Why the proxy at `proxy` was not built by `plan` (None when it was, as far as its expert map says)."""
    from planner.files import read_json

    emap_path = proxy / "expert_map.json"
    if not emap_path.is_file():
        return f"{proxy} has no expert_map.json: not a proxy `planner build` wrote"
    emap = read_json(emap_path, "expert map")
    if (emap.get("experts"), emap.get("method")) != (plan.experts, plan.method):
        return f"it keeps K={emap.get('experts')} by {emap.get('method')}, the plan K={plan.experts} by {plan.method}"
    if not plan.deferred:
        built = {int(layer): list(entry["kept"]) for layer, entry in emap.get("layers", {}).items()}
        if built != {int(layer): list(kept) for layer, kept in plan.layers.items()}:
            return "its kept experts differ from the plan's"
    return None


def _is_the_proxy(plan, ckpt) -> bool:
    """Is the checkpoint given the plan's proxy already (else its original)? Anything else is refused."""
    e = ckpt.arch.original_num_experts
    if e == plan.experts and plan.experts != plan.original_experts:
        if not (ckpt.path / "expert_map.json").is_file():
            raise SpecError(f"the plan is for {plan.model} ({plan.original_experts} experts per layer) and its K={plan.experts} proxy; "
                            f"{ckpt.path} has {e} experts per layer but no expert_map.json, so it is neither: not this plan's original "
                            f"({plan.original_experts} experts) and not a proxy `planner build` wrote from it")  # fmt: skip
        why = _built_from_other_plan(ckpt.path, plan)
        if why:
            raise SpecError(f"{ckpt.path} has {e} experts per layer, as the plan's proxy would, but {why}")
        return True
    if e != plan.original_experts:
        raise SpecError(f"{ckpt.path} has {e} experts per layer; the plan is for a model with {plan.original_experts} (or its K={plan.experts} proxy)")
    return False


def _proxy(plan, ckpt, out: Path, stats_path, force: bool, progress) -> tuple[Path, bool]:
    from planner.checkpoint import build
    from planner.stats.compute import resolve_plan

    if _is_the_proxy(plan, ckpt):
        return ckpt.path, False
    target = out / "proxy"
    if target.exists():
        why = _built_from_other_plan(target, plan)
        if why is None:
            return target, False  # built by this plan before: reused
        if not force:
            raise SpecError(f"{target} holds a proxy not built by this plan ({why}); pass --force to rebuild it")
    build(ckpt, resolve_plan(ckpt, plan, stats_path=stats_path), target, verify="auto", force=force, progress=progress)
    return target, True


def _reference_config(reference: Path, device: str, recipe_name: str | None, knob: float | None):
    """The RLConfig of the original's run, for the proxy to repeat; conflicting options are errors."""
    from planner.files import read_json
    from planner.rl.grpo import RLConfig

    ref_info = read_json(reference / "run.json", "`planner rl run` record", "; --reference-metrics takes a `planner rl run` directory")
    if not isinstance(ref_info, dict) or not isinstance(ref_info.get("config"), dict):
        raise SpecError(f"{reference}/run.json: not a `planner rl run` record (no config)")
    if recipe_name and ref_info.get("recipe") and recipe_name != ref_info["recipe"]:
        raise SpecError(f"--recipe {recipe_name}, but the reference run {reference} ran {ref_info['recipe']}: the proxy repeats the reference's settings")
    if knob is not None and ref_info.get("knob") is not None and knob != ref_info["knob"]:
        raise SpecError(f"--knob {knob}, but the reference run {reference} ran at {ref_info['knob']}: the proxy repeats the reference's settings")
    fields = RLConfig.__dataclass_fields__
    config = RLConfig(**{**{k: v for k, v in ref_info["config"].items() if k in fields}, "device": device})
    if config.steps < 2:
        raise SpecError(f"the reference run {reference} has {config.steps} step(s); a check needs at least 2 (one warm-up, one measured)")
    return config, {"recipe": ref_info.get("recipe") or recipe_name, "knob": ref_info.get("knob")}


def label_logs(plan_path: str | Path, reference: str | Path, proxy_metrics: str | Path, *, replica: str | Path | None = None,
               recipe_name: str | None = None) -> CheckReport:
    """The fidelity labels of a pair the user ran in a trainer, from the two logs alone (no checkpoint,
    no harness run)."""
    from planner.fidelity.calibrate import measure_pair
    from planner.plan import load_plan

    plan = load_plan(plan_path)
    labels = measure_pair(Path(reference), Path(proxy_metrics), plan, replica_dir=Path(replica) if replica else None,
                          recipe_name=recipe_name)  # fmt: skip
    return CheckReport(proxy_dir=None, built=False, device="-", steps=0, config={}, measured_peak_bytes=None, predicted_peak=None,
                       step_time_s=None, cluster=dict((plan.deployment or {}).get("predicted", {})), labels=labels, run_dir=None,
                       onset=labels.get("onset_proxy"))  # fmt: skip


def run_check(plan_path: str | Path, checkpoint: str | Path, out_dir: str | Path, *, device: str = "cpu", steps: int = 20,
              reference: str | Path | None = None, proxy_metrics: str | Path | None = None, replica: str | Path | None = None,
              recipe_name: str | None = None,
              knob: float | None = None, seed: int = 0, stats_path=None, force: bool = False,
              progress: Callable[[str, int, int], None] | None = None) -> CheckReport:  # fmt: skip
    from planner.checkpoint import Checkpoint
    from planner.plan import load_plan
    from planner.rl.grpo import RLConfig
    from planner.rl.recipes import recipe

    plan = load_plan(plan_path)
    out = Path(out_dir)
    run_dir = out / "run"
    if (run_dir / "metrics.csv").exists() and not force:
        raise SpecError(f"{run_dir} already holds a run; pass --force to replace it")
    if steps < 2:
        raise SpecError(f"--steps must be at least 2 (one warm-up step, one measured), got {steps}")
    info: dict[str, Any] = {}
    harness_reference = reference is not None and Path(reference).is_dir() and (Path(reference) / "run.json").is_file()
    if reference is not None and not harness_reference and proxy_metrics is None:
        raise SpecError(f"{reference} is not a `planner rl run` directory, so it has no settings for the harness to repeat: pass the "
                        "proxy's run in the same trainer with --proxy-metrics (the labels compare the two runs)")  # fmt: skip
    if proxy_metrics is not None:
        if reference is None:
            raise SpecError("--proxy-metrics needs --reference-metrics: the original's run in the same trainer")
        from planner.runs.read import read_run

        for path in (reference, proxy_metrics, replica):  # unreadable logs are refused before anything is built
            if path is not None and not (Path(path) / "run.json").is_file():
                read_run(path)
    if harness_reference:  # read and checked before anything is built or written
        config, ref = _reference_config(Path(reference), device, recipe_name, knob)
        info.update(ref)
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
    ckpt = Checkpoint(checkpoint)  # a bad checkpoint is refused before the output folder is made
    # what would fail after the build and the run is refused now: the device, the vocabulary, the pair's recipe
    from planner.rl.device import Device

    Device(device)
    if ckpt.arch.vocab_size < 256:
        raise SpecError(f"the harness samples byte-level prompts; {ckpt.path} has a vocabulary of {ckpt.arch.vocab_size} < 256")
    if reference is not None:
        from planner.fidelity.calibrate import pair_recipe

        info["recipe"] = pair_recipe(Path(reference), info.get("recipe"))
    _is_the_proxy(plan, ckpt)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _build_and_run(plan, ckpt, out, run_dir, config, info, reference, proxy_metrics, replica, stats_path, force, progress)
    except BaseException:  # an error, Ctrl-C or SIGTERM: an output folder this check made is not left behind, empty or half-filled
        if made:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _build_and_run(plan, ckpt, out: Path, run_dir: Path, config, info: dict, reference, proxy_metrics, replica, stats_path, force: bool,
                   progress) -> "CheckReport":  # fmt: skip
    from planner.checkpoint import Checkpoint
    from planner.fidelity.calibrate import measure_pair
    from planner.interrupts import deferred
    from planner.rl.grpo import GRPO, write_metrics
    from planner.rl.memory import measure_step_peak, predict_peak
    from planner.rl.recipes import recipe

    # Ctrl-C and SIGTERM stop the build between tensors and the run between steps (never inside torch)
    with deferred(waiting="stopping after the tensor or step in hand") as pending:

        def building(done: int, total: int) -> None:
            pending.check()
            if progress:
                progress("build", done, total)

        proxy_dir, built = _proxy(plan, ckpt, out, stats_path, force, building)
        pending.check()
        trainer = GRPO(proxy_dir, config)
        peak = 0.0
        for t in range(config.steps):
            pending.check()
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
        labels = measure_pair(Path(reference), Path(proxy_metrics) if proxy_metrics else run_dir, plan,
                              replica_dir=Path(replica) if replica else None, recipe_name=info.get("recipe"))  # fmt: skip
    return CheckReport(
        proxy_dir=str(proxy_dir), built=built, device=config.device, steps=config.steps, config=asdict(config), measured_peak_bytes=peak,
        predicted_peak=predict_peak(Checkpoint(proxy_dir).arch, config), step_time_s=statistics.median(timed),
        cluster=dict((plan.deployment or {}).get("predicted", {})), labels=labels, run_dir=str(run_dir), onset=onset,
    )  # fmt: skip


def render_check(r: CheckReport) -> str:
    from planner.render import label_text, table
    from planner.units import human_bytes

    if r.proxy_dir is None:
        lines = ["labels of the pair from the two trainer logs alone (no harness run; pass --checkpoint to build the proxy and "
                 "measure its memory and step time here)"]  # fmt: skip
    else:
        lines = [f"proxy {r.proxy_dir}" + (" (built now)" if r.built else ""), ""]
        rows = [[k, human_bytes(v)] for k, v in r.predicted_peak.items() if k != "total" and v]
        rows.append(["predicted peak", human_bytes(r.predicted_peak["total"])])
        rows.append([f"measured peak on {r.device}", human_bytes(r.measured_peak_bytes)])
        rows.append(["predicted / measured", f"{r.memory_ratio:.3f}"])
        lines.append(table(["harness memory (one device)", "bytes"], rows))
        lines.append("")
        lines.append(f"step time on {r.device}: {r.step_time_s:.3f} s (median of {plural(max(r.steps - 2, 1), 'step')}), {1 / r.step_time_s:.2f} steps/s")
    if r.cluster:
        c = r.cluster
        lines.append(f"the plan's target cluster (predicted): {human_bytes(c.get('memory_per_card_bytes', 0))} per card, "
                     f"{c.get('step_time_s', float('nan')):,.0f} s/step, {c.get('accelerator_hours_per_step', float('nan')):,.2f} "
                     f"accelerator-hours/step")  # fmt: skip
    if r.labels:
        keys = ("shift_log2", "shift_sd", "noise_log2", "outcome", "curve_agreement", "spearman_grad_norm", "onset_original", "onset_proxy")
        lines.append("")
        lines.append(table(["label", "value"], [[k, label_text(r.labels.get(k))] for k in keys]))
    if r.run_dir:
        lines.append(f"metrics in {r.run_dir}/metrics.csv")
    return "\n".join(lines)
