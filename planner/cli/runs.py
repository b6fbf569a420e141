"""`planner detect` (runs in). Added to the main command group by planner.cli; like every
command, it parses, calls one library function and renders."""

from __future__ import annotations

import click

from planner.cli.common import json_safe, emit_json, run_body


@click.command()
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
        emit_json(sig) if as_json else click.echo(render_signature(sig))

    run_body(body)


def _write_or_print(text: str, output: str | None, done: str) -> None:
    from planner.files import write_text_atomic

    if output:
        write_text_atomic(output, text)
        click.echo(done, err=True)
    else:
        click.echo(text, nl=False)


@click.command("export")
@click.argument("plan_path", metavar="PLAN", type=click.Path(exists=True, dir_okay=False))
@click.option("--to", "trainer", type=click.Choice(["verl", "mindspeed-rl", "nemo-rl"]), required=True)
@click.option("--model-path", required=True, help="Where the built proxy checkpoint lies on the training cluster.")
@click.option("--routing-replay", is_flag=True,
              help="Turn on the trainer's routing replay (verl R3, NeMo RL router_replay): the proxy run replays its own rollout routes.")
@click.option("--verl-version", default=None, help="The verl release to write for (0.6-0.9; default: the installed verl's, else 0.9).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Write here (default: print).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
def export(plan_path, trainer, model_path, routing_replay, verl_version, output, force) -> None:
    """The config that launches PLAN's proxy run in verl (Hydra overrides), MindSpeed-RL or NeMo RL (YAML)."""
    from planner.files import new_output
    from planner.plan import load_plan
    from planner.runs.trainers import export_plan

    def body():
        if output:
            new_output(output, force)
        text, _ = export_plan(load_plan(plan_path), trainer, model_path, routing_replay=routing_replay, version=verl_version)
        _write_or_print(text, output, f"wrote {output}")

    run_body(body)


@click.command("job")
@click.option("--from", "trainer", type=click.Choice(["verl", "mindspeed-rl", "nemo-rl"]), required=True)
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Write the job file here (default: print).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--json", "as_json", is_flag=True)
def job(trainer, config, output, force, as_json) -> None:
    """planner's job file (with its layouts) from a trainer's config: a YAML config or Hydra overrides."""
    import yaml

    from planner.files import new_output, write_text_atomic
    from planner.runs.trainers import job_from

    def body():
        if output:
            new_output(output, force)
        spec, cards, notes = job_from(trainer, config)
        data = spec.to_dict()
        text = f"# from {trainer} config {config}: {cards} devices\n" + "".join(f"# {n}\n" for n in notes) + yaml.safe_dump(data, sort_keys=False)
        if as_json:
            if output:
                write_text_atomic(output, text)
            return emit_json({"job": data, "devices": cards, "notes": notes, "output": output})
        _write_or_print(text, output, f"wrote {output} ({cards} devices)")

    run_body(body)


@click.command()
@click.argument("original", type=click.Path(exists=True, file_okay=False))
@click.argument("proxy", type=click.Path(exists=True, file_okay=False))
@click.option("--recipe", "recipe_name", type=click.Choice(["fp16-overflow", "rollout-mismatch"]), required=True)
@click.option("--seeds", default="0,1,2,3", show_default=True, help="Comma-separated seeds (calibration windows); at least 2, 4 for a decision.")
@click.option("--iters", type=click.IntRange(1, 30), default=None, help="Bisection steps (default: 8, as `rl margin` for static recipes).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "npu"]), default="cpu", show_default=True)
@click.option("--sequences", type=click.IntRange(2, 4096), default=4, show_default=True, help="Calibration sequences per seed.")
@click.option("--seq-len", type=click.IntRange(2, 65_536), default=64, show_default=True)
@click.option("--calib-text", type=click.Path(exists=True, dir_okay=False), default=None, help="Text to probe on (default: Python's stdlib docstrings).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Write the result (JSON) here.")
@click.option("--force", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
def probe(original, proxy, recipe_name, seeds, iters, device, sequences, seq_len, calib_text, output, force, as_json) -> None:
    """The critical knob of a static fault recipe on ORIGINAL and PROXY checkpoints (one decoder
    layer in memory at a time), and the signed shift with its noise: the calibration grid's labels."""
    import json
    from pathlib import Path

    from planner.cli.common import parse_seeds
    from planner.errors import SpecError
    from planner.files import new_output, write_text_atomic
    from planner.render import table
    from planner.rl.probe import probe_pair

    def body():
        if output:
            new_output(output, force)
        text = None
        if calib_text:
            text = Path(calib_text).read_text(errors="replace")
            if not text.strip():
                raise SpecError(f"--calib-text {calib_text} is empty")
        say = (lambda s: None) if as_json else (lambda s: click.echo(s, err=True))
        result = probe_pair(original, proxy, recipe_name, seeds=parse_seeds(seeds), iters=iters, device=device, sequences=sequences,
                            seq_len=seq_len, calib_text=text, say=say)  # fmt: skip
        if output:
            write_text_atomic(output, json.dumps(json_safe(result), indent=2))  # NaN as null: strict JSON
        if as_json:
            return emit_json(result)
        o, p, lab = result["original"], result["proxy"], result["labels"]
        rows = [[s, f"{a:.3f}", f"{b:.3f}"] for s, a, b in zip(result["seeds"], o["values"], p["values"])]
        click.echo(table(["seed", "original", "proxy"], rows, title=f"critical {result['knob']} ({recipe_name})"))
        click.echo(f"shift (proxy - original): {lab['shift_log2']:+.3f} log2 units, 90% interval [{lab['shift_low']:+.3f}, {lab['shift_high']:+.3f}]; "
                   f"noise floor (original's seed SD) {lab['noise_log2']:.3f}; {lab['outcome']} (tolerance +-1 log2 unit)")  # fmt: skip
        click.echo(f"{result['passes']} probe passes, {result['seconds_per_pass']:.2f} s each (median)" + (f"; wrote {output}" if output else ""))

    run_body(body)


COMMANDS = (detect, export, job, probe)
