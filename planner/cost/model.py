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

import numpy as np

from planner.arch import Architecture, count_parameters, expert_params, layer_params
from planner.cost.activations import layer_activation_bytes, output_activation_bytes
from planner.cost.hardware import Accelerator
from planner.cost.knobs import Knobs, load_knobs
from planner.cost.layouts import RolloutCandidates, TrainCandidates
from planner.cost.lengths import LengthModel
from planner.specs import Job

__all__ = ["CostModel", "TrainEval", "RolloutEval", "HOST_USABLE_FRACTION", "ROLLOUT_BATCHED_TOKENS", "BF16_BYTES", "FP32_BYTES"]

# Host RAM a node can give to offloaded tensors; the rest stays for the OS, dataloaders, Ray and
# pinned staging buffers (assumption, stated in reports).
HOST_USABLE_FRACTION = 0.8
# Tokens one rollout-engine forward may process at once (vLLM max_num_batched_tokens); its
# activation workspace is reserved up front by the engine's profiling run.
ROLLOUT_BATCHED_TOKENS = 8192
BF16_BYTES = 2.0  # bytes per element of a bf16 tensor: rollout weights, KV cache, activations on the wire
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
    switch_gather_s: np.ndarray  # weight_sync gather: every full tensor over the training groups (0 for shard)
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


