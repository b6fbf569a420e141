"""Where the fidelity estimator reaches: for every catalog model and every calibrated fault recipe,
the status `planner suggest` prints for its best proxy (calibrated with P and its interval, no skill
with the held-out figures, or uncalibrated with the reason; where no proxy clears --min-fidelity, the
proxy of highest calibrated P, marked so), and how many (model, fault) pairs get an
answer other than "uncalibrated".

Per model: its usual accelerator, the budget its original's own minimum device count (every proxy
runs on at most what the original needs), K/top_k >= 4 (2 where E is below 8 x top_k), no stats file
(so P, where calibrated, is the K/E-level one).

    python benchmarks/calibration_coverage.py [--models qwen3-30b-a3b,deepseek-v3] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.fidelity.estimator import FidelityEstimator, default_estimator_path  # noqa: E402
from planner.render import table  # noqa: E402
from planner.search.suggest import Request, Suggester, suggest  # noqa: E402

HARDWARE = {"deepseek-v3": "atlas-a3", "qwen3-235b-a22b": "atlas-a3", "mixtral-8x22b": "h100-sxm", "llama-4-scout": "h100-sxm",
            "glm-4.5-air": "h100-sxm", "gpt-oss-20b": "h100-sxm", "qwen3-next-80b-a3b": "h100-sxm",
            "nemotron-3-nano-30b-a3b": "h100-sxm"}  # fmt: skip
FAULTS = ("fp16-overflow", "rollout-mismatch", "router-collapse")


def line(model: str, fault: str, s) -> dict:
    b, below = s.best, False
    if b is None:
        # no proxy clears --min-fidelity: a calibrated P below it is an answer too (the proxy of highest P)
        proxies = [o for o in s.pareto if o.fidelity["status"] != "original" and o.p_reproduced is not None]
        if not proxies:
            return {"model": model, "fault": fault, "status": "-", "K": None, "family": None, "p": None, "reason": "no proxy qualifies"}
        b, below = max(proxies, key=lambda o: o.p_reproduced), True
    f = b.fidelity
    p = f.get("p_reproduced")
    interval = f.get("interval")
    shown = None if p is None else f"{p:.2f}" + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")
    family = (f.get("family") or {}).get("name")
    return {"model": model, "fault": fault, "status": f["status"], "K": b.experts, "family": family, "p": shown,
            "basis": f.get("basis"), "below_threshold": below,
            "reason": ("below --min-fidelity: " if below else "") + (f.get("reason") or "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated catalog models (default: every one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from planner.catalog import catalog_models, load_accelerator

    models = args.models.split(",") if args.models else sorted(catalog_models())
    estimator = FidelityEstimator.load(default_estimator_path())
    rows, start = [], time.perf_counter()
    for model in models:
        hardware = HARDWARE.get(model, "ascend-910b2")
        kind = "npu" if load_accelerator(hardware).family == "ascend" else "gpu"
        probe = Suggester(Request(model=model, hardware=hardware, budget=f"4096{kind}"), estimator)
        minimum = probe.minimum(probe.arch.original_num_experts)
        if minimum is None:
            rows += [{"model": model, "fault": f, "status": "-", "reason": "the original fits nowhere up to 4096 devices"} for f in FAULTS]
            continue
        top_k, e = probe.arch.moe.top_k, probe.arch.original_num_experts
        ratio = 4.0 if e >= 8 * top_k else 2.0
        for fault in FAULTS:
            request = Request(model=model, hardware=hardware, budget=f"{minimum.num_devices}{kind}", fault=fault, min_k_ratio=ratio)
            rows.append(line(model, fault, suggest(request, estimator=estimator)))
            print(f"  {model} {fault}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    answered = sum(r["status"] not in ("uncalibrated", "-") for r in rows)
    if args.json:
        print(json.dumps({"rows": rows, "answered": answered, "pairs": len(rows)}, indent=1))
        return
    print(table(["model", "fault", "K", "status", "P [interval]", "family", "reason"],
                [[r["model"], r["fault"], r.get("K") or "-", r["status"], r.get("p") or "-", r.get("family") or "-", r["reason"][:90]]
                 for r in rows], title="the best proxy's fidelity status per catalog model and fault"))  # fmt: skip
    print(f"\n{answered} of {len(rows)} (model, fault) pairs answered with a status other than uncalibrated")


if __name__ == "__main__":
    main()
