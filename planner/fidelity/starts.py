"""Where the calibration originals' routing starts, before any anti-balance pressure.

A router-collapse label is read against the original: how hard the recipe must push before the most
collapsed MoE layer's normalised top-k share passes the detector's threshold (0 balanced, 1
collapsed, threshold 0.9). An original that starts half-way there collapses sooner than one that
starts balanced, so the label depends on how the originals were trained.
`benchmarks/scale_transfer.py --balance-only` measures the start (the statistic over the first step
at the recipe's weakest knob, per margin seed) of a family's original and its clustered proxy, for
originals trained without load balancing (the grids' so far) and with their shape's published
balancing (planner.rl.models), and keeps the rows in calibration/starts.json. `summarise` gives,
per family, the mean start of its originals at the calibration scale under each way of training,
which the estimator states beside every router-collapse prediction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["STARTS_SCHEMA", "default_starts_path", "load_starts", "merge_starts", "measure_start", "summarise", "start_text", "IDENTITY"]

STARTS_SCHEMA = "planner.starts/1"
# what makes a row: the model (family, scale, seed, training length and balancing) and the proxy's K
IDENTITY = ("family", "hidden", "layers", "seed", "steps", "balancing", "proxy_experts")


def default_starts_path() -> Path:
    from importlib import resources

    return Path(str(resources.files("planner._calibration"))) / "starts.json"


def load_starts(path: str | Path | None = None) -> list[dict]:
    """The measured rows (empty where the file does not exist)."""
    from planner.files import read_records

    return read_records(path if path is not None else default_starts_path(), "routing-starts file", STARTS_SCHEMA, "rows")


def measure_start(model: str | Path, device: str, seeds: list[int]) -> list[float]:
    """Per seed, the router-collapse detector's statistic (the normalised top-k share of the most
    collapsed MoE layer: 0 balanced, 1 collapsed) over a model's first step at the recipe's weakest
    anti-balance knob: how close to the fault's threshold the model starts before any pressure."""
    from planner.rl.grpo import GRPO, Models
    from planner.rl.recipes import recipe

    r, models = recipe("router-collapse"), Models(model, device)
    return [GRPO(models, r.config(r.lo, seed=s, steps=1)).run()[0]["collapse_max"] for s in seeds]


def merge_starts(rows: list[dict], new: list[dict]) -> list[dict]:
    """`rows` with `new` added, a new row replacing an old one of the same identity."""
    key = lambda r: tuple(r.get(k) for k in IDENTITY)  # noqa: E731
    fresh = {key(r) for r in new}
    return [r for r in rows if key(r) not in fresh] + list(new)


def summarise(rows: list[dict], hidden: int = 64, layers: int = 3, steps: int = 300) -> dict[str, dict[str, Any]]:
    """Per family, per way of training ("none", "published"): the mean start of its originals at the
    given scale (each original's mean over its margin seeds, then over originals), how many originals,
    and the mean of their clustered proxies' starts."""
    out: dict[str, dict[str, Any]] = {}
    at = [r for r in rows if (r["hidden"], r["layers"], r["steps"]) == (hidden, layers, steps)]
    for family, made in sorted({(r["family"], r["balancing"]) for r in at}):
        mine = [r for r in at if (r["family"], r["balancing"]) == (family, made)]
        by_seed = {r["seed"]: r for r in mine}  # one row per original (the proxy's K aside)
        out.setdefault(family, {})[made] = {
            "original": round(float(np.mean([np.mean(r["original"]) for r in by_seed.values()])), 3),
            "proxy": round(float(np.mean([np.mean(r["proxy"]) for r in mine])), 3),
            "originals": len(by_seed), "threshold": mine[0]["threshold"]}  # fmt: skip
    return out


def start_text(starts: dict[str, Any] | None, balancing: str = "none") -> str:
    """The words for where a family's originals start, trained as `balancing` says, and where an
    original trained the other way starts, where measured (empty where the family's way was not)."""
    from planner.families import TRAINED

    if not starts or balancing not in starts:
        return ""
    own = starts[balancing]
    text = (f"its originals were trained {TRAINED[balancing]} and start {own['original']:.2f} of the way from balanced to "
            f"collapsed before any push (proxies {own['proxy']:.2f}; the detector fires at {own['threshold']:g})")  # fmt: skip
    for other in (w for w in starts if w != balancing):
        text += f"; trained {TRAINED[other]} an original starts at {starts[other]['original']:.2f}"
    return text
