"""What the reproduction job is worth: for the catalog models, the best proxy's reduction at the
production job and with the job searched, with the fidelity status of each.

Per model (its usual accelerator; K/top_k >= 4, or 2 where E is below 8 x top_k; the budget is the
original's own minimum device count, so every proxy runs on at most what the original needs): `planner suggest` as it answers, where a job
dimension shrinks only where the calibration data support it, and the same search with every job
dimension opened to the default bounds (1/16 of the batch, 1/4 of the response cap) whatever the
fidelity data say. The second is what the cost model alone gives: it is marked unvalidated, and it
is the saving the job-shrink calibration rows would have to earn. Reductions are against the
original's cheapest configuration with the production job, per step and to the fault (the
original's fault at step --fault-step; a proxy's steps from its predicted onset). The fp16 overflow
runs on the job in fp16, and once more with `--translate-knob` (its batch and length move the fault
by a measured amount: shrunk with the knob moved by it).

    python benchmarks/reproduction_jobs.py [--fault-step 40] [--models qwen3-30b-a3b,deepseek-v3]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.fidelity.estimator import FidelityEstimator, default_estimator_path  # noqa: E402
from planner.render import table  # noqa: E402
from planner.search.suggest import Request, Suggester, reduction, suggest  # noqa: E402
from planner.specs import Job  # noqa: E402

HARDWARE = {"deepseek-v3": "atlas-a3", "qwen3-235b-a22b": "atlas-a3", "mixtral-8x22b": "h100-sxm", "llama-4-scout": "h100-sxm"}
FAULTS = ("rollout-mismatch", "router-collapse", "grad-overflow")  # the fp16 overflow on the job in fp16 (the default trains in bf16)


class Opened(FidelityEstimator):
    """The estimator with every job dimension marked supported at no extra shift, on every routing
    shape (a what-if: what the cost model alone gives)."""

    def job_support(self, row, recipe, *, translate=False):
        return {dim: {"ok": True, "min_share": 1 / 64, "rows": 0, "levels": [], "reason": "opened for the what-if (unvalidated)"}
                for dim in ("prompts", "samples", "length")}  # fmt: skip


def best_line(model: str, fault: str, label: str, s) -> list:
    b = s.best
    if b is None:
        return [model, fault, label, "-", "-", "-", "-", "-", "-", "none qualifies"]
    r = reduction(b, s.baseline)
    status = b.fidelity["status"] + (f" P {b.fidelity['p_reproduced']:.2f}" if b.fidelity.get("p_reproduced") is not None else "")
    return [model, fault, label, b.experts, b.cost.num_devices, b.scale.describe(s.request.job), b.steps,
            f"{r['accelerator_hours']:.2f}x" if r["accelerator_hours"] else "-", f"{r['reproduction_hours']:.2f}x" if r["reproduction_hours"] else "-",
            status]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault-step", type=int, default=40)
    parser.add_argument("--models", default=None, help="comma-separated catalog models (default: every one)")
    args = parser.parse_args()
    from planner.catalog import catalog_models

    models = args.models.split(",") if args.models else sorted(catalog_models())
    shipped = FidelityEstimator.load(default_estimator_path())
    what_if = Opened(shipped.recipes, shipped.info, shipped.tolerance)
    rows, start = [], time.perf_counter()
    for model in models:
        hardware = HARDWARE.get(model, "ascend-910b2")
        probe = Suggester(Request(model=model, hardware=hardware, budget="4096npu" if hardware != "h100-sxm" else "4096gpu"), shipped)
        minimum = probe.minimum(probe.arch.original_num_experts)
        if minimum is None:
            rows.append([model, "-", "-", "-", "-", "-", "-", "-", "-", "the original fits nowhere up to 4096 devices"])
            continue
        kind = "gpu" if hardware == "h100-sxm" else "npu"
        for fault in FAULTS:
            top_k, e = probe.arch.moe.top_k, probe.arch.original_num_experts
            ratio = 4.0 if e >= 8 * top_k else 2.0  # Mixtral's 8 experts of top-2: K/top_k >= 4 would leave only E itself
            job = Job(precision="fp16") if fault == "grad-overflow" else Job()
            request = Request(model=model, hardware=hardware, budget=f"{minimum.num_devices}{kind}", fault=fault, fault_step=args.fault_step,
                              min_k_ratio=ratio, job=job)  # fmt: skip
            rows.append(best_line(model, fault, "as answered", suggest(request, estimator=shipped)))
            if fault == "grad-overflow":  # the knob moves with the batch's tokens: shrunk only with the translation
                rows.append(best_line(model, fault, "--translate-knob", suggest(replace(request, translate_knob=True), estimator=shipped)))
            rows.append(best_line(model, fault, "job opened (unvalidated)", suggest(request, estimator=what_if)))
            print(f"  {model} {fault}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(table(["model", "fault", "job", "K", "devices", "reproduction job", "steps", "fewer hours/step", "fewer hours to fault", "fidelity"],
                rows, title=f"best proxy within the original's minimum devices, original's fault at step {args.fault_step}"))  # fmt: skip


if __name__ == "__main__":
    main()
