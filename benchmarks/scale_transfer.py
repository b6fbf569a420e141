"""Scale transfer of the calibration labels: the same plan rule measured at several widths and depths.

For each routing shape (a family made from a catalog model), width and depth, and model seed: the
family's model at that scale is made the grid's way (dense pretraining, upcycling, MoE training),
the clustered plan at one K/E is built, and each recipe's critical knob is bisected on the
original and the proxy with the grid's seeds, probe length and resolution; the shift and its
standard error are the grid's labels (planner.fidelity.labels.knob_shift; router collapse's label is
its margin shift, as in the grid: its curve runs are not needed for it); each point keeps both sides'
per-seed margins, and a censored one the direction of its bound, which the fit takes as such, and
the original's fingerprint: a point at another K/E on a model made again from the same seed (the same
fingerprint, grid settings and device) takes the original's margins from the earlier point and
measures only its proxy (`original_reused`; measure_s is then the proxy's alone). Every point is
appended to the output as it completes, and each side's margins are kept beside its model as soon
as they are measured, so the run resumes where it stopped (a stopped point keeps its models and
finished bisections until it completes) and the largest points can be added where a GPU is lent
(`--device cuda`). `--steps` trains the models longer than the
grid's 300 + 300 steps (their names end in -t<steps>), so that a trend with width can be told from
one with training. `--kept-fraction` sets the plan rule (K/E); the fit gives each rule its own label
and width slope. A router-collapse point also records where each side's routing starts
(`start_collapse`: the detector's normalised top-k share at the first step, per margin seed, before
any anti-balance pressure), since its label is read against that start; `--balance-only` makes the
models and prints only that, in seconds to minutes where a point takes up to hours. Both keep the
starts in calibration/starts.json (planner.fidelity.starts), which the estimator states beside its
router-collapse predictions. `--balancing published` makes the originals with their shape's
published load balancing (planner.rl.models; their names end in -bal), and the fit takes their
points apart from the others'. `--proxy-build settled` builds each proxy with its kept experts'
correction bias settled again (`planner build --settle-bias`; the original's margins are reused
from an earlier point on the same model where there is one), and the fit takes those points apart
too, for the family of settled proxies (`suggest --settle-bias`).
Then it prints the points and the fitted slopes of the shift in log2 width, depth and training
length with their 90% intervals (planner.fidelity.transfer), which `planner calibrate fit` reads.

    python benchmarks/scale_transfer.py                                  # CPU: hidden 64, 128, 256; 3 and 6 layers
    python benchmarks/scale_transfer.py --recipes router-collapse --hidden 64,128   # one recipe, the cheaper widths
    python benchmarks/scale_transfer.py --recipes router-collapse --hidden 64 --steps 1200   # training length apart from width
    python benchmarks/scale_transfer.py --device cuda --hidden 64,256,1024 --budget-s 540
    python benchmarks/scale_transfer.py --balance-only --families deepseek_v3-e256 --hidden 64,128,256 --layers 3 --seeds 0
    python benchmarks/scale_transfer.py --balancing published --proxy-build settled --families deepseek_v3-e256 --recipes router-collapse --hidden 128 --layers 3 --seeds 0
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import platform
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def point_name(family: str, hidden: int, layers: int, seed: int, steps: int, balancing: str = "none") -> str:
    """The original's name: its scale, seed, (where not the grid's) training steps, and -bal where it
    was trained with its shape's published load balancing."""
    from planner.families import trained_name
    from planner.fidelity.transfer import BASE_STEPS

    return trained_name(f"{family}-h{hidden}-l{layers}-s{seed}" + (f"-t{steps}" if steps != BASE_STEPS else ""), balancing)


def measured_originals(points: list[dict]) -> dict[tuple[str, str, str, str], dict]:
    """The originals' margins already measured, by (original's fingerprint, recipe, device, grid key):
    a model made again from its seed is the same model (the fingerprint says so), so a point at
    another K/E on it measures only its proxy."""
    return {(p["original_fingerprint"], p["recipe"], p["device"], p["grid"]): p["margins"]["original"]
            for p in points if p.get("original_fingerprint") and p.get("grid") and p.get("margins")}  # fmt: skip


