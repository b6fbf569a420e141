"""Plain-text tables and unit formatting for the CLI. Never prints; returns strings."""

from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["table", "count", "label_text"]


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], *, title: str | None = None) -> str:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned."""
    cells = [[str(c) for c in headers]] + [[_cell(c) for c in row] for row in rows]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) if len(cells) > 1 else False for i in range(len(headers))]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        out = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)]
        return "  ".join(out).rstrip()

    lines = [title] if title else []
    lines.append(line(cells[0]))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(line(r) for r in cells[1:])
    return "\n".join(lines)


def label_text(value: object) -> object:
    """A measured label for a table cell: "-" where it is missing (None or NaN)."""
    return "-" if value is None or (isinstance(value, float) and value != value) else value


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _is_number(text: str) -> bool:
    t = text.replace(",", "").replace("x", "").replace("%", "").strip()
    if t in ("", "-"):
        return True
    try:
        float(t.split()[0])
        return True
    except ValueError:
        return False


def count(n: float) -> str:
    """Parameter counts as 30.53B / 768.0M."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:,.2f}{suffix}"
    return f"{n:,.0f}"
