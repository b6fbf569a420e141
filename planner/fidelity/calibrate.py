"""`planner calibrate`: run the grid, export the dataset, add measured pairs, fit the estimator.

    run   prepare the models and proxies, run both phases with N workers, export the dataset
    add   one (original, proxy) pair from two run directories and the proxy's plan
    fit   the FidelityEstimator on the dataset -> calibration/fidelity.json
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from planner.arch import Architecture
from planner.errors import SpecError
from planner.fidelity.dataset import ID_COLUMNS, architecture_features, pair_row, read_dataset, shape_key, write_dataset
from planner.fidelity.estimator import FidelityEstimator
from planner.fidelity.model import features_of
from planner.fidelity.grid import Grid, collect, prepare, run_workers
from planner.files import read_json

__all__ = ["run", "export", "merged", "progress", "add_pair", "fit"]


def _provenance(grid: Grid, storage: str, seeds: dict) -> dict[str, Any]:
    return {
        "command": " ".join(shlex.quote(a) for a in ["planner", *sys.argv[1:]]) if sys.argv else "",
        "grid": {k: list(v) if isinstance(v, tuple) else v for k, v in grid.__dict__.items()},
        "grid_key": grid.key(),
        "storage": storage,
        "seeds": seeds,
    }


def noise_floor(grid: Grid, originals: dict[str, dict]) -> list[dict]:
    """The noise floor of every (original, recipe): the critical knob per seed, its SD in log2
    units, the bisection's resolution and whether it is at most a quarter of that SD."""
    from planner.fidelity.labels import knob_scale

    from planner.fidelity.grid import PRODUCTION, split_unit

    out = []
    for unit, result in sorted(originals.items()):
        base, _, recipe_name, job = split_unit(unit)
        if job != PRODUCTION:  # the noise floor is the original's at the job its labels are measured against
            continue
        m, scale = result["margin"], knob_scale(recipe_name)
        sd = float(np.std(np.asarray(m["values"]) * scale, ddof=1))
        resolution = m.get("resolution", grid.resolution(recipe_name)) * scale
        out.append({"original": base, "recipe": recipe_name, "values": m["values"], "censored": m["censored"], "sd_log2": sd,
                    "resolution_log2": resolution, "resolution_ok": bool(resolution <= sd / 4)})  # fmt: skip
    return out


def export(storage: str, grid: Grid, workdir: Path, skip: frozenset = frozenset()) -> tuple[list[dict], list[dict]]:
    """Join the two phases' results into dataset rows (one per proxy, recipe and job) and the noise
    floor. A (recipe, K) where the fault cannot occur gets a row labelled "not applicable" (not
    measured). A grid with smaller jobs also labels every proxy at each of them, and the original
    itself (model "original", K = E), always against the original at the production job, with the
    job's shares of the production job in the job columns. The (original, recipe) pairs in `skip`
    are left out (a grid that spans sessions lands its complete originals only)."""
    from planner.fidelity.grid import PRODUCTION, job_shares, unit_id
    from planner.fidelity.labels import applicable

    records = json.loads((workdir / "models.json").read_text())
    originals, proxies = collect(storage, grid, "originals"), collect(storage, grid, "proxies")
    configs = {r["original"]: json.loads((Path(r["path"]) / "config.json").read_text()) for r in records.values() if r["model"] == "original"}
    rows = []
    for record in sorted(records.values(), key=lambda r: (r["original"], r["model"])):
        base, own = record["original"], record["model"] == "original"
        for recipe_name in grid.recipes:
            if not grid.measured_on(recipe_name, record["seed"]) or (base, recipe_name) in skip:
                continue
            for job in grid.jobs:
                if own and job == PRODUCTION:  # the original against itself: no label
                    continue
                unit = unit_id(base, record["model"], recipe_name, job)
                original, result = originals.get(unit_id(base, "original", recipe_name)), (originals if own else proxies).get(unit)
                fits = applicable(recipe_name, record["experts"], record["top_k"])
                if fits and (original is None or result is None):
                    continue
                arch = architecture_features(configs[base], record["experts"])
                # originals trained with their shape's published balancing, and proxies built with their
                # correction bias settled, are calibration families of their own
                row = {"family": grid.family_name(record["family"]), "routing_shape": shape_key(configs[base]), "original": base,
                       "model": record["model"], "method": record["method"],
                       "recipe": recipe_name, "experts": record["experts"], "original_experts": records[f"{base}/original"]["experts"],
                       "top_k": record["top_k"], "source": "grid"}  # fmt: skip
                row.update(features_of(record["statistics"], arch))
                row.update(pair_row(recipe_name, _sides(original or {}), _sides(result or {}),
                                    experts=record["experts"], top_k=record["top_k"]))  # fmt: skip
                if len(grid.jobs) > 1:
                    row.update(job_shares(job), job_grid=grid.key())
                rows.append(row)
    return rows, noise_floor(grid, originals)


