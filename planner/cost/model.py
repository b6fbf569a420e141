"""The RL step cost model: memory per device by phase, phase times, vectorised over layouts.

`CostModel(arch, accel, job)` precomputes what depends only on the model and the job; its methods
take arrays of candidate layouts (`TrainCandidates`, `RolloutCandidates`) and return arrays, so one
formula serves `planner cost --cards N` (arrays of length 1) and the enumeration of every layout.

Phases of one GRPO/PPO/DAPO step (verl / MindSpeed-RL timers; docs/cost-model.md section "Phases of
an RL step"):
  rollout      prefill (compute-bound) + decode (bandwidth/overhead-bound, a shrinking batch)
  reference    forward pass of the frozen reference model over every trained token
  old_logprob  forward pass of the actor (skipped on-policy)
  values       critic forward (PPO only)
  update       forward + backward (+ recompute) of the actor, ppo_epochs times (+ critic for PPO)
  switch       offload/onload to host, resharding train -> rollout weights, fixed engine costs
  reward       a fixed time the job states (rule-based rewards overlap and cost ~0)

Memory per device (Megatron-LM theoretical_memory_usage.py, extended; docs/cost-model.md section
"Memory per device"):
  model states  bf16 weights 2 B/param, fp32 main grads 4 B, Adam: fp32 master 4 B + moments 8 B
                (or 4 B in bf16), the optimizer part sharded over DP*CP (dense) and EDP (experts)
                by the distributed optimizer; dense parts split by TP, k/v by min(TP, kv heads),
                routed experts by EP*ETP, norms and routers replicated; per pipeline stage
  activations   planner.cost.activations per token and layer x tokens per micro-batch / (TP*CP) x
                in-flight micro-batches of 1F1B (pp - stage); routed copies x top_k x imbalance
  rollout       inference weights in the rollout layout + activation workspace + KV cache pool
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from planner.arch import Architecture, count_parameters, expert_params, layer_params
from planner.cost.activations import layer_activation_bytes, output_activation_bytes
from planner.cost.hardware import Accelerator
from planner.cost.knobs import Knobs, load_knobs
from planner.cost.layouts import RolloutCandidates, TrainCandidates
from planner.cost.lengths import LengthModel
from planner.specs import Job

__all__ = ["CostModel", "TrainEval", "RolloutEval", "HOST_USABLE_FRACTION", "ROLLOUT_BATCHED_TOKENS", "BF16_BYTES", "FP8_BYTES", "FP32_BYTES",
           "FP8_TRAIN_SPEEDUP"]

# Host RAM a node can give to offloaded tensors; the rest stays for the OS, dataloaders, Ray and
# pinned staging buffers (assumption, stated in reports).
HOST_USABLE_FRACTION = 0.8
# Tokens one rollout-engine forward may process at once (vLLM max_num_batched_tokens); its
# activation workspace is reserved up front by the engine's profiling run.
ROLLOUT_BATCHED_TOKENS = 8192
BF16_BYTES = 2.0  # bytes per element of a bf16 tensor: rollout weights, KV cache, activations on the wire
FP8_BYTES = 1.0
# Megatron's FP8 GEMMs speed MoE training up far less than the FP8 peak would: 242.9 against 240.5
# TFLOPS per H100 for Qwen3-30B-A3B, FP8 blockwise against BF16 (Megatron-LM PR #5728): the MoE
# update is bound by much besides its GEMMs
FP8_TRAIN_SPEEDUP = 242.9 / 240.5
FP32_BYTES = 4.0  # bytes per fp32 element: the rollout engine's logits


@dataclass(frozen=True)
class TrainEval:
    """Per-candidate arrays for the training-side phases (reference, old log-prob, update); the
    byte breakdown is the busiest pipeline stage's."""

    weights_bytes: np.ndarray
    grads_bytes: np.ndarray
    optimizer_bytes: np.ndarray
    activations_bytes: np.ndarray
    other_model_bytes: np.ndarray  # PPO: the critic's states kept on the device meanwhile
    update_bytes: np.ndarray  # peak over pipeline stages of the update phase
    logprob_bytes: np.ndarray  # actor forward-only pass
    reference_bytes: np.ndarray
    kept_bytes: np.ndarray  # training states that stay on the device while rolling out
    switch_host_s: np.ndarray  # the switch's host moves (offload, onload; reference weights)
    switch_gather_s: np.ndarray  # weight_sync gather or packed: every full tensor over the training groups (0 for shard)
    host_bytes_per_node: np.ndarray
    update_s: np.ndarray
    reference_s: np.ndarray
    old_logprob_s: np.ndarray
    values_s: np.ndarray
    update_compute_s: np.ndarray
    update_a2a_s: np.ndarray
    update_bubble_s: np.ndarray
    uneven_pp: np.ndarray
    # what `planner cost --explain` shows: the update's terms and their inputs
    update_flops: float  # model FLOPs of the update (every epoch, recomputed forwards included)
    update_tp_s: np.ndarray
    update_sync_s: np.ndarray
    update_swap_s: np.ndarray
    update_host_adam_s: np.ndarray  # optimizer_offload_fraction: the host's Adam step and its transfers
    update_etp_s: np.ndarray  # the dispatcher's all-gather / reduce-scatter over the expert-TP group
    update_cp_s: np.ndarray  # context parallelism: ring attention's K/V passes over the CP group
    expert_gemm_flops: np.ndarray  # one expert GEMM per micro-batch on one rank
    expert_gemm_efficiency: np.ndarray
    compute_slowdown: np.ndarray  # experts (imbalance, GEMM size) and the busiest pipeline stage
    micro_batches: np.ndarray  # per DP rank per optimizer step

    @property
    def switch_train_s(self) -> np.ndarray:
        """The part of the switch the training layout decides (host moves, the gather)."""
        return self.switch_host_s + self.switch_gather_s


@dataclass(frozen=True)
class RolloutEval:
    weights_bytes: np.ndarray
    workspace_bytes: np.ndarray
    kv_budget_bytes: np.ndarray  # what the engine's memory share leaves for the KV pool
    kv_per_sequence_bytes: np.ndarray  # one longest sequence
    concurrency: np.ndarray  # sequences one DP rank decodes at once (KV-bound or all of them)
    sequences_per_rank: np.ndarray  # in one generation round
    prefill_s: np.ndarray
    decode_s: np.ndarray
    rollout_s: np.ndarray
    decode_steps: np.ndarray  # decode iterations of one DP rank (the queue included)
    decode_overhead_s: np.ndarray  # per-step overhead (scheduler, sampling), eager launches, collective latency


GEMM_HALF_FLOPS = 0.6e9  # the GEMM size at which efficiency is half its large-GEMM value (Calculon; see CostModel._compute_slowdown)


# ---- what passes between the terms of `CostModel.train` and `CostModel.rollout` ------------------
class _Grid(NamedTuple):
    """A batch of training layouts: per candidate the parallel sizes as floats and the data-parallel
    groups; per (candidate, stage), flattened, the stage split of `CostModel._stages`."""

    n: int  # candidates
    devices: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    ep: np.ndarray
    cp: np.ndarray
    etp: np.ndarray
    dp: np.ndarray  # world / (TP * PP * CP)
    edp: np.ndarray  # world / (ETP * EP * PP)
    dp_opt: np.ndarray  # the distributed optimizer's shard group of dense states (DP * CP), else 1
    edp_opt: np.ndarray  # ... of expert states (EDP), else 1
    owner: np.ndarray  # per stage: its candidate
    stage: np.ndarray  # per stage: its index in its candidate's pipeline
    ppf: np.ndarray  # per stage: its candidate's stage count
    starts: np.ndarray  # where each candidate's stages start
    sums: dict  # per stage: sums of the per-layer parameter counts, "moe" (MoE layers) and "layers"
    is_first: np.ndarray  # per stage: 1.0 on the first stage
    is_last: np.ndarray  # per stage: 1.0 on the last stage
    moe_stage: np.ndarray  # per candidate: MoE layers of its busiest stage
    layers_stage: np.ndarray  # per candidate: layers of its busiest stage


class _States(NamedTuple):
    """Per (candidate, stage): parameters and bytes of the model states on one device."""

    dense_local: np.ndarray  # parameters: TP-split and replicated parts
    expert_local: np.ndarray  # parameters: routed experts over EP * ETP
    params_local: np.ndarray
    weights: np.ndarray
    grads: np.ndarray
    opt_all: np.ndarray  # the whole optimizer state of the device's shard, wherever it lives
    opt: np.ndarray  # the part of it on the device
    kept: np.ndarray  # what stays on the device while another phase runs


