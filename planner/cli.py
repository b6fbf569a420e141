"""The `planner` command. Each command parses, calls one library function, renders. The only
module that imports click or configures logging."""

from __future__ import annotations

import json
import logging
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click

from planner.errors import InfeasibleError, PlannerError, SpecError
from planner.files import new_output, refuse_existing, write_text_atomic
from planner.interrupts import Terminated
from planner.plan import SELECTION_METHODS

DEFAULT_MODEL = "qwen3-30b-a3b"
DEFAULT_HARDWARE = "ascend-910b2"
DEMO_EXPERTS = (64, 32, 16)
# one margin for every command that sizes devices, so the same job gets the same minimum count
memory_margin_option = click.option("--memory-margin", type=click.FloatRange(0.0, 0.9), default=0.1, show_default=True,
                                    help="Share of usable device memory kept free in the training phases.")  # fmt: skip


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(_clean(data), indent=2, default=_json_default))


def _terminated(signum, frame):
    raise Terminated()


def _run(fn):
    """Run a command body; planner errors print their message and exit with their code. Ctrl-C and
    SIGTERM unwind the body (outputs in progress are removed) and exit with 128 + the signal."""
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return fn()
    except PlannerError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except OSError as exc:  # an unwritable output, a parent that is a file, a full disk: the OS's words and the path
        where = f"{exc.filename}: " if exc.filename else ""
        click.echo(f"error: {where}{exc.strerror or exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        note = getattr(exc, "note", "") or "nothing half-written was kept; run the command again"
        click.echo(f"interrupted ({signal.Signals(signum).name}): {note}", err=True)
        sys.exit(128 + signum)
    finally:
        signal.signal(signal.SIGTERM, previous)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.version_option(package_name="planner")
def main(verbose: int) -> None:
    """Plan the cheapest proxy MoE model that still reproduces an RL training failure."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def models(as_json: bool) -> None:
    """The catalog: models and accelerators, with their sources."""
    from planner.summary import catalog_listing, render_catalog

    def body():
        listing = catalog_listing()
        _emit_json(listing) if as_json else click.echo(render_catalog(listing))

    _run(body)


@main.command()
@click.argument("model")
@click.option("--experts", type=int, default=None, help="Also show the proxy keeping K routed experts per MoE layer.")
@click.option("--json", "as_json", is_flag=True)
def inspect(model: str, experts: int | None, as_json: bool) -> None:
    """Parameters and routing of MODEL (catalog id, config.json or checkpoint directory)."""
    from planner.catalog import load_model
    from planner.inspect import describe, render_description

    def body():
        info = describe(load_model(model), experts)
        _emit_json(info) if as_json else click.echo(render_description(info))

    _run(body)


@main.command()
@click.argument("model")
@click.option("--hardware", default=DEFAULT_HARDWARE, show_default=True, help="Accelerator id or YAML profile.")
@click.option("--cards", type=click.IntRange(1, 65_536), default=None, help="Devices as the framework counts them (A3: dies).")
@click.option("--min-cards", is_flag=True, help="Find the smallest feasible device count and the best layout there.")
@click.option("--job", "job_path", type=click.Path(dir_okay=False), default=None, help="RL job YAML (default: GRPO 512x16).")
@click.option("--experts", type=int, default=None, help="Cost the proxy keeping K experts per MoE layer.")
@click.option("--max-cards", type=click.IntRange(1, 65_536), default=4096, show_default=True, help="Search bound for --min-cards.")
@click.option("--knobs", "knobs_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Your own `planner fit-knobs -o` output instead of the packaged efficiency knobs.")
@memory_margin_option
@click.option("--explain", is_flag=True, help="Also print the step's terms (compute, bubble, all-to-all, decode, ...) with their inputs.")
@click.option("--json", "as_json", is_flag=True)
def cost(model, hardware, cards, min_cards, job_path, experts, max_cards, knobs_file, memory_margin, explain, as_json) -> None:
    """Memory per device, step time by RL phase and accelerator-hours of MODEL."""
    from planner.catalog import load_accelerator, load_model
    from planner.cost.evaluate import evaluate, min_devices
    from planner.cost.fit import step_validation
    from planner.cost.knobs import knobs_path
    from planner.specs import load_job
    from planner.summary import render_cost, render_terms, validation_text

    def body():
        if (cards is None) == (not min_cards):
            raise SpecError("give exactly one of --cards N or --min-cards")
        arch = load_model(model, experts=experts)
        accel = load_accelerator(hardware)
        job = load_job(job_path)
        if min_cards:
            try:
                result = min_devices(arch, accel, job, max_devices=max_cards, memory_margin=memory_margin)
            except InfeasibleError as exc:
                if as_json:
                    _emit_json({"feasible": False, "model": arch.name, "experts": arch.moe.num_experts,
                                "accelerator": accel.id, "reasons": [str(exc)]})
                raise
        else:
            result = evaluate(arch, accel, job, cards, memory_margin=memory_margin)
        if not result.feasible and cards is not None:
            # say the smallest count that would fit, when there is one
            try:
                smallest = min_devices(arch, accel, job, max_devices=max_cards, memory_margin=memory_margin)
                result.reasons.append(
                    f"the smallest feasible count is {smallest.num_devices} {accel.device_unit}s "
                    f"({smallest.train_layout.describe()}; rollout {smallest.rollout_layout.describe()})"
                )
            except PlannerError as exc:
                result.reasons.append(str(exc))
        validation = step_validation(accel.family)
        if as_json:
            _emit_json({**result.to_json(), "knobs_file": str(knobs_path()), "step_time_validation": validation})
        else:
            click.echo(render_cost(result))
            if explain and result.feasible:
                click.echo("\n" + render_terms(result))
            click.echo(f"efficiency knobs: {knobs_path()}")
            click.echo(validation_text(validation))
        if not result.feasible:
            if not as_json:
                click.echo("error: infeasible: " + "; ".join(result.reasons), err=True)
            sys.exit(2)

    _run(lambda: calibrated(knobs_file, None, body))


@main.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--hardware", default=DEFAULT_HARDWARE, show_default=True)
@click.option("--job", "job_path", type=click.Path(dir_okay=False), default=None)
@click.option("--experts", default=",".join(map(str, DEMO_EXPERTS)), show_default=True, help="Comma-separated K values.")
@memory_margin_option
@click.option("--json", "as_json", is_flag=True)
def demo(model, hardware, job_path, experts, memory_margin, as_json) -> None:
    """The default case: original vs proxies, minimum devices, layouts, memory, time, hours."""
    from planner.catalog import load_accelerator
    from planner.specs import load_job
    from planner.summary import compare_proxies, render_comparison

    def body():
        ks = [int(k) for k in str(experts).split(",") if k.strip()]
        comparison = compare_proxies(model, load_accelerator(hardware), load_job(job_path), ks, memory_margin=memory_margin)
        _emit_json(comparison.to_json()) if as_json else click.echo(render_comparison(comparison))

    _run(body)


def calibration_options(fn):
    """--knobs and --estimator: a user's own `planner fit-knobs` / `planner calibrate fit` output."""
    fn = click.option("--estimator", "estimator_file", type=click.Path(exists=True, dir_okay=False), default=None,
                      help="Your own `planner calibrate fit` output instead of the packaged fidelity estimator.")(fn)  # fmt: skip
    return click.option("--knobs", "knobs_file", type=click.Path(exists=True, dir_okay=False), default=None,
                        help="Your own `planner fit-knobs -o` output instead of the packaged efficiency knobs.")(fn)  # fmt: skip


def calibrated(knobs_file: str | None, estimator_file: str | None, fn):
    """Run fn with the user's fitted files in use (each checked first: a bad one is a usage error)."""
    from planner.cost.knobs import using_knobs_file

    with using_knobs_file(knobs_file):
        if estimator_file is None:
            return fn()
        from planner.fidelity.estimator import using_estimator_file

        with using_estimator_file(estimator_file):
            return fn()


def _progress(label: str):
    """A progress callback printing to stderr: one updating line on a terminal, else every 10%."""
    state = {"last": -1}

    def report(done: int, total: int) -> None:
        pct = int(100 * done / total) if total else 100
        if sys.stderr.isatty():
            click.echo(f"\r{label}: {pct:3d}% ({done:,}/{total:,})", err=True, nl=pct >= 100)
        elif pct // 10 != state["last"] // 10 or pct == 100 and state["last"] != 100:
            click.echo(f"{label}: {pct}%", err=True)
        state["last"] = pct

    return report


def _ints(text: str | None) -> list[int]:
    try:
        return [int(x) for x in str(text).split(",") if x.strip()] if text else []
    except ValueError:
        raise SpecError(f"expected comma-separated integers, got {text!r}") from None


@main.command()
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.option("--calib-text", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Calibration text file (default: Python standard-library docstrings).")
@click.option("--calib-tokens", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=2), default=256, show_default=True, help="Tokens per calibration sequence.")
@click.option("--experts", default=None, help="Comma-separated K values to cluster for (default: E/2, E/4, E/8 where legal).")
@click.option("--methods", default="agglomerative", show_default=True, help="Comma-separated clustering methods.")
@click.option("--weights-only", is_flag=True, help="Data-free features only (router rows, weight sketches).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True)
@click.option("--force", is_flag=True, help="Overwrite an existing stats file.")
@click.option("--json", "as_json", is_flag=True, help="Print the per-plan summaries as JSON.")
def stats(checkpoint, calib_text, calib_tokens, seq_len, experts, methods, weights_only, seed, output, force, as_json) -> None:
    """Expert features, clusterings and per-plan statistics of a checkpoint."""
    from planner.checkpoint import Checkpoint
    from planner.stats.compute import compute_stats, default_experts
    from planner.stats.store import save_stats
    from planner.summary import render_stats

    def body():
        refuse_existing(output, force)
        ckpt = Checkpoint(checkpoint)
        ks = _ints(experts) or default_experts(ckpt.arch)
        text = Path(calib_text).read_text(errors="replace") if calib_text else None
        if text is not None and not text.strip():
            raise SpecError(f"--calib-text {calib_text}: the file is empty; give a text file, or leave the option out for the default text")
        bars = {}

        def progress(stage, done, total):
            bars.setdefault(stage, _progress(stage))(done, total)

        result = compute_stats(ckpt, experts=ks, methods=tuple(m.strip() for m in methods.split(",")), calib_text=text,
                               calib_tokens=calib_tokens, seq_len=seq_len, weights_only=weights_only, seed=seed,
                               progress=progress)  # fmt: skip
        save_stats(result, output, force=force)
        if as_json:
            _emit_json({key: plan["summary"] for key, plan in result["plans"].items()})
        else:
            click.echo(render_stats(result))
            click.echo(f"wrote {output}")

    _run(body)


@main.command()
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.option("--experts", type=int, required=True, help="K: routed experts kept per MoE layer.")
@click.option("--method", default="agglomerative", show_default=True,
              type=click.Choice(SELECTION_METHODS))
@click.option("--stats", "stats_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Stats file of this checkpoint (default: data-free features computed now).")
@click.option("--mtp", type=click.Choice(["drop", "prune"]), default="drop", show_default=True)
@click.option("--target-ep", default=None, help="Comma-separated EP sizes the proxy must run with.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True)
@click.option("--force", is_flag=True)
def plan(checkpoint, experts, method, stats_path, mtp, target_ep, seed, output, force) -> None:
    """Choose the experts to keep (one real expert per cluster) and write the plan YAML."""
    from planner.checkpoint import Checkpoint
    from planner.stats.compute import choose_plan

    def body():
        new_output(output, force)
        ckpt = Checkpoint(checkpoint)
        result = choose_plan(ckpt, experts, method, stats_path=stats_path, mtp=mtp, target_ep=tuple(_ints(target_ep)), seed=seed)
        warnings = result.check(ckpt.arch, list(ckpt.moe_layers))
        write_text_atomic(output, result.to_yaml())
        for w in warnings:
            click.echo(f"warning: {w}", err=True)
        click.echo(f"wrote {output}: K={experts} of {result.original_experts} experts, {len(result.layers)} MoE layers, method {method}")

    _run(body)


@main.command()
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--experts", type=int, default=None, help="Build without a plan file: K experts per layer.")
@click.option("--method", default="agglomerative", show_default=True,
              type=click.Choice(SELECTION_METHODS))
@click.option("--stats", "stats_path", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--mtp", type=click.Choice(["drop", "prune"]), default="drop", show_default=True)
@click.option("--verify", type=click.Choice(["auto", "always", "never"]), default="auto", show_default=True,
              help="Run the proxy in transformers after building, one decoder layer at a time in the checkpoint's dtype (bounded "
                   "memory at any size); always: the original too, for the KL between them (auto: for a keep-all plan only).")
@click.option("--force", is_flag=True, help="Replace an existing OUT_DIR.")
@click.option("--json", "as_json", is_flag=True)
def build(checkpoint, out_dir, plan_path, experts, method, stats_path, mtp, verify, force, as_json) -> None:
    """Write the proxy checkpoint: kept experts sliced and renumbered, verified, atomic."""
    from planner.checkpoint import Checkpoint
    from planner.checkpoint import build as build_proxy
    from planner.plan import load_plan
    from planner.stats.compute import choose_plan, resolve_plan

    def body():
        if (plan_path is None) == (experts is None):
            raise SpecError("give exactly one of --plan plan.yaml or --experts K")
        start = time.perf_counter()
        ckpt = Checkpoint(checkpoint)
        if plan_path:  # a deferred plan (planner suggest without a checkpoint) chooses its experts now
            the_plan = resolve_plan(ckpt, load_plan(plan_path), stats_path=stats_path)
        else:
            the_plan = choose_plan(ckpt, experts, method, stats_path=stats_path, mtp=mtp)
        choosing = time.perf_counter() - start  # a plan chosen now reads every expert's weights (sketches)
        report = build_proxy(ckpt, the_plan, out_dir, force=force, verify=verify, progress=_progress("writing"))
        if as_json:
            _emit_json({**report.to_json(), "seconds_choosing_experts": choosing, "seconds_total": time.perf_counter() - start})
        else:
            from planner.units import human_bytes

            click.echo(
                f"built {out_dir}: K={report.experts} of {report.original_experts} experts, "
                f"{human_bytes(report.bytes_written)} written, {human_bytes(report.bytes_skipped)} of dropped experts "
                f"not copied; {time.perf_counter() - start:.1f} s (choosing the experts {choosing:.1f} s, writing and checking "
                f"{report.seconds:.1f} s)"
            )
            for key, value in report.verification.items():
                click.echo(f"  {key}: {value}")
            for w in report.warnings:
                click.echo(f"  warning: {w}")

    _run(body)


@main.command("fit-knobs")
@click.option("--runs", "runs_path", type=click.Path(exists=True, dir_okay=False), default=None, help="Published runs YAML (default: calibration/published_runs.yaml).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Where to write the fitted knobs (default: print).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
def fit_knobs(runs_path, output, force) -> None:
    """Fit the efficiency knobs to the published runs, then refit without each run to measure the error on it."""
    from planner.cost.fit import fit_all, load_runs, write_fit
    from planner.summary import render_published_fit

    def body():
        if output:
            refuse_existing(output, force)
        runs = load_runs(runs_path)
        click.echo(f"fitting knobs to {len(runs)} runs, then refitting without each run in turn ...", err=True)
        result = fit_all(runs, progress=lambda n, total, run: click.echo(f"  left out and predicted {n + 1}/{total}: {run}", err=True))
        if output:
            write_fit(output, result)
            click.echo(render_published_fit(result), err=True)
            click.echo(f"wrote {output}", err=True)
        else:
            _emit_json(result)

    _run(body)


from planner import cli_rl, cli_runs, cli_search  # noqa: E402,F401  (register `rl`, `calibrate`, `detect`, `suggest`, `preflight`, `report`, `check`)

if __name__ == "__main__":  # pragma: no cover  (python -m planner.cli: run the registered copy)
    from planner.cli import main as registered

    registered()
