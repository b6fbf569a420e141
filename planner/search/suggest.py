"""`planner suggest`: the cheapest proxy within a budget whose predicted fidelity clears a threshold.

The space: K (legal values that are powers of two with K/top_k >= 4 by default, and E itself: the
original), the expert selection method (those a stats file holds, never the deliberately bad
calibration plans; without one the method is deferred to build time), the device count (whole
cards below a node, whole nodes above; within the budget, focused on each K's own minimum count,
see `Suggester._focus`), activation recomputation and what colocated mode offloads. Inside every point the parallel layouts
are enumerated exactly by the vectorised cost model (planner.cost), which returns the best one.

Optuna searches the space (two objectives: accelerator-hours per step down, predicted fidelity up;
constraints: memory fits, within budget, fidelity at or above the threshold), seeded, in memory or
on RDB storage shared by several processes: a sampler that visits each point once, in a seeded order,
where the space has at most ENUMERATE_UP_TO points or the trials cover it (the result is then
exhaustive enumeration's), else NSGA-II. Every evaluated point is kept; the
Pareto set (cost vs fidelity) is computed from them. `enumerate_all` evaluates the whole space, the
reference the search is checked against.

Fidelity comes from planner.fidelity's estimator as a block with a status: "calibrated" (P(fault
reproduced) with its interval, the predicted shift of the fault's critical knob with its interval),
"no-skill" (the estimator does not beat K/E alone on held-out originals for this fault: no P, the
measured shift at the nearest calibrated K instead), "uncalibrated" (the model or plan lies outside
the calibration data) or "not-applicable" (the fault cannot occur at this K). Only a calibrated P is
held to --min-fidelity; plans without one are ranked by cost among those that pass the hard rules:
the fault can occur at K, the plan is not a deliberately bad one, and (with a stats file) it drops no
more routing mass than a random plan of the same K would (1 - K/E: more means it keeps rarely used
experts). The original (K = E) reproduces its own fault by definition: fidelity 1.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from planner.arch import Architecture
from planner.catalog import load_accelerator, load_model_config
from planner.cost.evaluate import DEFAULT_MEMORY_MARGIN, CostResult, candidate_device_counts, evaluate, evaluator, infeasible, min_devices
from planner.cost.hardware import Accelerator
from planner.errors import PlannerError, SpecError
from planner.search.budget import Budget, budget_kind, parse_budget
from planner.search.reproduction import JobBounds, JobScale, Onset, job_scales, onset, split, with_workload
from planner.specs import Job, Offload
from planner.plan import BAD_METHODS
from planner.stats.store import check_stats_model, plan_key, plan_statistics, stale_note
from planner.units import plural

__all__ = ["FAULTS", "OFFLOADS", "POOLS", "RECOMPUTES", "DEFAULT_STEPS", "Request", "Option", "Suggestion", "Suggester", "suggest", "proposable", "saves",
           "reduction", "fault_conflicts"]  # fmt: skip

# user-facing fault names -> the calibration recipe that provokes them
FAULTS = {
    "grad-overflow": "fp16-overflow",
    "fp16-overflow": "fp16-overflow",
    "mismatch": "rollout-mismatch",
    "rollout-mismatch": "rollout-mismatch",
    "training-inference-mismatch": "rollout-mismatch",
    "entropy-collapse": "entropy-collapse",
    "router-collapse": "router-collapse",
    "grad-norm-divergence": "grad-blowup",
    "grad-blowup": "grad-blowup",
}
OFFLOADS = {"none": Offload(params=False, grads=False, optimizer=False), "optimizer": Offload(params=False, grads=False, optimizer=True),
            "all": Offload(params=True, grads=True, optimizer=True)}  # fmt: skip
# the placement the offload dimension also takes: rollout and training on separate pools (colocated:
# false), at the job's own staleness (0, on-policy, for a colocated job: the same dynamics)
POOLS = "pools"
ENUMERATE_UP_TO = 2000  # a space of at most this many points is enumerated (each point once), whatever --trials says
# Search heuristics (planner's own choices, checked against enumeration by benchmarks/suggest_search.py):
NEAR_MINIMUM = 3  # device counts kept from each K's minimum up: cost per step grows with devices past it
KEEP_EVERY_COUNT_UP_TO = 24  # a budget with at most this many allocation sizes keeps them all
DENSE_NODES = 8  # above that many nodes only powers of two (and the counts near a minimum) are searched
NSGA_POPULATION = (4, 40, 6)  # NSGA-II population: trials / 6, within [4, 40]
BASELINE_SPAN = 4  # the original's cheapest is looked for from its minimum count up to 4x it
BASELINE_COUNTS = (3, 8)  # there: the first 3 counts, 8 spread over the rest, and every count the search visits
RECOMPUTES = ("none", "selective", "moe", "full")  # every mode the cost model prices (moe: MindSpeed moe_zero_memory, Megatron recompute_modules moe)
DEFAULT_METHOD = "agglomerative"
DEFAULT_STEPS = 20  # steps a reproduction is priced at when the original's fault step is not given


@dataclass(frozen=True, kw_only=True)
class Request:
    model: str = "qwen3-30b-a3b"
    hardware: str = "ascend-910b2"
    job: Job = field(default_factory=Job)
    budget: str = "8npu"
    fault: str = "rollout-mismatch"  # the default job trains in bf16: an fp16 overflow cannot show there
    stats: dict | None = None  # a `planner stats` file of the checkpoint, parsed
    min_fidelity: float = 0.8
    trials: int = 300
    storage: str | None = None
    seed: int = 0
    steps: int | None = None  # steps of the reproduction; None: past the predicted onset (with fault_step), else DEFAULT_STEPS
    fault_step: int | None = None  # the step at which the original showed the fault (its own run, e.g. `planner detect`)
    job_bounds: JobBounds = field(default_factory=JobBounds)  # how far the reproduction's job may shrink
    translate_knob: bool = False  # shrink job dimensions that move the fault too, with the knob translated by the measured move
    settle_bias: bool = False  # the proxies settle their correction bias again (planner build --settle-bias): read on that family
    max_devices: int = 4096  # search bound for hours budgets
    min_k_ratio: float = 4.0  # K/top_k at least this: near-dense routing loses mismatch fragility (docs/proxy-rules.md)
    memory_margin: float = DEFAULT_MEMORY_MARGIN  # keep this share of usable device memory free (as `planner preflight` checks)
    # the original as the user ran it, to measure reductions against (not part of the search: a
    # stored study serves any baseline): its device count and its job (e.g. production scale)
    baseline_cards: int | None = None
    baseline_job: Job | None = None

    def key(self) -> str:
        """Identifies the search space and objectives: the study name on shared storage (with the
        contents of the knobs and estimator files in use, so a refit never reuses stale trials)."""
        stats_id = (self.stats or {}).get("checkpoint", {}).get("fingerprint")
        files = [hashlib.sha256(Path(p).read_bytes()).hexdigest() if Path(p).is_file() else None for p in calibration_files().values()]
        text = json.dumps([self.model, self.hardware, repr(self.job), self.budget, self.fault, stats_id, self.min_fidelity, self.steps,
                           self.max_devices, self.min_k_ratio, self.memory_margin, files, self.fault_step, repr(self.job_bounds),
                           self.translate_knob, self.settle_bias],
                          sort_keys=True)  # fmt: skip
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def calibration_files() -> dict[str, str]:
    """The fitted files the costs and fidelity come from: the packaged fits or a user's own
    (`--knobs`, `--estimator`); every output names them."""
    from planner.cost.knobs import knobs_path
    from planner.fidelity.estimator import default_estimator_path

    return {"knobs": str(knobs_path()), "estimator": str(default_estimator_path())}


@dataclass(frozen=True)
class Option:
    experts: int
    method: str
    recompute: str
    offload: str
    cost: CostResult
    fidelity: dict[str, Any]  # {status, reason, p_reproduced, interval, shift_log2, shift_interval, ...}
    within_budget: bool
    budget_note: str = ""
    scale: JobScale = JobScale()  # the reproduction's job against the production job
    onset: Onset | None = None  # when the fault shows, and the steps the reproduction runs
    placement: str = ""  # a colocated job's plan on separate pools: against the best colocated setting on its devices

    @property
    def fits(self) -> bool:
        return self.cost.feasible

    @property
    def p_reproduced(self) -> float | None:
        """P(fault reproduced) where it is calibrated (1 for the original), else None."""
        return self.fidelity["p_reproduced"]

    @property
    def score(self) -> float:
        """The search's fidelity objective: P where calibrated, 0 where there is none."""
        return self.p_reproduced if self.p_reproduced is not None else 0.0

    def passes_fidelity(self, min_fidelity: float) -> bool:
        return fidelity_passes(self.fidelity, min_fidelity)

    @property
    def hours(self) -> float:
        return self.cost.device_hours_per_step if self.fits else math.inf

    @property
    def steps(self) -> int:
        return self.onset.steps if self.onset else DEFAULT_STEPS

    @property
    def reproduction_hours(self) -> float:
        """Accelerator-hours to the fault: per step x the steps the reproduction runs."""
        return self.hours * self.steps

    @property
    def key(self) -> tuple:
        """The point of the search space this option is."""
        return (self.experts, self.method, self.cost.num_devices, self.recompute, self.offload, self.scale.key)

    def acceptable(self, min_fidelity: float) -> bool:
        return self.fits and self.within_budget and self.passes_fidelity(min_fidelity)

    def rank_key(self) -> tuple:
        # ties go to the larger K, then the least intrusive recompute and offload (their table order)
        return (self.reproduction_hours, self.hours, self.cost.num_devices, -self.score, -self.experts, self.method,
                RECOMPUTES.index(self.recompute), [*OFFLOADS, POOLS].index(self.offload), self.scale)  # fmt: skip

    def dominates(self, other: "Option") -> bool:
        """Same proxy on as many devices, no more hours and no more memory: `other`'s recompute or
        offload setting buys nothing over this one's."""
        return ((self.experts, self.method, self.cost.num_devices, self.scale) == (other.experts, other.method, other.cost.num_devices, other.scale)
                and self.hours <= other.hours and self.cost.peak_memory_bytes <= other.cost.peak_memory_bytes)  # fmt: skip

    def to_json(self, baseline: "Baseline | None", production: Job) -> dict[str, Any]:
        return {
            "experts": self.experts,
            "method": self.method,
            "recompute": self.recompute,
            "offload": self.offload,
            "job": self.scale.to_json(production),
            **figures(self.cost),
            "onset_step": self.onset.to_json() if self.onset else None,
            "steps": self.steps,
            "reproduction_hours": self.reproduction_hours if self.fits else None,
            "reproduction_wall_s": self.cost.step_time_s * self.steps if self.fits else None,
            "fidelity": dict(self.fidelity),
            "reduction": reduction(self, baseline),
            "within_budget": self.within_budget,
            "reasons": self.cost.reasons,
            "notes": self.cost.notes,
            "placement": self.placement or None,
        }