def progress(storage: str, grid: Grid, workdir: Path) -> list[dict]:
    """Per (recipe, phase, original): grid points, completed, running, failed attempts, the median
    seconds of a completed point, and the seconds of work left at that pace (one worker); `pace`
    says whose: its own points', its phase's other originals' (`phase`), its recipe's originals'
    (`originals`: an upper bound for proxies, which run no replicas), or None (nothing measured)."""
    import optuna

    from planner.fidelity.grid import grid_storage, grid_units, study_name

    records = json.loads((workdir / "models.json").read_text())
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = []
    for recipe_name in grid.recipes:
        for phase in ("originals", "proxies"):
            for base, units in grid_units(grid, records, recipe_name, phase).items():
                try:
                    trials = optuna.load_study(study_name=study_name(grid, recipe_name, phase, base), storage=grid_storage(storage)).get_trials(deepcopy=False)
                except KeyError:
                    trials = []
                state = lambda name: [t for t in trials if t.state.name == name]  # noqa: E731
                done = {t.params.get("unit") for t in state("COMPLETE")}
                measured = [(t.datetime_complete - t.datetime_start).total_seconds() for t in state("COMPLETE")
                            if "imported_from" not in t.user_attrs and t.datetime_start and t.datetime_complete]  # fmt: skip
                out.append({"recipe": recipe_name, "phase": phase, "original": base, "points": len(units), "complete": len(done & set(units)),
                            "running": len(state("RUNNING")), "failed": len(state("FAIL")),
                            "median_s": float(np.median(measured)) if measured else None, "left": len(set(units) - done),
                            "_seconds": measured})  # fmt: skip
    # a study with nothing measured yet goes at the pace of its recipe's other studies of the phase
    # (else of the recipe's originals: an upper bound for proxies, which run no replicas)
    for r in out:
        pace, r["pace"] = r["median_s"], "own"
        for source, same in (("phase", lambda o: o["recipe"] == r["recipe"] and o["phase"] == r["phase"]),
                             ("originals", lambda o: o["recipe"] == r["recipe"])):  # fmt: skip
            if pace is None:
                pooled = [x for o in out if same(o) for x in o["_seconds"]]
                pace, r["pace"] = (float(np.median(pooled)), source) if pooled else (None, None)
        r["left_s"] = pace * r["left"] if pace is not None else None
    for r in out:
        del r["_seconds"]
    return out


def _sides(result: dict) -> dict:
    """A grid result in pair_row's terms (replica runs gathered into one list)."""
    out = dict(result)
    out["replicas"] = [result[k] for k in sorted(result) if k.startswith("replica") and not k.endswith("_onset")]
    return out


def run(grid: Grid, grid_path: str | None, storage: str, workdir: Path, workers: int, out: Path,
        say: Callable[[str], None] = lambda s: None, results: Path | None = None, merge: bool = False,
        measured_only: bool = False) -> list[dict]:  # fmt: skip
    """The whole grid, resumable: every step skips what is already done (in the storage, or in the
    results files under `results`, which every completed point is appended to). With
    `measured_only`, nothing is measured: the originals whose every point of a recipe is measured
    are exported, and the rest is named."""
    if measured_only:
        if not (workdir / "models.json").is_file():
            raise SpecError(f"{workdir} holds no prepared grid (no models.json): nothing was measured there")
        left = [p for p in progress(storage, grid, workdir) if p["left"]]
        for p in left:
            say(f"  not exported: {p['recipe']} on {p['original']}, {p['phase']} {p['complete']} of {p['points']} points measured")
        return _write(grid, storage, workdir, out, say, merge, skip=frozenset((p["original"], p["recipe"]) for p in left))
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"preparing models and proxies under {workdir}")
    records = prepare(grid, workdir, progress=lambda family: say(f"  {family}: models ready"))
    originals = sum(r["model"] == "original" for r in records.values())
    say(f"{len(records)} models; phase 1: {originals} originals x {len(grid.recipes)} recipes on {workers} worker(s)")
    imported = run_workers(storage, grid, grid_path, workdir, "originals", workers, results)
    say(f"phase 2: {len(records) - originals} proxies x {len(grid.recipes)} recipes")
    imported += run_workers(storage, grid, grid_path, workdir, "proxies", workers, results)
    if imported:
        say(f"{imported} grid points taken from the results files under {results}")
    return _write(grid, storage, workdir, out, say, merge)


