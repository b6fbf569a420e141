"""Unit constants and formatting shared by every layer (no planner imports)."""

from __future__ import annotations

__all__ = ["GIB", "gib"]

GIB = 1024**3


def gib(n_bytes: float, *, suffix: bool = True) -> str:
    """Bytes as GiB with two decimals ('61.27 GiB'; '61.27' for table cells)."""
    return f"{n_bytes / GIB:,.2f}" + (" GiB" if suffix else "")