def figures(c: CostResult) -> dict[str, Any]:
    """One costed point in the JSON shape every plan and the original share."""
    return {
        "num_cards": c.num_devices,
        "device_unit": c.device_unit,
        "physical_cards": c.num_cards,
        "layout": {"train": c.train_layout.to_dict() if c.train_layout else None, "rollout": vars(c.rollout_layout) if c.rollout_layout else None},
        "memory_per_card_bytes": c.peak_memory_bytes if c.feasible else None,
        "usable_bytes_per_card": c.usable_bytes_per_device,
        "headroom_bytes": c.usable_bytes_per_device - c.peak_memory_bytes if c.feasible else None,
        "peak_phase": c.peak_phase,
        "step_time_s": c.step_time_s if c.feasible else None,
        "phase_times_s": c.phase_times_s,
        "accelerator_hours_per_step": c.device_hours_per_step if c.feasible else None,
    }


@dataclass(frozen=True)
class Baseline:
    """The original the reductions are measured against. By default under the proxies' own rules
    (the same memory margin): `minimum`, its fewest devices; `cheapest`, its fewest accelerator-hours
    per step over device counts from that minimum up to four times it, every recompute and offload.
    Named by the user (`--baseline-cards`, `--baseline-job`): the original as it ran, both fields
    that run. `layout_factor`: the run's step with its own layout over the planner's best layout for
    the same job on the same devices (1 unless the job file fixes a layout); `job_factors`, per
    reproduction job (JobScale key): the original's step there with the baseline's job over its step
    with that job (1 for the same job; None where that job does not fit there); `steps`: the steps
    the original's reproduction runs."""

    minimum: CostResult
    cheapest: CostResult
    named: str | None = None
    layout_factor: float = 1.0
    job_factors: dict[str, float | None] = field(default_factory=dict)
    steps: int = DEFAULT_STEPS