def _write(grid: Grid, storage: str, workdir: Path, out: Path, say: Callable[[str], None], merge: bool,
           skip: frozenset = frozenset()) -> list[dict]:  # fmt: skip
    rows, noise = export(storage, grid, workdir, skip)
    seeds = {"models": list(grid.seeds()), "margin": list(grid.margin_seeds), "curve": grid.curve_seed,
             "replica_gen": list(grid.replica_gen_seeds)}  # fmt: skip
    provenance = {**_provenance(grid, storage, seeds), "noise_floor": noise}
    if merge and out.is_file():
        rows, provenance, kept = merged(out, rows, provenance, grid)
        say(f"kept {kept} rows of other grids and pairs from {out}")
    write_dataset(rows, out, provenance)
    say(f"wrote {len(rows)} rows to {out}")
    return rows


def merged(dataset: Path, rows: list[dict], provenance: dict, grid: Grid) -> tuple[list[dict], dict, int]:
    """The grid's rows in place of the dataset's rows of the same grid: a family's grid replaces its
    rows of the same originals and recipes (other originals of the family, other recipes of a grid
    run a recipe at a time, other families, pairs added with `calibrate add` and every job grid's
    rows stay); a grid with smaller jobs replaces only its own rows it measured again (same grid,
    original, model, recipe and job), and the noise floors stay those of the family's grid. The
    provenance lists every grid the dataset holds."""
    from planner.fidelity.dataset import job_key, production_rows

    old = read_dataset(dataset)
    # the grid's own rows: its families' of its originals (one original's sliced and settled proxies are two families)
    ours = {(grid.family_name(family), grid.original(family, seed)) for family in grid.families for seed in grid.seeds()}
    if len(grid.jobs) > 1:
        again = {job_key(r) for r in rows}
        kept = [r for r in old if not (r.get("source") == "grid" and job_key(r) in again)]
    else:
        production = {id(r) for r in production_rows(old)}
        kept = [r for r in old if not ((str(r["family"]), str(r["original"])) in ours and r.get("source") == "grid"
                                       and r["recipe"] in grid.recipes and id(r) in production)]  # fmt: skip
    meta_path = dataset.with_suffix(".json")
    meta = read_json(meta_path, "dataset provenance") if meta_path.is_file() else {}
    recipes = set(grid.recipes)

    def replaced(g: dict) -> bool:  # the same grid run again over the same recipes (one run a recipe at a time keeps both commands)
        return g["grid_key"] == provenance["grid_key"] and set((g.get("grid") or {}).get("recipes") or recipes) <= recipes

    grids = [g for g in meta.get("grids", [{k: meta[k] for k in ("command", "grid", "grid_key", "storage", "seeds") if k in meta}])
             if g.get("grid_key") and not replaced(g)]  # fmt: skip
    grids.append({k: provenance[k] for k in ("command", "grid", "grid_key", "storage", "seeds")})
    noise = meta.get("noise_floor", [])
    if len(grid.jobs) == 1:
        # an original's noise floor is its own measurement, whichever way its proxies are built (the same studies)
        noise = [n for n in noise if not (n["original"] in {o for _, o in ours} and n["recipe"] in grid.recipes)] + provenance["noise_floor"]
    out = {**provenance, "grids": grids, "noise_floor": noise, "added": meta.get("added", [])}
    return kept + rows, out, len(kept)


def _load_run(d: Path) -> dict:
    """One side of a pair: a planner run directory (run.json with its settings, metrics.csv, and
    margin.json when `rl margin` measured it) or a trainer's run in any format planner.runs reads."""
    d = Path(d)
    if d.is_dir() and (d / "run.json").is_file():
        from planner.rl.grpo import read_metrics

        out: dict[str, Any] = {"info": read_json(d / "run.json", "run record"), "dir": d}
        if (d / "metrics.csv").is_file():
            out["rows"] = read_metrics(d)
        if (d / "margin.json").is_file():
            out["margin"] = read_json(d / "margin.json", "margin record")
        return out
    from planner.runs.read import read_run

    run = read_run(d)
    return {"info": {}, "dir": d, "rows": run.rows(), "trainer": run.trainer}


