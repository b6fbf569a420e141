"""`planner rl` (the RL harness) and `planner calibrate` (the fidelity grid and estimator).

Added to the main command group by planner.cli; like every command, each parses, calls one
library function and renders."""

from __future__ import annotations

import json
import shutil
from dataclasses import fields
from pathlib import Path

import click

from planner.cli.common import emit_json, parse_seeds, progress_line, run_body
from planner.errors import SpecError
from planner.families import BALANCINGS
from planner.files import new_output, refuse_existing, write_text_atomic
from planner.render import label_text, table

DATASET = "calibration/fidelity_dataset.csv"  # shown as the default; the files themselves are the package's
ESTIMATOR = "calibration/fidelity.json"


def packaged(path: str | None, default: str, must_exist: bool = False) -> Path:
    """`path`; where it is the default, the calibration file the package ships (found through the
    package, installed or editable, so the commands run from any folder)."""
    from importlib import resources

    out = Path(str(resources.files("planner._calibration"))) / Path(default).name if path in (None, default) else Path(path)
    if must_exist and not out.is_file():
        raise SpecError(f"{out}: no such file")
    return out
RECIPE_NAMES = ("fp16-overflow", "rollout-mismatch", "entropy-collapse", "grad-blowup", "router-collapse")


def _fresh_dir(path: str, force: bool, keep: tuple[str, ...] = ()) -> Path:
    """An output directory that holds no earlier result (unless --force), `keep` files aside."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise SpecError(f"{out} exists and is not a directory")
    clash = [p.name for p in out.iterdir() if p.name not in keep] if out.is_dir() else []
    if clash and not force:
        raise SpecError(f"{out} already holds {', '.join(sorted(clash)[:4])}; pass --force to overwrite")
    return out


def _settings(pairs: tuple[str, ...], reserved: tuple[str, ...]) -> dict:
    """--set key=value pairs into RLConfig fields, typed like the field."""
    from planner.rl.grpo import RLConfig

    known = {f.name: f for f in fields(RLConfig)}
    out = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or key not in known:
            raise SpecError(f"--set {pair!r}: expected KEY=VALUE with KEY one of {', '.join(known)}")
        if key in reserved:
            raise SpecError(f"--set {key}: use the --{key.replace('_', '-')} option")
        kind = str(known[key].type)
        try:
            if text.lower() in ("none", "null") and "None" in kind:
                out[key] = None
            elif kind.startswith("int"):
                out[key] = int(text)
            elif kind.startswith("float"):
                out[key] = float(text)
            else:
                out[key] = text
        except ValueError:
            raise SpecError(f"--set {pair!r}: {text!r} is not a valid {kind}") from None
    return out


@click.group()
def rl() -> None:
    """The GRPO harness: small models, runs under fault recipes, critical knobs."""


@rl.command("make-models")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--families", default="qwen3_moe,deepseek_v3", show_default=True)
@click.option("--dense-steps", type=click.IntRange(min=1), default=300, show_default=True)
@click.option("--moe-steps", type=click.IntRange(min=1), default=300, show_default=True)
@click.option("--balancing", type=click.Choice(BALANCINGS), default="none", show_default=True,
              help="Train the MoE stage without load balancing (as the calibration grids' models are made) or with each "
                   "shape's published balancing (balance loss, correction-bias updates; calibration/families.yaml).")
@click.option("--force", is_flag=True, help="Replace existing model directories.")
@click.option("--json", "as_json", is_flag=True)
def make_models(out_dir, families, dense_steps, moe_steps, balancing, force, as_json) -> None:
    """Make the small upcycled MoE models deterministically (OUT_DIR/FAMILY)."""
    from planner.families import family_configs
    from planner.rl.models import ModelRecipe, make_model

    def body():
        names = [f.strip() for f in families.split(",") if f.strip()]
        known = family_configs()
        unknown = [f for f in names if f not in known]
        if unknown:
            raise SpecError(f"unknown famil{'y' if len(unknown) == 1 else 'ies'} {unknown}; one of {', '.join(known)}")
        reports, bars = {}, {}

        def progress(stage: str, done: int, total: int) -> None:
            bars.setdefault(stage, progress_line(stage))(done, total)

        for family in names:
            target = Path(out_dir) / family
            if target.exists():
                if not force:
                    raise SpecError(f"{target} exists; pass --force to replace it")
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            reports[family] = make_model(family, target, ModelRecipe(dense_steps=dense_steps, moe_steps=moe_steps, balancing=balancing),
                                         progress=lambda stage, d, t, f=family: progress(f"{f} {stage}", d, t))  # fmt: skip
        if as_json:
            return emit_json(reports)
        rows = [[f, f"{r['parameters']:,}", f"{r['dense_loss'][1]:.3f}", f"{r['moe_loss'][1]:.3f}",
                 *(f"{r['expert_cosine_similarity'][q]:.2f}" for q in ("p5", "p50", "p95")),
                 "-" if r["routing_end"].get("collapse_max") is None else f"{r['routing_end']['collapse_max']:.3f}", f"{r['seconds']:.0f}"]
                for f, r in reports.items()]  # fmt: skip
        click.echo(table(["family", "params", "dense loss", "MoE loss", "cos p5", "cos p50", "cos p95", "collapse at end", "s"], rows))

    run_body(body)


def _recipe_config(recipe_name, knob, seed, steps, gen_seed, device, settings):
    from planner.rl.grpo import RLConfig
    from planner.rl.recipes import recipe

    extra = dict(settings, device=device, **({"gen_seed": gen_seed} if gen_seed is not None else {}))
    if recipe_name is None:
        return None, RLConfig(**{**extra, "seed": seed, "steps": steps})
    r = recipe(recipe_name)
    if knob is None:  # the recipe's settings without its knob: a baseline run
        return r, RLConfig(**{**r.base, **extra, "seed": seed, "steps": steps})
    return r, r.config(knob, seed=seed, steps=steps, **extra)


@rl.command("run")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--recipe", "recipe_name", type=click.Choice(RECIPE_NAMES), default=None, help="Fault recipe (default: plain GRPO).")
@click.option("--knob", type=float, default=None, help="The recipe's knob value (default: its settings without the knob).")
@click.option("--steps", type=click.IntRange(min=1), default=60, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda", "npu"]), default="cpu", show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--gen-seed", type=int, default=None, help="Sampling seed (same prompts, other samples: a replica).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override an RLConfig field (repeatable).")
@click.option("-o", "--output", type=click.Path(file_okay=False), required=True)
@click.option("--force", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
def rl_run(model_dir, recipe_name, knob, steps, device, seed, gen_seed, sets, output, force, as_json) -> None:
    """Run GRPO on MODEL_DIR; write metrics.csv and run.json to OUTPUT."""
    from planner.interrupts import deferred
    from planner.rl.grpo import GRPO, write_metrics

    def body():
        out = _fresh_dir(output, force, keep=("margin.json",))
        if knob is not None and recipe_name is None:
            raise SpecError("--knob sets a fault recipe's knob; pass --recipe too")
        r, config = _recipe_config(recipe_name, knob, seed, steps, gen_seed, device, _settings(sets, ("seed", "steps", "device", "gen_seed")))
        trainer = GRPO(model_dir, config)
        with deferred(waiting="stopping after the step in hand") as pending:  # between steps, never inside torch
            rows = trainer.run(progress=progress_line("GRPO steps"), stop=lambda rows: bool(pending))
        onset = r.onset(rows) if r else None
        seconds = sum(row["wall_s"] for row in rows)
        info = {"model": str(Path(model_dir).resolve()), "recipe": recipe_name, "knob": knob, "onset": onset,
                "steps_per_s": len(rows) / seconds if seconds else None}  # fmt: skip
        write_metrics(rows, out, config, info)
        if as_json:
            return emit_json({**info, "last": rows[-1]})
        keys = ("step", "loss", "grad_norm", "entropy", "kl_ref", "reward_mean", "mismatch_k3", "topk_share_max", "overflow")
        shown = rows if len(rows) <= 12 else rows[:: max(1, len(rows) // 10)] + [rows[-1]]
        click.echo(table(list(keys), [[f"{row[k]:.4g}" if isinstance(row[k], float) else row[k] for k in keys] for row in shown]))
        if r:
            click.echo(f"{r.name}: " + (f"fault at step {onset}" if onset is not None else "no fault") + f" ({r.fault})")
        click.echo(f"wrote {out}/metrics.csv ({len(rows)} steps, {info['steps_per_s']:.2f} steps/s)")

    run_body(body)


@rl.command("margin")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--recipe", "recipe_name", type=click.Choice(RECIPE_NAMES), required=True)
@click.option("--seeds", default="0,1", show_default=True, help="Comma-separated seeds; each is its own bisection.")
@click.option("--iters", type=click.IntRange(1, 30), default=None, help="Bisection steps (default: 8 for static recipes, 5 for dynamic ones).")
@click.option("--steps", type=int, default=None, help="Run length of one dynamic probe (default: 12, as the grid).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "npu"]), default="cpu", show_default=True)
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None, help="Write margin.json (and run.json) here.")
@click.option("--force", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
def rl_margin(model_dir, recipe_name, seeds, iters, steps, device, output, force, as_json) -> None:
    """The critical knob value at which the recipe's fault appears, by bisection, per seed."""
    from planner.rl.grpo import Models
    from planner.rl.margin import DEFAULT_ITERS, DEFAULT_PROBE_STEPS, critical_knob
    from planner.rl.recipes import recipe

    def body():
        r = recipe(recipe_name)
        out = None
        if output:
            out = Path(output)
            refuse_existing(out / "margin.json", force)
        seed_list = parse_seeds(seeds)
        if not seed_list:
            raise SpecError("--seeds: give at least one seed")
        n = iters if iters is not None else DEFAULT_ITERS[r.kind]
        steps_ = DEFAULT_PROBE_STEPS if steps is None else steps
        margin = critical_knob(Models(model_dir, device), r, seed_list, iters=n, steps=steps_)
        data = {**margin.to_json(), "knob": r.knob, "bracket": [r.lo, r.hi], "resolution": (r.hi - r.lo) / 2 ** (n + 1),
                "model": str(Path(model_dir).resolve()), "steps": steps_, "iters": n}  # fmt: skip
        if out:
            out.mkdir(parents=True, exist_ok=True)
            write_text_atomic(out / "margin.json", json.dumps(data, indent=2))
            if not (out / "run.json").exists():
                write_text_atomic(out / "run.json", json.dumps({"model": data["model"], "recipe": recipe_name}, indent=2))
        if as_json:
            return emit_json(data)
        rows = [[s, f"{v:.3f}", "censored" if c else ""] for s, v, c in zip(seed_list, margin.values, margin.censored)]
        click.echo(table(["seed", f"critical {r.knob}", ""], rows))
        click.echo(f"{r.name}: critical knob {margin.mean:.3f} +- {margin.spread:.3f} over {len(seed_list)} seed(s), "
                   f"resolution {data['resolution']:.3f}, {margin.probes} probes")  # fmt: skip

    run_body(body)


