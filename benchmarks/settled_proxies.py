"""Proxies whose correction bias is settled again after pruning, against the grid's proxies.

A proxy keeps its kept experts' correction-bias entries as the original left them; they balanced
all E experts, not the K kept ones, so on an original trained with its shape's published balancing
(a grid with `balancing: published`) the proxy starts further from balanced than its original and
its router collapses under less anti-balance pressure. This what-if settles the proxy's bias again, and
measures the settled proxy with the grid's router-collapse bisection (seeds, probe length, resolution). The original's and the unsettled
proxy's margins are the grid's own, read from its results files, so only the settled proxy is
measured. It prints, per plan, where each proxy starts (the detector's normalised top-k share at the
first step, mean over the margin seeds), both shifts and their outcomes, and writes the rows to
`--output` (calibration/settled_proxies.json) as they complete (a plan already there is not measured
again). Two ways to settle (`--how`):

- forward: the way the original's was settled (planner.rl.models.settle_correction_bias: the
  proxy's own forward passes on training batches at the family's published update rate until no
  bias drifts);
- calibration: the way `planner build --settle-bias` does it at any scale (planner stats
  --settle-bias: each layer's kept experts settled on the original's router logits of the grid's
  calibration text, the later layers' inputs not following the earlier layers' pruning), built by
  the builder from the plan.

    python benchmarks/settled_proxies.py --grid calibration/grids/deepseek_v3-e256-balanced.yaml \\
        --workdir calibration/work/e256-b --original deepseek_v3-e256-s0-bal --plans K64-agglomerative,K32-kmeans
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

RECIPE = "router-collapse"


def grid_margin(grid, results: Path, original: str, phase: str, unit: str) -> dict:
    """A point's margin as the grid recorded it (the last record of the unit)."""
    from planner.fidelity.grid import read_results, study_name

    found = read_results(results / f"{study_name(grid, RECIPE, phase, original)}.jsonl").get(unit)
    if not found:
        raise SystemExit(f"{unit}: not in the grid's results under {results} (measure the grid's {phase} first)")
    return found[-1]["margin"]


def settle(source: Path, out: Path, family: str, grid) -> dict:
    """A copy of the proxy at `out` with its correction bias settled; the settling's report."""
    import torch
    from transformers import AutoModelForCausalLM

    from planner.families import family_balancing
    from planner.rl.experts import fast_eager_experts
    from planner.rl.models import ModelRecipe, settle_correction_bias

    report = out / "settled.json"
    if report.is_file():
        return json.loads(report.read_text())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    fast_eager_experts(model)
    recipe = ModelRecipe(dense_steps=grid.dense_steps, moe_steps=grid.moe_steps, balancing="published")
    settled = settle_correction_bias(model, recipe, family_balancing(family)["bias_rate"], seed=3)
    if not settled:
        raise SystemExit(f"{source}: no correction bias to settle (a {family} proxy routes without one)")
    model.save_pretrained(tmp)
    (tmp / "settled.json").write_text(json.dumps(settled))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return settled


def settle_as_built(original: Path, plan: str, reference: Path, out: Path, grid) -> dict:
    """The proxy `plan` of the original built with its correction bias settled on the calibration
    text (planner stats/build --settle-bias) at `out`; its kept experts must be the grid proxy's at
    `reference`. Returns the settling's passes and drift per layer."""
    from planner.checkpoint import EXPERT_MAP_NAME, Checkpoint, build
    from planner.stats.compute import compute_stats, plan_from_stats

    report = out / "settled.json"
    if report.is_file():
        return json.loads(report.read_text())
    k, method = int(plan.split("-", 1)[0][1:]), plan.split("-", 1)[1]
    kind, draw = (method.rsplit("-", 1)[0], int(method.rsplit("-", 1)[1])) if method.startswith("random-") else (method, 0)
    ckpt = Checkpoint(original)
    stats = compute_stats(ckpt, experts=[k], methods=(kind,), calib_tokens=grid.calib_tokens, seq_len=64, seed=draw, settle_bias=True)
    the_plan = plan_from_stats(stats, k, kind, model=str(original), seed=draw, settle_bias=True)
    kept = {int(i): tuple(v["kept"]) for i, v in json.loads((reference / EXPERT_MAP_NAME).read_text())["layers"].items()}
    if kept != dict(the_plan.layers):
        raise SystemExit(f"{plan}: the statistics computed now keep other experts than the grid's proxy at {reference}")
    build(ckpt, the_plan, out, verify="never", force=True)
    settled = {layer: {n: v[n] for n in ("passes", "drift")} for layer, v in stats["plans"][f"K={k}/{kind}"]["settled_bias"].items()}
    (out / "settled.json").write_text(json.dumps(settled))
    return settled


