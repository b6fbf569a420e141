"""Efficiency knobs: what a peak-and-bandwidth model cannot know, per accelerator family.

The cost model multiplies hardware peaks by these achieved fractions and adds these overheads. They
are fitted to the published RL runs (calibration/published_runs.yaml) by `planner.cost.fit`: some
per family, some shared by the families, some left at their priors (see planner.cost.fit), never
per run; stored with the residuals and the leave-one-run-out errors in calibration/knobs.json.
Without a fitted file the priors below (literature ranges, cited) apply.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from importlib import resources
from pathlib import Path

__all__ = ["Knobs", "PRIOR", "KNOB_BOUNDS", "load_knobs", "knobs_path"]


@dataclass(frozen=True, kw_only=True)
class Knobs:
    train_mfu: float  # achieved fraction of dense peak in the actor update (model FLOPs + recompute)
    logprob_mfu: float  # same for forward-only passes (reference, old log-prob, prefill)
    decode_mbu: float  # achieved fraction of HBM bandwidth reading weights and KV in decode
    decode_step_overhead_s: float  # per decode step: scheduling, sampling, host syncs
    a2a_efficiency: float  # achieved fraction of the measured (or link) all-to-all bandwidth
    switch_fixed_s: float  # per RL step: engine wake/sleep, cache release, resharding setup
    switch_tensor_s: float  # per weight tensor gathered and handed to the rollout engine (weight_sync: gather)
    expert_imbalance: float = 1.2  # busiest EP rank's tokens / mean, for real routers (job default)
    attention_efficiency: float = 0.8  # causal attention's achieved rate relative to the GEMMs' (flash attention, ring CP)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


# Priors: the midpoints of public ranges (docs/cost-model.md section "Efficiency-knob priors"):
# MoE training MFU 0.24-0.35 on H100, ~0.10 on A3 RL updates; decode MBU 0.70-0.85 rule of thumb;
# per-step host sync 3-14 ms (cann-recipes); verl's per-tensor weight sync moves Qwen3-30B-A3B (12.8k
# Megatron tensors, 61 GB) in 15.8 s and Qwen3-235B-A22B (25k, 470 GB) in 58.6 s on H20 (verl
# fully-async docs): at most 1.2 ms per tensor with the bytes, 0.5 ms taken for the tensor alone.
# Attention relative to GEMMs: FlashAttention-2 runs forward and backward at 50-73% of A100 peak
# (arXiv 2307.08691) where large GEMMs reach about 80%: 0.8 (the dataclass default, both families).
PRIOR = {
    "ascend": Knobs(
        train_mfu=0.12,
        logprob_mfu=0.12,
        decode_mbu=0.5,
        decode_step_overhead_s=0.01,
        a2a_efficiency=0.8,
        switch_fixed_s=5.0,
        switch_tensor_s=5e-4,
    ),
    "nvidia": Knobs(
        train_mfu=0.3,
        logprob_mfu=0.3,
        decode_mbu=0.7,
        decode_step_overhead_s=0.005,
        a2a_efficiency=0.9,
        switch_fixed_s=5.0,
        switch_tensor_s=5e-4,
    ),
}

# Bounds the fit may not leave (physically meaningful ranges).
KNOB_BOUNDS = {
    "train_mfu": (0.02, 0.6),
    "logprob_mfu": (0.02, 0.6),
    "decode_mbu": (0.05, 0.95),
    "decode_step_overhead_s": (1e-4, 0.2),
    "a2a_efficiency": (0.2, 1.0),
    "switch_fixed_s": (0.0, 120.0),
    "switch_tensor_s": (1e-6, 0.01),
    "expert_imbalance": (1.0, 2.0),
    "attention_efficiency": (0.1, 1.5),
}


_CHOSEN: list[Path] = []  # a user's own fit (`--knobs FILE`); else the packaged one


def knobs_path() -> Path:
    """The knobs file in use: the user's (use_knobs_file) or the fit that ships with planner."""
    return _CHOSEN[0] if _CHOSEN else Path(str(resources.files("planner._calibration"))) / "knobs.json"


def use_knobs_file(path: str | Path) -> None:
    """Use a `planner fit-knobs` output instead of the packaged fit, after checking every family,
    knob name and value (finite, inside KNOB_BOUNDS)."""
    from planner.errors import SpecError
    from planner.files import read_json

    p = Path(path)
    data = read_json(p, "knobs file", "; write one with `planner fit-knobs -o FILE`")
    table = data.get("knobs") if isinstance(data, dict) else None
    if not isinstance(table, dict) or not table:
        raise SpecError(f"{p}: not a knobs file (no 'knobs' mapping of accelerator family -> knobs); write one with `planner fit-knobs -o FILE`")
    names = {f.name for f in fields(Knobs)}
    for family, entry in table.items():
        if family not in PRIOR:
            raise SpecError(f"{p}: unknown accelerator family {family!r}; known: {', '.join(PRIOR)}")
        if not isinstance(entry, dict):
            raise SpecError(f"{p}: knobs of {family} must be a mapping, got {entry!r}")
        for key, value in entry.items():
            if key not in names:
                continue  # residuals and notes ride along in fit output
            lo, hi = KNOB_BOUNDS.get(key, (0.0, float("inf")))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
                raise SpecError(f"{p}: {family}.{key} = {value!r} is outside [{lo}, {hi}]")
    _CHOSEN[:] = [p.resolve()]


@contextmanager
def using_knobs_file(path: str | Path | None):
    """The user's knobs file for the duration (None: the packaged fit), restored afterwards."""
    saved = list(_CHOSEN)
    try:
        if path is not None:
            use_knobs_file(path)
        yield
    finally:
        _CHOSEN[:] = saved


@lru_cache(maxsize=4)
def _load(path: str) -> dict[str, Knobs]:
    p = Path(path)
    if not p.is_file():
        return dict(PRIOR)
    data = json.loads(p.read_text())
    names = {f.name for f in fields(Knobs)}
    # a knob the file does not have (written before the knob existed) keeps its prior
    return {
        family: Knobs(**{**PRIOR[family].as_dict(), **{k: v for k, v in entry.items() if k in names}})
        for family, entry in data["knobs"].items()
    }


def load_knobs(family: str, path: str | Path | None = None) -> Knobs:
    """The fitted knobs of an accelerator family (the prior when no fit is stored)."""
    table = _load(str(path or knobs_path()))
    return table.get(family, PRIOR[family])


def stored_sync_checks(path: str | Path | None = None) -> tuple[dict, ...]:
    """The knobs file's check of the weight sync between separate pools (`planner fit-knobs` writes
    it: each published sync beside the model's at the same layouts); empty when the file has none."""
    return _sync_checks(str(path or knobs_path()))


@lru_cache(maxsize=4)
def _sync_checks(path: str) -> tuple[dict, ...]:
    p = Path(path)
    return tuple(json.loads(p.read_text()).get("sync_checks") or []) if p.is_file() else ()