@click.group()
def calibrate() -> None:
    """The fidelity grid, its dataset and the fitted estimator."""


@calibrate.command("run")
@click.option("--grid", "grid_path", type=click.Path(exists=True, dir_okay=False), default=None, help="Grid YAML (default: the built-in grid).")
@click.option("--storage", default="sqlite:///calibration.db", show_default=True, help="Optuna RDB storage URL shared by the workers.")
@click.option("--workers", type=int, default=2, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False), default="calibration/work", show_default=True, help="Models, proxies and stats.")
@click.option("--results", type=click.Path(file_okay=False), default=None,
              help="Keep every completed grid point in JSON-lines files here too (one per study), and take the points they "
                   "hold instead of measuring them: a grid that resumes in a fresh checkout or on another machine.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=DATASET, show_default=True)
@click.option("--merge", is_flag=True, help="Put the grid's rows into an existing dataset in place of its rows of the same families "
                                            "(a family's grid of its own); other families' rows and added pairs stay.")
@click.option("--recipes", default=None, help="Measure only these of the grid's recipes (comma-separated; e.g. the cheap static ones "
                                             "first): the same studies, so a later run of the rest adds to them.")
@click.option("--measured-only", is_flag=True, help="Measure nothing: export the originals whose every grid point of a recipe is "
                                                    "measured (a grid that spans sessions lands its complete originals) and name the rest.")
@click.option("--force", is_flag=True, help="Overwrite an existing dataset file.")
def calibrate_run(grid_path, storage, workers, workdir, results, output, merge, recipes, measured_only, force) -> None:
    """Run (or resume) the calibration grid and export the dataset."""
    from planner.fidelity.calibrate import run
    from planner.fidelity.grid import Grid

    def body():
        out = packaged(output, DATASET)
        if not merge:
            new_output(out, force, f" (the grid itself resumes from {storage}; --merge adds a family's rows to it)")
        if workers < 1:
            raise SpecError(f"--workers must be at least 1, got {workers}")
        grid = Grid.load(grid_path)
        if recipes:
            grid = grid.only(recipes)
        run(grid, grid_path, storage, Path(workdir), workers, out, say=lambda s: click.echo(s, err=True),
            results=Path(results) if results else None, merge=merge, measured_only=measured_only)  # fmt: skip

    run_body(body)


@calibrate.command("status")
@click.option("--grid", "grid_path", type=click.Path(exists=True, dir_okay=False), default=None, help="Grid YAML (default: the built-in grid).")
@click.option("--storage", default="sqlite:///calibration.db", show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False), default="calibration/work", show_default=True)
@click.option("--recipes", default=None, help="Only these of the grid's recipes (comma-separated): those of a `calibrate run --recipes`.")
@click.option("--json", "as_json", is_flag=True)
def calibrate_status(grid_path, storage, workdir, recipes, as_json) -> None:
    """Progress of a grid on its storage (any worker's machine): points done, running, failed, and the work left."""
    from planner.fidelity.calibrate import progress
    from planner.fidelity.grid import Grid

    def body():
        if not (Path(workdir) / "models.json").is_file():
            raise SpecError(f"{workdir} holds no prepared grid (no models.json); pass the --workdir of `calibrate run`")
        if storage.startswith("sqlite:///") and not Path(storage[len("sqlite:///"):]).is_file():  # a read: never make a new database
            raise SpecError(f"--storage {storage}: no such database file; pass the --storage of `calibrate run`")
        grid = Grid.load(grid_path)
        if recipes:
            grid = grid.only(recipes)
        rows = progress(storage, grid, Path(workdir))
        if as_json:
            return emit_json(rows)
        body = [[r["recipe"], r["phase"], r["original"], f"{r['complete']}/{r['points']}", r["running"], r["failed"],
                 "-" if r["median_s"] is None else f"{r['median_s']:.1f}", "-" if r["left_s"] is None else f"{r['left_s'] / 60:.0f}"]
                for r in rows]  # fmt: skip
        click.echo(table(["recipe", "phase", "original", "done", "running", "failed", "median s", "left min (1 worker)"], body))
        done, total = sum(r["complete"] for r in rows), sum(r["points"] for r in rows)
        left = sum(r["left_s"] or 0 for r in rows)
        unknown = sum(r["left"] for r in rows if r["left_s"] is None)
        bound = sum(r["left"] for r in rows if r["pace"] == "originals" and r["phase"] == "proxies")
        click.echo(f"{done} of {total} grid points complete; about {left / 3600:.1f} worker-hours left at the measured pace"
                   + (f" ({bound} proxies at their originals' pace until one is measured: an upper bound)" if bound else "")
                   + (f", and {unknown} points of recipes not measured yet" if unknown else ""))  # fmt: skip

    run_body(body)