def reduction(o: Option, baseline: Baseline | None) -> dict[str, Any]:
    """Devices: the baseline's (default: the original's fewest) over this point's; hours per step and
    hours to the fault: the baseline's (default: the original's cheapest) over this point's, split by
    mechanism (planner.search.reproduction.split)."""
    c = o.cost
    if baseline is None or not c.feasible:
        return {"cards": None, "accelerator_hours": None, "reproduction_hours": None, "by_mechanism": None}
    base = baseline.cheapest
    job = baseline.job_factors.get(o.scale.key, 1.0 if o.scale.production else None)
    return {"cards": baseline.minimum.num_devices / c.num_devices,
            **split(c.device_hours_per_step, c.num_devices, o.steps, base.device_hours_per_step, base.num_devices, baseline.steps,
                    layout=baseline.layout_factor, job=job, step_s=c.step_time_s)}  # fmt: skip


@dataclass
class Suggestion:
    request: Request
    accelerator: Accelerator
    budget: Budget
    recipe: str
    baseline: Baseline | None  # the original under the proxies' rules (None: does not fit the search bound)
    options: list[Option]  # every evaluated point
    ranked: list[Option]  # acceptable points, cheapest first
    pareto: list[Option]  # fitting, within budget: nondominated in (hours, fidelity)
    trials: int  # completed trials in the study (a brute-force search stops when it has covered the space)
    device_counts: list[int]  # the device counts searched
    best_trial: int | None  # the trial at which the chosen option was first evaluated
    diagnosis: list[str]
    fidelity_source: str  # "stats" or "prior"
    factors: list[str]  # fault-relevant factors a proxy keeps
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)  # the request cannot show the fault as asked
    space_points: int = 0  # the points of the search space
    enumerated: bool = False  # every point was visited (else NSGA-II sampled the space)
    job_support: dict[str, dict[str, Any]] = field(default_factory=dict)  # per job dimension: may it shrink, and why (not)
    job_joint: list[dict[str, Any]] = field(default_factory=list)  # jobs measured shrunk in several dimensions at once
    job_holdout: dict[str, Any] | None = None  # the job rows' held-out validation on the family (planner.fidelity.job_validate)
    job_scales: list[JobScale] = field(default_factory=list)  # the reproduction jobs searched

    @property
    def best(self) -> Option | None:
        return self.ranked[0] if self.ranked else None


def fidelity_passes(block: dict[str, Any], min_fidelity: float) -> bool:
    """A calibrated P (or the original's 1) clears the threshold; without one, the plan passes the
    hard rules: the fault can occur at its K and the plan was not rejected."""
    if block["status"] == "not-applicable" or block.get("rejected"):
        return False
    return block["p_reproduced"] >= min_fidelity if block["p_reproduced"] is not None else True


def fault_conflicts(recipe: str, precision: str) -> list[str]:
    """Why a job in `precision` cannot show the recipe's fault (empty when it can)."""
    if recipe == "fp16-overflow" and precision != "fp16":
        return [f"the fault is an fp16 loss-scale overflow but the job trains in {precision}: it cannot overflow that way; "
                "set precision: fp16 in the job, or name the fault the run actually shows"]  # fmt: skip
    return []


def _check_settle(request: Request, arch: Architecture, name: str) -> None:
    """--settle-bias needs a router with a correction bias and, with a stats file, one that settled it."""
    if arch.moe.correction_bias == "none":
        raise SpecError(f"--settle-bias: {name}'s router has no correction bias to settle (DeepSeek-V3's, GLM-4.5's and ERNIE-4.5's "
                        "have one); leave the option out")  # fmt: skip
    if request.stats and any("settled_bias" not in plan for plan in request.stats.get("plans", {}).values()):
        raise SpecError("--settle-bias: the stats file holds no settled correction bias; make it with `planner stats --settle-bias`")


