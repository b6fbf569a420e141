"""`planner detect` (runs in). Registered on the main command group by planner.cli; like it, each
command parses, calls one library function and renders."""

from __future__ import annotations

import click

from planner.cli import _emit_json, _run, main


@main.command()
@click.argument("run", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def detect(run: str, as_json: bool) -> None:
    """The fault signature of RUN: fault type, onset step and the evidence.

    RUN is a run's metrics in any supported format: a `planner rl run` directory, TensorBoard event
    files, verl's console log or JSONL file log, a MindSpeed-RL console log, a wandb history export
    (CSV or JSONL), or a directory holding one of them."""
    from planner.runs.signature import render_signature, signature

    def body():
        sig = signature(run)
        _emit_json(sig) if as_json else click.echo(render_signature(sig))

    _run(body)


@main.command("export")
@click.argument("plan_path", metavar="PLAN", type=click.Path(exists=True, dir_okay=False))
@click.option("--to", "trainer", type=click.Choice(["verl", "mindspeed-rl", "nemo-rl"]), required=True)
@click.option("--model-path", required=True, help="Where the built proxy checkpoint lies on the training cluster.")
@click.option("--routing-replay", is_flag=True, help="Replay the original's recorded routes (verl R3, NeMo RL router_replay).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Write here (default: print).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
def export(plan_path, trainer, model_path, routing_replay, output, force) -> None:
    """The config that launches PLAN's proxy run in verl (Hydra overrides), MindSpeed-RL or NeMo RL (YAML)."""
    from planner.files import refuse_existing, write_text_atomic
    from planner.plan import load_plan
    from planner.runs.trainers import export_plan

    def body():
        if output:
            refuse_existing(output, force)
        text, _ = export_plan(load_plan(plan_path), trainer, model_path, routing_replay=routing_replay)
        if output:
            write_text_atomic(output, text)
            click.echo(f"wrote {output}", err=True)
        else:
            click.echo(text, nl=False)

    _run(body)


@main.command("job")
@click.option("--from", "trainer", type=click.Choice(["verl", "mindspeed-rl", "nemo-rl"]), required=True)
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Write the job file here (default: print).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--json", "as_json", is_flag=True)
def job(trainer, config, output, force, as_json) -> None:
    """planner's job file (with its layouts) from a trainer's config: a YAML config or Hydra overrides."""
    import yaml

    from planner.files import refuse_existing, write_text_atomic
    from planner.runs.trainers import job_from

    def body():
        if output:
            refuse_existing(output, force)
        spec, cards, notes = job_from(trainer, config)
        data = spec.to_dict()
        if as_json:
            return _emit_json({"job": data, "devices": cards, "notes": notes})
        text = f"# from {trainer} config {config}: {cards} devices\n" + "".join(f"# {n}\n" for n in notes) + yaml.safe_dump(data, sort_keys=False)
        if output:
            write_text_atomic(output, text)
            click.echo(f"wrote {output} ({cards} devices)", err=True)
        else:
            click.echo(text, nl=False)

    _run(body)