@calibrate.command("fit")
@click.option("--dataset", type=click.Path(dir_okay=False), default=DATASET, show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=ESTIMATOR, show_default=True)
@click.option("--force", is_flag=True, help="Replace an existing estimator file.")
def calibrate_fit(dataset, output, force) -> None:
    """Fit the FidelityEstimator (per recipe: the shift model, its baselines and the skill gate)."""
    from planner.fidelity.calibrate import fit

    def body():
        output_path = packaged(output, ESTIMATOR)
        new_output(output_path, force)
        estimator = fit(packaged(dataset, DATASET, must_exist=True), output_path)
        rows = [[recipe, family, f["originals"], f["rows"], f["routing_shape"], e["gates"][family]["reason"]]
                for recipe, e in estimator.recipes.items() for family, f in e["families"].items()]  # fmt: skip
        click.echo(table(["recipe", "family", "originals", "rows", "routing shape", "skill gate (held-out originals of the family)"], rows))
        click.echo(f"wrote {output_path} ({estimator.info['rows']} rows)")

    run_body(body)


@calibrate.command("add")
@click.option("--original", "original_dir", type=click.Path(exists=True), required=True,
              help="The original's run: a planner run directory or a trainer's log in any format `planner detect` reads.")
@click.option("--proxy", "proxy_dir", type=click.Path(exists=True), required=True, help="The proxy's run, likewise.")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False), required=True)
@click.option("--replica", "replica_dir", type=click.Path(exists=True), default=None,
              help="A replica of the original run (other sampling seed): the curve-agreement noise floor.")