class _Micro(NamedTuple):
    """Per candidate: micro-batches and the tokens of one on one device."""

    m: np.ndarray  # per DP rank per optimizer step
    micro_all: np.ndarray  # per DP rank per epoch
    t_dev: np.ndarray  # tokens per device per micro-batch
    ep_imb: np.ndarray  # tokens on the busiest EP rank over the mean (1 without EP)


class _PhaseMemory(NamedTuple):
    other_model: np.ndarray  # per stage: the other trained model's kept states (PPO)
    peak_idx: np.ndarray  # per candidate: index of the update's busiest stage
    update_bytes: np.ndarray
    logprob_bytes: np.ndarray
    reference_bytes: np.ndarray


class _Host(NamedTuple):
    """Per candidate, per device of the busiest stage unless named otherwise."""

    kept_max: np.ndarray  # training states of every trained model left on the device
    moved: np.ndarray  # offloaded states of every trained model
    ref_weights: np.ndarray
    swapped: np.ndarray | float  # optimizer_swap: the optimizer state on the host (0.0 without)
    host_per_node: np.ndarray


class _Recompute(NamedTuple):
    """What recomputation reruns, per forward pass of the update."""

    fwd: float  # share of a forward's FLOPs rerun
    moe: float  # 1.0 when the MoE layers' dispatch and combine run again
    tp: float  # 1.0 when every layer's TP collectives run again


class _Slowdown(NamedTuple):
    gemm: np.ndarray  # FLOPs of one expert GEMM per micro-batch on one rank
    gemm_eff: np.ndarray
    slow: np.ndarray  # compute-time factor: experts and the busiest pipeline stage


class _Compute(NamedTuple):
    flops: float  # model FLOPs of the update, recomputed forwards included
    update: np.ndarray  # seconds of the update's compute (every epoch)
    forward: np.ndarray  # seconds of one forward-only pass (log-prob, reference, values)


class _PassComm(NamedTuple):
    per_pass: np.ndarray  # seconds in one forward-only pass
    update: np.ndarray  # seconds in the update (every epoch, backward and recompute included)


class _RolloutGrid(NamedTuple):
    """A batch of rollout layouts as floats, and what one decode step reads on a device."""

    tp: np.ndarray
    inst: np.ndarray  # devices of one engine instance, TP * DP
    dp: np.ndarray
    expert_parallel: np.ndarray  # the MoE layers expert-parallel over the instance (else tensor-parallel)
    weights: np.ndarray  # inference weight bytes per device
    expert_bytes: np.ndarray  # routed-expert bytes per device
    nonexpert_bytes: np.ndarray
    kv_tok: np.ndarray  # KV bytes per token of context, all attention layers
    state_seq: np.ndarray  # a hybrid's linear-layer state bytes per sequence (0 otherwise)
    tp_bw: np.ndarray
    inst_bw: np.ndarray


# Where Megatron weighs a routed copy by its router probability, which sets what the copy keeps for
# backward (planner.cost.activations): Megatron-Core 0.13 and later (verl's and NeMo RL's GPU images)
# in the SwiGLU; the older Megatron-Core that MindSpeed builds on (MindSpeed-RL: core_r0.8.0) in unpermute
ROUTED_PROBS = {"nvidia": "activation", "ascend": "unpermute"}


class _KV(NamedTuple):
    budget: np.ndarray
    seq_max: np.ndarray  # KV bytes of one longest sequence
    live_ctx: float  # expected context of a live sequence
    n_rank: np.ndarray  # sequences per DP rank per generation round
    conc: np.ndarray  # sequences decoded at once


