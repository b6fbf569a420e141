"""What the reproduction job is worth: for the catalog models, the best proxy's reduction at the
production job and with the job searched, with the fidelity status of each.

Per model (its usual accelerator; the budget is the original's own minimum device count, so every
proxy runs on at most what the original needs): `planner suggest` as it answers, where a job
dimension shrinks only where the calibration data support it, and the same search with every job
dimension opened to the default bounds (1/16 of the batch, 1/4 of the response cap) whatever the
fidelity data say. The second is what the cost model alone gives: it is marked unvalidated, and it
is the saving the job-shrink calibration rows would have to earn. Reductions are against the
original's cheapest configuration with the production job, per step and to the fault (the
original's fault at step --fault-step; a proxy's steps from its predicted onset).

    python benchmarks/reproduction_jobs.py [--fault-step 40] [--models qwen3-30b-a3b,deepseek-v3]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.fidelity.estimator import FidelityEstimator, default_estimator_path  # noqa: E402
from planner.render import table  # noqa: E402
from planner.search.suggest import Request, Suggester, reduction, suggest  # noqa: E402

HARDWARE = {"deepseek-v3": "atlas-a3", "qwen3-235b-a22b": "atlas-a3", "mixtral-8x22b": "h100-sxm", "llama-4-scout": "h100-sxm"}
FAULTS = ("rollout-mismatch", "router-collapse")


def opened(estimator: FidelityEstimator) -> FidelityEstimator:
    """The estimator with every job dimension marked supported at no extra shift (a what-if)."""
    out = copy.deepcopy(estimator)
    level = {"share": 1 / 64, "rows": 0, "originals": 0, "delta_mean": 0.0, "delta_interval": [0.0, 0.0], "ok": True}
    for entry in out.recipes.values():
        for family in entry.get("families", {}):
            entry.setdefault("job", {})[family] = {dim: {"ok": True, "min_share": 1 / 64, "rows": 0, "levels": [level]}
                                                   for dim in ("prompts", "samples", "length")}  # fmt: skip
    return out


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
    what_if = opened(shipped)
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
            request = Request(model=model, hardware=hardware, budget=f"{minimum.num_devices}{kind}", fault=fault, fault_step=args.fault_step)
            rows.append(best_line(model, fault, "as answered", suggest(request, estimator=shipped)))
            rows.append(best_line(model, fault, "job opened (unvalidated)", suggest(request, estimator=what_if)))
            print(f"  {model} {fault}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(table(["model", "fault", "job", "K", "devices", "reproduction job", "steps", "fewer hours/step", "fewer hours to fault", "fidelity"],
                rows, title=f"best proxy within the original's minimum devices, original's fault at step {args.fault_step}"))  # fmt: skip


if __name__ == "__main__":
    main()
