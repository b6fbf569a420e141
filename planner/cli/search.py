"""`planner suggest`, `planner preflight`, `planner report` and `planner check`: the commands users
start from. Added to the main group by planner.cli; each parses, calls one library function
and renders."""

from __future__ import annotations

from pathlib import Path

import click

from planner.cli.common import (DEFAULT_HARDWARE, DEFAULT_MODEL, emit_json, progress_line, run_body, calibrated, calibration_options,
                         memory_margin_option)  # fmt: skip
from planner.errors import SpecError
from planner.files import new_output, write_text_atomic

_SEARCH_OPTIONS = (
    click.option("--budget", required=True, help="8npu, 16gpu, 2x8npu (nodes x devices), 64card, or 40npu-h (accelerator-hours for --steps steps)."),
    click.option("--model", default=DEFAULT_MODEL, show_default=True, help="Catalog model or a path to config.json / a checkpoint."),
    click.option("--hardware", default=DEFAULT_HARDWARE, show_default=True),
    click.option("--job", "job_path", type=click.Path(dir_okay=False), default=None, help="RL job YAML (default: GRPO 512x16)."),
    click.option("--fault", default="rollout-mismatch", show_default=True,
                 help="grad-overflow, rollout-mismatch, entropy-collapse, router-collapse or grad-norm-divergence."),
    click.option("--stats", "stats_path", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="`planner stats` of the checkpoint: fidelity from plan statistics (without it, no plan-level P)."),
    click.option("--min-fidelity", type=float, default=0.8, show_default=True, help="Least calibrated P(fault reproduced); plans without a calibrated P are ranked by cost."),
    click.option("--trials", type=click.IntRange(min=1), default=300, show_default=True),
    click.option("--storage", default=None, help="Optuna storage URL (sqlite:///study.db, postgresql://...) shared by several processes."),
    click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True),
    click.option("--steps", type=int, default=None,
                 help="Steps of the reproduction (hours budgets, totals); default: past the predicted onset with --fault-step, else 20."),
    click.option("--fault-step", type=int, default=None,
                 help="The step at which the original showed the fault (its run's log; `planner detect` finds it): prices the reproduction to the fault."),
    click.option("--job-bounds", default=None,
                 help="How far the reproduction's job may shrink, where the fidelity data support it: batch=1/16,length=1/4 (the default)."),
    click.option("--translate-knob", is_flag=True,
                 help="Also shrink job dimensions that move the fault (fp16 overflow with the batch's tokens), where the move is validated on "
                      "held-out originals: the proxy then runs at the knob translated by it, which the output states."),
    click.option("--settle-bias", is_flag=True,
                 help="The proxies settle their correction bias again after pruning (`planner build --settle-bias`; with --stats, a "
                      "`planner stats --settle-bias` file): their P comes from the shape's family of settled proxies."),
    click.option("--min-k-ratio", type=click.FloatRange(min=0.0), default=4.0, show_default=True, help="Keep K/top_k at least this (0: any legal K)."),
    memory_margin_option,
    click.option("--baseline-cards", type=click.IntRange(min=1), default=None,
                 help="Measure reductions against the original on this many devices (as it ran), not its minimum."),
    click.option("--baseline-job", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="The job the original ran (e.g. at production scale); the reduction is split by mechanism."),
)  # fmt: skip


def search_options(fn):
    """The options `suggest` and `report` share, so a report reproduces a suggestion exactly."""
    for option in reversed(_SEARCH_OPTIONS):
        fn = option(fn)
    return fn


def _request(budget, model, hardware, job_path, fault, stats_path, min_fidelity, trials, storage, seed, steps, fault_step, job_bounds, translate_knob,
             settle_bias, min_k_ratio, memory_margin, baseline_cards, baseline_job):  # fmt: skip
    from planner.search.reproduction import JobBounds
    from planner.search.suggest import Request
    from planner.specs import load_job
    from planner.stats.store import load_stats

    return Request(model=model, hardware=hardware, job=load_job(job_path), budget=budget, fault=fault,
                   stats=load_stats(stats_path) if stats_path else None, min_fidelity=min_fidelity, trials=trials,
                   storage=storage, seed=seed, steps=steps, fault_step=fault_step, job_bounds=JobBounds.parse(job_bounds),
                   translate_knob=translate_knob, settle_bias=settle_bias, min_k_ratio=min_k_ratio, memory_margin=memory_margin,
                   baseline_cards=baseline_cards, baseline_job=load_job(baseline_job) if baseline_job else None)  # fmt: skip


