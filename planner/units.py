"""Unit constants and formatting shared by every layer (no planner imports)."""

from __future__ import annotations

__all__ = ["GIB", "gib", "human_bytes", "plural"]

GIB = 1024**3


def gib(n_bytes: float, *, suffix: bool = True) -> str:
    """Bytes as GiB with two decimals ('61.27 GiB'; '61.27' for table cells)."""
    return f"{n_bytes / GIB:,.2f}" + (" GiB" if suffix else "")


def human_bytes(n_bytes: float) -> str:
    """1.50 GiB / 12.3 MiB / 512 B."""
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n_bytes) >= size:
            return f"{n_bytes / size:,.2f} {unit}"
    return f"{n_bytes:,.0f} B"


def plural(n: float, word: str) -> str:
    """'1 npu', '8 npus', '1 step': a count with its noun."""
    return f"{n:,g} {word}" + ("" if n == 1 else "s")
