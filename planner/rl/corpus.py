"""Text that ships with the machine: the Python standard library's own source.

Files under the interpreter's stdlib directory (no site-packages, no test suites) are split
deterministically by a hash of their name and their directory's name: about 90% for pretraining the
small models, 4% for calibration text, 6% for RL prompts. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import sysconfig
from functools import lru_cache
from pathlib import Path

import numpy as np

__all__ = ["stdlib_files", "split_bytes", "prompt_windows"]


@lru_cache(maxsize=1)
def stdlib_files() -> tuple[Path, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "/test" in f"/{rel}" or rel.startswith(("test", "idlelib", "lib2to3")):
            continue
        out.append(path)
    return tuple(out)


def _bucket(path: Path) -> int:
    return hashlib.sha256(path.name.encode() + str(path.parent.name).encode()).digest()[0] % 100


@lru_cache(maxsize=3)
def split_bytes(split: str, limit: int = 4_000_000) -> np.ndarray:
    """Concatenated bytes of one split: train (buckets 0-89), calibration (90-93), prompts (94-99)."""
    ranges = {"train": (0, 90), "calibration": (90, 94), "prompts": (94, 100)}
    lo, hi = ranges[split]
    chunks, total = [], 0
    for path in stdlib_files():
        if lo <= _bucket(path) < hi:
            data = path.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= limit:
                break
    return np.frombuffer(b"\n".join(chunks)[:limit], dtype=np.uint8)


def prompt_windows(count: int, length: int, seed: int) -> np.ndarray:
    """`count` byte windows of `length` from the prompt split, drawn with `seed`."""
    data = split_bytes("prompts")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, data.size - length, size=count)
    return np.stack([data[s : s + length] for s in starts]).astype(np.int64)