@click.option("--recipe", "recipe_name", type=click.Choice(RECIPE_NAMES), default=None)
@click.option("--dataset", type=click.Path(dir_okay=False), default=DATASET, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def calibrate_add(original_dir, proxy_dir, plan_path, replica_dir, recipe_name, dataset, as_json) -> None:
    """Add one measured (original, proxy) pair to the dataset; refit with `calibrate fit`."""
    from planner.fidelity.calibrate import add_pair

    def body():
        dataset_path = packaged(dataset, DATASET)
        row = add_pair(dataset_path, Path(original_dir), Path(proxy_dir), Path(plan_path), replica_dir=replica_dir and Path(replica_dir),
                       recipe_name=recipe_name)  # fmt: skip
        if as_json:
            return emit_json(row)
        keys = ("recipe", "experts", "shift_log2", "shift_sd", "outcome", "curve_agreement", "spearman_grad_norm", "onset_original",
                "onset_proxy", "run_reproduced")
        click.echo(table(list(keys), [[label_text(row.get(k)) for k in keys]]))
        click.echo(f"added to {dataset_path}; run `planner calibrate fit` to refit")

    run_body(body)


@calibrate.command("report")
@click.option("--dataset", type=click.Path(dir_okay=False), default=DATASET, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def calibrate_report(dataset, as_json) -> None:
    """Held-out validation per recipe (leave one original out, leave one family out) against K/E alone and the recipe's mean."""
    from planner.fidelity.dataset import read_dataset
    from planner.fidelity.validate import cross_validate, render_report

    def body():
        report = cross_validate(read_dataset(packaged(dataset, DATASET, must_exist=True)))
        emit_json(report) if as_json else click.echo(render_report(report))

    run_body(body)


COMMANDS = (rl, calibrate)
