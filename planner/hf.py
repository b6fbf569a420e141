"""torch and transformers, imported on first use with an error that names the extra to install."""

from __future__ import annotations

from planner.errors import PlannerError

__all__ = ["require_torch"]


def require_torch(purpose: str):
    """(torch, transformers), or a clear error saying `purpose` needs the [hf] extra."""
    try:
        import torch
        import transformers
    except ImportError as exc:  # pragma: no cover - exercised only on a base install
        raise PlannerError(f"{purpose} needs torch and transformers: pip install 'planner[hf]' ({exc})") from None
    return torch, transformers
