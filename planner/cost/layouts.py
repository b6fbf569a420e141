"""Parallel layouts as the frameworks accept them, as arrays for vectorised evaluation.

Training (Megatron-Core rules): world = tp*pp*cp*dp; tp divides the attention heads and, for GQA,
either divides the kv heads or is a multiple of them (Megatron-Core 0.16 and later sub-shard the QKV
activations when tp exceeds the query groups, PR #2565: NeMo RL ran Nemotron-3-Nano's 2 kv heads at
TP8; older cores, as MindSpeed's, need num_query_groups % tp == 0, and the search proposes only such
layouts, which every backend accepts); pp <= layers; when pp does not divide the layers, stages
get floor/ceil shares (MindSpeed's pipeline_num_transformer_layers list expresses any such split,
Megatron-Core's first/last-stage layer counts some of them) and the result says so; expert
parallelism borrows ranks from tp*cp*dp (ep*etp divides it) and ep divides the expert count K;
etp divides the expert width.

Rollout (vLLM rules): an engine instance spans tp*dp devices; tp divides the heads, and kv heads
either split evenly (kv % tp == 0) or replicate (tp % kv == 0); the MoE layers span the instance,
as expert parallelism (ep = tp*dp, which must divide K) or tensor parallelism (ep = 1, the expert
width splits tp*dp ways); the device count is a whole number of instances.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from planner.arch import Architecture
from planner.errors import LayoutError
from planner.specs import RolloutLayout, TrainLayout

__all__ = [
    "TrainCandidates",
    "RolloutCandidates",
    "train_layout_problems",
    "rollout_layout_problems",
    "enumerate_train",
    "enumerate_rollout",
    "check_train_layout",
    "check_rollout_layout",
]


@lru_cache(maxsize=4096)
def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _pow2_upto(n: int) -> list[int]:
    out, p = [], 1
    while p <= n:
        out.append(p)
        p *= 2
    return out


@dataclass(frozen=True)
class TrainCandidates:
    devices: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    ep: np.ndarray
    cp: np.ndarray
    etp: np.ndarray

    @property
    def dp(self) -> np.ndarray:
        return self.devices // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> np.ndarray:
        return self.devices // (self.etp * self.ep * self.pp)

    def __len__(self) -> int:
        return len(self.tp)

    def layout(self, i: int) -> TrainLayout:
        return TrainLayout(tp=int(self.tp[i]), pp=int(self.pp[i]), ep=int(self.ep[i]), cp=int(self.cp[i]), etp=int(self.etp[i]))

    @classmethod
    def of(cls, rows: list[tuple[int, int, int, int, int, int]]) -> "TrainCandidates":
        arr = np.array(rows, dtype=np.int64).reshape(-1, 6)
        return cls(*(arr[:, i] for i in range(6)))

    @classmethod
    def concat(cls, parts: list["TrainCandidates"]) -> "TrainCandidates":
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("devices", "tp", "pp", "ep", "cp", "etp")))

    @classmethod
    def single(cls, devices: int, layout: TrainLayout) -> "TrainCandidates":
        return cls.of([(devices, layout.tp, layout.pp, layout.ep, layout.cp, layout.etp)])


@dataclass(frozen=True)
class RolloutCandidates:
    devices: np.ndarray
    tp: np.ndarray
    dp: np.ndarray
    ep: np.ndarray

    @property
    def instance(self) -> np.ndarray:
        return self.tp * self.dp

    @property
    def instances(self) -> np.ndarray:
        return self.devices // (self.tp * self.dp)

    def __len__(self) -> int:
        return len(self.tp)

    def layout(self, i: int) -> RolloutLayout:
        return RolloutLayout(tp=int(self.tp[i]), dp=int(self.dp[i]), ep=int(self.ep[i]))

    @classmethod
    def of(cls, rows: list[tuple[int, int, int, int]]) -> "RolloutCandidates":
        arr = np.array(rows, dtype=np.int64).reshape(-1, 4)
        return cls(*(arr[:, i] for i in range(4)))

    @classmethod
    def concat(cls, parts: list["RolloutCandidates"]) -> "RolloutCandidates":
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("devices", "tp", "dp", "ep")))

    @classmethod
    def single(cls, devices: int, layout: RolloutLayout) -> "RolloutCandidates":
        return cls.of([(devices, layout.tp, layout.dp, layout.ep)])


def train_layout_problems(arch: Architecture, devices: int, lay: TrainLayout) -> list[str]:
    """Every rule the layout breaks, each with its numbers (empty when valid)."""
    a, k = arch.attention, arch.moe.num_experts
    out = []
    if a.num_heads % lay.tp:
        out.append(f"tp={lay.tp} does not divide the {a.num_heads} attention heads")
    if a.kind == "gqa" and a.num_kv_heads % lay.tp and lay.tp % a.num_kv_heads:
        out.append(f"tp={lay.tp} neither divides nor is a multiple of the {a.num_kv_heads} kv heads (Megatron-Core: "
                   "num_query_groups % tp == 0, or tp % num_query_groups == 0 from core 0.16)")  # fmt: skip
    model_par = lay.tp * lay.pp * lay.cp
    if devices % model_par:
        out.append(f"tp*pp*cp = {lay.tp}*{lay.pp}*{lay.cp} = {model_par} does not divide {devices} devices")
    else:
        rest = devices // lay.pp
        if rest % (lay.ep * lay.etp):
            out.append(
                f"ep*etp = {lay.ep}*{lay.etp} = {lay.ep * lay.etp} does not divide tp*cp*dp = {devices}/{lay.pp} = "
                f"{rest} (expert parallelism borrows ranks from tp*cp*dp)"
            )
    if lay.pp > arch.num_layers:
        out.append(f"pp={lay.pp} exceeds the {arch.num_layers} layers")
    if lay.pipeline_layers is not None and (sum(lay.pipeline_layers) != arch.num_layers or min(lay.pipeline_layers) < 1):
        out.append(f"pipeline_layers {list(lay.pipeline_layers)} hold {sum(lay.pipeline_layers)} layers; the model has {arch.num_layers} "
                   "(every stage at least one)")  # fmt: skip
    if k % lay.ep:
        out.append(f"ep={lay.ep} does not divide K={k} experts")
    if arch.moe.expert_intermediate % lay.etp:
        out.append(f"etp={lay.etp} does not divide the expert width {arch.moe.expert_intermediate}")
    return out


def rollout_layout_problems(arch: Architecture, devices: int, lay: RolloutLayout) -> list[str]:
    a, k = arch.attention, arch.moe.num_experts
    inst = lay.tp * lay.dp
    out = []
    if a.num_heads % lay.tp:
        out.append(f"tp={lay.tp} does not divide the {a.num_heads} attention heads")
    if a.kind == "gqa" and a.num_kv_heads % lay.tp and lay.tp % a.num_kv_heads:
        out.append(f"tp={lay.tp} neither divides nor is a multiple of the {a.num_kv_heads} kv heads")
    if devices % inst:
        out.append(f"an instance of tp*dp = {lay.tp}*{lay.dp} = {inst} devices does not divide {devices} devices")
    if lay.ep not in (1, inst):
        out.append(f"ep={lay.ep} must be 1 (tensor-parallel experts) or tp*dp = {inst} (expert parallel over the instance)")
    elif lay.ep > 1 and k % lay.ep:
        out.append(f"ep={lay.ep} does not divide K={k} experts")
    elif lay.ep == 1 and arch.moe.expert_intermediate % inst:
        out.append(f"tensor-parallel experts: tp*dp={inst} does not divide the expert width {arch.moe.expert_intermediate}")
    if out and lay.dp > 1:  # vLLM's data-parallel MoE mode is not how several engines are written
        out.append(f"dp={lay.dp} makes one engine of tp*dp = {inst} devices (vLLM's data-parallel attention, the MoE spread over "
                   f"all {inst}); independent engines of tp={lay.tp} devices each (verl's rollout replicas) are dp: 1, and "
                   f"{devices} devices then run {devices // lay.tp if devices % lay.tp == 0 else 'a whole number of'} of them")  # fmt: skip
    return out


def check_train_layout(arch: Architecture, devices: int, lay: TrainLayout) -> None:
    problems = train_layout_problems(arch, devices, lay)
    if problems:
        raise LayoutError(f"train layout {lay.describe()} on {devices} devices is invalid: " + "; ".join(problems))


def check_rollout_layout(arch: Architecture, devices: int, lay: RolloutLayout) -> None:
    problems = rollout_layout_problems(arch, devices, lay)
    if problems:
        raise LayoutError(f"rollout layout {lay.describe()} on {devices} devices is invalid: " + "; ".join(problems))


MAX_SEARCH_PP = 16  # deeper pipelines are valid when given, but the search stops here


def enumerate_train(
    arch: Architecture, devices: int, *, max_tp: int, max_cp: int = 1, max_pp: int = MAX_SEARCH_PP
) -> TrainCandidates:
    """Every valid training layout on `devices` with tp and cp powers of two within the scale-up
    domain, dividing the kv heads (the rule every Megatron-Core accepts), etp 1 or tp, pp up to
    `max_pp` and the layer count; built with array masks."""
    a, k = arch.attention, arch.moe.num_experts
    heads = a.num_kv_heads if a.kind == "gqa" else a.num_heads
    tps = [t for t in _pow2_upto(min(max_tp, devices)) if a.num_heads % t == 0 and heads % t == 0]
    cps = _pow2_upto(min(max_cp, devices))
    pps = [p for p in _divisors(devices) if p <= min(arch.num_layers, max_pp)]
    eps = _divisors(k)
    tp, cp, pp, ep, etp_is_tp = (
        g.ravel() for g in np.meshgrid(tps, cps, pps, eps, [0, 1], indexing="ij")
    )
    etp = np.where(etp_is_tp == 1, tp, 1)
    ok = devices % (tp * cp * pp) == 0
    ok &= (devices // pp) % (ep * etp) == 0
    ok &= arch.moe.expert_intermediate % etp == 0
    ok &= (etp_is_tp == 0) | (tp > 1)  # etp = tp = 1 is the same layout as etp = 1
    n = int(ok.sum())
    return TrainCandidates(np.full(n, devices, dtype=np.int64), tp[ok], pp[ok], ep[ok], cp[ok], etp[ok])


def enumerate_rollout(arch: Architecture, devices: int, *, max_tp: int) -> RolloutCandidates:
    """Every valid rollout layout on `devices` (tp a power of two within the scale-up domain)."""
    a, k = arch.attention, arch.moe.num_experts
    rows = []
    for tp in _pow2_upto(min(max_tp, devices)):
        if a.num_heads % tp or (a.kind == "gqa" and a.num_kv_heads % tp and tp % a.num_kv_heads):
            continue
        for inst in _divisors(devices):
            if inst % tp:
                continue
            dp = inst // tp
            if k % inst == 0:
                rows.append((devices, tp, dp, inst))
            elif arch.moe.expert_intermediate % inst == 0:
                rows.append((devices, tp, dp, 1))
    return RolloutCandidates.of(rows)