class CostModel:
    """Cost of one RL step of `arch` on `accel` for `job`, vectorised over layouts."""

    def __init__(self, arch: Architecture, accel: Accelerator, job: Job, knobs: Knobs | None = None):
        self.arch, self.accel, self.job = arch, accel, job
        self.knobs = knobs or load_knobs(accel.family)
        self.imbalance = job.expert_imbalance if job.expert_imbalance is not None else self.knobs.expert_imbalance
        self.lengths = LengthModel.from_spec(job.response_tokens)
        self.counts = count_parameters(arch)
        self._per_layer()
        self._flops()

    # ---- precomputation ----------------------------------------------------------------------
    def _per_layer(self) -> None:
        arch, job = self.arch, self.job
        lp = [layer_params(arch, i) for i in range(arch.num_layers)]
        fields_ = ("attention_sharded", "attention_kv", "attention_replicated", "norms", "router",
                   "routed_experts", "shared_experts", "dense_mlp")
        self._prefix = {f: np.concatenate([[0], np.cumsum([getattr(p, f) for p in lp])]).astype(float) for f in fields_}
        is_moe = np.array([i in arch.moe_layers for i in range(arch.num_layers)], dtype=float)
        self._prefix["moe"] = np.concatenate([[0], np.cumsum(is_moe)])
        probs = ROUTED_PROBS[self.accel.family]
        act = layer_activation_bytes(arch, act_bytes=job.activation_bytes, backend=job.trainer_backend, recompute=job.recompute, probs=probs)
        self.act = act
        k = arch.moe.top_k
        # per token and layer at imbalance 1, without the routed copies (which scale separately):
        # summed per stage through the prefix sums, and the largest MoE and other layer
        fixed = act.per_layer(arch)
        self._prefix["act_fixed"] = np.concatenate([[0], np.cumsum(fixed)])
        self.act_moe_layer, self.act_dense_layer = self._largest(fixed, is_moe)
        self.act_routed = act.routed_per_copy * k  # per token at imbalance 1
        self.act_output = output_activation_bytes(arch, act_bytes=job.activation_bytes, backend=job.trainer_backend)
        # what one layer holds while it runs, whatever the update recomputes: forward-only passes,
        # and the MoE layer that recompute moe rebuilds in backward
        whole = layer_activation_bytes(arch, act_bytes=job.activation_bytes, backend=job.trainer_backend, recompute="none", probs=probs)
        self.work_moe_layer, self.work_dense_layer = self._largest(whole.per_layer(arch), is_moe)
        self.work_moe_inside = whole.moe_fixed - act.moe_fixed  # rebuilt in backward under recompute moe
        self.work_routed = whole.routed_per_copy * k
        c = self.counts
        self.embedding_params = c.embeddings
        self.head_params = c.lm_head
        self.final_norm_params = arch.hidden_size * (2 if arch.norm == "layernorm" else 1)
        self.expert_params = expert_params(arch)
        self.routed_total = c.routed_experts
        self.attn_sharded_total = self._prefix["attention_sharded"][-1]
        self.attn_kv_total = self._prefix["attention_kv"][-1]
        # weight tensors as the trainer holds them: Megatron's grouped experts keep two per routed
        # expert (fc1 = gate and up, fc2); about ten per layer for attention, norms, router and the
        # dense or shared MLP; embedding, final norm and head
        self.weight_tensors = 2.0 * arch.num_moe_layers * arch.moe.num_experts + 10.0 * arch.num_layers + 3.0
        # attention layers (the KV cache, ring attention) and a hybrid's linear layers (their state)
        self.n_attention = len(arch.attention_layers)
        self.n_linear = arch.num_linear_layers

    @staticmethod
    def _largest(per_layer: list[float], is_moe: np.ndarray) -> tuple[float, float]:
        """The largest per-layer value among MoE layers and among the others (0 where none)."""
        values = np.asarray(per_layer, dtype=float)
        moe, other = values[is_moe > 0], values[is_moe == 0]
        return (float(moe.max()) if moe.size else 0.0), (float(other.max()) if other.size else 0.0)

    def _flops(self) -> None:
        arch, job, L = self.arch, self.job, self.lengths
        a = arch.attention
        # Forward FLOPs per token in matmuls: 2 per active parameter, the embedding lookup excluded
        # (PaLM appendix B; Megatron num_floating_point_operations counts the router too: we do).
        # A tied output head still multiplies: count it once for the lookup-free embedding.
        tied_head = arch.vocab_size * arch.hidden_size if arch.tie_embeddings else 0
        self.matmul_flops_per_token = 2.0 * (self.counts.active - self.counts.embeddings + tied_head)
        if arch.linear is not None:  # a hybrid's linear layers: the chunked scan, linear in length
            self.matmul_flops_per_token += arch.num_linear_layers * arch.linear.scan_flops_per_token
        self.expert_flops_per_token = 2.0 * arch.num_moe_layers * arch.moe.top_k * self.expert_params
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim if a.kind == "mla" else a.head_dim
        # QK^T and AV per query and attended key: 2*heads*(d_qk + d_v) FLOPs
        self.attn_flops_per_pair = 2.0 * a.num_heads * (qk + a.v_dim)
        groups: dict = {}
        for i in arch.attention_layers:
            w = arch.layer_windows[i]
            groups[w] = groups.get(w, 0) + 1
        self._groups = list(groups.items())  # distinct attention windows, layers using each
        prompt = job.prompt_tokens.mean
        # E[sum over layers of attended pairs of one training sequence]
        self.train_pairs_per_seq = L.expect(lambda r: self._pairs(prompt + r))
        self.prefill_pairs_per_seq = float(self._pairs(np.array([prompt]))[0])
        # log-prob passes over micro-batches padded to their longest sequence (no packing): every
        # sequence computes as long as the expected longest of its micro-batch, attention dense over it
        self.logprob_padding = 1.0
        if job.logprob_padded_seqs:
            padded = prompt + L.expected_max(job.logprob_padded_seqs)
            flops = padded * self.matmul_flops_per_token + float(self._pairs(np.array([padded]))[0]) * self.attn_flops_per_pair
            self.logprob_padding = flops * job.num_sequences / self.forward_flops_per_step()

    def _pairs(self, seq_len: np.ndarray) -> np.ndarray:
        """Attended (query, key) pairs of causal attention over a sequence, summed over layers."""
        n = np.asarray(seq_len, dtype=float)
        total = np.zeros_like(n)
        for w, layers in self._groups:
            if w is None:
                part = n * (n + 1) / 2
            elif w[0] == "sliding":
                size = w[1]
                part = np.where(n <= size, n * (n + 1) / 2, size * (size + 1) / 2 + (n - size) * size)
            else:  # chunked: full causal inside each chunk
                size = w[1]
                full = np.floor(n / size)
                rest = n - full * size
                part = full * size * (size + 1) / 2 + rest * (rest + 1) / 2
            total += layers * part
        return total

    def _span(self, context: np.ndarray) -> np.ndarray:
        """Keys one decode query attends to at `context`, summed over layers."""
        c = np.asarray(context, dtype=float)
        total = np.zeros_like(c)
        for w, layers in self._groups:
            if w is None:
                total += layers * c
            elif w[0] == "sliding":
                total += layers * np.minimum(c, w[1])
            else:
                total += layers * (np.mod(c, w[1]) + 1)
        return total

    # ---- byte sizes ---------------------------------------------------------------------------
    def _state_bytes(self) -> tuple[float, float, float]:
        """(weight, grad, optimizer) bytes per parameter for the backend and precision."""
        job = self.job
        w = job.param_bytes
        if job.trainer_backend == "transformers":
            # torch AdamW on the model as loaded: grads and both moments in the parameter dtype
            return w, w, 2 * w
        grad = 4  # Megatron accumulates main grads in fp32
        moments = 8 if job.optimizer_moments == "fp32" else 4
        master = 0 if w == 4 else 4
        return w, grad, master + moments

    # ---- training side ------------------------------------------------------------------------
    def _stages(self, cand: TrainCandidates):
        """Flattened (candidate, stage) arrays: owner candidate, stage index, the owner's stage
        count, where each owner's stages start, and per-stage sums of the per-layer counts."""
        pp = cand.pp
        owner = np.repeat(np.arange(len(cand)), pp)
        first = np.concatenate([[0], np.cumsum(pp)[:-1]])
        stage = np.arange(int(pp.sum())) - np.repeat(first, pp)
        ppf = pp[owner]
        L = self.arch.num_layers
        lo = (stage * L) // ppf
        hi = ((stage + 1) * L) // ppf
        given = self.job.pipeline_layers
        if given is not None:  # the job's own per-stage counts, for candidates of its stage count
            bounds = np.concatenate([[0], np.cumsum(given)])
            mine = ppf == len(given)
            lo = np.where(mine, bounds[np.minimum(stage, len(given))], lo)
            hi = np.where(mine, bounds[np.minimum(stage + 1, len(given))], hi)
        sums = {f: self._prefix[f][hi] - self._prefix[f][lo] for f in self._prefix}
        sums["layers"] = (hi - lo).astype(float)
        return owner, stage, ppf, first, sums

    @staticmethod
    def _uneven(n: int, owner: np.ndarray, layers: np.ndarray) -> np.ndarray:
        """Per candidate: do its stages hold different numbers of layers?"""
        most, least = np.zeros(n), np.full(n, np.inf)
        np.maximum.at(most, owner, layers)
        np.minimum.at(least, owner, layers)
        return most != least

    def train(self, cand: TrainCandidates) -> TrainEval:
        """Memory and time of the training-side phases (reference, old log-prob, values, update)
        for each candidate layout: the terms below, one method each, assembled into a TrainEval."""
        job = self.job
        models = float(job.trained_models)  # PPO: a critic of the actor's size
        g = self._grid(cand)
        st = self._stage_states(g)
        mb = self._micro_batches(g)
        act = self._activations(g, mb)
        mem = self._phase_memory(g, st, mb, act)
        host = self._host_memory(g, st)
        slow = self._compute_slowdown(g, mb)
        rc = self._recompute()
        comp = self._compute_times(g, slow.slow, rc)
        bubble, fwd_bubble = self._pipeline_bubble(g, mb, comp.update), self._pipeline_bubble(g, mb, comp.forward)
        a2a, etp, tp = self._ep_all_to_all(g, mb, rc), self._expert_tp_comm(g, mb, rc), self._tp_comm(g, mb, rc)
        cp = self._cp_comm(g, mb, rc)
        sync = self._dp_sync(g, st, mem.peak_idx)
        swap = self._optimizer_swap(host.swapped)
        host_adam = self._host_adam(g, st, mem.peak_idx)
        update = (comp.update + bubble + a2a.update + etp.update + tp.update + cp.update + sync + swap + host_adam) * models
        logprob = comp.forward + fwd_bubble + a2a.per_pass + etp.per_pass + tp.per_pass + cp.per_pass
        zeros = np.zeros(g.n)
        dispatch = job.dispatch  # as the job gives it: data reaching every rank before a pass starts
        peak = mem.peak_idx
        return TrainEval(
            weights_bytes=st.weights[peak],
            grads_bytes=st.grads[peak],
            optimizer_bytes=st.opt[peak],
            activations_bytes=act[peak],
            other_model_bytes=mem.other_model[peak],
            update_bytes=mem.update_bytes,
            logprob_bytes=mem.logprob_bytes,
            reference_bytes=mem.reference_bytes,
            kept_bytes=host.kept_max,
            switch_host_s=self._switch_host_seconds(g, st, host),
            switch_gather_s=self._weight_sync_gather(g),
            host_bytes_per_node=host.host_per_node,
            update_s=update + dispatch.get("update", 0.0),
            reference_s=logprob + dispatch.get("reference", 0.0) if job.reference_model else zeros,
            old_logprob_s=zeros if job.skip_old_logprob else logprob + dispatch.get("old_logprob", 0.0),
            values_s=logprob if job.algorithm == "ppo" else zeros,
            update_compute_s=comp.update,
            update_a2a_s=a2a.update,
            update_bubble_s=bubble,
            update_flops=comp.flops,
            update_tp_s=tp.update,
            update_sync_s=sync,
            update_swap_s=swap * np.ones(g.n),
            update_host_adam_s=host_adam,
            update_etp_s=etp.update,
            update_cp_s=cp.update,
            expert_gemm_flops=slow.gemm,
            expert_gemm_efficiency=slow.gemm_eff,
            compute_slowdown=slow.slow,
            micro_batches=mb.m,
            uneven_pp=self._uneven(g.n, g.owner, g.sums["layers"]),
        )

    # -- train: layout and memory terms --
    def _grid(self, cand: TrainCandidates) -> _Grid:
        """The layout grid and the stage split. DP = world / (TP * PP * CP) and EDP = world /
        (ETP * EP * PP) (Megatron-Core's rules, planner.cost.layouts); the distributed optimizer
        shards dense states over DP * CP and expert states over EDP (docs/cost-model.md "Memory per
        device"), nothing without it; the stages are `_stages`' (Megatron's even split, or the job's
        pipeline_layers), with the layer counts of each candidate's busiest stage."""
        job = self.job
        devices = cand.devices.astype(float)
        tp, pp, ep, cp, etp = (x.astype(float) for x in (cand.tp, cand.pp, cand.ep, cand.cp, cand.etp))
        dp = devices / (tp * pp * cp)
        edp = devices / (etp * ep * pp)
        dp_opt = dp * cp if job.distributed_optimizer else np.ones_like(dp)
        edp_opt = edp if job.distributed_optimizer else np.ones_like(dp)
        owner, stage, ppf, starts, s = self._stages(cand)
        return _Grid(
            n=len(cand), devices=devices, tp=tp, pp=pp, ep=ep, cp=cp, etp=etp, dp=dp, edp=edp, dp_opt=dp_opt, edp_opt=edp_opt,
            owner=owner, stage=stage, ppf=ppf, starts=starts, sums=s,
            is_first=(stage == 0).astype(float), is_last=(stage == ppf - 1).astype(float),
            moe_stage=np.maximum.reduceat(s["moe"], starts), layers_stage=np.maximum.reduceat(s["layers"], starts),
        )

    def _stage_states(self, g: _Grid) -> _States:
        """Parameter and model-state bytes per (candidate, stage) on one device (Megatron-LM
        theoretical_memory_usage.py, extended; docs/cost-model.md "Memory per device"):
          params     (attention projections incl. k/v, shared experts, dense MLP) / TP + replicated
                     attention + norms + router + embedding / TP (first stage) + head / TP + final
                     norm (last stage) + routed experts / (EP x ETP)
          weights    params x weight bytes; grads params x grad bytes (`_state_bytes`)
          optimizer  dense params x optimizer bytes / (DP x CP) + expert params x optimizer bytes / EDP
                     (distributed optimizer); on the device none of it under optimizer_swap (MindSpeed
                     swap_optimizer), 1 - optimizer_offload_fraction of it otherwise
          kept       what the offload settings leave on the device while another phase runs"""
        arch, job = self.arch, self.job
        wb, gb, ob = self._state_bytes()
        o, s, tp = g.owner, g.sums, g.tp
        # the output layer: untied, or (tied, PP > 1) a copy Megatron keeps on the last stage
        head = self.head_params if self.head_params else np.where(g.ppf > 1, self.embedding_params, 0.0)
        dense_local = (
            (s["attention_sharded"] + s["attention_kv"] + s["shared_experts"] + s["dense_mlp"]) / tp[o]
            + s["attention_replicated"]
            + s["norms"]
            + s["router"]
            + g.is_first * self.embedding_params / tp[o]
            + g.is_last * (head / tp[o] + self.final_norm_params)
        )
        expert_local = s["routed_experts"] / (g.ep[o] * g.etp[o])
        params_local = dense_local + expert_local
        router_extra = 0.0
        if job.trainer_backend == "transformers" and arch.moe.router_fp32:
            router_extra = s["router"] * (4 - wb)  # fp32 router weights in a bf16 model
        weights = params_local * wb + router_extra
        grads = params_local * gb + router_extra
        opt_all = dense_local * ob / g.dp_opt[o] + expert_local * ob / g.edp_opt[o] + 2 * router_extra
        # swapped optimizer state lives on the host and streams in for the step; an offloaded
        # fraction lives (and is stepped) on the host for good
        host_frac = job.optimizer_offload_fraction
        opt = opt_all * 0.0 if job.optimizer_swap else opt_all * (1.0 - host_frac)
        off = job.offload
        # what stays on the device while another phase (rollout, reference) runs
        kept = weights * (not off.params) + grads * (not off.grads) + opt * (not off.optimizer)
        return _States(dense_local, expert_local, params_local, weights, grads, opt_all, opt, kept)

    def _micro_batches(self, g: _Grid) -> _Micro:
        """Micro-batches per DP rank per optimizer step, m = max(1, ceil(tokens per optimizer step
        / (DP * micro_tokens))), and m * mini_batches per epoch; tokens per device per micro-batch,
        micro_tokens / (CP * TP) (sequence parallelism with TP; docs/cost-model.md "Activation
        memory"); the busiest EP rank's imbalance factor, 1 without EP (docs/cost-model.md
        "Memory per device")."""
        job = self.job
        tokens_opt = job.tokens_per_step / job.mini_batches
        m = np.maximum(1.0, np.ceil(tokens_opt / (g.dp * job.micro_tokens)))
        t_dev = job.micro_tokens / (g.cp * g.tp)
        ep_imb = np.where(g.ep > 1, self.imbalance, 1.0)
        return _Micro(m=m, micro_all=m * job.mini_batches, t_dev=t_dev, ep_imb=ep_imb)

    def _activations(self, g: _Grid, mb: _Micro) -> np.ndarray:
        """Activation bytes per (candidate, stage) in the update: `_stage_activation` over the
        micro-batches 1F1B keeps in flight on stage s, min(PP - s, m) (docs/cost-model.md "Memory
        per device"; planner.cost.activations per token and layer)."""
        o = g.owner
        in_flight = np.minimum(g.ppf - g.stage, mb.m[o])
        return self._stage_activation(mb.t_dev[o], g.sums, mb.ep_imb[o], in_flight, g.is_last)

    def _phase_memory(self, g: _Grid, st: _States, mb: _Micro, act: np.ndarray) -> _PhaseMemory:
        """Device bytes of the training phases, per stage, and their peaks over each candidate's
        stages (docs/cost-model.md "Memory per device"):
          update     weights + grads + optimizer + activations + (models - 1) x kept (PPO's critic)
          log-prob   weights + one layer's forward working set (+ the output log-probs on the last
                     stage) + the kept states besides the weights + (models - 1) x kept
          reference  reference weights + the working set + models x kept (0 without a reference)
        The update's busiest stage (`peak_idx`) gives TrainEval's byte breakdown."""
        job = self.job
        models = float(job.trained_models)
        wb = self._state_bytes()[0]
        off = job.offload
        o, starts = g.owner, g.starts
        other_model = (models - 1.0) * st.kept  # the critic's (or actor's) states kept meanwhile
        update_stage = st.weights + st.grads + st.opt + act + other_model
        # forward-only pass: weights and one layer's working set plus the output log-probs
        fwd_work = mb.t_dev[o] * (np.maximum(self.work_moe_layer + self.work_routed, self.work_dense_layer) + g.is_last * self.act_output)
        logprob_stage = st.weights + fwd_work + (st.kept - st.weights * (not off.params)) + other_model
        reference_stage = st.params_local * wb + fwd_work + models * st.kept
        peak_idx = self._argmax_by_owner(update_stage, starts, g.owner)
        return _PhaseMemory(
            other_model=other_model,
            peak_idx=peak_idx,
            update_bytes=update_stage[peak_idx],
            logprob_bytes=np.maximum.reduceat(logprob_stage, starts),
            reference_bytes=np.maximum.reduceat(reference_stage, starts) if job.reference_model else np.zeros(g.n),
        )

    def _host_memory(self, g: _Grid, st: _States) -> _Host:
        """Host memory per node: per device (each term at its busiest stage) the states offload
        moved off it, the reference weights, the swapped optimizer state (optimizer_swap) and the
        host optimizer's share (optimizer_offload_fraction), each for every trained model, times
        the node's devices; checked against HOST_USABLE_FRACTION of host RAM (an assumption)."""
        job, accel = self.job, self.accel
        models = float(job.trained_models)
        wb = self._state_bytes()[0]
        starts = g.starts
        kept_max = models * np.maximum.reduceat(st.kept, starts)
        moved = models * np.maximum.reduceat(st.weights + st.grads + st.opt - st.kept, starts)  # offloaded, per device
        ref_weights = np.maximum.reduceat(st.params_local * wb, starts) if job.reference_model else np.zeros(g.n)
        swapped = models * np.maximum.reduceat(st.opt_all, starts) if job.optimizer_swap else 0.0
        on_host = models * np.maximum.reduceat(st.opt_all, starts) * job.optimizer_offload_fraction  # the host optimizer's share
        host_per_node = (moved + ref_weights + swapped + on_host) * np.minimum(g.devices, accel.devices_per_node)
        return _Host(kept_max=kept_max, moved=moved, ref_weights=ref_weights, swapped=swapped, host_per_node=host_per_node)

    def _switch_host_seconds(self, g: _Grid, st: _States, host: _Host) -> np.ndarray:
        """The switch's host-link moves (MindSpeed-RL offload/onload; docs/cost-model.md "Phases of
        an RL step"): 2 x (offloaded states + reference weights + the actor's weights again for the
        old log-prob pass) / host link bandwidth, the 2 for the two directions."""
        job = self.job
        models = float(job.trained_models)
        # host link, each way, per step: the offloaded states come back for the update, the actor's
        # weights once more for the old log-prob pass, the reference weights for theirs
        moved_params = models * np.maximum.reduceat(st.weights, g.starts) * job.offload.params
        host_moves = host.moved + host.ref_weights + (0.0 if job.skip_old_logprob else moved_params)
        return 2.0 * host_moves / self.accel.host_link_bytes_per_s

    # -- train: compute terms --
    def _expert_share(self) -> float:
        """The routed experts' share of the forward FLOPs: tokens x 2 x MoE layers x top_k x expert
        parameters / forward FLOPs (`_flops`; PaLM appendix B's 2 FLOPs per parameter and token)."""
        return self.job.tokens_per_step * self.expert_flops_per_token / self.forward_flops_per_step()

    def _compute_slowdown(self, g: _Grid, mb: _Micro) -> _Slowdown:
        """The update's compute-time factor from the experts and the busiest pipeline stage:
          gemm = 2 x micro_tokens x EP x top_k x h x I / (TP x CP x E)   one expert GEMM per micro-batch
          eff  = gemm / (gemm + GEMM_HALF_FLOPS)                       (Calculon's op-size curve)
          slow = (1 + expert share x (imbalance / eff - 1)) x busiest stage's layers x PP / layers"""
        arch, job = self.arch, self.job
        ep, tp, cp = g.ep, g.tp, g.cp
        # expert GEMMs: the busiest EP rank sets the pace, and a small GEMM runs below the dense
        # layers' efficiency (Calculon's op-size curve: 0.6 at 1 GFLOP, 0.9 at 16; fitted as
        # g / (g + 0.6 GFLOP)). Per micro-batch one expert sees micro_tokens x ep x etp / (tp x cp)
        # tokens x top_k / E, over a width I / etp: narrow expert-TP slices and EP1 make small GEMMs
        gemm = 2.0 * job.micro_tokens * ep * arch.moe.top_k * arch.hidden_size * arch.moe.expert_intermediate / (tp * cp * arch.moe.num_experts)
        gemm_eff = gemm / (gemm + GEMM_HALF_FLOPS)
        slow = 1.0 + self._expert_share() * (mb.ep_imb / gemm_eff - 1.0)
        slow = slow * g.layers_stage * g.pp / arch.num_layers  # and the busiest pipeline stage
        return _Slowdown(gemm=gemm, gemm_eff=gemm_eff, slow=slow)

    def _recompute(self) -> _Recompute:
        """What activation recomputation reruns in the update (Megatron --recompute-modules,
        MindSpeed --moe-zero-memory; docs/cost-model.md "Activation memory"): full, one forward
        (and every collective); moe, the MoE layers' share of a forward (routed and shared experts)
        and their all-to-all; selective and none, nothing counted."""
        job = self.job
        fwd_flops = self.forward_flops_per_step()
        # recomputation: full reruns every layer's forward; moe reruns the MoE layers (routed
        # experts, and their dispatch and combine); selective's norms and SwiGLU are not counted
        moe_share = self._expert_share() + job.tokens_per_step * 2.0 * self.counts.shared_experts / fwd_flops
        return _Recompute(
            fwd={"full": 1.0, "moe": moe_share}.get(job.recompute, 0.0),
            moe=1.0 if job.recompute in ("full", "moe") else 0.0,
            tp=1.0 if job.recompute == "full" else 0.0,
        )

    def _compute_times(self, g: _Grid, slow: np.ndarray, rc: _Recompute) -> _Compute:
        """Compute seconds, attention timed at its own efficiency (docs/cost-model.md "Step time"):
          flops   = epochs x forward FLOPs x (3 + recomputed share)   (forward + backward = 3 forwards)
          timed   = 1 + attention share x (1 / attention_efficiency - 1)
          update  = epochs x forward FLOPs x (3 timed + recomputed share (x timed under full))
                    / (devices x peak x train_mfu) x slow
          forward = forward FLOPs x timed x log-prob padding / (devices x peak x logprob_mfu) x slow"""
        job, kn = self.job, self.knobs
        peak = self.train_peak_flops()
        fwd_flops = self.forward_flops_per_step()
        train_flops = job.ppo_epochs * fwd_flops * (3.0 + rc.fwd)
        # attention runs at its own fraction of the GEMMs' rate: time counts its FLOPs at that rate
        # (a recomputed MoE layer has none)
        timed = 1.0 + self.attention_share() * (1.0 / kn.attention_efficiency - 1.0)
        timed_flops = job.ppo_epochs * fwd_flops * (3.0 * timed + rc.fwd * (timed if job.recompute == "full" else 1.0))
        compute = timed_flops / (g.devices * peak * kn.train_mfu) * slow
        fwd_compute = fwd_flops * timed * self.logprob_padding / (g.devices * peak * kn.logprob_mfu) * slow
        return _Compute(flops=train_flops, update=compute, forward=fwd_compute)

    @staticmethod
    def _pipeline_bubble(g: _Grid, mb: _Micro, busy: np.ndarray) -> np.ndarray:
        """The 1F1B pipeline bubble of a pass that computes for `busy` seconds: busy x (PP - 1) / m
        (docs/cost-model.md "Step time": PP bubble)."""
        return busy * (g.pp - 1) / mb.m

    # -- train: communication terms --
    def _ep_all_to_all(self, g: _Grid, mb: _Micro, rc: _Recompute) -> _PassComm:
        """EP all-to-all, dispatch + combine per micro-batch and MoE layer of the busiest stage:
          bytes     = tokens per device x top_k x h x activation bytes x (EP - 1) / EP x imbalance
          per pass  = micro-batches per epoch x MoE layers x 2 x bytes / achieved a2a bandwidth
          update    = epochs x per pass x (2 + recomputed MoE)         (forward, backward, recompute)
        at the mean of the dispatch and combine bandwidths measured at the EP size, spread over
        EP x ETP devices (reference-figures.md "EP all-to-all bandwidth"), x a2a_efficiency."""
        arch, job, accel, kn = self.arch, self.job, self.accel, self.knobs
        ep, etp = g.ep, g.etp
        # EP all-to-all: per micro-batch and MoE layer of the busiest stage, dispatch + combine in
        # forward and again in backward (and in the recomputed forward)
        # an EP group's ranks sit etp apart (Megatron's expert rank order etp-ep-edp-pp)
        a2a_bw = 0.5 * (accel.a2a_bytes_per_s(ep, "dispatch", ep * etp) + accel.a2a_bytes_per_s(ep, "combine", ep * etp)) * kn.a2a_efficiency
        a2a_bytes = mb.t_dev * arch.moe.top_k * arch.hidden_size * job.activation_bytes * (ep - 1) / ep * mb.ep_imb
        per_pass = np.where(ep > 1, mb.micro_all * g.moe_stage * 2 * a2a_bytes / a2a_bw, 0.0)
        return _PassComm(per_pass=per_pass, update=job.ppo_epochs * per_pass * (2.0 + rc.moe))

    def _expert_tp_comm(self, g: _Grid, mb: _Micro, rc: _Recompute) -> _PassComm:
        """Expert TP, per micro-batch and MoE layer of the busiest stage: the dispatcher's all-gather
        of the routed tokens over the ETP group and its reduce-scatter before the combine:
          bytes     = tokens per device x top_k x h x activation bytes x (ETP - 1) x imbalance
          per pass  = micro-batches per epoch x MoE layers x 2 x bytes / link bandwidth(ETP)
          update    = epochs x per pass x (2 + recomputed MoE)"""
        arch, job = self.arch, self.job
        etp = g.etp
        # expert TP: the dispatcher all-gathers the routed tokens over the ETP group after the
        # all-to-all and reduce-scatters them before the combine
        etp_bytes = mb.t_dev * arch.moe.top_k * arch.hidden_size * job.activation_bytes * (etp - 1) * mb.ep_imb
        etp_pass = mb.micro_all * g.moe_stage * 2 * etp_bytes / self.accel.link_bytes_per_s(etp)
        return _PassComm(per_pass=etp_pass, update=job.ppo_epochs * etp_pass * (2.0 + rc.moe))

    def _tp_comm(self, g: _Grid, mb: _Micro, rc: _Recompute) -> _PassComm:
        """TP with sequence parallelism: 4 all-gathers / reduce-scatters per layer per forward pass
        over the busiest stage's layers:
          bytes     = micro_tokens / CP x h x activation bytes x (TP - 1) / TP
          per pass  = micro-batches per epoch x layers x 4 x bytes / link bandwidth(TP)
          update    = epochs x per pass x (2 + recomputed forward under full recompute)"""
        arch, job = self.arch, self.job
        tp = g.tp
        # TP (sequence-parallel) all-gather / reduce-scatter: 2 per block (mixer, MLP) per forward
        # pass, 4 per layer; a Nemotron-H layer is one block
        tp_bytes = job.micro_tokens / g.cp * arch.hidden_size * job.activation_bytes * (tp - 1) / tp
        tp_pass = mb.micro_all * g.layers_stage * 2 * arch.norms_per_layer * tp_bytes / self.accel.link_bytes_per_s(tp)
        return _PassComm(per_pass=tp_pass, update=job.ppo_epochs * tp_pass * (2.0 + rc.tp))

    def _cp_comm(self, g: _Grid, mb: _Micro, rc: _Recompute) -> _PassComm:
        """Context parallelism as Megatron-Core runs it (ring attention over the CP group, zig-zag
        chunks): in every attention layer each CP rank passes its K and V chunk CP - 1 hops round
        the ring in the forward, and K, V and their gradients in the backward:
          bytes     = micro_tokens / CP x (K + V width) / TP x activation bytes x (CP - 1)
          per pass  = micro-batches per epoch x layers x bytes / link bandwidth(TP x CP)
          update    = epochs x per pass x (3 + recomputed forward under full recompute)
        (the backward moves twice the forward's bytes; TP splits the heads, so each TP rank passes
        its own heads' share). MLA attends over every head's full K and V (num_kv_heads = heads)."""
        arch, job = self.arch, self.job
        att = arch.attention
        cp, tp = g.cp, g.tp
        kv_width = att.kv_width + att.num_kv_heads * att.v_dim
        cp_bytes = job.micro_tokens / cp * kv_width / tp * job.activation_bytes * (cp - 1)
        attending = g.layers_stage * self.n_attention / arch.num_layers  # a hybrid's attention layers only
        per_pass = np.where(cp > 1, mb.micro_all * attending * cp_bytes / self.accel.link_bytes_per_s(tp * cp), 0.0)
        return _PassComm(per_pass=per_pass, update=job.ppo_epochs * per_pass * (3.0 + rc.tp))

    def _dp_sync(self, g: _Grid, st: _States, peak_idx: np.ndarray) -> np.ndarray:
        """DP gradient reduce-scatter and parameter all-gather (distributed optimizer), once per
        optimizer step, for the update's busiest stage, over the links of one pipeline stage:
          per step = (dense params x (DP*CP - 1) / (DP*CP) + expert params x (EDP - 1) / EDP)
                     x (grad bytes + weight bytes) / link bandwidth(devices / PP)
        times epochs x mini-batches."""
        wb, gb, _ = self._state_bytes()
        dp, cp, edp = g.dp, g.cp, g.edp
        # DP: reduce-scatter grads and all-gather params once per optimizer step; a DP group and
        # an expert-DP group both span the devices of one pipeline stage (TP innermost)
        stage_bw = self.accel.link_bytes_per_s(g.devices / g.pp)
        dense_peak = st.dense_local[peak_idx]
        expert_peak = st.expert_local[peak_idx]
        sync = (dense_peak * (dp * cp - 1) / (dp * cp) + expert_peak * (edp - 1) / edp) * (gb + wb) / stage_bw
        steps = self.job.ppo_epochs * self.job.mini_batches
        return sync * steps

    def _optimizer_swap(self, swapped: np.ndarray | float) -> np.ndarray | float:
        """optimizer_swap (MindSpeed swap_optimizer): the optimizer state in and out over the host
        link each optimizer step, 2 x swapped bytes / host link bandwidth x epochs x mini-batches."""
        steps = self.job.ppo_epochs * self.job.mini_batches
        return 2.0 * swapped / self.accel.host_link_bytes_per_s * steps

    def _host_adam(self, g: _Grid, st: _States, peak_idx: np.ndarray) -> np.ndarray:
        """optimizer_offload_fraction (Megatron's hybrid device optimizer; verl / NeMo RL
        optimizer_cpu_offload): per optimizer step, for the host's share of the busiest stage's
        distributed-optimizer shard, fp32 gradients down and parameters back over the host link,
        and Adam on the host CPUs that the node's devices share:
          steps x fraction x shard params x ((4 + weight bytes) / host link bandwidth
                                             + node's devices / host Adam params per second)"""
        job, accel = self.job, self.accel
        wb = self._state_bytes()[0]
        o = g.owner
        steps = job.ppo_epochs * job.mini_batches
        # hybrid device optimizer: per step the host's share of gradients goes down (fp32), its
        # parameters come back (bf16), and the host CPUs, shared by the node's devices, run Adam
        # (the rank's distributed-optimizer shard: dense parameters over DP x CP, experts over EDP)
        shard_peak = (st.dense_local / g.dp_opt[o] + st.expert_local / g.edp_opt[o])[peak_idx]
        return steps * job.optimizer_offload_fraction * shard_peak * (
            (4.0 + wb) / accel.host_link_bytes_per_s
            + np.minimum(g.devices, accel.devices_per_node) / accel.host_adam_params_per_s
        )

    def _weight_sync_gather(self, g: _Grid) -> np.ndarray:
        """weight_sync gather and packed: every full tensor reaches each device through the slowest
        group it is gathered over,
          total params x 2 B / link bandwidth(span) [+ weight tensors x switch_tensor_s: gather only]
        with span = all devices when PP > 1, else max(TP, EP x ETP); 0 for weight_sync shard. gather
        hands the engine one tensor at a time (a fixed cost each: the call, its IPC handle or
        broadcast, the engine's load); packed one large buffer at a time, whose count is small."""
        if self.job.weight_sync == "shard":
            return np.zeros(g.n)
        # each device receives every full tensor of the model (bf16; its own shard is a small
        # part), through the slowest group it is gathered over; a pipeline broadcast spans the
        # whole job (pipeline stages are Megatron's outermost ranks)
        gather_span = np.where(g.pp > 1, g.devices, np.maximum(g.tp, g.ep * g.etp))
        gather = self.counts.total * BF16_BYTES / self.accel.link_bytes_per_s(gather_span)
        per_tensor = self.weight_tensors * self.knobs.switch_tensor_s if self.job.weight_sync == "gather" else 0.0
        return gather + per_tensor

    def _stage_activation(self, tokens, sums, imbalance, in_flight, is_last, transient=True):
        """Activation bytes a pipeline stage holds at its peak: `in_flight` micro-batches of
        `tokens` tokens per device saved for backward (layer inputs only under full recompute),
        plus one layer (under recompute moe: one MoE layer's inside) rebuilt in backward (`transient`), plus the output
        head's saved tensors on the last stage. `sums`: the stage's layers, MoE layers and
        per-layer saved bytes (`act_fixed`, routed copies apart)."""
        n_moe = sums["moe"]
        routed = self.act_routed * imbalance
        if self.job.recompute == "full":
            saved = sums["layers"] * self.act.layer_input
            biggest = np.where(n_moe > 0, self.act_moe_layer + routed, self.act_dense_layer)
            held = tokens * (in_flight * saved + (biggest if transient else 0.0))
        else:
            per_mb = sums["act_fixed"] + n_moe * routed
            held = tokens * in_flight * per_mb
            if self.job.recompute == "moe" and transient:  # one MoE layer rebuilt in backward
                held = held + tokens * np.where(n_moe > 0, self.work_moe_inside + self.work_routed * imbalance, 0.0)
        return held + is_last * tokens * self.act_output

    def forward_flops_per_step(self) -> float:
        """Model FLOPs of one forward pass over every token of the step: 2 per active matmul
        parameter per token (PaLM appendix B) plus causal attention over the length distribution."""
        job = self.job
        return job.tokens_per_step * self.matmul_flops_per_token + job.num_sequences * self.train_pairs_per_seq * self.attn_flops_per_pair

    def attention_share(self) -> float:
        """Causal attention's share of the forward pass's FLOPs."""
        job = self.job
        return job.num_sequences * self.train_pairs_per_seq * self.attn_flops_per_pair / self.forward_flops_per_step()

    def update_model_flops(self) -> float:
        """Model FLOPs of the update (forward + backward = 3 forwards, per epoch; PPO adds the
        critic), the numerator of the MFU verl reports; recomputation is not model FLOPs."""
        models = float(self.job.trained_models)
        return 3.0 * self.job.ppo_epochs * self.forward_flops_per_step() * models

    def saved_activation_bytes(self, tokens: float) -> float:
        """Bytes one forward pass over `tokens` tokens saves for backward on a single device (no
        parallelism, one micro-batch, balanced routing): what saved_tensors_hooks measure."""
        arch = self.arch
        whole = {f: self._prefix[f][-1] for f in ("moe", "act_fixed")} | {"layers": float(arch.num_layers)}
        return float(self._stage_activation(tokens, whole, 1.0, 1.0, 1.0, transient=False))

    def model_state_bytes(self) -> dict[str, float]:
        """Weights, gradients and optimizer state of the whole model on one device (no sharding)."""
        cand = TrainCandidates.of([(1, 1, 1, 1, 1, 1)])
        te = self.train(cand)
        return {"weights": float(te.weights_bytes[0]), "grads": float(te.grads_bytes[0]), "optimizer": float(te.optimizer_bytes[0])}

    @staticmethod
    def _argmax_by_owner(values: np.ndarray, starts: np.ndarray, owner: np.ndarray) -> np.ndarray:
        """Index into `values` of each owner's maximum (owners contiguous, beginning at `starts`)."""
        best = np.maximum.reduceat(values, starts)
        hits = np.flatnonzero(values == best[owner])
        _, first = np.unique(owner[hits], return_index=True)
        return hits[first]

    def train_peak_flops(self) -> float:
        """The matmul peak the training passes are timed at: the training precision's, except FP8,
        timed at the bf16 peak x FP8_TRAIN_SPEEDUP (refused on a device without FP8)."""
        if self.job.precision == "fp8":
            self.accel.peak_flops("fp8")  # raises where the device has no FP8
            return self.accel.peak_bf16_flops * FP8_TRAIN_SPEEDUP
        return self.accel.peak_flops(self.job.precision)

    # ---- rollout side -------------------------------------------------------------------------
    def rollout_peak_flops(self) -> float:
        return self.accel.peak_flops(self.job.rollout_precision)

    def rollout_weight_bytes(self, cand: RolloutCandidates) -> np.ndarray:
        """Inference weights on one device: the linear layers' (attention projections, dense and
        shared MLPs, routed experts) in the rollout precision, embeddings, output head, norms and
        router in bf16 (as vLLM's FP8 serving keeps them)."""
        arch, c = self.arch, self.counts
        tp = cand.tp.astype(float)
        inst = cand.instance.astype(float)
        a = arch.attention
        kv_split = np.minimum(tp, a.num_kv_heads) if a.kind == "gqa" else tp
        sharded, kvp = self.attn_sharded_total, self.attn_kv_total
        replicated_attn = c.attention - sharded - kvp
        linear_bytes = self._rollout_linear_bytes()
        linear = (sharded + c.shared_experts + c.dense_mlp) / tp + kvp / kv_split + replicated_attn + c.routed_experts / inst  # MoE spans the instance
        kept_bf16 = (c.embeddings + c.lm_head) / tp + c.norms + c.router
        return linear * linear_bytes + kept_bf16 * BF16_BYTES

    def _rollout_linear_bytes(self) -> float:
        return FP8_BYTES if self.job.rollout_precision == "fp8" else BF16_BYTES

    def kv_bytes_per_token(self, cand: RolloutCandidates) -> np.ndarray:
        """KV-cache bytes one token of context costs on one device (bf16 cache), over the attention
        layers (all of them but a hybrid's linear ones)."""
        a = self.arch.attention
        tp = cand.tp.astype(float)
        if a.kind == "mla":  # latent + rope key per layer, replicated on every TP rank (vLLM MLA)
            per_layer = np.full_like(tp, (a.kv_lora_rank + a.qk_rope_head_dim) * BF16_BYTES)
        else:
            local_heads = np.maximum(1.0, np.ceil(a.num_kv_heads / tp))
            per_layer = 2.0 * local_heads * a.head_dim * BF16_BYTES  # K and V
        return per_layer * self.n_attention

    def state_bytes_per_sequence(self, cand: RolloutCandidates) -> np.ndarray:
        """A hybrid's fixed cache per sequence on one device: each linear layer's recurrent state
        (in the engine's state precision) and its convolution window (bf16), heads split over TP."""
        m = self.arch.linear
        if m is None:
            return np.zeros(len(cand.tp))
        per_layer = m.state_elements * m.state_bytes + m.conv_state_elements * BF16_BYTES
        return self.n_linear * per_layer / cand.tp.astype(float)

    def kv_sequence_bytes(self, cand: RolloutCandidates, context: float) -> np.ndarray:
        """Cache bytes of one sequence of `context` tokens on one device: the KV cache (windowed
        layers capped) and a hybrid's fixed linear-layer state."""
        kept = 0.0
        for w, layers in self._groups:
            kept += layers * (context if w is None else min(context, w[1]))
        return self.kv_bytes_per_token(cand) * kept / max(self.n_attention, 1) + self.state_bytes_per_sequence(cand)

    def rollout(self, cand: RolloutCandidates, kept_train_bytes: np.ndarray | float = 0.0) -> RolloutEval:
        """Memory and time of the rollout for each candidate engine layout, with `kept_train_bytes`
        of training states left on each device: the terms below, one method each, assembled."""
        job, L = self.job, self.lengths
        r = self._rollout_grid(cand)
        workspace = self._rollout_workspace(r)
        kv = self._kv_concurrency(cand, r, workspace, kept_train_bytes)
        step_fixed = self._decode_step_fixed(r)
        prefill = self._prefill(r, kv)
        decode, extra_steps = self._decode(r, kv, step_fixed)
        # DAPO dynamic sampling: further rounds of the same size, each with its own long tail
        rounds = job.rollout_oversampling
        prefill, decode = prefill * rounds, decode * rounds
        n_steps = (float(sum(L.bin_steps)) + extra_steps) * rounds
        return RolloutEval(
            weights_bytes=r.weights,
            workspace_bytes=workspace,
            kv_budget_bytes=kv.budget,
            kv_per_sequence_bytes=kv.seq_max,
            concurrency=kv.conc,
            sequences_per_rank=kv.n_rank,
            prefill_s=prefill,
            decode_s=decode,
            rollout_s=prefill + decode,
            decode_steps=n_steps,
            decode_overhead_s=n_steps * step_fixed,
        )

    def _rollout_grid(self, cand: RolloutCandidates) -> _RolloutGrid:
        """The engine layouts as floats (vLLM rules, planner.cost.layouts: an instance spans TP x DP
        devices, its MoE layers expert- or tensor-parallel over it), the inference weights per
        device (`rollout_weight_bytes`), the routed experts' part of them (bf16, over the
        instance), the KV bytes per token (`kv_bytes_per_token`) and the TP and instance links."""
        tp = cand.tp.astype(float)
        inst = cand.instance.astype(float)
        weights = self.rollout_weight_bytes(cand)
        expert_bytes_dev = self.routed_total / inst * self._rollout_linear_bytes()
        return _RolloutGrid(
            tp=tp, inst=inst, dp=cand.dp.astype(float), expert_parallel=cand.ep > 1,
            weights=weights, expert_bytes=expert_bytes_dev, nonexpert_bytes=weights - expert_bytes_dev,
            kv_tok=self.kv_bytes_per_token(cand), state_seq=self.state_bytes_per_sequence(cand), tp_bw=self.accel.link_bytes_per_s(tp), inst_bw=self.accel.link_bytes_per_s(inst),
        )

    def _rollout_workspace(self, r: _RolloutGrid) -> np.ndarray:
        """The engine's activation workspace, reserved up front by its profiling run for one batch of
        ROLLOUT_BATCHED_TOKENS (vLLM max_num_batched_tokens):
          tokens x (2 B x (4 h + 2 x widest MLP / TP) + 4 B x vocab / TP)"""
        arch = self.arch
        h = arch.hidden_size
        widest = max(arch.dense_intermediate, arch.moe.shared_intermediate, arch.moe.expert_intermediate * arch.moe.top_k)
        # the engine's activation workspace for one batch of ROLLOUT_BATCHED_TOKENS: per token, four
        # hidden-wide bf16 buffers (residual, normed input, attention output, MLP output) and the widest
        # MLP's gate and up projections split over TP, plus the fp32 logits over the TP-split vocabulary
        return ROLLOUT_BATCHED_TOKENS * (BF16_BYTES * (4 * h + 2 * widest / r.tp) + FP32_BYTES * arch.vocab_size / r.tp)

    def _kv_concurrency(self, cand: RolloutCandidates, r: _RolloutGrid, workspace: np.ndarray,
                        kept_train_bytes: np.ndarray | float) -> _KV:  # fmt: skip
        """KV budget and concurrency (docs/cost-model.md "Memory per device"):
          budget      = rollout_memory_utilization x usable HBM - weights - workspace - kept training states
          concurrency = max(1, min(sequences per DP rank per round, floor(budget / KV of one sequence
                        at its expected live context))), at most rollout_max_seqs (vLLM max_num_seqs)"""
        job, L = self.job, self.lengths
        kept = np.broadcast_to(np.asarray(kept_train_bytes, dtype=float), r.tp.shape)
        budget = job.rollout_memory_utilization * self.accel.usable_bytes - r.weights - workspace - kept
        seq_max = self.kv_sequence_bytes(cand, job.max_sequence_tokens)
        live_ctx = job.prompt_tokens.mean + L.live_context_extra
        capacity = np.maximum(budget, 0.0) / self.kv_sequence_bytes(cand, live_ctx)
        n_rank = job.num_sequences / (cand.instances.astype(float) * r.dp)  # per generation round
        conc = np.maximum(np.minimum(n_rank, np.floor(capacity)), 1.0)
        if job.rollout_max_seqs is not None:
            conc = np.minimum(conc, float(job.rollout_max_seqs))
        return _KV(budget=budget, seq_max=seq_max, live_ctx=live_ctx, n_rank=n_rank, conc=conc)

    def _prefill(self, r: _RolloutGrid, kv: _KV) -> np.ndarray:
        """Prefill, compute-bound over the instance, in the rollout precision whatever the training's:
          sequences x (prompt x matmul FLOPs per token + attended pairs x FLOPs per pair)
          / (instance devices x rollout peak x logprob_mfu)      (FLOPs: PaLM appendix B, `_flops`)"""
        peak = self.rollout_peak_flops()  # the engine's precision, whatever the training's
        prompt = self.job.prompt_tokens.mean
        # prefill: compute-bound over the instance
        prefill_flops = kv.n_rank * r.dp * (prompt * self.matmul_flops_per_token + self.prefill_pairs_per_seq * self.attn_flops_per_pair)
        return prefill_flops / (r.inst * peak * self.knobs.logprob_mfu)

    def _decode(self, r: _RolloutGrid, kv: _KV, step_fixed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Decode seconds of one generation round and the queue's extra steps (docs/cost-model.md
        "Step time"): the sum over the length model's step bins of steps x `_decode_step` at the
        surviving batch (concurrency x survival) and the bin's context, plus, when a DP rank has
        more sequences than the KV pool holds, (sequences - concurrency) x mean length /
        concurrency full-batch steps at the live context."""
        L, prompt, spec = self.lengths, self.job.prompt_tokens.mean, self.job.speculative
        # decode: sum over step bins of the step time at the live batch, all bins at once (rows: bins,
        # columns: candidates)
        steps = np.asarray(L.bin_steps, dtype=float)[:, None]
        batch = kv.conc[None, :] * np.asarray(L.survival, dtype=float)[:, None]
        context = np.broadcast_to(prompt + np.asarray(L.bin_mid, dtype=float)[:, None], batch.shape)
        per_bin = steps * self._decode_step(r, step_fixed, batch, context)
        if spec is not None:
            # speculation where the rank's batch is at most max_batch: accept_length tokens a step,
            # each step verifying draft_tokens + 1 tokens of every sequence
            on = batch <= spec.max_batch if spec.max_batch else np.ones_like(batch, dtype=bool)
            verify = steps / spec.accept_length * self._decode_step(r, step_fixed, batch, context, spec.draft_tokens + 1)
            per_bin = np.where(on, verify, per_bin)
        decode = per_bin.sum(axis=0)
        # more sequences than the KV pool holds: full-batch steps until the queue drains
        extra_steps = np.maximum(kv.n_rank - kv.conc, 0.0) * L.mean / kv.conc
        decode = decode + extra_steps * self._decode_step(r, step_fixed, kv.conc, np.full_like(r.tp, kv.live_ctx))
        return decode, extra_steps

    def _decode_step(self, r: _RolloutGrid, step_fixed: np.ndarray, batch: np.ndarray, context: np.ndarray, tokens: int = 1) -> np.ndarray:
        """One decode step at `batch` sequences per DP rank and `context` tokens, `tokens` new tokens
        per sequence (a speculative verification step: the drafts and the bonus): the roofline time
        (`_decode_roofline`) + the per-layer communication (`_decode_comm`) + the fixed cost
        (`_decode_step_fixed`) (docs/cost-model.md "Step time")."""
        return self._decode_roofline(r, batch, context, tokens) + self._decode_comm(r, batch * tokens) + step_fixed

    def _decode_roofline(self, r: _RolloutGrid, batch: np.ndarray, context: np.ndarray, tokens: int = 1) -> np.ndarray:
        """max(bytes / (HBM bandwidth x decode_mbu), FLOPs / (rollout peak x logprob_mfu)) of one decode
        step (docs/cost-model.md "Step time"), with
          bytes = non-expert weights + expert bytes x (1 - (1 - k/E)^(tokens x batch x DP)) + batch x KV read
          FLOPs = tokens x batch x (matmul FLOPs per token + FLOPs per pair x attended keys) / TP
        with `tokens` new tokens per sequence (1; a speculative verification step's drafts + 1, which
        read each sequence's KV once)."""
        arch, accel, kn = self.arch, self.accel, self.knobs
        peak = self.rollout_peak_flops()  # the engine's precision, whatever the training's
        k_over_e = arch.moe.top_k / arch.moe.num_experts
        touched = 1.0 - (1.0 - k_over_e) ** (tokens * batch * r.dp)
        span = self._span(context)
        # each sequence reads its KV over the attended keys, and reads and writes a hybrid's state
        nbytes = r.nonexpert_bytes + r.expert_bytes * touched + batch * (r.kv_tok * span / max(self.n_attention, 1) + 2.0 * r.state_seq)
        flops = tokens * batch * (self.matmul_flops_per_token + self.attn_flops_per_pair * span) / r.tp
        return np.maximum(nbytes / (accel.hbm_bytes_per_s * kn.decode_mbu), flops / (peak * kn.logprob_mfu))

    def _decode_comm(self, r: _RolloutGrid, batch: np.ndarray) -> np.ndarray:
        """Communication seconds of one decode step (docs/cost-model.md "Step time"), bytes over the
        group's link bandwidth, per layer:
          attention   ring all-reduce over TP, 2 x batch x h x 2 B x (TP - 1) / TP
          MoE layer   EP: dispatch + combine, 2 x batch / TP x top_k x h x 2 B x (inst - 1) / inst;
                      experts tensor-parallel: ring all-reduce of the instance's tokens,
                      2 x batch x DP x h x 2 B x (inst - 1) / inst"""
        arch = self.arch
        h, tp, inst = arch.hidden_size, r.tp, r.inst
        # per layer: attention TP all-reduce; MoE dispatch + combine (EP) or all-reduce of the
        # instance's tokens (experts tensor-parallel over the instance)
        attn_comm = 2.0 * batch * h * BF16_BYTES * (tp - 1) / tp / r.tp_bw  # ring all-reduce: 2 (tp - 1) / tp of the bytes
        moe_comm = np.where(
            r.expert_parallel,
            2.0 * batch / tp * arch.moe.top_k * h * BF16_BYTES * (inst - 1) / inst / r.inst_bw,  # dispatch and combine
            2.0 * batch * r.dp * h * BF16_BYTES * (inst - 1) / inst / r.inst_bw,  # ring all-reduce
        )
        return (arch.num_layers - arch.layer_mixers.count("none")) * attn_comm + arch.num_moe_layers * moe_comm

    def _decode_step_fixed(self, r: _RolloutGrid) -> np.ndarray:
        """The fixed cost of one decode step (docs/cost-model.md "Step time"): decode_step_overhead_s
        + (eager mode) layers x eager_layer_s + the latency of each layer's small collectives,
        (layers + dense layers) x TP latency + MoE layers x (1 or 2) x instance latency."""
        arch, accel = self.arch, self.accel
        # fixed cost of one decode step: the scheduler and sampler; in eager mode every layer's
        # kernels are launched from Python; and the latency of each layer's small collectives:
        # attention's TP all-reduce, and for the MoE block dispatch + combine (EP) or one
        # all-reduce over the instance (two, gather and reduce-scatter, when DP ranks share it)
        dense_layers = arch.num_layers - arch.num_moe_layers
        moe_collectives = np.where(r.expert_parallel | (r.dp > 1), 2.0, 1.0) * (r.inst > 1)
        latency = (arch.num_layers + dense_layers) * (r.tp > 1) * accel.latency_s(r.tp) + arch.num_moe_layers * moe_collectives * accel.latency_s(r.inst)
        eager = 0.0 if self.job.rollout_graphs else arch.num_layers * accel.eager_layer_s
        return self.knobs.decode_step_overhead_s + eager + latency

    # ---- switching between phases -----------------------------------------------------------
    def pool_sync_seconds(self, train: TrainEval, ti: int, rollout: RolloutEval, ri: int) -> float:
        """The trained weights sent from the training pool to a rollout pool of its own, per step
        (colocated: false): for `gather` and `packed` the training side's gather of every full
        tensor (as in the colocated switch; `gather` with its cost per tensor) and the whole bf16
        model over the network between the pools; for `shard` each rollout device's shard over the
        network. No host moves and no engine sleep or wake: each pool keeps its memory."""
        net = self.accel.inter_node_bytes_per_s
        if self.job.weight_sync == "shard":
            return float(rollout.weights_bytes[ri] / net)
        return float(train.switch_gather_s[ti]) + self.counts.total * BF16_BYTES / net

    def switch_seconds(self, train: TrainEval, ti: int, rollout: RolloutEval, ri: int, rollout_instance: int) -> float:
        """Host moves, weight sync and the fixed engine costs (sleep/wake, cache release) of one step.

        The training layout's part (TrainEval.switch_train_s: host moves; `gather` and `packed`, verl's
        and NeMo RL's weight sync, the full model over the training groups) plus, for
        `shard` (cann-recipes' all-to-all-v), each device's rollout shard over the instance's links."""
        shard = 0.0
        if self.job.weight_sync == "shard":
            shard = float(rollout.weights_bytes[ri] / self.accel.link_bytes_per_s(rollout_instance))
        return float(train.switch_train_s[ti]) + shard + self.knobs.switch_fixed_s
