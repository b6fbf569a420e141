"""Frozen, validated specs that users write: the RL job and its parallel layouts (YAML in/out).

Unknown keys are errors that name the key and the allowed ones; values are checked with the
numbers in the message. Construction validates; a spec that exists is a valid one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping


from planner.errors import SpecError
from planner.trainer_versions import TRAINERS, Release, release

__all__ = ["Job", "TrainLayout", "RolloutLayout", "Offload", "Lengths", "load_job", "check_keys", "RECOMPUTE_MODES"]

# Activation recomputation in the update: none; selective (Megatron --recompute-modules moe_act
# layernorm); moe (also the whole MoE layer, rebuilt from its input in backward: Megatron's `moe`
# module; MindSpeed's --moe-zero-memory is the NPU form); full (every layer, from its input)
RECOMPUTE_MODES = ("none", "selective", "moe", "full")
WEIGHT_SYNC = ("gather", "packed", "shard")
DISPATCH_PASSES = ("reference", "old_logprob", "update")  # passes a job's dispatch_s may delay


def check_keys(data: Mapping[str, Any], allowed: list[str], where: str, required: tuple[str, ...] = ()) -> None:
    if not isinstance(data, Mapping):
        raise SpecError(f"{where}: expected a mapping, got {type(data).__name__} ({data!r})")
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}")
    missing = [k for k in required if k not in data]
    if missing:
        raise SpecError(f"{where}: missing required key(s) {', '.join(map(repr, missing))}")


def _int(value: Any, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or int(value) != value:
        raise SpecError(f"{where}: expected an integer, got {value!r}")
    if value < minimum:
        raise SpecError(f"{where}: must be >= {minimum}, got {value}")
    return int(value)


def _num(value: Any, where: str, minimum: float = 0.0, maximum: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise SpecError(f"{where}: must be a finite number, got {value}")
    if not minimum <= value <= maximum:
        raise SpecError(f"{where}: must lie in [{minimum}, {maximum}], got {value}")
    return float(value)


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{where}: expected true or false, got {value!r}")
    return value


def _choice(value: Any, choices: tuple[str, ...], where: str) -> str:
    if value not in choices:
        raise SpecError(f"{where}: {value!r} is not one of {', '.join(choices)}")
    return value


@dataclass(frozen=True, kw_only=True)
class TrainLayout:
    """Megatron-style training layout. world = tp*cp*dp*pp; expert parallelism borrows ranks from
    dp*cp*tp (it does not multiply the world): ep*etp must divide tp*cp*dp, and the expert-data-
    parallel size is edp = world / (etp*ep*pp)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    etp: int | None = None  # expert tensor parallelism; Megatron-Core's default is etp = tp
    # decoder layers per pipeline stage, as published runs set them (MindSpeed's pipeline layer list,
    # Megatron's first/last-stage counts); None: the balanced split
    pipeline_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "pipeline_layers" and getattr(self, f.name) is not None:
                _int(getattr(self, f.name), f"train_layout.{f.name}")
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        if self.pipeline_layers is not None:
            layers = self.pipeline_layers
            if isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple)) or not layers:
                raise SpecError(f"train_layout.pipeline_layers must be a list of layer counts, one per stage, got {layers!r}")
            counts = tuple(_int(n, f"train_layout.pipeline_layers[{i}]") for i, n in enumerate(layers))
            if len(counts) != self.pp:
                raise SpecError(f"train_layout.pipeline_layers has {len(counts)} stages {list(counts)}; pp is {self.pp}")
            object.__setattr__(self, "pipeline_layers", counts)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "train_layout") -> "TrainLayout":
        check_keys(data, [f.name for f in fields(cls)], where)
        return cls(**{k: (v if k == "pipeline_layers" else _int(v, f"{where}.{k}")) for k, v in data.items()})

    def to_dict(self) -> dict[str, Any]:
        """As a job file writes it: per-stage counts as a list, and only when given."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "pipeline_layers"}
        if self.pipeline_layers is not None:
            out["pipeline_layers"] = list(self.pipeline_layers)
        return out

    def describe(self) -> str:
        etp = f" ETP{self.etp}" if self.etp != self.tp else ""
        stages = f" layers {','.join(map(str, self.pipeline_layers))}" if self.pipeline_layers else ""
        return f"TP{self.tp} PP{self.pp} EP{self.ep} CP{self.cp}{etp}{stages}"


@dataclass(frozen=True, kw_only=True)
class RolloutLayout:
    """vLLM-style rollout layout. One engine instance spans tp*dp devices: attention is tensor-
    parallel over tp and data-parallel over dp; the MoE layers span the whole instance, either as
    expert parallelism (ep = tp*dp) or tensor-parallel (ep = 1). Instances = devices / (tp*dp)."""

    tp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            _int(getattr(self, f.name), f"rollout_layout.{f.name}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "rollout_layout") -> "RolloutLayout":
        check_keys(data, [f.name for f in fields(cls)], where)
        return cls(**{k: _int(v, f"{where}.{k}") for k, v in data.items()})

    def describe(self) -> str:
        return f"TP{self.tp} DP{self.dp} EP{self.ep}"


@dataclass(frozen=True, kw_only=True)
class Offload:
    """What colocated mode moves to host memory while another phase holds the devices."""

    params: bool = True
    grads: bool = True
    optimizer: bool = True


@dataclass(frozen=True, kw_only=True)
class Speculative:
    """Speculative decoding in the rollout engine: a draft of `draft_tokens` per sequence, verified in
    one step that yields `accept_length` tokens on average (the bonus token included), switched on
    while an engine rank decodes at most `max_batch` sequences (cann-recipes' adaptive switch; 0 for
    always on)."""

    method: str = "sam"  # sam | ngram | mtp: where the drafts come from (no draft model is costed)
    draft_tokens: int = 3
    accept_length: float = 1.0
    max_batch: int = 0

    def __post_init__(self) -> None:
        _choice(self.method, ("sam", "ngram", "mtp"), "speculative.method")
        _int(self.draft_tokens, "speculative.draft_tokens")
        _num(self.accept_length, "speculative.accept_length", 1.0, self.draft_tokens + 1.0)
        _int(self.max_batch, "speculative.max_batch", minimum=0)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "speculative") -> "Speculative":
        check_keys(data, [f.name for f in fields(cls)], where, required=("accept_length",))
        try:
            return cls(**data)
        except SpecError as exc:  # named at `where` (the job file's key), with the bound's reason
            bound = " (at most draft_tokens + 1: the drafts and the bonus token)" if "accept_length" in str(exc) else ""
            raise SpecError(f"{where}.{str(exc).removeprefix('speculative.')}{bound}") from None


@dataclass(frozen=True, kw_only=True)
class Lengths:
    """A token-length distribution: its mean and maximum (and, for responses, a gamma shape)."""

    mean: float
    max: int
    shape: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.mean <= self.max:
            raise SpecError(f"need 0 < mean <= max, got mean {self.mean}, max {self.max}")
        if self.shape <= 0:
            raise SpecError(f"shape must be > 0, got {self.shape}")

    @classmethod
    def parse(cls, value: Any, where: str) -> "Lengths":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            mean = _num(value, where, minimum=1)
            return cls(mean=mean, max=int(math.ceil(mean)))
        check_keys(value, ["mean", "max", "shape"], where, required=("mean", "max"))
        try:
            return cls(
                mean=_num(value["mean"], f"{where}.mean", minimum=1),
                max=_int(value["max"], f"{where}.max"),
                shape=_num(value.get("shape", 2.0), f"{where}.shape", minimum=1e-3),
            )
        except SpecError as exc:
            raise SpecError(f"{where}: {exc}") from None


_JOB_DOC = {
    "algorithm": "grpo | ppo | dapo (ppo adds a critic of the actor's size: values pass and critic update)",
    "prompts_per_step": "prompts in one RL step (global batch of prompts)",
    "samples_per_prompt": "responses sampled per prompt (group size)",
    "prompt_tokens": "mean prompt length, or {mean, max}",
    "response_tokens": "{mean, max[, shape]}: response lengths; gamma-shaped, truncated at max",
    "precision": "bf16 | fp16 | fp32 | fp8 (training compute and weights; fp8: Megatron's FP8 GEMMs over bf16 weights, timed at "
    "the MoE training speed-up measured for them, not the FP8 peak)",
    "rollout_precision": "bf16 | fp8 (the rollout engine's weights and matmuls; default bf16 whatever the training precision: "
    "fp8 serves the linear layers' weights in one byte and runs its matmuls at the FP8 peak, the KV cache stays bf16)",
    "recompute": "none | selective | moe | full (activation recomputation in the update; moe: each MoE layer rebuilt from its input in backward)",
    "colocated": "actor, reference and rollout share the devices (time-shared; default true); false puts the rollout on a pool "
    "of its own (rollout_devices) and training on the rest, the trained weights sent across each step",
    "speculative": "{method: sam | ngram | mtp, draft_tokens (3), accept_length (tokens a verification step yields, the bonus "
    "token included; measure it), max_batch (speculate only while a rank decodes at most this many sequences; 0: always)}: "
    "speculative decoding in the rollout; a verification step reads the weights once for draft_tokens + 1 tokens per sequence",
    "rollout_devices": "with colocated: false, the rollout pool's devices (the rest train); searched when absent",
    "max_staleness": "with colocated: false, steps the rollout may run ahead of training (default 0: on-policy, the pools "
    "take turns; k >= 1: generation of step t + k overlaps training of step t, each batch trained k steps after the "
    "weights that generated it)",
    "partial_rollout": "with max_staleness >= 1: the engine keeps generating across weight updates and for later steps "
    "(NeMo RL's async GRPO with in_flight_weight_updates, verl's fully-async partial rollout): the weight sync overlaps "
    "generation, and up to max_staleness + 1 steps' sequences decode at once (default false: whole batches, the "
    "generation pool waiting for the weights)",
    "offload": "{params, grads, optimizer}: moved to host while another phase runs",
    "reference_model": "a frozen reference model for the KL term (one forward pass per step)",
    "skip_old_logprob": "no old log-prob pass: on-policy, one optimizer step per RL step (the old log-probs equal the "
    "detached current), or with trainer: verl its bypass_mode (the rollout's log-probs stand in, any number of steps); with "
    "`trainer` named and this key absent, that trainer's own default (verl, NeMo RL: the pass runs; MindSpeed-RL 2.0+: "
    "skipped when the step is one optimizer step)",
    "trainer": "verl | nemo-rl | mindspeed-rl: the trainer that runs the job; with trainer_version, the passes the job "
    "asks for are checked against what that release can do (planner/trainer_versions.py)",
    "trainer_version": "the trainer's release, e.g. 0.6.1: verl skips the old log-prob pass from 0.6.1 (bypass_mode), "
    "NeMo RL from 0.7 (force_on_policy_ratio) and its reference pass from 0.6",
    "train_layout": "{tp, pp, ep, cp[, etp][, pipeline_layers: [layers per stage]]}; searched when absent",
    "rollout_layout": "{tp, dp, ep}; searched when absent",
    "ppo_epochs": "passes over the batch in the update (default 1)",
    "mini_batches": "optimizer steps per epoch (default 1)",
    "micro_batch_tokens": "tokens per micro-batch in the update and log-prob passes (default: one longest sequence)",
    "logprob_padded_seqs": "sequences per log-prob micro-batch when the trainer pads each micro-batch to its longest "
    "sequence (verl's Megatron path without dynamic batching or packing: log_prob_micro_batch_size_per_gpu); default none: packed, no padding",
    "distributed_optimizer": "optimizer state sharded over data-parallel ranks (default true)",
    "optimizer_swap": "optimizer state lives in host memory and is swapped in for the step on the device (MindSpeed swap_optimizer; default false)",
    "optimizer_offload_fraction": "share of the optimizer state and step kept on the host CPU (Megatron's hybrid "
    "device optimizer, verl/NeMo RL optimizer_cpu_offload with optimizer_offload_fraction; default 0): the host runs "
    "Adam on it, gradients go down and parameters come back over the host link each optimizer step",
    "optimizer_moments": "fp32 | bf16 Adam moments (default fp32)",
    "trainer_backend": "megatron | transformers (default megatron): whose kernels set the activation bytes, and the "
    "bytes per parameter (megatron: bf16 weights, fp32 main grads, fp32 master + Adam moments; transformers: torch AdamW "
    "on the model as loaded, grads and moments in the parameter dtype); sharding follows Megatron's rules for both",
    "rollout_graphs": "the rollout engine replays captured graphs (vLLM CUDA graphs, vllm-ascend graph mode; default "
    "true); false = eager mode (verl's enforce_eager: true), which pays the kernel launches of every layer each decode step",
    "weight_sync": "gather | packed | shard: how trained weights reach the rollout engine. gather: every full tensor "
    "is gathered over the training groups and handed to the engine tensor by tensor, a fixed cost per tensor (verl "
    "before 0.7.1, MindSpeed-RL, NeMo RL before 0.4); packed: the same bytes, flattened into large buffers handed over "
    "one buffer at a time (NeMo RL from 0.4, verl from 0.7.1); shard (cann-recipes' all-to-all-v resharding): each "
    "device receives only its rollout shard. Default: the path of the release that trainer and trainer_version name "
    "(planner/trainer_versions.py), else gather",
    "rollout_memory_utilization": "fraction of usable device memory the rollout engine may take (default 0.85)",
    "expert_imbalance": "tokens on the busiest expert-parallel rank over the mean (default: the knobs' value for real routers, 1.2, a prior no published run pins down; 1.0 = forced balance)",
    "reward_s": "fixed time of the reward phase per step in seconds (default 0: rule-based, overlapped)",
    "dispatch_s": "{reference, old_logprob, update}: seconds a pass waits for its data to reach every rank before "
    "its first collective (verl's single controller dispatching through the host; cann-recipes measured 57 s and 73 s "
    "on 256 dies, under 1 s and 5 s with device-to-device transfer); added as given, default none",
    "rollout_oversampling": "responses generated per kept response (DAPO dynamic sampling; default 1.0): the rollout "
    "runs this many generation rounds of the step's size on average, one after another, each waiting for its longest response",
    "rollout_max_seqs": "sequences one rollout engine rank decodes at once at most (vLLM max_num_seqs; default: as many "
    "as the KV cache holds)",
}


@dataclass(frozen=True, kw_only=True)
class Job:
    algorithm: str = "grpo"
    prompts_per_step: int = 512
    samples_per_prompt: int = 16
    prompt_tokens: Lengths = field(default_factory=lambda: Lengths(mean=78, max=256))
    response_tokens: Lengths = field(default_factory=lambda: Lengths(mean=1577, max=3072))
    precision: str = "bf16"
    rollout_precision: str = "bf16"
    recompute: str = "full"
    colocated: bool = True
    offload: Offload = field(default_factory=Offload)
    reference_model: bool = True
    skip_old_logprob: bool = True
    train_layout: TrainLayout | None = None
    rollout_layout: RolloutLayout | None = None
    ppo_epochs: int = 1
    mini_batches: int = 1
    micro_batch_tokens: int | None = None
    logprob_padded_seqs: int | None = None
    distributed_optimizer: bool = True
    optimizer_swap: bool = False
    optimizer_offload_fraction: float = 0.0
    optimizer_moments: str = "fp32"
    trainer_backend: str = "megatron"
    rollout_memory_utilization: float = 0.85
    rollout_graphs: bool = True
    weight_sync: str | None = None  # None: the named release's path, else gather (resolved in __post_init__)
    expert_imbalance: float | None = None
    reward_s: float = 0.0
    dispatch_s: tuple[tuple[str, float], ...] = ()  # (pass, seconds) pairs; a mapping in YAML
    rollout_oversampling: float = 1.0
    rollout_max_seqs: int | None = None
    rollout_devices: int | None = None
    max_staleness: int = 0
    partial_rollout: bool = False
    speculative: Speculative | None = None
    trainer: str | None = None
    trainer_version: str | None = None

    def __post_init__(self) -> None:
        _choice(self.algorithm, ("grpo", "ppo", "dapo"), "algorithm")
        _choice(self.precision, ("bf16", "fp16", "fp32", "fp8"), "precision")
        _choice(self.rollout_precision, ("bf16", "fp8"), "rollout_precision")
        _choice(self.recompute, RECOMPUTE_MODES, "recompute")
        _choice(self.optimizer_moments, ("fp32", "bf16"), "optimizer_moments")
        _choice(self.trainer_backend, ("megatron", "transformers"), "trainer_backend")
        if self.weight_sync is not None:
            _choice(self.weight_sync, WEIGHT_SYNC, "weight_sync")
        _num(self.optimizer_offload_fraction, "optimizer_offload_fraction", 0.0, 1.0)
        if self.optimizer_offload_fraction > 0 and self.optimizer_swap:
            raise SpecError(
                f"optimizer_swap streams the whole optimizer state through the device for each step; "
                f"optimizer_offload_fraction {self.optimizer_offload_fraction:g} runs part of the step on the host: set one of them"
            )
        _int(self.prompts_per_step, "prompts_per_step")
        _int(self.samples_per_prompt, "samples_per_prompt")
        _int(self.ppo_epochs, "ppo_epochs")
        _int(self.mini_batches, "mini_batches")
        _num(self.rollout_memory_utilization, "rollout_memory_utilization", 0.05, 1.0)
        if self.expert_imbalance is not None:
            _num(self.expert_imbalance, "expert_imbalance", 1.0, 64.0)
        _num(self.reward_s, "reward_s")
        for phase, seconds in self.dispatch_s:
            _choice(phase, DISPATCH_PASSES, "dispatch_s key")
            _num(seconds, f"dispatch_s.{phase}")
        if len(dict(self.dispatch_s)) != len(self.dispatch_s):
            raise SpecError(f"dispatch_s names a pass twice: {self.dispatch_s}")
        _num(self.rollout_oversampling, "rollout_oversampling", 1.0, 64.0)
        if self.micro_batch_tokens is not None:
            _int(self.micro_batch_tokens, "micro_batch_tokens")
        if self.rollout_max_seqs is not None:
            _int(self.rollout_max_seqs, "rollout_max_seqs")
        if self.logprob_padded_seqs is not None:
            _int(self.logprob_padded_seqs, "logprob_padded_seqs")
        if self.rollout_devices is not None:
            _int(self.rollout_devices, "rollout_devices")
        _int(self.max_staleness, "max_staleness", minimum=0)
        if self.partial_rollout and not self.max_staleness:
            raise SpecError("partial_rollout generates ahead of training: it needs colocated: false and max_staleness >= 1")
        if self.colocated and (self.rollout_devices is not None or self.max_staleness):
            raise SpecError(f"rollout_devices and max_staleness describe separate pools: set colocated: false with them "
                            f"(got rollout_devices {self.rollout_devices}, max_staleness {self.max_staleness})")  # fmt: skip
        if self.mini_batches > self.num_sequences:
            raise SpecError(f"mini_batches={self.mini_batches} exceeds the {self.num_sequences} sequences per step")
        updates = self.ppo_epochs * self.mini_batches
        if self.skip_old_logprob and updates > 1 and self.trainer != "verl":  # verl's bypass mode takes the rollout's log-probs
            raise SpecError(
                f"skip_old_logprob: true needs one optimizer step per RL step (on-policy), but ppo_epochs * "
                f"mini_batches = {self.ppo_epochs} * {self.mini_batches} = {updates}; set skip_old_logprob: false, or "
                "trainer: verl, whose bypass_mode takes the rollout's log-probs as the old policy's for any number of steps"
            )
        self._check_release()
        if self.weight_sync is None:  # the named release's refit path
            object.__setattr__(self, "weight_sync", self.release.weight_sync if self.release is not None else "gather")

    def _check_release(self) -> None:
        """The passes the job asks for against what its trainer's release can do."""
        if self.trainer is None:
            if self.trainer_version is not None:
                raise SpecError(f"trainer_version {self.trainer_version} needs trainer (one of {', '.join(TRAINERS)})")
            return
        _choice(self.trainer, TRAINERS, "trainer")
        r = self.release
        if r is None:
            return
        if self.skip_old_logprob and r.old_logprob_skip is None:
            raise SpecError(f"skip_old_logprob: true, but {r.label} always runs the old log-prob pass "
                            f"({_SKIP_FROM[r.trainer]}); set skip_old_logprob: false or a later trainer_version")  # fmt: skip
        if not self.reference_model and r.reference_skip is None:
            raise SpecError(f"reference_model: false, but {r.label} always computes the reference log-probs "
                            "(grpo.skip_reference_policy_logprobs_calculation came in NeMo RL 0.6); set reference_model: true "
                            "or a later trainer_version")  # fmt: skip

    @property
    def release(self) -> Release | None:
        """The trainer release the job names (trainer and trainer_version), else None."""
        if self.trainer is None or self.trainer_version is None:
            return None
        return release(self.trainer, str(self.trainer_version))

    # ---- derived -----------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def trained_models(self) -> int:
        """Models the update phase trains with the same layout and optimizer: PPO's critic is a copy of
        the actor's architecture (verl and MindSpeed-RL build it from the actor's config), so 2; else 1."""
        return 2 if self.algorithm == "ppo" else 1

    @property
    def max_sequence_tokens(self) -> int:
        return self.prompt_tokens.max + self.response_tokens.max

    @property
    def mean_sequence_tokens(self) -> float:
        return self.prompt_tokens.mean + self.response_tokens.mean

    @property
    def tokens_per_step(self) -> float:
        """Prompt + response tokens the step trains on."""
        return self.num_sequences * self.mean_sequence_tokens

    @property
    def micro_tokens(self) -> int:
        return self.micro_batch_tokens or self.max_sequence_tokens

    @property
    def dispatch(self) -> dict[str, float]:
        """Seconds each pass waits for its data (dispatch_s), by pass."""
        return dict(self.dispatch_s)

    @property
    def activation_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    # ---- YAML --------------------------------------------------------------------------------
    @classmethod
    def allowed_keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, where: str = "job") -> "Job":
        data = {} if data is None else data
        check_keys(data, cls.allowed_keys(), where)
        kw: dict[str, Any] = {}
        for key, value in data.items():
            at = f"{where}.{key}"
            if key in ("prompt_tokens", "response_tokens"):
                kw[key] = Lengths.parse(value, at)
            elif key == "offload":
                if isinstance(value, bool):
                    kw[key] = Offload(params=value, grads=value, optimizer=value)
                else:
                    check_keys(value, ["params", "grads", "optimizer"], at)
                    kw[key] = Offload(**{k: _bool(v, f"{at}.{k}") for k, v in value.items()})
            elif key == "dispatch_s":
                if value is not None and not isinstance(value, Mapping):
                    raise SpecError(f"{at}: expected a mapping of {', '.join(DISPATCH_PASSES)} to seconds, got {value!r}")
                check_keys(value or {}, list(DISPATCH_PASSES), at)
                kw[key] = tuple(sorted((k, _num(v, f"{at}.{k}")) for k, v in (value or {}).items()))
            elif key == "speculative":
                kw[key] = None if value is None else Speculative.from_dict(value, at)
            elif key == "train_layout":
                kw[key] = None if value is None else TrainLayout.from_dict(value, at)
            elif key == "rollout_layout":
                kw[key] = None if value is None else RolloutLayout.from_dict(value, at)
            elif key in ("colocated", "reference_model", "skip_old_logprob", "distributed_optimizer", "optimizer_swap", "rollout_graphs", "partial_rollout"):
                kw[key] = _bool(value, at)
            elif key in ("prompts_per_step", "samples_per_prompt", "ppo_epochs", "mini_batches"):
                kw[key] = _int(value, at)
            elif key == "max_staleness":
                kw[key] = _int(value, at, minimum=0)
            elif key in ("micro_batch_tokens", "rollout_max_seqs", "logprob_padded_seqs", "rollout_devices"):
                kw[key] = None if value is None else _int(value, at)
            elif key in ("rollout_memory_utilization", "expert_imbalance", "reward_s", "rollout_oversampling", "optimizer_offload_fraction"):
                kw[key] = _num(value, at)
            elif key == "trainer_version" and isinstance(value, float):  # YAML reads 0.10 as 0.1
                raise SpecError(f"{at}: {value!r} is a number; write the release as text, quoted ('0.10'), so YAML keeps its digits")
            elif key in ("trainer", "trainer_version"):
                kw[key] = None if value is None else str(value)
            else:
                kw[key] = value
        if kw.get("trainer") and "skip_old_logprob" not in kw:  # the trainer's own default
            kw["skip_old_logprob"] = _skips_by_default(kw, where)
        try:
            return cls(**kw)
        except SpecError as exc:
            raise SpecError(f"{where}: {exc}") from None

    @property
    def pipeline_layers(self) -> tuple[int, ...] | None:
        """The fixed training layout's per-stage layer counts, when the job gives them."""
        return self.train_layout.pipeline_layers if self.train_layout is not None else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.train_layout is not None:
            out["train_layout"] = self.train_layout.to_dict()
        out["dispatch_s"] = self.dispatch or None
        for key in ("prompt_tokens", "response_tokens"):
            if out[key]["shape"] == 2.0:
                del out[key]["shape"]
        return {k: v for k, v in out.items() if v is not None}

    @staticmethod
    def documentation() -> dict[str, str]:
        return dict(_JOB_DOC)


