"""`planner stats`, `plan` and `build`: expert statistics, pruning plans and proxy checkpoints."""

from __future__ import annotations

import time
from pathlib import Path

import click

from planner.cli.common import emit_json, parse_ints, progress_line, run_body
from planner.errors import SpecError
from planner.files import new_output, refuse_existing, write_text_atomic
from planner.plan import SELECTION_METHODS

@click.command()
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.option("--calib-text", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Calibration text file (default: Python standard-library docstrings).")
@click.option("--calib-tokens", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=2), default=256, show_default=True, help="Tokens per calibration sequence.")
@click.option("--experts", default=None, help="Comma-separated K values to cluster for (default: E/2, E/4, E/8 where legal).")
@click.option("--methods", default="agglomerative", show_default=True, help="Comma-separated clustering methods.")
@click.option("--weights-only", is_flag=True, help="Data-free features only (router rows, weight sketches).")
@click.option("--settle-bias", is_flag=True, help="Also settle each plan's kept experts' correction bias on the calibration text "
              "(routers with one: DeepSeek-V3, GLM-4.5, ...), for `plan`/`build --settle-bias`.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True)
@click.option("--force", is_flag=True, help="Overwrite an existing stats file.")
@click.option("--json", "as_json", is_flag=True, help="Print the per-plan summaries as JSON.")
def stats(checkpoint, calib_text, calib_tokens, seq_len, experts, methods, weights_only, settle_bias, seed, output, force,
          as_json) -> None:  # fmt: skip
    """Expert features, clusterings and per-plan statistics of a checkpoint."""
    from planner.checkpoint import Checkpoint
    from planner.stats.compute import compute_stats, default_experts
    from planner.stats.store import save_stats
    from planner.summary import render_stats

    def body():
        new_output(output, force)
        ckpt = Checkpoint(checkpoint)
        ks = parse_ints(experts) or default_experts(ckpt.arch)
        text = Path(calib_text).read_text(errors="replace") if calib_text else None
        if text is not None and not text.strip():
            raise SpecError(f"--calib-text {calib_text}: the file is empty; give a text file, or leave the option out for the default text")
        bars = {}

        def progress(stage, done, total):
            bars.setdefault(stage, progress_line(stage))(done, total)

        result = compute_stats(ckpt, experts=ks, methods=tuple(m.strip() for m in methods.split(",")), calib_text=text,
                               calib_tokens=calib_tokens, seq_len=seq_len, weights_only=weights_only, seed=seed,
                               settle_bias=settle_bias, progress=progress)  # fmt: skip
        save_stats(result, output, force=force)
        if as_json:
            emit_json({key: plan["summary"] for key, plan in result["plans"].items()})
        else:
            click.echo(render_stats(result))
            click.echo(f"wrote {output}")

    run_body(body)


@click.command()
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.option("--experts", type=int, required=True, help="K: routed experts kept per MoE layer.")
@click.option("--method", default="agglomerative", show_default=True,
              type=click.Choice(SELECTION_METHODS))
@click.option("--stats", "stats_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Stats file of this checkpoint (default: data-free features computed now).")
@click.option("--mtp", type=click.Choice(["drop", "prune"]), default="drop", show_default=True)
@click.option("--target-ep", default=None, help="Comma-separated EP sizes the proxy must run with.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--settle-bias", is_flag=True, help="The kept experts' correction bias settled again after pruning, from the "
              "stats file (planner stats --settle-bias), instead of sliced. Fidelity is then read on the shape's family of settled proxies "
              "(suggest/preflight), where it has one.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True)
@click.option("--force", is_flag=True)
def plan(checkpoint, experts, method, stats_path, mtp, target_ep, seed, settle_bias, output, force) -> None:
    """Choose the experts to keep (one real expert per cluster) and write the plan YAML."""
    from planner.checkpoint import Checkpoint
    from planner.stats.compute import choose_plan

    def body():
        new_output(output, force)
        ckpt = Checkpoint(checkpoint)
        result = choose_plan(ckpt, experts, method, stats_path=stats_path, mtp=mtp, target_ep=tuple(parse_ints(target_ep)), seed=seed,
                             settle_bias=settle_bias)  # fmt: skip
        warnings = result.check(ckpt.arch, list(ckpt.moe_layers))
        write_text_atomic(output, result.to_yaml())
        for w in warnings:
            click.echo(f"warning: {w}", err=True)
        click.echo(f"wrote {output}: K={experts} of {result.original_experts} experts, {len(result.layers)} MoE layers, method {method}")

    run_body(body)


@click.command()
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
@click.option("--settle-bias", is_flag=True, help="The kept experts' correction bias settled again after pruning, from the "
              "stats file (planner stats --settle-bias), instead of sliced. Fidelity is then read on the shape's family of settled proxies "
              "(suggest/preflight), where it has one.")
@click.option("--force", is_flag=True, help="Replace an existing OUT_DIR.")
@click.option("--json", "as_json", is_flag=True)
def build(checkpoint, out_dir, plan_path, experts, method, stats_path, mtp, verify, settle_bias, force, as_json) -> None:
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
            the_plan = resolve_plan(ckpt, load_plan(plan_path), stats_path=stats_path, settle_bias=settle_bias)
        else:
            the_plan = choose_plan(ckpt, experts, method, stats_path=stats_path, mtp=mtp, settle_bias=settle_bias)
        choosing = time.perf_counter() - start  # a plan chosen now reads every expert's weights (sketches)
        report = build_proxy(ckpt, the_plan, out_dir, force=force, verify=verify, progress=progress_line("writing"))
        if as_json:
            emit_json({**report.to_json(), "seconds_choosing_experts": choosing, "seconds_total": time.perf_counter() - start})
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

    run_body(body)


COMMANDS = (stats, plan, build)
