"""python -m planner.cli: the `planner` command."""

from planner.cli import main

main()