def start(model: Path, seeds: list[int]) -> float:
    """Where a model starts (planner.fidelity.starts.measure_start), the mean over the margin seeds."""
    from planner.fidelity.starts import measure_start

    return float(np.mean(measure_start(model, "cpu", seeds)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", required=True, help="a grid YAML with balancing: published")
    parser.add_argument("--workdir", required=True, help="the grid's work directory (its models)")
    parser.add_argument("--results", default="calibration/results", help="the grid's results files")
    parser.add_argument("--original", required=True, help="e.g. deepseek_v3-e256-s0-bal")
    parser.add_argument("--plans", required=True, help="comma-separated proxies of the original, e.g. K64-agglomerative")
    parser.add_argument("--how", choices=("forward", "calibration"), default="forward", help="how to settle (the docstring says)")
    parser.add_argument("-o", "--output", default="calibration/settled_proxies.json")
    args = parser.parse_args()

    from planner.fidelity.grid import Grid, unit_id
    from planner.fidelity.labels import knob_scale, knob_shift
    from planner.files import write_text_atomic
    from planner.render import table
    from planner.rl.margin import critical_knob
    from planner.rl.grpo import Models
    from planner.rl.recipes import recipe

    grid, results, work = Grid.load(args.grid), Path(args.results), Path(args.workdir)
    family = json.loads((work / "models.json").read_text())[f"{args.original}/original"]["family"]
    seeds, r = list(grid.margin_seeds), recipe(RECIPE)
    out = Path(args.output)
    rows = json.loads(out.read_text())["rows"] if out.is_file() else []
    original = grid_margin(grid, results, args.original, "originals", unit_id(args.original, "original", RECIPE))
    models = work / "models" / args.original
    original_start = start(models / "original", seeds)
    for plan in args.plans.split(","):
        if any((row["original"], row["plan"], row.get("how", "forward")) == (args.original, plan, args.how) for row in rows):
            continue
        t0 = time.perf_counter()
        proxy = grid_margin(grid, results, args.original, "proxies", unit_id(args.original, plan, RECIPE))
        if args.how == "forward":
            settled_dir = work / "settled" / args.original / plan
            report = settle(models / plan, settled_dir, family, grid)
        else:
            settled_dir = work / "settled-calibration" / args.original / plan
            report = settle_as_built(models / "original", plan, models / plan, settled_dir, grid)
        m = critical_knob(Models(settled_dir, "cpu"), r, seeds, iters=grid.iters(RECIPE), steps=grid.margin_steps)
        shifts = {side: knob_shift(RECIPE, original["values"], values, original_censored=original["censored"], proxy_censored=censored,
                                   resolution=grid.resolution(RECIPE))
                  for side, values, censored in (("grid", proxy["values"], proxy["censored"]), ("settled", list(m.values), list(m.censored)))}  # fmt: skip
        rows.append({"original": args.original, "plan": plan, "how": args.how, "settle": report,
                     "start": {"original": original_start, "grid": start(models / plan, seeds), "settled": start(settled_dir, seeds)},
                     "critical": {"original": original["mean"] * knob_scale(RECIPE), "grid": proxy["mean"] * knob_scale(RECIPE),
                                  "settled": m.mean * knob_scale(RECIPE)},
                     "margins": {"settled": m.to_json()},
                     "shift": {side: s.shift for side, s in shifts.items()}, "se": {side: s.se for side, s in shifts.items()},
                     "outcome": {side: s.outcome for side, s in shifts.items()}, "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, json.dumps({"grid": str(args.grid), "rows": rows}, indent=1))
        print(f"  {args.original}/{plan}: shift {rows[-1]['shift']['grid']:+.2f} -> {rows[-1]['shift']['settled']:+.2f} log2 "
              f"({rows[-1]['seconds']:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
    print(table(["original", "plan", "settled by", "starts: original", "grid proxy", "settled", "shift: grid", "settled", "outcome: grid",
                 "settled"],
                [[row["original"], row["plan"], row.get("how", "forward"), *(f"{row['start'][s]:.3f}" for s in ("original", "grid", "settled")),
                  *(f"{row['shift'][s]:+.2f} ({row['se'][s]:.2f})" for s in ("grid", "settled")), row["outcome"]["grid"], row["outcome"]["settled"]]
                 for row in rows]))  # fmt: skip


if __name__ == "__main__":
    main()
