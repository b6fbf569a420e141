"""`planner models`, `inspect`, `cost`, `demo` and `fit-knobs`: the catalog and the cost model."""

from __future__ import annotations

import sys

import click

from planner.cli.common import DEFAULT_HARDWARE, DEFAULT_MODEL, DEMO_EXPERTS, calibrated, emit_json, memory_margin_option, parse_ints, run_body
from planner.errors import InfeasibleError, PlannerError, SpecError
from planner.files import new_output
from planner.search.budget import MAX_DEVICES

@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def models(as_json: bool) -> None:
    """The catalog: models and accelerators, with their sources."""
    from planner.summary import catalog_listing, render_catalog

    def body():
        listing = catalog_listing()
        emit_json(listing) if as_json else click.echo(render_catalog(listing))

    run_body(body)


@click.command()
@click.argument("model")
@click.option("--experts", type=int, default=None, help="Also show the proxy keeping K routed experts per MoE layer.")
@click.option("--json", "as_json", is_flag=True)
def inspect(model: str, experts: int | None, as_json: bool) -> None:
    """Parameters and routing of MODEL (catalog id, config.json or checkpoint directory)."""
    from planner.catalog import load_model
    from planner.inspect import describe, render_description

    def body():
        info = describe(load_model(model), experts)
        emit_json(info) if as_json else click.echo(render_description(info))

    run_body(body)


@click.command()
@click.argument("model")
@click.option("--hardware", default=DEFAULT_HARDWARE, show_default=True, help="Accelerator id or YAML profile.")
@click.option("--cards", type=click.IntRange(1, MAX_DEVICES), default=None, help="Devices as the framework counts them (A3: dies).")
@click.option("--min-cards", is_flag=True, help="Find the smallest feasible device count and the best layout there.")
@click.option("--job", "job_path", type=click.Path(dir_okay=False), default=None, help="RL job YAML (default: GRPO 512x16).")
@click.option("--experts", type=int, default=None, help="Cost the proxy keeping K experts per MoE layer.")
@click.option("--max-cards", type=click.IntRange(1, MAX_DEVICES), default=4096, show_default=True, help="Search bound for --min-cards.")
@click.option("--knobs", "knobs_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Your own `planner fit-knobs -o` output instead of the packaged efficiency knobs.")
@memory_margin_option
@click.option("--explain", is_flag=True, help="Also print the step's terms (compute, bubble, all-to-all, decode, ...) with their inputs.")
@click.option("--json", "as_json", is_flag=True)
def cost(model, hardware, cards, min_cards, job_path, experts, max_cards, knobs_file, memory_margin, explain, as_json) -> None:
    """Memory per device, step time by RL phase and accelerator-hours of MODEL."""
    from planner.catalog import load_accelerator, load_model
    from planner.cost.evaluate import evaluate, min_devices
    from planner.cost.fit import feature_validation, step_validation
    from planner.cost.knobs import knobs_path
    from planner.specs import load_job
    from planner.summary import feature_validation_lines, render_cost, render_terms, validation_text

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
                if as_json:  # one JSON object: the verdict with its error and exit code
                    emit_json({"feasible": False, "model": arch.name, "experts": arch.moe.num_experts,
                               "accelerator": accel.id, "reasons": [str(exc)], "error": str(exc), "exit_code": exc.exit_code})
                    sys.exit(exc.exit_code)
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
        validation = step_validation(accel.family, accelerator=accel.id)
        features = feature_validation(result.job or job, accel.family)
        if as_json:
            emit_json({**result.to_json(), "knobs_file": str(knobs_path()), "step_time_validation": validation, "feature_validation": features})
        else:
            click.echo(render_cost(result))
            if explain and result.feasible:
                click.echo("\n" + render_terms(result))
            click.echo(f"efficiency knobs: {knobs_path()}")
            click.echo("\n".join([validation_text(validation), *feature_validation_lines(features)]))
        if not result.feasible:
            if not as_json:
                click.echo("error: infeasible: " + "; ".join(result.reasons), err=True)
            sys.exit(2)

    run_body(lambda: calibrated(knobs_file, None, body))


@click.command()
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
        ks = parse_ints(experts)
        if not ks:
            raise SpecError(f"--experts {experts!r}: give the proxies' K values, comma-separated (e.g. 32,64)")
        comparison = compare_proxies(model, load_accelerator(hardware), load_job(job_path), ks, memory_margin=memory_margin)
        emit_json(comparison.to_json()) if as_json else click.echo(render_comparison(comparison))

    run_body(body)


@click.command("fit-knobs")
@click.option("--runs", "runs_path", type=click.Path(exists=True, dir_okay=False), default=None, help="Published runs YAML (default: calibration/published_runs.yaml).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Where to write the fitted knobs (default: print).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
def fit_knobs(runs_path, output, force) -> None:
    """Fit the efficiency knobs to the published runs, then refit without each run to measure the error on it."""
    from planner.cost.fit import fit_all, load_runs, write_fit
    from planner.summary import render_published_fit

    def body():
        if output:
            new_output(output, force)
        runs = load_runs(runs_path)
        click.echo(f"fitting knobs to {len(runs)} runs, then refitting without each run in turn ...", err=True)
        result = fit_all(runs, progress=lambda n, total, run: click.echo(f"  left out and predicted {n + 1}/{total}: {run}", err=True),
                         path=runs_path)  # fmt: skip
        if output:
            write_fit(output, result)
            click.echo(render_published_fit(result), err=True)
            click.echo(f"wrote {output}", err=True)
        else:
            emit_json(result)

    run_body(body)


COMMANDS = (models, inspect, cost, demo, fit_knobs)
