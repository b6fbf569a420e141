"""The `planner` command. Each command parses, calls one library function, renders. The only
package that imports click or configures logging.

One module per command group (catalog: models, inspect, cost, demo, fit-knobs; checkpoints: stats,
plan, build; search: suggest, preflight, check, report; runs: detect, export, job, probe; rl: the
RL harness and calibration), all importing what they share from planner.cli.common and nothing
from one another; this module makes the main group and adds their commands. The entry point is
`planner.cli:main`."""

from __future__ import annotations

import json
import logging
import sys

import click

from planner.cli import catalog, checkpoints, rl, runs, search

__all__ = ["main"]


class _Group(click.Group):
    """The main group: under --json, a usage error that click finds while reading the options (a
    value out of range, a path that does not exist) comes as the JSON object every other error
    comes as, with exit code 2, instead of click's usage text."""

    def main(self, args=None, **extra):
        args = list(sys.argv[1:] if args is None else args)
        if "--json" not in args:
            return super().main(args, **extra)
        try:
            code = super().main(args, standalone_mode=False, **extra)  # an Exit (--help, --version) comes back as its code
        except click.ClickException as exc:
            click.echo(json.dumps({"error": exc.format_message(), "exit_code": exc.exit_code}))
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo(json.dumps({"error": "aborted", "exit_code": 1}))
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.version_option(package_name="planner")
def main(verbose: int) -> None:
    """Plan the cheapest proxy MoE model that still reproduces an RL training failure."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")



for _module in (catalog, checkpoints, search, runs, rl):
    for _command in _module.COMMANDS:
        main.add_command(_command)