@click.command()
@search_options
@calibration_options
@click.option("--json", "as_json", is_flag=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Write the best option's plan YAML here.")
@click.option("--force", is_flag=True)
def suggest(as_json, output, force, knobs_file, estimator_file, **search) -> None:
    """The cheapest proxy within the budget whose predicted fidelity clears the threshold."""
    from planner.search.output import plan_of, render_suggestion, suggestion_json
    from planner.search.suggest import suggest as run_suggest

    def body():
        if output:
            new_output(output, force)
        result = run_suggest(_request(**search), progress=None if as_json else progress_line("search"))
        if output and result.best:
            write_text_atomic(new_output(output, force), plan_of(result, result.best).to_yaml())
        if as_json:
            emit_json(suggestion_json(result))
        else:
            click.echo(render_suggestion(result))
            if output and result.best:
                click.echo(f"wrote {output}")
        if not result.best:
            raise SystemExit(1)

    run_body(lambda: calibrated(knobs_file, estimator_file, body))


@click.command()
@click.argument("request", type=click.Path(dir_okay=False))
@calibration_options
@click.option("--json", "as_json", is_flag=True)
def preflight(request, knobs_file, estimator_file, as_json) -> None:
    """Check a reproduction request before it is filed: PASS/WARN/FAIL per check; exit 1 on any FAIL."""
    from planner.preflight import preflight as run_preflight
    from planner.preflight import preflight_json, render_preflight

    def body():
        checks = run_preflight(request)
        emit_json(preflight_json(checks)) if as_json else click.echo(render_preflight(checks, request))
        if any(c.status == "FAIL" for c in checks):
            raise SystemExit(1)

    run_body(lambda: calibrated(knobs_file, estimator_file, body))


@click.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(exists=True, dir_okay=False))
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), default=None,
              help="The original checkpoint (or the built proxy); not needed to label two trainer logs (--reference-metrics, --proxy-metrics).")
@click.option("--reference-metrics", "reference", type=click.Path(exists=True), default=None,
              help="The original's run: a `planner rl run` directory (its settings are reused and fidelity labels computed against it) "
                   "or a trainer's log in any format `planner detect` reads (then give --proxy-metrics).")
@click.option("--proxy-metrics", "proxy_metrics", type=click.Path(exists=True), default=None,
              help="The proxy's run in the same trainer as --reference-metrics: the labels compare these two runs.")
@click.option("--replica", type=click.Path(exists=True), default=None, help="A replica of the reference run (curve-agreement noise floor).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "npu"]), default="cpu", show_default=True)
@click.option("--steps", type=int, default=20, show_default=True)
@click.option("--recipe", "recipe_name", default=None, help="Fault recipe to run (without --reference-metrics).")
@click.option("--knob", type=float, default=None)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--stats", "stats_path", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("-o", "--output", type=click.Path(file_okay=False), default="check", show_default=True, help="Proxy and run go here.")
@click.option("--add-to", "add_to", type=click.Path(dir_okay=False), default=None, help="Append the labels to this calibration dataset.")
@click.option("--force", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
def check(plan_path, checkpoint, reference, proxy_metrics, replica, device, steps, recipe_name, knob, seed, stats_path, output, add_to, force,
          as_json) -> None:  # fmt: skip
    """Build the proxy if needed, run the RL harness on the device, print predicted vs measured; or label two trainer logs."""
    from planner.check import label_logs, render_check, run_check

    def body():
        if add_to and not reference:
            raise SpecError("--add-to needs --reference-metrics: labels compare the proxy with the original's run")
        if checkpoint is None and not (reference and proxy_metrics):
            raise SpecError("--checkpoint is needed to build and run the proxy; only two trainer logs (--reference-metrics and "
                            "--proxy-metrics) are labelled without one")  # fmt: skip
        bars: dict = {}
        if checkpoint is None:
            report = label_logs(plan_path, reference, proxy_metrics, replica=replica, recipe_name=recipe_name)
        else:
            report = run_check(plan_path, checkpoint, output, device=device, steps=steps, reference=reference, proxy_metrics=proxy_metrics,
                               replica=replica, recipe_name=recipe_name, knob=knob, seed=seed, stats_path=stats_path, force=force,
                               progress=None if as_json else (lambda stage, d, t: bars.setdefault(stage, progress_line(stage))(d, t)))  # fmt: skip
        if add_to:
            from planner.fidelity.calibrate import add_pair

            add_pair(Path(add_to), Path(reference), Path(proxy_metrics or report.run_dir), Path(plan_path),
                     replica_dir=Path(replica) if replica else None, recipe_name=report.labels["recipe"])  # fmt: skip
        emit_json(report.to_json()) if as_json else click.echo(render_check(report))
        if add_to and not as_json:
            click.echo(f"added the pair to {add_to}; refit with `planner calibrate fit --dataset {add_to}`")

    run_body(body)


@click.command()
@search_options
@calibration_options
@click.option("-o", "--output", type=click.Path(file_okay=False), required=True, help="Report directory (report.md, report.html, figures/).")
@click.option("--force", is_flag=True, help="Replace an existing report directory (only a report directory).")
@click.option("--json", "as_json", is_flag=True, help="Print report.json (with the files written) instead of the summary line.")
def report(output, force, as_json, knobs_file, estimator_file, **search) -> None:
    """A capacity-planning report: Markdown and HTML with PNG figures (the search is `suggest`'s)."""
    import json

    from planner.report import build_report, check_report_dir, write_report

    def body():
        check_report_dir(output, force)
        result = build_report(_request(**search), progress=(lambda s: None) if as_json else (lambda s: click.echo(s, err=True)))
        out = write_report(result, output, force=force)
        files = sorted(str(f) for f in out.rglob("*") if f.is_file())
        if as_json:
            emit_json({**json.loads((out / "report.json").read_text()), "files": files})
        else:
            click.echo(f"wrote {out}/report.md, {out}/report.html and {len(list((out / 'figures').glob('*.png')))} figures")
        if not result.suggestion.best:  # as suggest: the report says why, and the exit code says it too
            if not as_json:
                click.echo("no proxy clears every constraint within the budget; report.md says why and the smallest budget that would do", err=True)
            raise SystemExit(1)

    run_body(lambda: calibrated(knobs_file, estimator_file, body))


COMMANDS = (suggest, preflight, check, report)
