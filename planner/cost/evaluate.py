"""Cost of an RL step at a device count: the best feasible layouts, or why none fits.

`evaluate(...)` answers `planner cost --cards N`; `min_devices(...)` answers `--min-cards`.
Training and rollout layouts are chosen separately (their memory peaks fall in different phases):
the training layout minimises reference + old log-prob + update time among those that fit; the
rollout layout, given what the training side leaves on the device, minimises rollout time; the
switch time then follows from both. A job on separate pools (colocated: false) is costed the same
way on each pool's devices, for the job's split or every split in whole nodes; its step is the
pools' pipeline (CostResult.overlap_s, CostResult.pools).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from planner.arch import Architecture
from planner.cost.hardware import Accelerator
from planner.cost.knobs import Knobs, stored_sync_checks
from planner.cost.layouts import (
    RolloutCandidates,
    TrainCandidates,
    check_rollout_layout,
    check_train_layout,
    enumerate_rollout,
    enumerate_train,
)
from planner.cost.model import HOST_USABLE_FRACTION, CostModel
from planner.errors import InfeasibleError, LayoutError, SpecError
from planner.specs import Job, Offload, RolloutLayout, TrainLayout
from planner.units import gib

__all__ = ["CostResult", "evaluate", "infeasible", "min_devices", "candidate_device_counts", "DEFAULT_MEMORY_MARGIN"]

# the share of usable device memory kept free in the training phases, the same for every command that
# sizes devices (cost, demo, suggest, report, preflight): the same job gets the same minimum count
DEFAULT_MEMORY_MARGIN = 0.1


@dataclass(frozen=True)
class CostResult:
    model: str
    experts: int
    original_experts: int
    accelerator: str
    device_unit: str
    devices_per_card: int
    num_devices: int
    feasible: bool
    reasons: list[str]
    train_layout: TrainLayout | None
    rollout_layout: RolloutLayout | None
    phase_times_s: dict[str, float]
    memory_per_device_bytes: dict[str, dict[str, float]]
    peak_phase: str | None
    usable_bytes_per_device: float
    host_memory_bytes_per_node: float
    host_memory_limit_bytes_per_node: float
    layouts_evaluated: int
    notes: list[str] = field(default_factory=list)
    job: Job | None = None
    terms: list[dict] = field(default_factory=list)  # the step's terms with their inputs (`planner cost --explain`)
    # separate pools (colocated: false): the seconds the two pools' work overlaps in a step (max_staleness
    # >= 1), and each pool's devices, busy share, the weight sync and the policy lag
    overlap_s: float = 0.0
    pools: dict[str, Any] | None = None

    @property
    def num_cards(self) -> float:
        return self.num_devices / self.devices_per_card

    @property
    def step_time_s(self) -> float:
        """The phases' sum, less what separate pools overlap (generation of a later step during training)."""
        return float(sum(self.phase_times_s.values())) - self.overlap_s if self.feasible else float("nan")

    @property
    def device_hours_per_step(self) -> float:
        return self.num_devices * self.step_time_s / 3600.0

    @property
    def card_hours_per_step(self) -> float:
        return self.num_cards * self.step_time_s / 3600.0

    @property
    def tokens_per_s_per_device(self) -> float:
        if not self.feasible or self.job is None:
            return float("nan")
        return self.job.tokens_per_step / self.step_time_s / self.num_devices

    @property
    def peak_memory_bytes(self) -> float:
        if self.peak_phase is None:
            return float("nan")
        return self.memory_per_device_bytes[self.peak_phase]["total"]

    def to_json(self) -> dict[str, Any]:
        unit = self.device_unit
        out: dict[str, Any] = {
            "model": self.model,
            "experts": self.experts,
            "original_experts": self.original_experts,
            "accelerator": self.accelerator,
            "feasible": self.feasible,
            "num_cards": self.num_devices,
            "device_unit": unit,
            "devices_per_card": self.devices_per_card,
            "physical_cards": self.num_cards,
            "step_time_s": None if not self.feasible else self.step_time_s,
            "phase_times_s": self.phase_times_s,
            "memory_per_card_bytes": self.memory_per_device_bytes,
            "peak_phase": self.peak_phase,
            "usable_bytes_per_card": self.usable_bytes_per_device,
            "host_memory_bytes": {"per_node": self.host_memory_bytes_per_node, "limit_per_node": self.host_memory_limit_bytes_per_node},
            "accelerator_hours_per_step": None if not self.feasible else self.device_hours_per_step,
            "physical_card_hours_per_step": None if not self.feasible else self.card_hours_per_step,
            "tokens_per_s_per_card": None if not self.feasible else self.tokens_per_s_per_device,
            "tokens_per_s_per_physical_card": None if not self.feasible else self.tokens_per_s_per_device * self.devices_per_card,
            "train_layout": None if self.train_layout is None else self.train_layout.to_dict(),
            "rollout_layout": None if self.rollout_layout is None else vars(self.rollout_layout),
            "layouts_evaluated": self.layouts_evaluated,
            "overlap_s": self.overlap_s,
            "pools": self.pools,
            "reasons": self.reasons,
            "notes": self.notes,
            "terms": self.terms,
        }
        out["units"] = (
            f"num_cards, memory_per_card_bytes, accelerator_hours_per_step and tokens_per_s_per_card count "
            f"{unit}s, the devices the training framework sees; one physical card holds {self.devices_per_card} {unit}"
            + ("s" if self.devices_per_card > 1 else "")
        )
        return out


