"""Does the Optuna search of `planner suggest` find exhaustive enumeration's optimum, and how fast?

For catalog cases whose space can be enumerated, the whole space is evaluated (the baseline,
measured in the same run), then the search runs with the default 300 trials. Printed per case:
space size, enumeration wall time, search wall time, the trial at which the search first reached
the optimum, and whether its best equals enumeration's (same accelerator-hours per step, K and
device count).

    python benchmarks/suggest_search.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.render import table  # noqa: E402
from planner.search.suggest import Option, Request, Suggester, proposable, suggest  # noqa: E402

CASES = [
    Request(model="qwen3-30b-a3b", hardware="ascend-910b2", budget="8npu", fault="grad-overflow"),
    Request(model="qwen3-30b-a3b", hardware="ascend-910b2", budget="16npu", fault="router-collapse"),
    Request(model="glm-4.5-air", hardware="h20", budget="16gpu", fault="entropy-collapse"),
    Request(model="deepseek-v3", hardware="atlas-a3", budget="128npu", fault="grad-overflow"),
    Request(model="qwen3-235b-a22b", hardware="atlas-a3", budget="200npu-h", fault="rollout-mismatch"),
    Request(model="mixtral-8x7b", hardware="h100-sxm", budget="8gpu", fault="grad-overflow", min_k_ratio=2.0),
    # large budgets: many device counts, where the cheapest point sits at each K's own minimum count
    Request(model="qwen3-30b-a3b", hardware="ascend-910b2", budget="2048npu", fault="grad-overflow"),
    Request(model="deepseek-v3", hardware="atlas-a3", budget="512npu", fault="entropy-collapse"),
]


def same(a: Option | None, b: Option | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a.hours - b.hours) <= 1e-9 * b.hours and a.experts == b.experts and a.cost.num_devices == b.cost.num_devices


def main() -> int:
    rows, ok = [], True
    for req in CASES:
        start = time.perf_counter()
        space = Suggester(req)
        everything = space.enumerate_all()
        baseline = space.baseline()
        exhaustive = min((o for o in everything if proposable(o, baseline, req.min_fidelity)), key=Option.rank_key, default=None)
        t_enum = time.perf_counter() - start
        result = suggest(req)
        match = same(result.best, exhaustive)
        ok &= match
        best = result.best
        rows.append([f"{req.model} {req.hardware} {req.budget} {req.fault}", space.space_size(), f"{t_enum:.2f}", f"{result.seconds:.2f}",
                     f"{t_enum / result.seconds:.1f}x", result.trials, len(result.options), "-" if result.best_trial is None else result.best_trial,
                     "-" if best is None else f"K={best.experts} {best.cost.num_devices} {best.cost.device_unit}s {best.hours:.2f} h/step",
                     "yes" if match else "NO"])  # fmt: skip
    print(table(["case", "space", "enumerate s", "search s", "enum/search", "trials", "points tried", "optimum at trial", "best", "= exhaustive"],
                rows))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