# where each trainer's skip of the old log-prob pass came in (planner/trainer_versions.py has the sources)
_SKIP_FROM = {"verl": "bypass_mode came in verl 0.6.1", "nemo-rl": "force_on_policy_ratio skips it from NeMo RL 0.7",
              "mindspeed-rl": "its automatic on-policy skip came in MindSpeed-RL 2.0"}


def _skips_by_default(kw: Mapping[str, Any], where: str) -> bool:
    """Whether the named trainer skips the old log-prob pass without being asked: MindSpeed-RL (2.0 and
    later, or no version named) when the step is one optimizer step; verl and NeMo RL never."""
    if kw["trainer"] != "mindspeed-rl":
        return False
    if kw.get("trainer_version") is not None:
        try:
            if release("mindspeed-rl", kw["trainer_version"]).old_logprob_skip_default != "on-policy":
                return False
        except SpecError as exc:
            raise SpecError(f"{where}: {exc}") from None
    return int(kw.get("ppo_epochs", 1)) * int(kw.get("mini_batches", 1)) == 1


def load_job(path: str | Path | None) -> Job:
    """A job from a YAML file; the default job (the DeepSeek-R1 GRPO run of docs/reference-figures.md
    section "Published RL runs") when None."""
    if path is None:
        return Job()
    from planner.files import read_yaml

    p = Path(path)
    return Job.from_dict(read_yaml(p, "job file"), where=str(p))