def candidate_device_counts(accel: Accelerator, max_devices: int) -> list[int]:
    """Device counts a cluster is allocated in: whole cards below a node, whole nodes above."""
    per_node, per_card = accel.devices_per_node, accel.devices_per_card
    small = [n for n in (1, 2, 4, 8, 16, 32) if n < per_node and n % per_card == 0]
    return [n for n in small + list(range(per_node, max_devices + 1, per_node)) if n <= max_devices]


def _max_tp(accel: Accelerator) -> int:
    return min(accel.devices_per_node, 16)


# Context parallelism splits each packed micro-batch of micro_batch_tokens over CP ranks; the search
# tries CP up to MAX_SEARCH_CP while every rank keeps at least CP_MIN_TOKENS of it (below that the
# ring's K/V passes outweigh the attention they overlap, and Megatron's zig-zag split wants 2 x CP
# chunks of a sequence), so jobs of a few thousand tokens per micro-batch search CP 1 only
MAX_SEARCH_CP = 8
CP_MIN_TOKENS = 4096


def _max_cp(job: Job) -> int:
    cp = 1
    while cp * 2 <= MAX_SEARCH_CP and job.micro_tokens / (cp * 2) >= CP_MIN_TOKENS:
        cp *= 2
    return cp


class _Reasons(list):
    """Why no layout fits, and the index of the closest layout (`best`) to name."""

    def __init__(self, items=(), best: int = 0):
        super().__init__(items)
        self.best = best