def pair_recipe(original_dir: Path, recipe_name: str | None, proxy: dict | None = None, original: dict | None = None) -> str:
    """The recipe a pair is labelled under: --recipe, the runs' records, or the fault the original's
    log shows (`planner check` asks before any proxy runs)."""
    from planner.rl.recipes import RECIPES

    original = original or _load_run(original_dir)
    names = {side["info"].get("recipe") for side in (original, proxy) if side} - {None}
    if recipe_name is not None:
        if names and names != {recipe_name}:
            raise SpecError(f"--recipe {recipe_name}, but the runs' records name {sorted(names)}")
        return recipe_name
    if len(names) > 1:
        raise SpecError(f"the two runs name recipes {sorted(names)}; pass --recipe")
    if names:
        return names.pop()
    from planner.runs.detect import detect, first_fault, signals_of

    rows = original.get("rows") or []
    found = first_fault(detect(*signals_of(rows))) if rows else None
    if found is None or found.fault not in RECIPES:
        what = f"shows {found.fault} from step {found.onset}" if found else "shows no fault"
        raise SpecError(f"the original run {original_dir} names no recipe and {what}; pass --recipe ({', '.join(RECIPES)})")
    return found.fault


def measure_pair(original_dir: Path, proxy_dir: Path, plan, *, replica_dir: Path | None = None, recipe_name: str | None = None) -> dict:
    """The dataset row of one measured (original, proxy) pair: features and labels.

    Each run is a planner run directory (`planner rl run`/`rl margin -o`/`planner check`: metrics.csv,
    run.json, and margin.json when `rl margin` measured it) or a trainer's run in any format
    `planner detect` reads (verl, MindSpeed-RL, NeMo RL, wandb, TensorBoard). Labels come from what
    is there: the shift needs both margins (2 seeds at least, 4 for a decision worth having), curve
    agreement a replica of the original (else only the grad-norm Spearman), the onsets and whether the
    proxy's run shows the fault the recipe's detector finds in the original's. A trainer's run names
    no model: the original's config comes from the plan's model (catalog id or path)."""
    from planner.catalog import load_model_config
    from planner.rl.recipes import recipe

    runs = {name: _load_run(d) for name, d in (("original", original_dir), ("proxy", proxy_dir), ("replica", replica_dir)) if d is not None}
    recipe_name = pair_recipe(original_dir, recipe_name, proxy=runs["proxy"], original=runs["original"])
    r = recipe(recipe_name)
    _check_same_settings(runs)
    if runs["original"]["info"].get("model"):
        model_dir = Path(runs["original"]["info"]["model"])
        config = read_json(model_dir / "config.json", "model config", " (the original run's model)")
        original_ref = str(model_dir)
    else:
        original_ref, config = plan.model, load_model_config(plan.model)[1]
    original_arch = Architecture.from_config(config)
    experts = original_arch.original_num_experts
    if experts != plan.original_experts:
        raise SpecError(f"the plan is for {plan.original_experts} experts; the original run's model has {experts}")
    proxy_model = runs["proxy"]["info"].get("model")
    proxy_config = Path(proxy_model) / "config.json" if proxy_model else None
    if proxy_config is not None and proxy_config.is_file():
        kept = Architecture.from_config(read_json(proxy_config, "model config")).original_num_experts
        if kept != plan.experts:
            raise SpecError(f"the plan keeps {plan.experts} experts per layer; the proxy run's model has {kept}")

    def measured(name: str) -> dict:
        margin = runs[name].get("margin")
        if margin is not None and margin.get("recipe") != recipe_name:
            raise SpecError(f"{runs[name]['dir']}/margin.json measured {margin.get('recipe')}, not {recipe_name}; "
                            "keep one recipe per run directory")  # fmt: skip
        out: dict[str, Any] = {"margin": margin}
        if "rows" in runs[name]:
            out["curve"] = runs[name]["rows"]
            out["curve_onset"] = r.onset(runs[name]["rows"])
        return out

    original, proxy = measured("original"), measured("proxy")
    if "replica" in runs and "rows" in runs["replica"]:
        original["replicas"] = [runs["replica"]["rows"]]
    top_k = original_arch.moe.top_k
    labels = pair_row(recipe_name, original, proxy, experts=plan.experts, top_k=top_k)
    arch = architecture_features(config, plan.experts)
    from planner.arch.routing import routing_shape
    from planner.families import family_of_shape

    # a pair joins the calibration family of its routing shape, where there is one; else (another shape,
    # or a proxy whose correction bias was settled again, which no calibration grid builds) a family of
    # its own, named so that it is never taken for a calibration family
    family = None if plan.correction_bias else family_of_shape(routing_shape(original_arch))
    row = {"family": family or f"added:{'settled-bias:' if plan.correction_bias else ''}{shape_key(config)}", "routing_shape": shape_key(config),
           "original": original_ref, "model": str(proxy_dir), "method": plan.method,
           "recipe": recipe_name, "experts": plan.experts, "original_experts": plan.original_experts, "top_k": top_k,
           "source": f"add:{original_dir}|{proxy_dir}"}  # fmt: skip
    row.update(features_of(plan.statistics or {}, arch))
    row.update(labels)
    return row