def side_margin(model: Path, fingerprint: str, recipe_name: str, device: str, settings: str, measure) -> Margin:
    """One side's margins, kept beside its model as soon as they are measured: a point stopped between
    its two bisections (a hidden-512 point takes hours on one core) resumes at the second. Kept
    margins count only for the same model (fingerprint), grid settings and device."""
    from planner.files import write_text_atomic
    from planner.rl.margin import Margin

    kept = model.with_name(f"{model.name}.{recipe_name}.{device}.margins.json")
    key = {"fingerprint": fingerprint, "grid": settings}
    if kept.is_file():
        stored = json.loads(kept.read_text())
        if {k: stored.get(k) for k in key} == key:
            print(f"  {model.parent.name}/{model.name}: {recipe_name} margins kept from a stopped run", file=sys.stderr, flush=True)
            return Margin.from_json(stored["margins"])
    t0 = time.perf_counter()
    margin = measure()
    write_text_atomic(kept, json.dumps({**key, "margins": margin.to_json()}))
    knobs = ", ".join(f"{v:+.2f}" + (" (censored)" if c else "") for v, c in zip(margin.values, margin.censored))
    print(f"  {model.parent.name}/{model.name}: {recipe_name} critical knob per seed {knobs}, "
          f"{margin.probes} probes in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
    return margin


def prepare(family: str, hidden: int, layers: int, seed: int, kept: float, device: str, work: Path, steps: int, balancing: str = "none",
            build: str = "sliced"):  # fmt: skip
    """The point's original (made unless already on disk) and its agglomerative proxy at K/E `kept`,
    built as `build` says (settled: its kept experts' correction bias settled again on the
    original's router logits, as `planner build --settle-bias` does): (checkpoint of the original,
    original's dir, proxy's dir, K, seconds to make)."""
    from planner.checkpoint import Checkpoint
    from planner.checkpoint import build as build_proxy
    from planner.families import scaled_family_config
    from planner.fidelity.grid import Grid
    from planner.rl.models import ModelRecipe, make_model
    from planner.stats.compute import compute_stats, plan_from_stats

    grid = Grid()
    config = scaled_family_config(family, hidden, layers)
    name = point_name(family, hidden, layers, seed, steps, balancing)
    original = work / name / "original"
    start = time.perf_counter()
    if not (original / "config.json").is_file():
        report = make_model(family, original, ModelRecipe(dense_steps=steps, moe_steps=steps, seed=seed, balancing=balancing), config=config,
                            device=device)  # fmt: skip
        print(f"  {name}: original made in {time.perf_counter() - start:.0f} s; its routing over the last steps: "
              f"{report['routing_end']}", file=sys.stderr, flush=True)  # fmt: skip
    made = time.perf_counter() - start
    ckpt = Checkpoint(original)
    k = Grid(families=(family,), kept_fractions=(kept,)).experts(family)[0]
    settle = build == "settled"
    proxy = work / name / (f"K{k}-agglomerative" + ("-settled" if settle else ""))
    if not (proxy / "expert_map.json").is_file():
        stats = compute_stats(ckpt, experts=[k], methods=("agglomerative",), calib_tokens=grid.calib_tokens, seq_len=64, settle_bias=settle)
        build_proxy(ckpt, plan_from_stats(stats, k, "agglomerative", model=str(original), settle_bias=settle), proxy, verify="never", force=True)
    return ckpt, original, proxy, k, made


def measure_point(family: str, hidden: int, layers: int, seed: int, recipes: list[str], kept: float, device: str, work: Path,
                  steps: int, known: dict[tuple[str, str, str, str], dict] | None = None, balancing: str = "none",
                  build: str = "sliced") -> list[dict]:  # fmt: skip
    from planner.arch.routing import routing_shape
    from planner.checkpoint import Checkpoint
    from planner.fidelity.grid import Grid
    from planner.fidelity.labels import knob_scale, knob_shift
    from planner.fidelity.starts import measure_start
    from planner.fidelity.transfer import censored_bound
    from planner.rl.grpo import Models
    from planner.rl.margin import Margin, critical_knob
    from planner.rl.recipes import recipe

    grid, name = Grid(), point_name(family, hidden, layers, seed, steps, balancing)
    ckpt, original, proxy, k, made = prepare(family, hidden, layers, seed, kept, device, work, steps, balancing, build)
    e, top_k = ckpt.arch.original_num_experts, ckpt.arch.moe.top_k
    points, settings = [], grid.key()
    fingerprints = {"original": ckpt.fingerprint(), "proxy": Checkpoint(proxy).fingerprint()}
    fingerprint = fingerprints["original"]
    # where each side starts, before any anti-balance pressure: a router-collapse label is read against it
    start = {side: measure_start(path, device, list(grid.margin_seeds)) for side, path in (("original", original), ("proxy", proxy))
             } if "router-collapse" in recipes else None  # fmt: skip
    for recipe_name in recipes:
        r = recipe(recipe_name)
        t0 = time.perf_counter()
        before = (known or {}).get((fingerprint, recipe_name, device, settings))
        margins = {"original": Margin.from_json(before)} if before else {}
        for side, path in (("original", original), ("proxy", proxy)):
            if side not in margins:
                margins[side] = side_margin(path, fingerprints[side], recipe_name, device, settings,
                                            lambda: critical_knob(Models(path, device), r, list(grid.margin_seeds), iters=grid.iters(recipe_name),
                                                                  steps=grid.margin_steps))  # fmt: skip
        shift = knob_shift(recipe_name, list(margins["original"].values), list(margins["proxy"].values),
                           original_censored=margins["original"].censored, proxy_censored=margins["proxy"].censored,
                           resolution=grid.resolution(recipe_name))  # fmt: skip
        points.append({"recipe": recipe_name, "shape": routing_shape(ckpt.arch).key(), "family": family, "hidden": hidden, "layers": layers,
                       "original": name, "plan": f"K{k}-agglomerative", "experts": k, "original_experts": e, "top_k": top_k,
                       "kept_fraction": k / e, "shift_log2": shift.shift, "shift_se": shift.se, "noise_log2": shift.noise,
                       "outcome": shift.outcome, "censored": shift.censored,
                       "bound": censored_bound(*((list(margins[s].values), list(margins[s].censored)) for s in ("original", "proxy")), r.lo, r.hi),
                       "margins": {s: margins[s].to_json() for s in ("original", "proxy")},
                       "critical_original": margins["original"].mean * knob_scale(recipe_name),
                       "critical_proxy": margins["proxy"].mean * knob_scale(recipe_name), "device": device,
                       "steps": steps, "balancing": balancing, "proxy_build": build, "make_s": round(made, 1), "measure_s": round(time.perf_counter() - t0, 1),
                       "original_fingerprint": fingerprint, "grid": settings, "original_reused": bool(before)}
                      | ({"start_collapse": start} if recipe_name == "router-collapse" else {}))  # fmt: skip
    return points


def start_row(family: str, hidden: int, layers: int, seed: int, steps: int, balancing: str, k: int, start: dict[str, list[float]]) -> dict:
    """A row of calibration/starts.json (planner.fidelity.starts): where a model and its proxy start."""
    from planner.runs.detect import THRESHOLDS

    return {"family": family, "hidden": hidden, "layers": layers, "seed": seed, "steps": steps, "balancing": balancing, "proxy_experts": k,
            "original": [round(v, 4) for v in start["original"]], "proxy": [round(v, 4) for v in start["proxy"]],
            "threshold": THRESHOLDS["router-collapse"]}  # fmt: skip


def keep_starts(rows: list[dict], path: Path, workdir: Path) -> None:
    """Add `rows` to the starts file under the workdir's lock (runs on other cores share it)."""
    from planner.fidelity.starts import STARTS_SCHEMA, load_starts, merge_starts
    from planner.files import write_text_atomic

    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "transfer.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        merged = merge_starts(load_starts(path), rows)
        write_text_atomic(path, json.dumps({"schema": STARTS_SCHEMA, "rows": merged}, indent=1))


def balance_table(args: argparse.Namespace) -> None:
    """Where the originals and their proxies start: the mean over the grid's margin seeds of the
    normalised top-k share of the most collapsed MoE layer at the first step, against the router-
    collapse detector's threshold; each row is kept in the starts file as it is measured."""
    from planner.fidelity.grid import Grid
    from planner.fidelity.starts import measure_start
    from planner.render import table

    seeds, rows = list(Grid().margin_seeds), []
    for family, hidden, layers, seed in scales(args):
        _, original, proxy, k, _ = prepare(family, hidden, layers, seed, args.kept_fraction, args.device, Path(args.workdir), args.steps,
                                           args.balancing)  # fmt: skip
        start = {side: measure_start(path, args.device, seeds) for side, path in (("original", original), ("proxy", proxy))}
        row = start_row(family, hidden, layers, seed, args.steps, args.balancing, k, start)
        keep_starts([row], Path(args.starts), Path(args.workdir))
        at = [float(np.mean(row[side])) for side in ("original", "proxy")]
        print(f"  {original.parent.name}: original starts at {at[0]:.3f}, proxy K={k} at {at[1]:.3f}", file=sys.stderr, flush=True)
        rows.append([family, hidden, layers, seed, args.steps, args.balancing, k, f"{at[0]:.3f}", f"{at[1]:.3f}", f"{row['threshold']:g}"])
    print(table(["family", "hidden", "layers", "seed", "steps", "balancing", "proxy K", "original starts", "proxy starts", "threshold"], rows))


def scales(args: argparse.Namespace) -> list[tuple[str, int, int, int]]:
    """(family, hidden, layers, seed) of every point asked for."""
    return [(f, int(h), int(layer), int(s)) for f in args.families.split(",") for h in args.hidden.split(",")
            for layer in args.layers.split(",") for s in args.seeds.split(",")]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="qwen3_moe-e128,deepseek_v3-e256", help="families made from catalog models (one softmax, one sigmoid-grouped)")
    parser.add_argument("--hidden", default="64,128,256")
    parser.add_argument("--layers", default="3,6")
    parser.add_argument("--seeds", default="0,1", help="model seeds per (family, width, depth)")
    parser.add_argument("--recipes", default="fp16-overflow,rollout-mismatch,router-collapse",
                        help="measured on the same model, which is deleted after its point: name every recipe wanted")
    parser.add_argument("--kept-fraction", type=float, default=0.25)
    parser.add_argument("--steps", type=int, default=300, help="dense and MoE training steps (the grid's: 300)")
    from planner.families import BALANCINGS

    parser.add_argument("--balancing", default="none", choices=BALANCINGS,
                        help="how the originals' MoE stage is trained: without load balancing (the grid's models so far) or with "
                             "their shape's published balancing (planner.rl.models)")
    from planner.plan import PROXY_BUILDS

    parser.add_argument("--proxy-build", default="sliced", choices=PROXY_BUILDS,
                        help="how the proxies are built: sliced, or with their kept experts' correction bias settled again "
                             "(`planner build --settle-bias`; a router with a correction bias only); fitted apart")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | npu: where models train and recipes run")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting new points after this many seconds")
    parser.add_argument("--balance-only", action="store_true",
                        help="make the models and print where each side's routing starts (the router-collapse detector's "
                             "statistic at the first step), without bisecting; the models stay for the points")
    parser.add_argument("--workdir", default=str(ROOT / "calibration" / "work" / "transfer"))
    parser.add_argument("-o", "--output", default=str(ROOT / "calibration" / "transfer.json"))
    parser.add_argument("--starts", default=str(ROOT / "calibration" / "starts.json"),
                        help="where the routing starts are kept (--balance-only, and every router-collapse point)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from planner.errors import SpecError
    from planner.rl.device import Device

    try:
        Device(args.device)  # before any model is made: an absent accelerator is a usage error, not a traceback
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from planner.fidelity.grid import Grid
    from planner.fidelity.transfer import TRANSFER_SCHEMA, fit_transfer, slopes_text
    from planner.files import write_text_atomic
    from planner.render import table
    from planner.families import family_architecture

    if args.balance_only:
        balance_table(args)
        return
    out = Path(args.output)
    data = json.loads(out.read_text()) if out.is_file() else {"schema": TRANSFER_SCHEMA, "points": []}
    done = {(p["original"], p["recipe"], p["kept_fraction"], p.get("steps"), p.get("proxy_build", "sliced"))
            for p in data["points"]}  # the name says the balancing  # fmt: skip
    recipes = args.recipes.split(",")
    start = time.perf_counter()
    plan = scales(args)
    for n, (family, hidden, layers, seed) in enumerate(plan, 1):
        name = point_name(family, hidden, layers, seed, args.steps, args.balancing)
        k = Grid(families=(family,), kept_fractions=(args.kept_fraction,)).experts(family)[0]
        kept = k / family_architecture(family).original_num_experts  # a point's identity: its model, recipe, K/E and training
        todo = [r for r in recipes if (name, r, kept, args.steps, args.proxy_build) not in done]
        if not todo:
            continue
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent; {len(plan) - n + 1} points left for the next run", file=sys.stderr)
            break
        print(f"[{n}/{len(plan)}] {name}: {', '.join(todo)} on {args.device}", file=sys.stderr, flush=True)
        known = measured_originals(json.loads(out.read_text())["points"] if out.is_file() else [])
        points = measure_point(family, hidden, layers, seed, todo, args.kept_fraction, args.device, Path(args.workdir), args.steps, known,
                               args.balancing, args.proxy_build)  # fmt: skip
        # runs for other points may share the output (one per core): read it again under a lock and add to what is there
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        with open(Path(args.workdir) / "transfer.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = json.loads(out.read_text()) if out.is_file() else data
            data["points"].extend(points)
            data["provenance"] = {"command": " ".join(["python", *sys.argv]), "python": platform.python_version(), "machine": platform.machine()}
            write_text_atomic(out, json.dumps(data, indent=1))
        starts = [start_row(family, hidden, layers, seed, args.steps, args.balancing, p["experts"], p["start_collapse"])
                  for p in points if p.get("start_collapse") and args.proxy_build == "sliced"]  # the starts file holds sliced proxies'  # fmt: skip
        if starts:
            keep_starts(starts, Path(args.starts), Path(args.workdir))
        shutil.rmtree(Path(args.workdir) / name, ignore_errors=True)  # the models are remade from their seed if ever needed
    seed = lambda p: re.search(r"-s(\d+)(-t\d+)?(-bal)?$", p["original"]).group(1)  # noqa: E731  (names end in -s<seed>[-t<steps>][-bal])
    rows = [[p["family"], p["recipe"], p["hidden"], p["layers"], seed(p), p.get("steps"), p.get("balancing", "none"), p.get("proxy_build", "sliced"),
             f"{p['kept_fraction']:g}", f"{p['shift_log2']:+.3f}",
             f"{p['shift_se']:.3f}", p["outcome"], p["device"], p["make_s"], p["measure_s"]] for p in data["points"]]  # fmt: skip
    print(table(["family", "recipe", "hidden", "layers", "seed", "steps", "balancing", "build", "K/E", "shift", "se", "outcome", "device", "make s", "measure s"], rows))
    for key, fit in fit_transfer(data["points"]).items():
        if not fit.get("fitted"):
            print(f"{key}: not fitted ({fit.get('reason')})")
            continue
        bounds = f" ({fit['bounds']} censored, as bounds)" if fit.get("bounds") else ""
        print(f"{key}: {fit['points']} points{bounds}, hidden {fit['hidden']}, layers {fit['layers']}, steps {fit['steps']}, K/E "
              f"{fit['kept_fraction']}: shift {', '.join(slopes_text(fit))} (90% intervals); between-original SD {fit['tau']:.3f} log2, "
              f"residual SD {fit['residual_sd']:.3f} in units of the points' own SEs")  # fmt: skip
    if any(not math.isfinite(p["shift_log2"]) for p in data["points"]):
        print("note: some points have no finite shift", file=sys.stderr)


if __name__ == "__main__":
    main()