GEMM_HALF_FLOPS = 0.6e9  # the GEMM size at which efficiency is half its large-GEMM value (Calculon, see above)


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
        act = layer_activation_bytes(arch, act_bytes=job.activation_bytes, backend=job.trainer_backend, recompute=job.recompute)
        self.act = act
        k = arch.moe.top_k
        # per token, per layer kind, at imbalance 1 (the routed part scales separately)
        self.act_moe_layer = act.attention + act.moe_fixed
        self.act_routed = act.routed_per_copy * k  # per token at imbalance 1
        self.act_dense_layer = act.attention + act.dense
        self.act_output = output_activation_bytes(arch, act_bytes=job.activation_bytes, backend=job.trainer_backend)
        # what one layer holds while it runs, whatever the update recomputes: forward-only passes,
        # and the MoE layer that recompute moe rebuilds in backward
        whole = layer_activation_bytes(arch, act_bytes=job.activation_bytes, backend=job.trainer_backend, recompute="none")
        self.work_moe_layer = whole.attention + whole.moe_fixed
        self.work_moe_inside = whole.moe_fixed - act.moe_fixed  # rebuilt in backward under recompute moe
        self.work_routed = whole.routed_per_copy * k
        self.work_dense_layer = whole.attention + whole.dense
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

    def _flops(self) -> None:
        arch, job, L = self.arch, self.job, self.lengths
        a = arch.attention
        # Forward FLOPs per token in matmuls: 2 per active parameter, the embedding lookup excluded
        # (PaLM appendix B; Megatron num_floating_point_operations counts the router too: we do).
        # A tied output head still multiplies: count it once for the lookup-free embedding.
        tied_head = arch.vocab_size * arch.hidden_size if arch.tie_embeddings else 0
        self.matmul_flops_per_token = 2.0 * (self.counts.active - self.counts.embeddings + tied_head)
        self.expert_flops_per_token = 2.0 * arch.num_moe_layers * arch.moe.top_k * self.expert_params
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim if a.kind == "mla" else a.head_dim
        # QK^T and AV per query and attended key: 2*heads*(d_qk + d_v) FLOPs
        self.attn_flops_per_pair = 2.0 * a.num_heads * (qk + a.v_dim)
        groups: dict = {}
        for w in arch.layer_windows:
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
        arch, job, accel, kn = self.arch, self.job, self.accel, self.knobs
        wb, gb, ob = self._state_bytes()
        devices = cand.devices.astype(float)
        tp, pp, ep, cp, etp = (x.astype(float) for x in (cand.tp, cand.pp, cand.ep, cand.cp, cand.etp))
        dp = devices / (tp * pp * cp)
        edp = devices / (etp * ep * pp)
        dp_opt = dp * cp if job.distributed_optimizer else np.ones_like(dp)
        edp_opt = edp if job.distributed_optimizer else np.ones_like(dp)
        models = float(job.trained_models)  # PPO: a critic of the actor's size

        owner, stage, ppf, starts, s = self._stages(cand)
        o = owner
        is_first = (stage == 0).astype(float)
        is_last = (stage == ppf - 1).astype(float)
        # the output layer: untied, or (tied, PP > 1) a copy Megatron keeps on the last stage
        head = self.head_params if self.head_params else np.where(ppf > 1, self.embedding_params, 0.0)
        dense_local = (
            (s["attention_sharded"] + s["attention_kv"] + s["shared_experts"] + s["dense_mlp"]) / tp[o]
            + s["attention_replicated"]
            + s["norms"]
            + s["router"]
            + is_first * self.embedding_params / tp[o]
            + is_last * (head / tp[o] + self.final_norm_params)
        )
        expert_local = s["routed_experts"] / (ep[o] * etp[o])
        params_local = dense_local + expert_local
        router_extra = 0.0
        if job.trainer_backend == "transformers" and arch.moe.router_fp32:
            router_extra = s["router"] * (4 - wb)  # fp32 router weights in a bf16 model
        weights = params_local * wb + router_extra
        grads = params_local * gb + router_extra
        opt_all = dense_local * ob / dp_opt[o] + expert_local * ob / edp_opt[o] + 2 * router_extra
        # swapped optimizer state lives on the host and streams in for the step; an offloaded
        # fraction lives (and is stepped) on the host for good
        host_frac = job.optimizer_offload_fraction
        opt = opt_all * 0.0 if job.optimizer_swap else opt_all * (1.0 - host_frac)
        off = job.offload
        # what stays on the device while another phase (rollout, reference) runs
        kept = weights * (not off.params) + grads * (not off.grads) + opt * (not off.optimizer)

        # micro-batches per DP rank per optimizer step, and tokens per device per micro-batch
        tokens_opt = job.tokens_per_step / job.mini_batches
        m = np.maximum(1.0, np.ceil(tokens_opt / (dp * job.micro_tokens)))
        t_dev = job.micro_tokens / (cp * tp)
        ep_imb = np.where(ep > 1, self.imbalance, 1.0)
        n_moe = s["moe"]
        in_flight = np.minimum(ppf - stage, m[o])
        act = self._stage_activation(t_dev[o], n_moe, s["layers"], ep_imb[o], in_flight, is_last)
        other_model = (models - 1.0) * kept  # the critic's (or actor's) states kept meanwhile
        update_stage = weights + grads + opt + act + other_model
        # forward-only pass: weights and one layer's working set plus the output log-probs
        fwd_work = t_dev[o] * (np.maximum(self.work_moe_layer + self.work_routed, self.work_dense_layer) + is_last * self.act_output)
        logprob_stage = weights + fwd_work + (kept - weights * (not off.params)) + other_model
        reference_stage = params_local * wb + fwd_work + models * kept

        peak_idx = self._argmax_by_owner(update_stage, starts, owner)
        update_bytes = update_stage[peak_idx]
        logprob_bytes = np.maximum.reduceat(logprob_stage, starts)
        reference_bytes = np.maximum.reduceat(reference_stage, starts) if job.reference_model else np.zeros(len(cand))
        kept_max = models * np.maximum.reduceat(kept, starts)
        moved = models * np.maximum.reduceat(weights + grads + opt - kept, starts)  # offloaded, per device
        ref_weights = np.maximum.reduceat(params_local * wb, starts) if job.reference_model else np.zeros(len(cand))
        swapped = models * np.maximum.reduceat(opt_all, starts) if job.optimizer_swap else 0.0
        on_host = models * np.maximum.reduceat(opt_all, starts) * host_frac  # the host optimizer's share
        host_per_node = (moved + ref_weights + swapped + on_host) * np.minimum(devices, accel.devices_per_node)
        # host link, each way, per step: the offloaded states come back for the update, the actor's
        # weights once more for the old log-prob pass, the reference weights for theirs
        moved_params = models * np.maximum.reduceat(weights, starts) * off.params
        host_moves = moved + ref_weights + (0.0 if job.skip_old_logprob else moved_params)

        # ---- time --------------------------------------------------------------------------
        peak = accel.peak_flops(job.precision)
        fwd_flops = self.forward_flops_per_step()
        expert_share = job.tokens_per_step * self.expert_flops_per_token / fwd_flops
        # expert GEMMs: the busiest EP rank sets the pace, and a small GEMM runs below the dense
        # layers' efficiency (Calculon's op-size curve: 0.6 at 1 GFLOP, 0.9 at 16; fitted as
        # g / (g + 0.6 GFLOP)). Per micro-batch one expert sees micro_tokens x ep x etp / (tp x cp)
        # tokens x top_k / E, over a width I / etp: narrow expert-TP slices and EP1 make small GEMMs
        gemm = 2.0 * job.micro_tokens * ep * arch.moe.top_k * arch.hidden_size * arch.moe.expert_intermediate / (tp * cp * arch.moe.num_experts)
        gemm_eff = gemm / (gemm + GEMM_HALF_FLOPS)
        slow = 1.0 + expert_share * (ep_imb / gemm_eff - 1.0)
        moe_stage = np.maximum.reduceat(n_moe, starts)
        layers_stage = np.maximum.reduceat(s["layers"], starts)
        slow = slow * layers_stage * pp / arch.num_layers  # and the busiest pipeline stage
        # recomputation: full reruns every layer's forward; moe reruns the MoE layers (routed
        # experts, and their dispatch and combine); selective's norms and SwiGLU are not counted
        moe_share = expert_share + job.tokens_per_step * 2.0 * self.counts.shared_experts / fwd_flops
        recompute_fwd = {"full": 1.0, "moe": moe_share}.get(job.recompute, 0.0)
        recompute_moe = 1.0 if job.recompute in ("full", "moe") else 0.0
        recompute_tp = 1.0 if job.recompute == "full" else 0.0
        train_flops = job.ppo_epochs * fwd_flops * (3.0 + recompute_fwd)
        # attention runs at its own fraction of the GEMMs' rate: time counts its FLOPs at that rate
        # (a recomputed MoE layer has none)
        timed = 1.0 + self.attention_share() * (1.0 / kn.attention_efficiency - 1.0)
        timed_flops = job.ppo_epochs * fwd_flops * (3.0 * timed + recompute_fwd * (timed if job.recompute == "full" else 1.0))
        compute = timed_flops / (devices * peak * kn.train_mfu) * slow
        fwd_compute = fwd_flops * timed * self.logprob_padding / (devices * peak * kn.logprob_mfu) * slow
        bubble = compute * (pp - 1) / m
        fwd_bubble = fwd_compute * (pp - 1) / m

        # EP all-to-all: per micro-batch and MoE layer of the busiest stage, dispatch + combine in
        # forward and again in backward (and in the recomputed forward)
        # an EP group's ranks sit etp apart (Megatron's expert rank order etp-ep-edp-pp)
        a2a_bw = 0.5 * (accel.a2a_bytes_per_s(ep, "dispatch", ep * etp) + accel.a2a_bytes_per_s(ep, "combine", ep * etp)) * kn.a2a_efficiency
        micro_all = m * job.mini_batches  # micro-batches per DP rank per epoch
        a2a_bytes = t_dev * arch.moe.top_k * arch.hidden_size * job.activation_bytes * (ep - 1) / ep * ep_imb
        per_pass = np.where(ep > 1, micro_all * moe_stage * 2 * a2a_bytes / a2a_bw, 0.0)
        a2a_update = job.ppo_epochs * per_pass * (2.0 + recompute_moe)
        # expert TP: the dispatcher all-gathers the routed tokens over the ETP group after the
        # all-to-all and reduce-scatters them before the combine
        etp_bytes = t_dev * arch.moe.top_k * arch.hidden_size * job.activation_bytes * (etp - 1) * ep_imb
        etp_pass = micro_all * moe_stage * 2 * etp_bytes / accel.link_bytes_per_s(etp)
        etp_update = job.ppo_epochs * etp_pass * (2.0 + recompute_moe)
        # TP (sequence-parallel) all-gather / reduce-scatter: 4 per layer per forward pass
        tp_bytes = job.micro_tokens / cp * arch.hidden_size * job.activation_bytes * (tp - 1) / tp
        tp_pass = micro_all * layers_stage * 4 * tp_bytes / accel.link_bytes_per_s(tp)
        tp_update = job.ppo_epochs * tp_pass * (2.0 + recompute_tp)
        # DP: reduce-scatter grads and all-gather params once per optimizer step; a DP group and
        # an expert-DP group both span the devices of one pipeline stage (TP innermost)
        stage_bw = accel.link_bytes_per_s(devices / pp)
        dense_peak = dense_local[peak_idx]
        expert_peak = expert_local[peak_idx]
        sync = (dense_peak * (dp * cp - 1) / (dp * cp) + expert_peak * (edp - 1) / edp) * (gb + wb) / stage_bw
        steps = job.ppo_epochs * job.mini_batches
        swap = 2.0 * swapped / accel.host_link_bytes_per_s * steps
        # hybrid device optimizer: per step the host's share of gradients goes down (fp32), its
        # parameters come back (bf16), and the host CPUs, shared by the node's devices, run Adam
        # (the rank's distributed-optimizer shard: dense parameters over DP x CP, experts over EDP)
        shard_peak = (dense_local / dp_opt[o] + expert_local / edp_opt[o])[peak_idx]
        host_adam = steps * host_frac * shard_peak * (
            (4.0 + wb) / accel.host_link_bytes_per_s
            + np.minimum(devices, accel.devices_per_node) / accel.host_adam_params_per_s
        )
        update = (compute + bubble + a2a_update + etp_update + tp_update + sync * steps + swap + host_adam) * models
        logprob = fwd_compute + fwd_bubble + per_pass + etp_pass + tp_pass
        # weight_sync gather: each device receives every full tensor of the model (bf16; its own
        # shard is a small part), through the slowest group it is gathered over; a pipeline
        # broadcast spans the whole job (pipeline stages are Megatron's outermost ranks)
        gather_span = np.where(pp > 1, devices, np.maximum(tp, ep * etp))
        gather = self.counts.total * BF16_BYTES / accel.link_bytes_per_s(gather_span) + self.weight_tensors * kn.switch_tensor_s
        gather = gather if job.weight_sync == "gather" else np.zeros(len(cand))
        zeros = np.zeros(len(cand))
        dispatch = job.dispatch  # as the job gives it: data reaching every rank before a pass starts
        return TrainEval(
            weights_bytes=weights[peak_idx],
            grads_bytes=grads[peak_idx],
            optimizer_bytes=opt[peak_idx],
            activations_bytes=act[peak_idx],
            other_model_bytes=other_model[peak_idx],
            update_bytes=update_bytes,
            logprob_bytes=logprob_bytes,
            reference_bytes=reference_bytes,
            kept_bytes=kept_max,
            switch_host_s=2.0 * host_moves / accel.host_link_bytes_per_s,
            switch_gather_s=gather,
            host_bytes_per_node=host_per_node,
            update_s=update + dispatch.get("update", 0.0),
            reference_s=logprob + dispatch.get("reference", 0.0) if job.reference_model else zeros,
            old_logprob_s=zeros if job.skip_old_logprob else logprob + dispatch.get("old_logprob", 0.0),
            values_s=logprob if job.algorithm == "ppo" else zeros,
            update_compute_s=compute,
            update_a2a_s=a2a_update,
            update_bubble_s=bubble,
            update_flops=train_flops,
            update_tp_s=tp_update,
            update_sync_s=sync * steps,
            update_swap_s=swap * np.ones(len(cand)),
            update_host_adam_s=host_adam,
            update_etp_s=etp_update,
            expert_gemm_flops=gemm,
            expert_gemm_efficiency=gemm_eff,
            compute_slowdown=slow,
            micro_batches=m,
            uneven_pp=self._uneven(len(cand), o, s["layers"]),
        )

    def _stage_activation(self, tokens, n_moe, n_layers, imbalance, in_flight, is_last, transient=True):
        """Activation bytes a pipeline stage holds at its peak: `in_flight` micro-batches of
        `tokens` tokens per device saved for backward (layer inputs only under full recompute),
        plus one layer (under recompute moe: one MoE layer's inside) rebuilt in backward (`transient`), plus the output
        head's saved tensors on the last stage."""
        routed = self.act_routed * imbalance
        if self.job.recompute == "full":
            saved = n_layers * self.act.layer_input
            biggest = np.where(n_moe > 0, self.act_moe_layer + routed, self.act_dense_layer)
            held = tokens * (in_flight * saved + (biggest if transient else 0.0))
        else:
            per_mb = n_moe * (self.act_moe_layer + routed) + (n_layers - n_moe) * self.act_dense_layer
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
        return float(self._stage_activation(tokens, arch.num_moe_layers, arch.num_layers, 1.0, 1.0, 1.0, transient=False))

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

    # ---- rollout side -------------------------------------------------------------------------
    def rollout_weight_bytes(self, cand: RolloutCandidates) -> np.ndarray:
        arch, c = self.arch, self.counts
        tp = cand.tp.astype(float)
        inst = cand.instance.astype(float)
        a = arch.attention
        kv_split = np.minimum(tp, a.num_kv_heads) if a.kind == "gqa" else tp
        sharded, kvp = self.attn_sharded_total, self.attn_kv_total
        replicated_attn = c.attention - sharded - kvp
        dense_parts = c.shared_experts + c.dense_mlp + c.embeddings + c.lm_head
        params = (sharded + dense_parts) / tp + kvp / kv_split + replicated_attn + c.norms + c.router
        params = params + c.routed_experts / inst  # MoE spans the instance (EP or TP)
        return params * BF16_BYTES  # rollout engines serve bf16 weights

    def kv_bytes_per_token(self, cand: RolloutCandidates) -> np.ndarray:
        """KV-cache bytes one token of context costs on one device (bf16 cache)."""
        a = self.arch.attention
        tp = cand.tp.astype(float)
        if a.kind == "mla":  # latent + rope key per layer, replicated on every TP rank (vLLM MLA)
            per_layer = np.full_like(tp, (a.kv_lora_rank + a.qk_rope_head_dim) * BF16_BYTES)
        else:
            local_heads = np.maximum(1.0, np.ceil(a.num_kv_heads / tp))
            per_layer = 2.0 * local_heads * a.head_dim * BF16_BYTES  # K and V
        return per_layer * self.arch.num_layers

    def kv_sequence_bytes(self, cand: RolloutCandidates, context: float) -> np.ndarray:
        """KV bytes of one sequence of `context` tokens on one device (windowed layers capped)."""
        kept = 0.0
        for w, layers in self._groups:
            kept += layers * (context if w is None else min(context, w[1]))
        return self.kv_bytes_per_token(cand) * kept / self.arch.num_layers

    def rollout(self, cand: RolloutCandidates, kept_train_bytes: np.ndarray | float = 0.0) -> RolloutEval:
        arch, job, accel, kn, L = self.arch, self.job, self.accel, self.knobs, self.lengths
        tp = cand.tp.astype(float)
        inst = cand.instance.astype(float)
        dp = cand.dp.astype(float)
        expert_parallel = cand.ep > 1
        weights = self.rollout_weight_bytes(cand)
        h = arch.hidden_size
        widest = max(arch.dense_intermediate, arch.moe.shared_intermediate, arch.moe.expert_intermediate * arch.moe.top_k)
        # the engine's activation workspace for one batch of ROLLOUT_BATCHED_TOKENS: per token, four
        # hidden-wide bf16 buffers (residual, normed input, attention output, MLP output) and the widest
        # MLP's gate and up projections split over TP, plus the fp32 logits over the TP-split vocabulary
        workspace = ROLLOUT_BATCHED_TOKENS * (BF16_BYTES * (4 * h + 2 * widest / tp) + FP32_BYTES * arch.vocab_size / tp)
        kept = np.broadcast_to(np.asarray(kept_train_bytes, dtype=float), tp.shape)
        budget = job.rollout_memory_utilization * accel.usable_bytes - weights - workspace - kept
        seq_max = self.kv_sequence_bytes(cand, job.max_sequence_tokens)
        live_ctx = job.prompt_tokens.mean + L.live_context_extra
        capacity = np.maximum(budget, 0.0) / self.kv_sequence_bytes(cand, live_ctx)
        n_rank = job.num_sequences / (cand.instances.astype(float) * dp)  # per generation round
        conc = np.maximum(np.minimum(n_rank, np.floor(capacity)), 1.0)
        if job.rollout_max_seqs is not None:
            conc = np.minimum(conc, float(job.rollout_max_seqs))

        peak = accel.peak_flops("bf16")  # rollout engines serve bf16 whatever the training precision
        prompt = job.prompt_tokens.mean
        # prefill: compute-bound over the instance
        prefill_flops = n_rank * dp * (prompt * self.matmul_flops_per_token + self.prefill_pairs_per_seq * self.attn_flops_per_pair)
        prefill = prefill_flops / (inst * peak * kn.logprob_mfu)

        # decode: sum over step bins of the step time at the live batch
        expert_bytes_dev = self.routed_total / inst * BF16_BYTES
        nonexpert_bytes = weights - expert_bytes_dev
        k_over_e = arch.moe.top_k / arch.moe.num_experts
        kv_tok = self.kv_bytes_per_token(cand)
        inst_bw = accel.link_bytes_per_s(inst)
        tp_bw = accel.link_bytes_per_s(tp)
        # fixed cost of one decode step: the scheduler and sampler; in eager mode every layer's
        # kernels are launched from Python; and the latency of each layer's small collectives:
        # attention's TP all-reduce, and for the MoE block dispatch + combine (EP) or one
        # all-reduce over the instance (two, gather and reduce-scatter, when DP ranks share it)
        dense_layers = arch.num_layers - arch.num_moe_layers
        moe_collectives = np.where(expert_parallel | (dp > 1), 2.0, 1.0) * (inst > 1)
        latency = (arch.num_layers + dense_layers) * (tp > 1) * accel.latency_s(tp) + arch.num_moe_layers * moe_collectives * accel.latency_s(inst)
        eager = 0.0 if job.rollout_graphs else arch.num_layers * accel.eager_layer_s
        step_fixed = kn.decode_step_overhead_s + eager + latency

        def step_time(batch: np.ndarray, context: np.ndarray) -> np.ndarray:
            touched = 1.0 - (1.0 - k_over_e) ** (batch * dp)
            span = self._span(context)
            nbytes = nonexpert_bytes + expert_bytes_dev * touched + batch * kv_tok * span / arch.num_layers
            flops = batch * (self.matmul_flops_per_token + self.attn_flops_per_pair * span) / tp
            t = np.maximum(nbytes / (accel.hbm_bytes_per_s * kn.decode_mbu), flops / (peak * kn.logprob_mfu))
            # per layer: attention TP all-reduce; MoE dispatch + combine (EP) or all-reduce of the
            # instance's tokens (experts tensor-parallel over the instance)
            attn_comm = 2.0 * batch * h * BF16_BYTES * (tp - 1) / tp / tp_bw  # ring all-reduce: 2 (tp - 1) / tp of the bytes
            moe_comm = np.where(
                expert_parallel,
                2.0 * batch / tp * arch.moe.top_k * h * BF16_BYTES * (inst - 1) / inst / inst_bw,  # dispatch and combine
                2.0 * batch * dp * h * BF16_BYTES * (inst - 1) / inst / inst_bw,  # ring all-reduce
            )
            comm = arch.num_layers * attn_comm + arch.num_moe_layers * moe_comm
            return t + comm + step_fixed

        decode = np.zeros_like(tp)
        for steps, survival, mid in zip(L.bin_steps, L.survival, L.bin_mid):
            decode = decode + steps * step_time(conc * survival, np.full_like(tp, prompt + mid))
        # more sequences than the KV pool holds: full-batch steps until the queue drains
        extra_steps = np.maximum(n_rank - conc, 0.0) * L.mean / conc
        decode = decode + extra_steps * step_time(conc, np.full_like(tp, live_ctx))
        # DAPO dynamic sampling: further rounds of the same size, each with its own long tail
        rounds = job.rollout_oversampling
        prefill, decode = prefill * rounds, decode * rounds
        n_steps = (float(sum(L.bin_steps)) + extra_steps) * rounds
        return RolloutEval(
            weights_bytes=weights,
            workspace_bytes=workspace,
            kv_budget_bytes=budget,
            kv_per_sequence_bytes=seq_max,
            concurrency=conc,
            sequences_per_rank=n_rank,
            prefill_s=prefill,
            decode_s=decode,
            rollout_s=prefill + decode,
            decode_steps=n_steps,
            decode_overhead_s=n_steps * step_fixed,
        )

    # ---- switching between phases -----------------------------------------------------------
    def switch_seconds(self, train: TrainEval, ti: int, rollout: RolloutEval, ri: int, rollout_instance: int) -> float:
        """Host moves, weight sync and the fixed engine costs (sleep/wake, cache release) of one step.

        The training layout's part (TrainEval.switch_train_s: host moves; `gather`, verl's and NeMo
        RL's weight sync, the full model tensor by tensor over the training groups) plus, for
        `shard` (cann-recipes' all-to-all-v), each device's rollout shard over the instance's links."""
        shard = 0.0
        if self.job.weight_sync == "shard":
            shard = float(rollout.weights_bytes[ri] / self.accel.link_bytes_per_s(rollout_instance))
        return float(train.switch_train_s[ti]) + shard + self.knobs.switch_fixed_s