def add_pair(dataset: Path, original_dir: Path, proxy_dir: Path, plan_path: Path, *, replica_dir: Path | None = None,
             recipe_name: str | None = None) -> dict:  # fmt: skip
    """Append the row of one measured pair (measure_pair) to the dataset; provenance records its sources."""
    from planner.plan import load_plan

    row = measure_pair(original_dir, proxy_dir, load_plan(plan_path), replica_dir=replica_dir, recipe_name=recipe_name)
    recipe_name = row["recipe"]
    labels = ("shift_log2", "curve_agreement", "spearman_grad_norm", "run_reproduced")
    if not any(isinstance(row.get(k), float) and math.isfinite(row[k]) for k in labels) and row.get("outcome") != "not applicable":
        raise SpecError(f"{original_dir} and {proxy_dir} give no label ({', '.join(labels)} all empty): measure both with "
                        "`planner rl margin -o` (the shift) or runs of the same recipe, the original's showing its fault, with a "
                        "replica (curves); nothing was added")  # fmt: skip
    rows = read_dataset(dataset) if dataset.is_file() else []
    rows.append(row)
    meta_path = dataset.with_suffix(".json")
    meta = read_json(meta_path, "dataset provenance") if meta_path.is_file() else {}
    if not isinstance(meta, dict) or (meta_path.is_file() and not {"rows", "columns", "added", "grid", "grids", "command"} & set(meta)):
        raise SpecError(f"{meta_path}: not the dataset's provenance file (a planner calibration dataset keeps its commands, grids "
                        "and added pairs there); nothing was added")  # fmt: skip
    meta.pop("rows", None), meta.pop("columns", None), meta.pop("versions", None)
    meta.setdefault("added", []).append({"original": str(original_dir), "proxy": str(proxy_dir), "plan": str(plan_path),
                                         "replica": str(replica_dir) if replica_dir else None, "recipe": recipe_name})  # fmt: skip
    write_dataset(rows, dataset, meta)
    return row


def _check_same_settings(runs: dict) -> None:
    """The runs of a pair must differ only in the model (and the replica in its sampling seed)."""
    free = {"gen_seed", "device", "threads"}
    configs = {n: r["info"].get("config") for n, r in runs.items() if r["info"].get("config")}
    if "original" in configs:
        for name, config in configs.items():
            diff = sorted(k for k in (set(config) | set(configs["original"])) - free if config.get(k) != configs["original"].get(k))
            if diff:
                raise SpecError(f"the {name} run differs from the original run in {', '.join(diff)}; a pair must share its settings")
        if "replica" in configs and configs["replica"].get("gen_seed") == configs["original"].get("gen_seed"):
            raise SpecError("the replica run uses the original's sampling seed; make it with --gen-seed set to another value")
    margins = {n: r["margin"] for n, r in runs.items() if "margin" in r}
    if len(margins) == 2:
        a, b = margins.values()
        diff = [k for k in ("steps", "iters", "bracket") if a.get(k) != b.get(k)] + (["seeds"] if len(a["values"]) != len(b["values"]) else [])
        if diff:
            raise SpecError(f"the two margins were measured with different {', '.join(diff)}")


def fit(dataset: Path, out: Path) -> FidelityEstimator:
    rows = read_dataset(dataset)
    if not rows:
        raise SpecError(f"{dataset}: no rows to fit on; run `planner calibrate run` first")
    missing = [c for c in ID_COLUMNS if c not in rows[0]]
    if missing:
        raise SpecError(f"{dataset}: missing column(s) {', '.join(missing)}; not a planner calibration dataset")
    estimator = FidelityEstimator.fit(rows, info={"dataset": str(dataset)})
    if not estimator.recipes:
        from planner.fidelity.model import MIN_ROWS, recipe_features, training_rows

        counts = {r: len(training_rows(rows, r, recipe_features(r))) for r in sorted({row["recipe"] for row in rows})}
        raise SpecError(f"{dataset}: no recipe has {MIN_ROWS} labelled rows from 2 originals or more (labelled rows with every feature: "
                        f"{counts}); nothing was written")  # fmt: skip
    estimator.save(out)
    return estimator