class _Evaluator:
    def __init__(self, arch: Architecture, accel: Accelerator, job: Job, knobs: Knobs | None, memory_margin: float = DEFAULT_MEMORY_MARGIN):
        if not job.colocated:  # separate pools: nothing is offloaded to make room for the other phase
            job = dataclasses.replace(job, offload=Offload(params=False, grads=False, optimizer=False))
        self.arch, self.accel, self.job = arch, accel, job
        self.model = CostModel(arch, accel, job, knobs)
        self.usable = accel.usable_bytes
        self.train_limit = self.usable * (1 - memory_margin)  # a safety margin left free in the training phases
        self.memory_margin = memory_margin
        self.host_limit = accel.host_memory_bytes_per_node * HOST_USABLE_FRACTION
        # kept between device counts (see `evaluator`): layouts enumerated, and each separate pool's
        # estimate and fitting layout, by device count
        self._train_candidates: dict[int, TrainCandidates] = {}
        self._rollout_candidates: dict[int, RolloutCandidates] = {}
        self._train_pools: dict[int, tuple] = {}
        self._rollout_pools: dict[int, tuple] = {}

    def train_candidates(self, devices: int) -> TrainCandidates:
        if self.job.train_layout is not None:
            check_train_layout(self.arch, devices, self.job.train_layout)
            return TrainCandidates.single(devices, self.job.train_layout)
        cache = self._train_candidates
        if devices not in cache:
            cache[devices] = enumerate_train(self.arch, devices, max_tp=_max_tp(self.accel), max_cp=_max_cp(self.job))
        return cache[devices]

    def rollout_candidates(self, devices: int) -> RolloutCandidates:
        if self.job.rollout_layout is not None:
            check_rollout_layout(self.arch, devices, self.job.rollout_layout)
            return RolloutCandidates.single(devices, self.job.rollout_layout)
        cache = self._rollout_candidates
        if devices not in cache:
            cache[devices] = enumerate_rollout(self.arch, devices, max_tp=_max_tp(self.accel))
        return cache[devices]

    def run(self, devices: int) -> CostResult:
        accel = self.accel
        if devices % accel.devices_per_card:
            raise SpecError(
                f"{devices} {accel.device_unit}s is not a whole number of {accel.id} cards "
                f"({accel.devices_per_card} {accel.device_unit}s per card)"
            )
        return self._colocated(devices) if self.job.colocated else self._pools(devices)

    def _colocated(self, devices: int) -> CostResult:
        """Training and rollout on the same devices in turn: the training layout that fits with the
        least training time, then the rollout layout that fits beside what training keeps."""
        job, m = self.job, self.model
        tc, rc = self.train_candidates(devices), self.rollout_candidates(devices)
        reasons = self._no_layouts(tc, devices, rc, devices)
        if reasons:
            return self._infeasible(devices, reasons, len(tc) + len(rc))
        te = m.train(tc)
        # the switch depends on the training layout too
        ti, reasons = self._fit_train(tc, te, te.update_s + te.reference_s + te.old_logprob_s + te.values_s + te.switch_train_s)
        if ti is None:
            return self._infeasible(devices, reasons, len(tc) + len(rc), self._train_layout(tc, reasons.best))
        kept = float(te.kept_bytes[ti])
        re = m.rollout(rc, kept_train_bytes=kept)
        ri, reasons = self._fit_rollout(rc, re, kept)
        if ri is None:
            return self._infeasible(devices, reasons, len(tc) + len(rc), self._train_layout(tc, ti), rc.layout(reasons.best))
        phases = self._phases(te, ti, re, ri)
        phases["switch"] = m.switch_seconds(te, ti, re, ri, int(rc.instance[ri]))
        memory = self._memory(te, ti, re, ri, kept)
        return self._result(devices, tc, te, ti, rc, re, ri, phases, memory)

    def _pools(self, devices: int) -> CostResult:
        """Rollout on a pool of its own and training on the rest (colocated: false): the job's
        rollout_devices, or the split with the shortest step among whole nodes (whole cards within
        one node); each pool's layouts chosen as in the colocated case, nothing offloaded."""
        job, accel = self.job, self.accel
        if job.rollout_devices is not None:
            if not 0 < job.rollout_devices < devices:
                raise SpecError(f"rollout_devices {job.rollout_devices} leaves no training pool on {devices} {accel.device_unit}s")
            splits = [job.rollout_devices]
        else:
            unit = accel.devices_per_node if devices >= 2 * accel.devices_per_node else accel.devices_per_card
            splits = list(range(unit, devices, unit))
            if not splits:
                return self._infeasible(devices, [f"{devices} {accel.device_unit}s cannot be split into a rollout and a training pool"], 0)
        results = [self._split(devices, r) for r in splits]
        fits = [r for r in results if r.feasible]
        if fits:
            best = min(fits, key=lambda r: r.step_time_s)
            if len(splits) > 1:
                best.notes.append(f"{len(fits)} of {len(splits)} pool splits fit; this one ({best.pools['rollout_devices']} rollout + "
                                  f"{best.pools['train_devices']} training {accel.device_unit}s) has the shortest step")  # fmt: skip
            return best
        shown = results if len(results) <= 3 else [results[0], results[len(results) // 2], results[-1]]
        reasons = [reason for r in shown for reason in r.reasons]
        return self._infeasible(devices, reasons, sum(r.layouts_evaluated for r in results))

    def _split(self, devices: int, rollout_devices: int) -> CostResult:
        job, m, unit = self.job, self.model, self.accel.device_unit
        train_devices = devices - rollout_devices
        where = f"pools of {rollout_devices} rollout + {train_devices} training {unit}s: "
        try:
            tc, rc = self.train_candidates(train_devices), self.rollout_candidates(rollout_devices)
        except LayoutError as exc:
            return self._infeasible(devices, [where + str(exc)], 0)
        reasons = self._no_layouts(tc, train_devices, rc, rollout_devices)
        if reasons:
            return self._infeasible(devices, [where + r for r in reasons], len(tc) + len(rc))
        te, ti, reasons = self._pool_train(train_devices, tc)
        if ti is None:
            return self._infeasible(devices, [where + r for r in reasons], len(tc) + len(rc), self._train_layout(tc, reasons.best))
        re, ri, reasons = self._pool_rollout_fit(rollout_devices, rc)
        if ri is None:
            return self._infeasible(devices, [where + r for r in reasons], len(tc) + len(rc), self._train_layout(tc, ti), rc.layout(reasons.best))
        phases = self._phases(te, ti, re, ri)
        phases["weight_sync"] = sync = m.pool_sync_seconds(te, ti, re, ri)
        generate = phases["rollout"] + phases["reward"]
        train = sum(phases[p] for p in ("reference", "old_logprob", "values", "update") if p in phases)
        # off-policy, generation of a later step overlaps training; with partial rollout the engine
        # also keeps generating while the weights arrive, so the sync hides behind generation too
        overlap = (min(generate, train + sync) if job.partial_rollout else min(generate, train)) if job.max_staleness else 0.0
        step = sum(phases.values()) - overlap
        pools = {"rollout_devices": rollout_devices, "train_devices": train_devices, "max_staleness": job.max_staleness,
                 "rollout_busy": generate / step, "train_busy": train / step, "weight_sync_s": sync, "policy_lag_steps": job.max_staleness,
                 "partial_rollout": job.partial_rollout,
                 "bound_by": "rollout" if generate >= train + (sync if job.partial_rollout else 0.0) else "training"}  # fmt: skip
        memory = self._memory(te, ti, re, ri, None)
        result = self._result(devices, tc, te, ti, rc, re, ri, phases, memory, overlap=overlap, pools=pools)
        result.notes.insert(0, self._pools_note(pools))
        return result

    def _pool_train(self, devices: int, tc):
        """A training pool's estimate and its fitting layout (or the reasons none fits), once per
        pool size: the splits of every device count the search tries share their pool sizes."""
        cache = self._train_pools
        if devices not in cache:
            te = self.model.train(tc)
            cache[devices] = (te, *self._fit_train(tc, te, te.update_s + te.reference_s + te.old_logprob_s + te.values_s + te.switch_gather_s))
        return cache[devices]

    def _pool_rollout_fit(self, devices: int, rc):
        """A rollout pool's estimate and its fitting layout (or the reasons none fits), once per pool size."""
        cache = self._rollout_pools
        if devices not in cache:
            re = self._pool_rollout(rc)
            cache[devices] = (re, *self._fit_rollout(rc, re, 0.0))
        return cache[devices]

    def _pool_rollout(self, rc):
        """The rollout pool's time per step. With partial rollout the engine takes the sequences of up
        to max_staleness + 1 steps at once (the queue runs ahead of training), so one step's share is
        that larger batch's rollout over max_staleness + 1: its long tail is paid once for all of them,
        and the KV pool and max_num_seqs still bound what decodes at once."""
        if not self.job.partial_rollout:
            return self.model.rollout(rc, kept_train_bytes=0.0)
        ahead = self.job.max_staleness + 1
        re = self._queue_model.rollout(rc, kept_train_bytes=0.0)  # the queue's counts per rank, one step's share of its time
        return dataclasses.replace(re, prefill_s=re.prefill_s / ahead, decode_s=re.decode_s / ahead, rollout_s=re.rollout_s / ahead,
                                   decode_overhead_s=re.decode_overhead_s / ahead)  # fmt: skip

    @functools.cached_property
    def _queue_model(self) -> CostModel:
        """The cost model of the partial rollout's queue: max_staleness + 1 steps' prompts at once."""
        job = self.job
        return CostModel(self.arch, self.accel, dataclasses.replace(job, prompts_per_step=job.prompts_per_step * (job.max_staleness + 1)),
                         self.model.knobs)  # fmt: skip

    def _pools_note(self, p: dict[str, Any]) -> str:
        unit = self.accel.device_unit
        head = (f"separate pools: {p['rollout_devices']} rollout + {p['train_devices']} training {unit}s, the trained weights sent "
                f"across in {p['weight_sync_s']:,.1f} s a step{self._sync_check_text()}; rollout pool busy {p['rollout_busy']:.0%}, "
                f"training pool {p['train_busy']:.0%} of the step")  # fmt: skip
        if not p["max_staleness"]:
            return head + "; on-policy (max_staleness 0): the pools take turns, each idle while the other works"
        partial = (f"; partial rollout: the engine keeps generating through the sync, up to {p['max_staleness'] + 1} steps' sequences "
                   f"at once" if p["partial_rollout"] else "")  # fmt: skip
        return (head + f"; generation of step t + {p['max_staleness']} overlaps training of step t (bound by the {p['bound_by']} pool), "
                f"so each batch is trained {p['policy_lag_steps']} step(s) after the weights that generated it" + partial)  # fmt: skip

    def _sync_check_text(self) -> str:
        """What the pool sync was checked against (the knobs file's sync checks), for the packed path
        the checks measured (NeMo RL from 0.4)."""
        checks = stored_sync_checks() if self.job.weight_sync == "packed" else ()
        if not checks:
            return ""
        ratios = sorted(c["ratio"] for c in checks)
        span = f"x{ratios[0]:.1f}" if len(ratios) == 1 else f"x{ratios[0]:.1f}-{ratios[-1]:.1f}"
        bound = ": read it as an upper bound" if ratios[0] > 1.25 else ": read it as a lower bound" if ratios[-1] < 0.8 else ""
        return f" (the model's sync is {span} of the {len(checks)} NeMo RL measured between pools{bound})"

    def _no_layouts(self, tc, train_devices: int, rc, rollout_devices: int) -> list[str]:
        unit, arch = self.accel.device_unit, self.arch
        reasons = []
        if len(tc) == 0:
            reasons.append(f"no valid training layout on {train_devices} {unit}s for {arch.name} with K={arch.moe.num_experts}")
        if len(rc) == 0:
            reasons.append(f"no valid rollout layout on {rollout_devices} {unit}s")
        return reasons

    def _fit_train(self, tc, te, train_time) -> tuple[int | None, "_Reasons"]:
        """The training layout with the least `train_time` among those whose phases fit device and
        host memory, or None with the reasons (naming the closest layout, `reasons.best`)."""
        accel, limit = self.accel, self.train_limit
        train_fit = (te.update_bytes <= limit) & (te.logprob_bytes <= limit) & (te.reference_bytes <= limit)
        host_fit = te.host_bytes_per_node <= self.host_limit
        ok = train_fit & host_fit
        if ok.any():
            return int(np.flatnonzero(ok)[np.argmin(train_time[ok])]), _Reasons()
        i = int(np.argmin(np.maximum(te.update_bytes, te.reference_bytes)))
        lay = self._train_layout(tc, i)
        reasons = _Reasons(best=i)
        if not train_fit[i]:
            reasons.append(
                f"update phase needs {gib(te.update_bytes[i])} per {accel.device_unit} at best ({lay.describe()}: "
                f"weights {gib(te.weights_bytes[i])}, grads {gib(te.grads_bytes[i])}, optimizer "
                f"{gib(te.optimizer_bytes[i])}, activations {gib(te.activations_bytes[i])}; reference phase "
                f"{gib(te.reference_bytes[i])}) > {gib(limit)} usable on {accel.id}"
                + (f" with {self.memory_margin:.0%} kept free" if self.memory_margin else "")
            )
        if not host_fit[i]:
            reasons.append(
                f"offloaded states need {gib(te.host_bytes_per_node[i])} of host memory per node > "
                f"{gib(self.host_limit)} ({HOST_USABLE_FRACTION:.0%} of {gib(accel.host_memory_bytes_per_node)})"
            )
        if not reasons:
            reasons.append("no training layout fits both device and host memory")
        return None, reasons

    def _fit_rollout(self, rc, re, kept: float) -> tuple[int | None, "_Reasons"]:
        """The fastest rollout layout whose engine memory, after weights, workspace and what training
        keeps, holds at least one longest sequence's KV cache per rank (vLLM refuses to start
        otherwise), or None with the reason."""
        roll_fit = re.kv_budget_bytes >= re.kv_per_sequence_bytes
        if roll_fit.any():
            return int(np.flatnonzero(roll_fit)[np.argmin(re.rollout_s[roll_fit])]), _Reasons()
        job = self.job
        i = int(np.argmax(re.kv_budget_bytes - re.kv_per_sequence_bytes))
        return None, _Reasons([
            f"rollout: at best ({rc.layout(i).describe()}) weights {gib(re.weights_bytes[i])} + workspace "
            f"{gib(re.workspace_bytes[i])} + training states kept {gib(kept)} leave "
            f"{gib(max(re.kv_budget_bytes[i], 0.0))} of {job.rollout_memory_utilization:.2f} x {gib(self.usable)} "
            f"for the KV cache; one {job.max_sequence_tokens}-token sequence needs {gib(re.kv_per_sequence_bytes[i])}"
        ], best=i)  # fmt: skip

    def _phases(self, te, ti: int, re, ri: int) -> dict[str, float]:
        job = self.job
        phases = {
            "rollout": float(re.rollout_s[ri]),
            "reference": float(te.reference_s[ti]),
            "old_logprob": float(te.old_logprob_s[ti]),
            "values": float(te.values_s[ti]),
            "update": float(te.update_s[ti]),
            "reward": float(job.reward_s),
        }
        if job.algorithm != "ppo":
            phases.pop("values")
        return phases

    def _memory(self, te, ti: int, re, ri: int, kept: float | None) -> dict[str, dict[str, float]]:
        """Bytes per device by phase; the rollout's `kept` is what training leaves beside it (None:
        a pool of its own)."""
        job = self.job
        rollout = {} if kept is None else {"training_states_kept": float(kept)}
        rollout.update(weights=float(re.weights_bytes[ri]), workspace=float(re.workspace_bytes[ri]), kv_cache=float(max(re.kv_budget_bytes[ri], 0.0)))
        memory = {
            "rollout": rollout,
            "reference": {"total": float(te.reference_bytes[ti])},
            "old_logprob": {"total": float(te.logprob_bytes[ti])},
            "update": {
                "weights": float(te.weights_bytes[ti]),
                "grads": float(te.grads_bytes[ti]),
                "optimizer": float(te.optimizer_bytes[ti]),
                "activations": float(te.activations_bytes[ti]),
            },
        }
        if job.algorithm == "ppo":
            memory["update"]["critic_kept"] = float(te.other_model_bytes[ti])
        if job.skip_old_logprob:
            memory.pop("old_logprob")
        if not job.reference_model:
            memory.pop("reference")
        for parts in memory.values():
            parts.setdefault("total", float(sum(parts.values())))
        return memory

    def _result(self, devices: int, tc, te, ti: int, rc, re, ri: int, phases: dict[str, float], memory: dict, *, overlap: float = 0.0,
                pools: dict | None = None) -> CostResult:  # fmt: skip
        lay = self._train_layout(tc, ti)
        notes = self._notes(lay, te, ti, re, ri)
        if self.job.optimizer_swap:
            notes.append("optimizer state is swapped: it lives in host memory and streams in for each optimizer step")
        return CostResult(
            **_point(self.arch, self.accel, devices),
            feasible=True,
            reasons=[],
            train_layout=lay,
            rollout_layout=rc.layout(ri),
            phase_times_s=phases,
            memory_per_device_bytes=memory,
            peak_phase=max(memory, key=lambda p: memory[p]["total"]),
            usable_bytes_per_device=self.usable,
            host_memory_bytes_per_node=float(te.host_bytes_per_node[ti]),
            host_memory_limit_bytes_per_node=self.host_limit,
            layouts_evaluated=len(tc) + len(rc),
            notes=notes,
            job=self.job if pools is None else dataclasses.replace(self.job, rollout_devices=pools["rollout_devices"]),  # the split chosen
            terms=self._terms(devices if pools is None else pools["train_devices"], lay, te, ti, re, ri, phases),
            overlap_s=overlap,
            pools=pools,
        )

    def _terms(self, train_devices: int, lay: TrainLayout, te, ti: int, re, ri: int, phases: dict[str, float]) -> list[dict]:
        """The chosen layouts' step time as its terms, each with the inputs of its formula (`train_devices`:
        the training pool's)."""
        m, job, accel = self.model, self.job, self.accel
        kn = m.knobs
        models = job.trained_models
        f = lambda a: float(a[ti])  # noqa: E731
        u = lambda a: models * float(a[ti])  # noqa: E731  (PPO updates the critic the same way)
        per = f" (x{models}: actor and critic)" if models > 1 else ""
        recomputed = {"full": ", recomputed forward", "moe": ", recomputed MoE layers"}.get(job.recompute, "")
        dispatch = job.dispatch
        out = [
            ("update", "compute", u(te.update_compute_s),
             f"{te.update_flops / 1e15:,.1f} PFLOP (forward, backward{recomputed}) / ({train_devices} x {m.train_peak_flops() / 1e12:,.0f} TFLOP/s x "
             f"train_mfu {kn.train_mfu:.3f}), attention ({m.attention_share():.0%} of the FLOPs) at attention_efficiency "
             f"{kn.attention_efficiency:.3f} of that rate, x slowdown {f(te.compute_slowdown):.2f} (expert GEMMs of {f(te.expert_gemm_flops) / 1e9:.2f} "
             f"GFLOP at efficiency {f(te.expert_gemm_efficiency):.2f}, expert imbalance {m.imbalance:g} where ep > 1, the busiest "
             f"pipeline stage){per}"),
            ("update", "data dispatch", dispatch.get("update", 0.0), "the job's dispatch_s"),
            ("update", "pipeline bubble", u(te.update_bubble_s), f"compute x (pp - 1) / {f(te.micro_batches):.0f} micro-batches, pp {lay.pp}"),
            ("update", "expert all-to-all", u(te.update_a2a_s), f"ep {lay.ep}; a2a_efficiency {kn.a2a_efficiency:.3f}"),
            ("update", "tensor-parallel collectives", u(te.update_tp_s), f"tp {lay.tp}"),
            ("update", "context-parallel ring (K/V passes)", u(te.update_cp_s), f"cp {lay.cp}"),
            ("update", "gradient sync (data parallel)", u(te.update_sync_s), "reduce-scatter and all-gather once per optimizer step"),
            ("update", "expert-TP gather", u(te.update_etp_s), f"etp {lay.etp}: tokens all-gathered and reduce-scattered over the expert-TP group"),
            ("update", "optimizer swap", u(te.update_swap_s), "host link, optimizer_swap" if job.optimizer_swap else "no swap"),
            ("update", "host optimizer", u(te.update_host_adam_s),
             f"optimizer_offload_fraction {job.optimizer_offload_fraction:g}: gradients down, parameters up over the host link, "
             f"Adam at {accel.host_adam_params_per_s / 1e9:g} G params/s per node"),
            ("rollout", "prefill", float(re.prefill_s[ri]), f"logprob_mfu {kn.logprob_mfu:.3f}"),
            ("rollout", "decode", float(re.decode_s[ri]),
             f"{float(re.decode_steps[ri]):,.0f} steps, {float(re.concurrency[ri]):,.0f} of {float(re.sequences_per_rank[ri]):,.0f} "
             f"sequences at once per DP rank; weights and KV read at decode_mbu {kn.decode_mbu:.3f}; of which "
             f"{float(re.decode_overhead_s[ri]):,.0f} s fixed per-step cost (decode_step_overhead_s {kn.decode_step_overhead_s:g}"
             + (f" + layers x {accel.eager_layer_s * 1e6:g} us eager launches" if not job.rollout_graphs else ", graphs")
             + f" + each layer's collective latency, {accel.collective_latency_s * 1e6:g} us in the scale-up domain, "
             f"{accel.scale_out_latency_s * 1e6:g} us beyond)"),
        ]
        for phase in ("reference", "old_logprob", "values", "reward"):
            if phases.get(phase):
                out.append((phase, phase.replace("_", " "), phases[phase], "the job's reward_s" if phase == "reward"
                            else f"forward pass at logprob_mfu {kn.logprob_mfu:.3f}"
                            + (f", micro-batches of {job.logprob_padded_seqs} padded to their longest (x{m.logprob_padding:.2f} FLOPs)" if job.logprob_padded_seqs else "")
                            + (f", {dispatch[phase]:g} s data dispatch (the job's dispatch_s)" if dispatch.get(phase) else "")))  # fmt: skip
        if phases.get("switch"):
            host, fixed = f(te.switch_host_s), kn.switch_fixed_s
            sync = phases["switch"] - host - fixed
            out += [
                ("switch", "host moves", host, f"offloaded states and weights over the host link ({accel.host_link_bytes_per_s / 1e9:g} GB/s), each way"),
                ("switch", "weight sync", sync,
                 f"weight_sync gather: the full model tensor by tensor, {m.weight_tensors:,.0f} tensors x switch_tensor_s {kn.switch_tensor_s:g} "
                 f"+ {sync - m.weight_tensors * kn.switch_tensor_s:,.1f} s of bytes" if job.weight_sync == "gather"
                 else "weight_sync packed: the full model's bytes in large buffers, no cost per tensor" if job.weight_sync == "packed"
                 else "weight_sync shard: each device receives its rollout shard over the instance's links"),
                ("switch", "engine sleep and wake", fixed, f"switch_fixed_s {fixed:g}"),
            ]  # fmt: skip
        if phases.get("weight_sync"):
            net = accel.inter_node_bytes_per_s
            gathered = f(te.switch_gather_s) if job.weight_sync != "shard" else 0.0
            out += [
                ("weight_sync", "gather over the training groups", gathered, f"as the colocated switch's weight sync (weight_sync {job.weight_sync})"),
                ("weight_sync", "sent across the pools", phases["weight_sync"] - gathered,
                 f"{'the whole bf16 model' if job.weight_sync != 'shard' else 'each rollout device its shard'} over the network "
                 f"({net / 1e9:g} GB/s)"),
            ]  # fmt: skip
        return [{"phase": p, "term": t, "seconds": s, "inputs": i} for p, t, s, i in out]

    def _train_layout(self, tc, i: int) -> TrainLayout:
        """Candidate i's layout, with the job's per-stage layer counts where they apply to it."""
        lay = tc.layout(i)
        given = self.job.pipeline_layers
        return dataclasses.replace(lay, pipeline_layers=given) if given and len(given) == lay.pp else lay

    def _notes(self, lay: TrainLayout, te, ti: int, re, ri: int) -> list[str]:
        arch = self.arch
        notes = []
        if te.uneven_pp[ti] and lay.pipeline_layers:
            notes.append(f"pipeline stages hold {list(lay.pipeline_layers)} layers (the job's pipeline_layers); memory and time are "
                         "those of the busiest stage")  # fmt: skip
        elif te.uneven_pp[ti]:
            notes.append(
                f"pipeline split is uneven: {arch.num_layers} layers over PP{lay.pp} (stages of {arch.num_layers // lay.pp} "
                f"and {arch.num_layers // lay.pp + 1}; set train_layout.pipeline_layers to the counts your MindSpeed pipeline "
                "layer list or Megatron first/last-stage settings give); memory and time are those of the busiest stage"
            )
        if re.concurrency[ri] < re.sequences_per_rank[ri]:
            notes.append(
                f"rollout is KV-bound: {re.concurrency[ri]:.0f} of {re.sequences_per_rank[ri]:.0f} sequences per DP rank "
                "fit the KV pool at once; the rest wait"
            )
        if arch.is_pruned:
            k, e = arch.moe.num_experts, arch.original_num_experts
            notes.append(
                f"proxy keeps {k}/{e} experts: FLOPs and all-to-all bytes per token match the original (top-{arch.moe.top_k} kept); "
                "expert weights, grads and optimizer states shrink by about K/E"
            )
            notes.append(
                "not faithful to the original: expert-parallel size is capped by K; decode touches a larger share of each "
                "device's experts per step, so rollout is more weight-bandwidth-bound than the original at equal batch; "
                "routing imbalance of the pruned router differs from the original's"
            )
        r = self.job.release
        if r is not None:
            if self.job.skip_old_logprob:
                notes.append(f"{r.label} skips the old log-prob pass")
            elif r.old_logprob_skip is None:
                notes.append(f"{r.label} runs the old log-prob pass; this release cannot skip it")
            else:
                notes.append(f"{r.label} runs the old log-prob pass (skipped with {r.old_logprob_skip})")
            if r.logprob_optimizer_offload:
                notes.append(f"{r.label} also moves the optimizer state to the host and back around the log-prob pass each step "
                             "(its prep timers took 10-13 s a step on Qwen3-235B/30B until NeMo RL PR #1404 removed the move in 0.5); not in this step time")  # fmt: skip
        if arch.linear is not None:
            kind = {"gdn": "gated DeltaNet", "mamba2": "Mamba-2"}[arch.linear.kind]
            notes.append(
                f"hybrid: {arch.num_linear_layers} {kind} layers of {arch.num_layers} hold no KV cache but a fixed state per "
                "sequence; their scan FLOPs and saved activations are analytic, and no published run of a hybrid model is in "
                "the efficiency fit, so its step time is an extrapolation"
            )
        if self.accel.devices_per_card > 1:
            notes.append(
                f"{self.accel.id}: counts are in {self.accel.device_unit}s as torch_npu sees them; "
                f"{self.accel.devices_per_card} per physical card"
            )
        return notes

    def _infeasible(self, devices: int, reasons: list[str], n: int, train=None, rollout=None) -> CostResult:
        return infeasible(self.arch, self.accel, self.job, devices, reasons, layouts_evaluated=n, train=train, rollout=rollout)


def _point(arch: Architecture, accel: Accelerator, devices: int) -> dict:
    """What names a costed point, feasible or not: the model at its K, the accelerator, the count."""
    return {"model": arch.name, "experts": arch.moe.num_experts, "original_experts": arch.original_num_experts, "accelerator": accel.id,
            "device_unit": accel.device_unit, "devices_per_card": accel.devices_per_card, "num_devices": devices}


def infeasible(arch: Architecture, accel: Accelerator, job: Job, devices: int, reasons: list[str], *, layouts_evaluated: int = 0,
               train=None, rollout=None) -> CostResult:  # fmt: skip
    """The result of a point that cannot run, with the reasons (the layouts tried, if any)."""
    return CostResult(
        **_point(arch, accel, devices),
        feasible=False,
        reasons=reasons,
        train_layout=train,
        rollout_layout=rollout,
        phase_times_s={},
        memory_per_device_bytes={},
        peak_phase=None,
        usable_bytes_per_device=accel.usable_bytes,
        host_memory_bytes_per_node=float("nan"),
        host_memory_limit_bytes_per_node=accel.host_memory_bytes_per_node * HOST_USABLE_FRACTION,
        layouts_evaluated=layouts_evaluated,
        job=job,
    )


def evaluate(arch: Architecture, accel: Accelerator, job: Job, devices: int, knobs: Knobs | None = None, *,
             memory_margin: float = DEFAULT_MEMORY_MARGIN) -> CostResult:  # fmt: skip
    """Cost at `devices` devices, with the job's layouts or the best feasible ones (training phases
    leave `memory_margin` of usable memory free)."""
    return evaluator(arch, accel, job, knobs, memory_margin=memory_margin)(devices)


def evaluator(arch: Architecture, accel: Accelerator, job: Job, knobs: Knobs | None = None, *,
              memory_margin: float = DEFAULT_MEMORY_MARGIN) -> Callable[[int], CostResult]:  # fmt: skip
    """`evaluate` of one model, accelerator and job as a function of the device count, for callers
    that try many counts: the layouts enumerated and the separate pools' estimates per pool size are
    kept between calls (a search over counts and pool splits meets the same pool sizes again)."""
    ev = _Evaluator(arch, accel, job, knobs, memory_margin)

    def run(devices: int) -> CostResult:
        if devices < 1:
            raise SpecError(f"--cards must be >= 1, got {devices}")
        return ev.run(devices)

    return run


def min_devices(
    arch: Architecture, accel: Accelerator, job: Job, *, max_devices: int = 4096, knobs: Knobs | None = None,
    memory_margin: float = DEFAULT_MEMORY_MARGIN,
) -> CostResult:
    """The smallest feasible device count (and the best layouts there)."""
    ev = _Evaluator(arch, accel, job, knobs, memory_margin)
    counts = candidate_device_counts(accel, max_devices)
    if not counts:
        raise SpecError(f"--max-cards {max_devices} is below the smallest allocation of {accel.id} ({accel.devices_per_card})")
    last: CostResult | None = None
    layout_problem = ""
    for n in counts:
        try:
            result = ev.run(n)
        except LayoutError as exc:  # a fixed layout that does not fit this count
            layout_problem = str(exc)
            continue
        if result.feasible:
            return result
        last = result
    detail = "; ".join(last.reasons) if last is not None else f"the job's layouts fit no device count: {layout_problem}"
    raise InfeasibleError(
        f"{arch.name} (K={arch.moe.num_experts}) does not fit on up to {max_devices} {accel.device_unit}s of {accel.id}: {detail}"
    )
