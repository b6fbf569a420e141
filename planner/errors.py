"""Domain errors. Each carries the numbers that explain it; the CLI maps them to exit codes."""

from __future__ import annotations

__all__ = [
    "PlannerError",
    "SpecError",
    "UnknownModelError",
    "ConfigError",
    "LayoutError",
    "InfeasibleError",
    "PlanError",
    "CheckpointError",
]


class PlannerError(Exception):
    """Base of every error planner raises on purpose."""

    exit_code = 1


class SpecError(PlannerError):
    """Something a user wrote (a job, a layout, an option) is invalid."""

    exit_code = 2


class UnknownModelError(SpecError):
    """A model or accelerator reference that is neither in the catalog nor a readable path."""


class ConfigError(SpecError):
    """A config.json (or accelerator profile) that cannot describe a supported model."""


class LayoutError(SpecError):
    """A parallel layout that the frameworks would reject; the message names every factor."""


class InfeasibleError(PlannerError):
    """No layout fits the memory (or the budget); the message says what would."""

    exit_code = 2


class PlanError(SpecError):
    """A pruning plan that breaks a builder rule; the message names the rule and the numbers."""


class CheckpointError(PlannerError):
    """A checkpoint that cannot be read safely (corrupt, truncated, inconsistent with its config)."""

    exit_code = 2