class Suggester:
    """Evaluates points of the space (cost cached per K/devices/recompute/offload, fidelity per K/method)."""

    def __init__(self, request: Request, estimator=None):
        from planner.fidelity.estimator import FidelityEstimator, default_estimator_path

        self.request = request
        if request.fault not in FAULTS:
            raise SpecError(f"--fault {request.fault!r}: one of {', '.join(sorted(FAULTS))}")
        if not 0.0 <= request.memory_margin < 1.0:
            raise SpecError(f"--memory-margin must lie in [0, 1), got {request.memory_margin}")
        if not 0.0 <= request.min_fidelity <= 1.0:
            raise SpecError(f"--min-fidelity must lie in [0, 1] (a probability of reproducing the fault), got {request.min_fidelity}")
        if request.trials < 1:
            raise SpecError(f"--trials must be at least 1, got {request.trials}")
        if request.steps is not None and request.steps < 1:
            raise SpecError(f"--steps must be at least 1 (the reproduction's length), got {request.steps}")
        if request.fault_step is not None and request.fault_step < 0:
            raise SpecError(f"--fault-step must be a step number (0 or more), got {request.fault_step}")
        self.recipe = FAULTS[request.fault]
        self.accel = load_accelerator(request.hardware)
        self.budget = parse_budget(request.budget, self.accel)
        self.name, self.config = load_model_config(request.model)
        self.arch = Architecture.from_config(self.config, name=self.name)
        self.estimator = estimator or FidelityEstimator.load(default_estimator_path())
        if request.settle_bias:
            _check_settle(request, self.arch, self.name)
        e = self.arch.original_num_experts
        floor = request.min_k_ratio * self.arch.moe.top_k
        self.experts = sorted({k for k in self.arch.legal_expert_counts() if k & (k - 1) == 0 and k >= floor} | {e})
        self.methods = self._methods()
        # the job dimensions the fidelity data let the reproduction shrink, and the jobs that gives
        row = self.features(self.experts[0], self.methods[0])
        self.job_support = self.estimator.job_support(row, self.recipe, translate=request.translate_knob)
        self.job_joint = self.estimator.job_joint(row, self.recipe)
        self.job_holdout = self.estimator.job_holdout(row, self.recipe)
        self.scales = job_scales(request.job, request.job_bounds, self.job_support, self.job_joint)
        self._onsets: dict[tuple[int, str], Onset] = {}
        self._costs: dict[tuple, CostResult] = {}
        self._evaluators: dict[tuple, Any] = {}  # (experts, recompute, offload, scale) -> evaluate at a device count
        self._fidelity: dict[tuple, dict] = {}
        self._minimum: dict[int, CostResult | None] = {}
        limit = self.budget.max_devices if self.budget.max_devices is not None else request.max_devices
        counts = candidate_device_counts(self.accel, limit)
        if not counts:
            raise SpecError(f"--budget {request.budget}: below the smallest allocation of {self.accel.id} ({self.accel.devices_per_card} {self.accel.device_unit}s)")
        self.devices = self._focus(counts)

    @cached_property
    def offloads(self) -> list[str]:
        """The offload settings searched, and separate pools: a job already on separate pools keeps
        them (its offload does not apply), a colocated one may move to them on-policy."""
        return [POOLS] if not self.request.job.colocated else [*OFFLOADS, POOLS]

    def minimum(self, experts: int) -> CostResult | None:
        """K's own smallest device count (most memory-frugal settings, the request's memory margin),
        up to the search bound; None when it fits nowhere there."""
        if experts not in self._minimum:
            arch = self.arch.with_experts(experts)  # K = E: the original itself
            job = replace(self.request.job, recompute="full", offload=OFFLOADS["all"])
            try:
                self._minimum[experts] = min_devices(arch, self.accel, job, max_devices=self.request.max_devices,
                                                     memory_margin=self.request.memory_margin)  # fmt: skip
            except PlannerError:  # InfeasibleError among them
                self._minimum[experts] = None
        return self._minimum[experts]

    def _focus(self, counts: list[int]) -> list[int]:
        """The device counts searched. Cost per step grows with devices beyond a K's minimum count,
        so the cheapest points lie at or just above the minimum counts: those (and the two counts
        after each) are always in; of the rest, counts below a node, up to 8 nodes, and nodes in
        powers of two. A small budget keeps every allocation size."""
        per_node = self.accel.devices_per_node
        near = set()
        for k in self.experts:
            m = self.minimum(k)
            if m is not None and m.num_devices in counts:
                i = counts.index(m.num_devices)
                near.update(counts[i : i + NEAR_MINIMUM])
        if len(counts) <= KEEP_EVERY_COUNT_UP_TO:
            return counts
        return [n for n in counts if n in near or n < per_node or n // per_node <= DENSE_NODES or (n // per_node) & (n // per_node - 1) == 0]

    def _methods(self) -> list[str]:
        stats = self.request.stats
        if not stats:
            return [DEFAULT_METHOD]
        check_stats_model(stats, self.arch, self.name)
        # deliberately bad plans (calibration baselines) are never proposed
        methods = sorted({key.split("/")[1] for key in stats.get("plans", {})} - set(BAD_METHODS))
        return methods or [DEFAULT_METHOD]

    @cached_property
    def warnings(self) -> list[str]:
        """Faults the job as given cannot show (a proxy then reproduces nothing, however faithful),
        and plan measures of a stats file the estimator was not fitted on."""
        stale = stale_note(self.request.stats) if self.request.stats else None
        return fault_conflicts(self.recipe, self.request.job.precision) + ([stale] if stale else [])

    @cached_property
    def factors(self) -> list[str]:
        moe, job = self.arch.moe, self.request.job
        routing = f"top-{moe.top_k} {moe.scoring}" + (f", {moe.n_group} groups (top {moe.topk_group})" if moe.grouped else "")
        return [
            f"routing: {routing}" + (", renormalised" if moe.norm_topk_prob else ""),
            f"precision {job.precision}, router weights in {'fp32' if moe.router_fp32 else job.precision}",
            f"sequence lengths: prompt <= {job.prompt_tokens.max}, response <= {job.response_tokens.max} (mean {job.response_tokens.mean:g})",
            f"{job.algorithm.upper()} {job.prompts_per_step} x {job.samples_per_prompt}, {job.ppo_epochs} epoch(s) x {job.mini_batches} mini-batch(es)",
            "backbone, attention, shared experts, embeddings: unchanged",
        ]

    def cost(self, experts: int, devices: int, recompute: str, offload: str, scale: str = JobScale().key) -> CostResult:
        key = (experts, devices, recompute, offload, scale)
        if key not in self._costs:
            arch = self.arch.with_experts(experts)  # K = E: the original itself
            job = replace(JobScale.from_key(scale).apply(self.request.job), recompute=recompute)
            job = replace(job, colocated=False, offload=OFFLOADS["none"]) if offload == POOLS else replace(job, offload=OFFLOADS[offload])
            try:
                run = self._evaluators.get(key[:1] + key[2:])
                if run is None:  # one per proxy and job: it keeps what the device counts share
                    run = self._evaluators[key[:1] + key[2:]] = evaluator(arch, self.accel, job, memory_margin=self.request.memory_margin)
                self._costs[key] = run(devices)
            except PlannerError as exc:  # a job that cannot run, or a job-fixed layout that cannot run on this count
                self._costs[key] = infeasible(arch, self.accel, job, devices, [str(exc)])
        return self._costs[key]

    def fidelity(self, experts: int, method: str, scale: str = JobScale().key) -> dict[str, Any]:
        """The fidelity block of a plan at a reproduction job (a smaller job adds its measured extra shift)."""
        key = (experts, method, scale)
        if key not in self._fidelity:
            e = self.arch.original_num_experts
            if experts == e:
                self._fidelity[key] = {"status": "original", "reason": "the original reproduces its own fault", "recipe": self.recipe,
                                       "p_reproduced": 1.0, "interval": [1.0, 1.0], "shift_log2": 0.0, "shift_interval": [0.0, 0.0]}  # fmt: skip
                if scale != JobScale().key:  # the original at a smaller job is neither the baseline nor a proxy
                    self._fidelity[key] = {**self._fidelity[key], "rejected": "the original at a smaller job: its own fidelity there is not predicted"}
            else:
                row = {**self.features(experts, method), **JobScale.from_key(scale).columns()}
                block = self.estimator.predict(row, self.recipe, translate=self.request.translate_knob)
                dropped = row.get("frequency_dropped_mean")
                if dropped is not None and math.isfinite(dropped) and dropped > 1 - experts / e + 1e-9:
                    block = {**block, "rejected": f"drops {dropped:.2f} of the routing mass, more than a random plan of K={experts} "
                                                  f"would ({1 - experts / e:.2f}): it keeps rarely used experts"}  # fmt: skip
                self._fidelity[key] = block
        return self._fidelity[key]

    def onset(self, experts: int, scale: str = JobScale().key) -> Onset:
        """When the fault shows on the proxy with K experts at a reproduction job, and the steps its
        reproduction runs: from the original's fault step (--fault-step) and the onset ratio the
        calibration measured (at a smaller job, times the factor its job grid measured)."""
        key = (experts, scale)
        if key not in self._onsets:
            req, original = self.request, experts == self.arch.original_num_experts
            row = {**self.features(experts, self.methods[0]), **JobScale.from_key(scale).columns()}
            ratio = None if original else self.estimator.onset(row, self.recipe)
            found = onset(req.fault_step, ratio, req.steps or DEFAULT_STEPS, original=original)
            if req.steps is not None and req.fault_step is not None:  # the user's run length stands
                short = (f", which ends before the predicted onset's upper end (step {found.interval[1]:.0f})"
                         if found.interval and req.steps < math.ceil(found.interval[1]) else "")  # fmt: skip
                found = replace(found, steps=req.steps, original_steps=req.steps, basis=found.basis + f"; run for --steps {req.steps} as given{short}")
            self._onsets[key] = found
        return self._onsets[key]

    def features(self, experts: int, method: str) -> dict[str, float]:
        from planner.fidelity.dataset import plan_row

        return plan_row(self.config, experts, plan_statistics(self.request.stats or {}, plan_key(experts, method)),
                        "settled" if self.request.settle_bias else "sliced")  # fmt: skip

    def option(self, experts: int, method: str, devices: int, recompute: str, offload: str, scale: str = JobScale().key) -> Option:
        cost = self.cost(experts, devices, recompute, offload, scale)
        when = self.onset(experts, scale)
        within, note = True, ""
        if self.budget.max_devices is not None and devices > self.budget.max_devices:
            within, note = False, f"{devices} > {self.budget.max_devices} {self.accel.device_unit}s"
        if self.budget.device_hours is not None and cost.feasible:
            total = cost.device_hours_per_step * when.steps
            if total > self.budget.device_hours:
                within, note = False, f"{total:,.1f} > {self.budget.device_hours:g} {self.accel.device_unit}-hours for {when.steps} steps"
        placement = self.placement(experts, devices, recompute, scale) if offload == POOLS and self.request.job.colocated and cost.feasible else ""
        return Option(experts, method, recompute, offload, cost, self.fidelity(experts, method, scale), within, note, JobScale.from_key(scale), when,
                      placement)  # fmt: skip

    def placement(self, experts: int, devices: int, recompute: str, scale: str) -> str:
        """A colocated job's point on separate on-policy pools against the best colocated setting
        (every offload) of the same proxy, recompute and job on the same devices."""
        pools, unit = self.cost(experts, devices, recompute, POOLS, scale), self.accel.device_unit
        p = pools.pools
        head = (f"separate pools, on-policy ({p['rollout_devices']} rollout + {p['train_devices']} training {unit}s taking turns, "
                f"weights sent across in {p['weight_sync_s']:,.1f} s)")  # fmt: skip
        fitting = [(c.step_time_s, name) for name in OFFLOADS if (c := self.cost(experts, devices, recompute, name, scale)).feasible]
        if not fitting:
            return f"{head}: colocated does not fit on these {devices} {unit}s at any offload setting"
        step, name = min(fitting)
        faster = pools.step_time_s < step
        return (f"{head}: {pools.step_time_s:,.0f} s a step against {step:,.0f} s colocated (offload {name}, the best colocated setting on "
                f"the same {devices} {unit}s): {'faster' if faster else 'slower'} by {max(step, pools.step_time_s) / min(step, pools.step_time_s):.2f}x"
                + (", since no engine sleeps or wakes and nothing moves to the host" if faster else ""))  # fmt: skip

    def space(self) -> dict[str, list]:
        """The search's dimensions and their values."""
        return {"experts": self.experts, "method": self.methods, "devices": self.devices, "recompute": list(RECOMPUTES), "offload": self.offloads,
                "job": [s.key for s in self.scales]}  # fmt: skip

    def space_size(self) -> int:
        return math.prod(len(v) for v in self.space().values())

    def enumerates(self) -> bool:
        """Does the search visit every point of the space (else NSGA-II samples it)?"""
        return self.space_size() <= max(self.request.trials, ENUMERATE_UP_TO)

    def enumerate_all(self) -> list[Option]:
        import itertools

        return [self.option(*point) for point in itertools.product(*self.space().values())]

    # ---- the Optuna search -------------------------------------------------------------------
    def search(self, progress: Callable[[int, int], None] | None = None) -> tuple[list[Option], dict[tuple, int], int]:
        """Run the study; every option evaluated (here or by other workers of the study), the trial
        number that first reached each, and the study's completed trials."""
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        req = self.request
        min_fid = req.min_fidelity
        space = self.space()
        names = tuple(space)
        # a space small enough (or trials enough) to visit every point once, in a seeded order: the result is
        # enumeration's; NSGA-II only for a space too large to enumerate
        brute = self.enumerates()
        if brute:
            from planner.search.space import SpaceSampler

            sampler = SpaceSampler(space, seed=req.seed)
        else:
            lo, hi, per = NSGA_POPULATION
            sampler = optuna.samplers.NSGAIISampler(seed=req.seed, population_size=min(hi, max(lo, req.trials // per)))
        storage = None
        if req.storage:
            from planner.rdb import rdb_storage

            storage = rdb_storage(req.storage)
        study = optuna.create_study(study_name=f"suggest-{req.key()}", storage=storage, sampler=sampler,
                                    directions=["minimize", "maximize"], load_if_exists=True)  # fmt: skip
        seen: dict[tuple, int] = {}
        done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        for t in done:  # earlier workers' points
            seen.setdefault(tuple(t.params[n] for n in names), t.number)
        if brute:
            to_run, target = len(sampler.missing(study)), self.space_size()
        else:
            if not study.trials:
                # warm start: every K at its own minimum count (the cheapest region), every recompute and offload setting
                for k in self.experts:
                    m = self.minimum(k)
                    devices = m.num_devices if m is not None and m.num_devices in self.devices else self.devices[-1]
                    for recompute in RECOMPUTES:
                        for offload in self.offloads:
                            study.enqueue_trial({"experts": k, "method": self.methods[0], "devices": devices, "recompute": recompute, "offload": offload,
                                                 "job": self.scales[-1].key})  # fmt: skip
            to_run, target = req.trials - len(done), req.trials
        counted = {"trials": target - to_run}

        def objective(trial: optuna.Trial):
            params = tuple(trial.suggest_categorical(name, choices) for name, choices in space.items())
            opt = self.option(*params)
            seen.setdefault(params, trial.number)
            memory = 0.0 if opt.fits else 1.0
            budget = 0.0 if opt.within_budget else 1.0
            trial.set_constraint("memory", memory)
            trial.set_constraint("budget", budget)
            trial.set_constraint("fidelity", 0.0 if opt.passes_fidelity(min_fid) else 1.0)
            counted["trials"] += 1
            if progress:
                progress(min(counted["trials"], target), target)
            hours = opt.reproduction_hours if opt.fits else 1e12
            return hours, opt.score

        if to_run > 0:
            from planner.interrupts import deferred

            # Ctrl-C or SIGTERM stops the study between trials, never inside one: a stored study keeps
            # only whole trials, and the same command resumes it
            note = (f"the study in {req.storage} keeps every finished trial; run the same command again to resume" if req.storage
                    else "nothing was kept; run the command again")  # fmt: skip
            with deferred(note) as pending:
                stop = lambda st, tr: st.stop() if pending or getattr(sampler, "exhausted", False) else None  # noqa: E731
                study.optimize(objective, n_trials=to_run, callbacks=[stop])
        if progress:
            progress(target, target)  # the space is covered (or the trials are spent), here or by other workers
        completed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        for t in completed:
            key = tuple(t.params[n] for n in names)
            seen.setdefault(key, t.number)
        return [self.option(*key) for key in seen], seen, len(completed)

    def baseline(self) -> Baseline | None:
        req = self.request
        if req.baseline_cards is not None or req.baseline_job is not None:
            return self.named_baseline()
        e = self.arch.original_num_experts
        minimum = self.minimum(e)
        if minimum is None:
            return None
        all_counts = candidate_device_counts(self.accel, min(self.request.max_devices, BASELINE_SPAN * minimum.num_devices))
        counts = [n for n in all_counts if n >= minimum.num_devices]
        first, spread = BASELINE_COUNTS
        counts = set(counts[:first]) | {counts[round(i * (len(counts) - 1) / (spread - 1))] for i in range(spread)}
        # and every count the search visits: no original the search evaluates is cheaper than the baseline
        counts |= {n for n in self.devices if n >= minimum.num_devices}
        fitting = [c for n in sorted(counts) for r in RECOMPUTES for o in self.offloads if (c := self.cost(e, n, r, o)).feasible]
        cheapest = min(fitting + [minimum], key=lambda c: c.device_hours_per_step)
        return Baseline(minimum, cheapest, job_factors=self._job_factors(cheapest), steps=self.onset(e).original_steps)

    def named_baseline(self) -> Baseline:
        """The original as the user ran it: --baseline-cards (default: its fewest devices) with
        --baseline-job (default: the proxies' job), costed with its own layout where the job file
        fixes one, else the planner's best there."""
        req = self.request
        arch = self.arch.with_experts(self.arch.original_num_experts)
        job = req.baseline_job or req.job
        if req.baseline_cards is None:
            ran = min_devices(arch, self.accel, job, max_devices=req.max_devices, memory_margin=req.memory_margin)
        else:
            ran = evaluate(arch, self.accel, job, req.baseline_cards, memory_margin=req.memory_margin)
            if not ran.feasible:
                raise SpecError(f"--baseline-cards {req.baseline_cards}: the original does not fit there with "
                                f"{'the baseline job' if req.baseline_job else 'the job'}: " + "; ".join(ran.reasons))  # fmt: skip
        planned, layout = ran, 1.0
        if job.train_layout is not None or job.rollout_layout is not None:  # its own layout against the planner's, same job and devices
            free = evaluate(arch, self.accel, with_workload(job, job), ran.num_devices, memory_margin=req.memory_margin)
            if free.feasible:
                planned, layout = free, ran.step_time_s / free.step_time_s
        unit = self.accel.device_unit
        named = (f"the original as you ran it: {ran.num_devices} {unit}s, "
                 + (f"its own job ({job.prompts_per_step} x {job.samples_per_prompt} per step)" if req.baseline_job else "the same job"))
        return Baseline(ran, ran, named, layout, self._job_factors(planned), self.onset(self.arch.original_num_experts).original_steps)

    def _job_factors(self, planned: CostResult) -> dict[str, float | None]:
        """Per reproduction job: the original's step on `planned`'s devices with `planned`'s job over its
        step there with that job's workload (planned's settings, the planner's layout); 1 where the
        workloads are the same, None where that job does not fit there."""
        arch = self.arch.with_experts(self.arch.original_num_experts)
        reference, step = with_workload(planned.job, planned.job), planned.step_time_s
        if reference != planned.job:  # planned ran a fixed layout: compare workloads at the planner's layout
            free = evaluate(arch, self.accel, reference, planned.num_devices, memory_margin=self.request.memory_margin)
            step = free.step_time_s if free.feasible else step
        out: dict[str, float | None] = {}
        for scale in self.scales:
            job = with_workload(planned.job, scale.apply(self.request.job))
            if job == reference:
                out[scale.key] = 1.0
                continue
            same = evaluate(arch, self.accel, job, planned.num_devices, memory_margin=self.request.memory_margin)
            out[scale.key] = step / same.step_time_s if same.feasible else None
        return out


def _pareto(options: list[Option]) -> list[Option]:
    # the original (P = 1) ends the front; a proxy that fails a hard rule (the fault cannot occur at its K, a
    # rejected plan) is on no front
    pool = sorted({(o.reproduction_hours, -o.score): o for o in options if o.fits and o.within_budget and fidelity_passes(o.fidelity, 0.0)}.items())
    front, best_p = [], -math.inf
    for (hours, neg_p), o in pool:
        if -neg_p > best_p:
            front.append(o)
            best_p = -neg_p
    return front


def _diagnose(s: Suggester, options: list[Option], baseline: Baseline | None) -> list[str]:
    """Why no proxy qualifies: which rule removed each candidate K (and method), and the smallest
    budget that would do."""
    req, unit = s.request, s.accel.device_unit
    e, top_k = s.arch.original_num_experts, s.arch.moe.top_k
    out = []
    if s.experts == [e]:
        below = [k for k in s.arch.legal_expert_counts() if k < e and k & (k - 1) == 0]
        out.append(f"no proxy in the search space: --min-k-ratio {req.min_k_ratio:g} x top_k {top_k} keeps K >= {req.min_k_ratio * top_k:g}, "
                   f"and of the legal K (powers of two) only E={e} itself is that large"
                   + (f"; lower --min-k-ratio to search K in {below}" if below else ""))  # fmt: skip
    fitting = [o for o in options if o.fits]
    if not fitting:
        frugal = [o for o in options if o.recompute == "full" and o.offload == "all"] or options
        closest = max(frugal, key=lambda o: (o.cost.num_devices, -o.experts)) if frugal else None  # most devices, fewest experts
        why = closest.cost.reasons[0] if closest and closest.cost.reasons else "?"
        out.append(f"no evaluated point fits in memory on up to {plural(s.devices[-1], unit)}; the closest (K={closest.experts if closest else '?'}, "
                   f"{plural(closest.cost.num_devices, unit) if closest else '?'}, full recompute, offload all): {why}")  # fmt: skip
    for (k, method), points in sorted(_by_candidate(options, e).items()):
        out.append(f"{plan_key(k, method)}: {_why_not(points, req.min_fidelity, baseline, s.budget.describe(s.accel), unit)}")
    smallest = _smallest_budget(s, fitting)
    if smallest:
        out.append(smallest)
    return out


def _by_candidate(options: list[Option], original_experts: int) -> dict[tuple[int, str], list[Option]]:
    out: dict[tuple[int, str], list[Option]] = {}
    for o in options:
        if o.experts != original_experts:
            out.setdefault((o.experts, o.method), []).append(o)
    return out


def _why_not(points: list[Option], min_fidelity: float, baseline: Baseline | None, budget: str, unit: str) -> str:
    """The first rule that removes every evaluated point of one candidate (K, method), in the order
    they apply: fidelity's hard rules, the threshold, memory, the budget, a saving over the original."""
    f = next((o.fidelity for o in points if o.scale.production), points[0].fidelity)  # the block at the production job
    if f["status"] == "not-applicable":
        return f"the fault cannot occur at this K: {f['reason']}"
    if f.get("rejected"):
        return f"rejected: {f['rejected']}"
    if f["p_reproduced"] is not None and f["p_reproduced"] < min_fidelity:
        return f"predicted P {f['p_reproduced']:.2f} [{f['interval'][0]:.2f}, {f['interval'][1]:.2f}] is below --min-fidelity {min_fidelity}"
    fitting = [o for o in points if o.fits]
    if not fitting:
        o = max(points, key=lambda o: o.cost.num_devices)
        return f"fits in memory on none of the evaluated counts (on {o.cost.num_devices} {unit}s: {(o.cost.reasons or ['?'])[0]})"
    within = [o for o in fitting if o.within_budget]
    if not within:
        o = min(fitting, key=lambda o: o.hours)
        return f"over the budget {budget}: the cheapest fitting point needs {o.budget_note}"
    o = min(within, key=lambda o: (o.hours, o.cost.num_devices))
    b = baseline
    assert b is not None, "without a baseline every fitting proxy saves, so one within the budget is proposed"
    return (f"costs more than the original in every measure: at best {o.cost.num_devices} {unit}s, {o.hours:,.2f} {unit}-hours/step and "
            f"{o.reproduction_hours:,.1f} to the fault against the original's {b.minimum.num_devices} {unit}s minimum, "
            f"{b.cheapest.device_hours_per_step:,.2f} {unit}-hours/step cheapest and {b.cheapest.device_hours_per_step * b.steps:,.1f} to the fault")  # fmt: skip


def _smallest_budget(s: Suggester, fitting: list[Option]) -> str:
    """The smallest budget, in the budget's own grammar, under which some K whose predicted fidelity
    clears the threshold fits: its minimum device count, or for an hours budget the fewest
    accelerator-hours of the points evaluated or of each K's minimum count."""
    req, unit = s.request, s.accel.device_unit
    kind = budget_kind(s.accel)
    e = s.arch.original_num_experts  # the original is no proxy: it names no budget
    good = [k for k in s.experts if k != e and any(fidelity_passes(s.fidelity(k, m), req.min_fidelity) for m in s.methods)]
    minima = [(m, k) for k in good if (m := s.minimum(k)) is not None]
    if s.budget.device_hours is not None:
        points = [(o.reproduction_hours, o.hours, o.steps, o.experts, o.cost.num_devices) for o in fitting
                  if o.experts != e and o.passes_fidelity(req.min_fidelity)]  # fmt: skip
        points += [(m.device_hours_per_step * s.onset(k).steps, m.device_hours_per_step, s.onset(k).steps, k, m.num_devices) for m, k in minima]
        if not points:
            return ""
        total, hours, steps, k, n = min(points)
        return f"smallest budget that would do: {math.ceil(total * 10) / 10:g}{kind}-h (K={k} on {n} {unit}s, {hours:,.2f} {unit}-hours/step x {steps} steps)"
    if not minima:
        return ""
    m, k = min(minima, key=lambda t: (t[0].num_devices, -t[1]))
    return f"smallest budget that would do: {m.num_devices}{kind} (K={k} fits there, {m.device_hours_per_step:,.2f} {unit}-hours/step)"


def saves(o: Option, baseline: Baseline | None) -> bool:
    """Does the point cost less than the original in some measure (fewer devices than its minimum,
    fewer accelerator-hours per step than its cheapest, or fewer to the fault)? A plan dearer in
    every measure is no proxy to propose. Without a baseline (the original fits nowhere in the
    search bound) every fitting proxy saves."""
    if baseline is None:
        return True
    base = baseline.cheapest.device_hours_per_step
    return o.cost.num_devices < baseline.minimum.num_devices or o.hours < base or o.reproduction_hours < base * baseline.steps


def proposable(o: Option, baseline: Baseline | None, min_fidelity: float) -> bool:
    """A proxy (not the original itself) that fits, is within the budget, passes the fidelity rules
    and saves over the original in some measure."""
    return o.experts != o.cost.original_experts and o.acceptable(min_fidelity) and saves(o, baseline)


def suggest(request: Request, *, progress: Callable[[int, int], None] | None = None, estimator=None,
            suggester: Suggester | None = None) -> Suggestion:  # fmt: skip
    import time

    start = time.perf_counter()
    s = suggester or Suggester(request, estimator)
    options, first_seen, trials = s.search(progress)
    baseline = s.baseline()  # one baseline, computed once, for every line of the output
    ranked: list[Option] = []
    for o in sorted((o for o in options if proposable(o, baseline, request.min_fidelity)), key=Option.rank_key):
        if not any(r.dominates(o) for r in ranked):  # a setting that buys neither time nor memory is not listed
            ranked.append(o)
    best = ranked[0] if ranked else None
    best_trial = first_seen[best.key] if best else None
    return Suggestion(
        request=request, accelerator=s.accel, budget=s.budget, recipe=s.recipe, baseline=baseline, options=options, ranked=ranked,
        pareto=_pareto(options), trials=trials, space_points=s.space_size(), enumerated=s.enumerates(), device_counts=s.devices, best_trial=best_trial,
        diagnosis=[] if ranked else _diagnose(s, options, baseline), fidelity_source="stats" if request.stats else "prior", factors=s.factors,
        seconds=time.perf_counter() - start, warnings=s.warnings, job_support=s.job_support, job_joint=s.job_joint, job_scales=s.scales,
        job_holdout=s.job_holdout,
    )  # fmt: skip
