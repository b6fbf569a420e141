"""What the command modules share: defaults, the one memory-margin option, JSON output, the body
runner that turns planner errors into their exit codes, progress lines, and the user's own fitted
files. Imported by every module of planner.cli; it imports none of them."""

from __future__ import annotations

import json
import math
import signal
import sys
from typing import Any

import click

from planner.cost.evaluate import DEFAULT_MEMORY_MARGIN
from planner.errors import PlannerError, SpecError
from planner.interrupts import Terminated

__all__ = ["DEFAULT_MODEL", "DEFAULT_HARDWARE", "DEMO_EXPERTS", "memory_margin_option", "json_safe", "emit_json", "run_body",
           "calibration_options", "calibrated", "progress_line", "parse_ints"]  # fmt: skip

DEFAULT_MODEL = "qwen3-30b-a3b"
DEFAULT_HARDWARE = "ascend-910b2"
DEMO_EXPERTS = (64, 32, 16)
# one margin for every command that sizes devices, so the same job gets the same minimum count
memory_margin_option = click.option("--memory-margin", type=click.FloatRange(0.0, 0.9), default=DEFAULT_MEMORY_MARGIN, show_default=True,
                                    help="Share of usable device memory kept free in the training phases.")  # fmt: skip


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def emit_json(data: Any) -> None:
    click.echo(json.dumps(json_safe(data), indent=2, default=_json_default))


def _terminated(signum, frame):
    raise Terminated()


def _fail(message: str, code: int) -> None:
    """An error's message and exit: under --json a JSON object on stdout (the message and the exit
    code), else one line on stderr."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.params.get("as_json"):
        click.echo(json.dumps({"error": message, "exit_code": code}))
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(code)


def run_body(fn):
    """Run a command body; planner errors print their message and exit with their code (a JSON object
    on stdout under --json). Ctrl-C and SIGTERM unwind the body (outputs in progress are removed) and
    exit with 128 + the signal."""
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return fn()
    except PlannerError as exc:
        _fail(str(exc), exc.exit_code)
    except OSError as exc:  # an unwritable output, a parent that is a file, a full disk: the OS's words and the path
        where = f"{exc.filename}: " if exc.filename else ""
        _fail(f"{where}{exc.strerror or exc}", 2)
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        note = getattr(exc, "note", "") or "nothing half-written was kept; run the command again"
        click.echo(f"interrupted ({signal.Signals(signum).name}): {note}", err=True)
        sys.exit(128 + signum)
    finally:
        signal.signal(signal.SIGTERM, previous)


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


def progress_line(label: str):
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


def parse_seeds(text: str | None) -> list[int]:
    """--seeds: distinct non-negative integers (each seed is one measurement: a repeat would count twice)."""
    seeds = parse_ints(text)
    bad = [s for s in seeds if s < 0]
    if bad:
        raise SpecError(f"--seeds {text!r}: seeds are non-negative integers, got {bad[0]}")
    if len(set(seeds)) < len(seeds):
        raise SpecError(f"--seeds {text!r}: a seed is given twice (each seed is its own measurement)")
    return seeds


def parse_ints(text: str | None) -> list[int]:
    try:
        return [int(x) for x in str(text).split(",") if x.strip()] if text else []
    except ValueError:
        bad = next(x.strip() for x in str(text).split(",") if x.strip() and not x.strip().lstrip("-").isdigit())
        raise SpecError(f"expected comma-separated integers, got {text!r} ({bad!r} is not one)") from None
