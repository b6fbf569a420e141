"""Bytes saved for backward, per token and per decoder layer, by trainer backend.

Two backends, one structure: a decoder layer saves, per token, what its attention block, its MLP
(dense, or MoE with router, routed copies and shared expert) and its norms keep for the backward
pass. The coefficients differ with the kernels that run:

`megatron` (Megatron-Core / MindSpeed with fused kernels; the form of Korthikanti et al., arXiv
2205.05198, Table 2, extended to GQA/MLA and MoE as in docs/cost-model.md section "Activation
memory"):
  fused RMSNorm keeps its input and the fp32 inverse RMS; a linear keeps its input; flash attention
  keeps q, k, v, its output and the fp32 log-sum-exp per head; fused SwiGLU keeps its input only;
  a routed copy keeps the permuted input, the fc1 output (gate|up) and the SwiGLU output, and where
  the router probability weighs it: `probs="unpermute"` (Megatron-Core up to 0.12, the base of
  MindSpeed-RL and of verl's MindSpeed on Ascend) the fc2 output, which unpermute keeps to weigh;
  `probs="activation"` (Megatron-Core 0.13 and later, "memory-efficient token permutation", what
  verl's and NeMo RL's GPU images run) the fp32 probability, which the weighted SwiGLU keeps, and
  unpermute keeps nothing. The router keeps fp32 logits and probs.

`transformers` (transformers' own modeling code, as verl's FSDP backend runs it): what autograd
actually saves there, read op by op from the models (tests/test_activation_memory.py measures it
with torch.autograd.graph.saved_tensors_hooks): RMSNorm computes in fp32 and keeps an fp32 copy of
its input, the fp32 inverse RMS and the normalised value; SiLU and the gate*up product keep their
inputs unfused; grouped expert matmuls keep their inputs; three index tensors route each copy.

Recompute: `none` keeps all of it; `full` keeps each layer's input (checkpointing) and rebuilds one
layer at a time in backward (`transient`); `selective` (Megatron --recompute-modules moe_act
layernorm) drops the norm outputs and the SwiGLU outputs of routed copies; `moe` (--recompute-modules
moe layernorm; MindSpeed's --moe-zero-memory; under transformers a checkpoint of each MoE block)
keeps nothing inside the MoE layers: router, dispatched copies, experts and combine are rebuilt in
backward, one layer at a time.

Everything here is per token of one micro-batch on one device before tensor/sequence parallelism
(the caller divides by TP: Megatron requires sequence parallelism with TP for MoE).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.arch import Architecture

__all__ = ["LayerActivations", "layer_activation_bytes", "output_activation_bytes"]

FP32 = 4
INDEX = 8  # int64 token indices
PROBS = ("unpermute", "activation")  # where Megatron weighs a routed copy by its router probability


@dataclass(frozen=True)
class LayerActivations:
    """Saved bytes per token of one layer: attention block, MLP block, and what full recompute
    keeps (the layer input). `routed_per_copy` is the part of `moe` that scales with tokens on the
    busiest expert rank (k copies per token times the imbalance factor)."""

    attention: float  # the attention block with its input norm, and the post-attention norm
    moe_fixed: float  # router and shared-expert part of an MoE layer (per token)
    routed_per_copy: float  # per routed copy of a token
    dense: float  # MLP of a dense layer
    layer_input: float
    linear: float = 0.0  # a hybrid's linear-mixer block with its input norm, and the post-mixer norm
    post_norm: float = 0.0  # the norm in front of the MLP (and its output): part of attention/linear

    def per_layer(self, arch: Architecture) -> list[float]:
        """Saved bytes per token of each decoder layer without its routed copies: the token mixer
        with its norms, and the router and shared expert of an MoE layer or the dense MLP. A
        Nemotron-H block holds a mixer or an MLP, each behind one norm."""
        mixer = {"attention": self.attention, "linear": self.linear, "none": self.post_norm}
        free, moe = set(arch.ffn_free_layers), set(arch.moe_layers)
        out = []
        for i, kind in enumerate(arch.layer_mixers):
            if i in free:
                out.append(mixer[kind] - self.post_norm)
            else:
                out.append(mixer[kind] + (self.moe_fixed if i in moe else self.dense))
        return out


def _rmsnorm(width: int, act: int, backend: str) -> float:
    if backend == "transformers":
        # fp32 copy of the input (the input itself when act is fp32), fp32 inverse RMS, normalised
        return FP32 * width + FP32 + act * width
    return act * width + FP32  # fused kernel: input and inverse RMS


def _attention(arch: Architecture, act: int, backend: str) -> float:
    a, h = arch.attention, arch.hidden_size
    total = _rmsnorm(h, act, backend) + act * h  # input norm; normalised output feeds q/k/v (or q_a/kv_a)
    if a.kind == "mla":
        nope_rope = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank:  # q_a output through its norm; the normalised latent feeds q_b
            total += _rmsnorm(a.q_lora_rank, act, backend) + act * a.q_lora_rank
        total += _rmsnorm(a.kv_lora_rank, act, backend) + act * a.kv_lora_rank  # kv latent norm, kv_b input
        q = k = a.num_heads * nope_rope
        v = o = a.num_heads * a.v_head_dim
        heads = a.num_heads
        if backend == "transformers":
            # v is a view of the kv_b output (k_nope | v), which stays alive whole; the attention
            # output and its reshaped copy (o_proj input) are separate tensors
            v = a.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
            o = 2 * a.num_heads * a.v_head_dim
    else:
        q = o = a.num_heads * a.head_dim
        k = v = a.num_kv_heads * a.head_dim
        heads = a.num_heads
        if a.qk_norm == "head":
            if backend == "transformers":
                total += (FP32 + act) * (q + k) + FP32 * (a.num_heads + a.num_kv_heads)
            else:
                total += act * (q + k) + FP32 * (a.num_heads + a.num_kv_heads)
        elif a.qk_norm == "full":
            if backend == "transformers":
                total += (FP32 + act) * (q + k) + 2 * FP32
            else:
                total += act * (q + k) + 2 * FP32
        elif a.qk_norm == "l2":
            total += act * (q + k)
    # flash attention: q, k, v, output, fp32 log-sum-exp per head
    total += act * (q + k + v + o) + FP32 * heads
    return total


def _linear_mixer(arch: Architecture, act: int, backend: str) -> float:
    """A gated DeltaNet or Mamba-2 block, analytically (not measured: the fused kernels run on
    accelerators only): its input norm and normalised output, the in_proj output (the convolution's
    input and the gates), the convolution's output before and after SiLU, fp32 decay and step per
    head, the fp32 state at each chunk boundary that the chunked scan keeps for backward, and the
    gated norm of the mixer's output with its normalised result (out_proj's input)."""
    m, h = arch.linear, arch.hidden_size
    total = _rmsnorm(h, act, backend) + act * h
    total += act * m.in_proj_width + 2 * act * m.conv_dim + 2 * FP32 * m.num_heads
    total += FP32 * m.state_elements / m.chunk
    total += act * m.inner + _rmsnorm(m.inner, act, backend) + act * m.inner
    return total


def _mlp_saved(arch: Architecture, width: int, act: int, backend: str) -> float:
    """A dense or shared MLP's saved bytes per token beyond its (shared) input."""
    if not arch.gated_mlp:  # up out (activation input), activation out (down input)
        return act * 2 * width
    if backend == "transformers":
        return act * 4 * width  # gate out (SiLU input), SiLU out, up out, product (down input)
    return act * 3 * width  # fc1 out (gate|up, fused SwiGLU input), SwiGLU out (fc2 input)


def layer_activation_bytes(
    arch: Architecture, *, act_bytes: int, backend: str, recompute: str, probs: str = "unpermute"
) -> LayerActivations:
    h, moe = arch.hidden_size, arch.moe
    attention = _attention(arch, act_bytes, backend)
    post_norm = _rmsnorm(h, act_bytes, backend) + act_bytes * h  # post-attention norm, its output
    num_experts, k = moe.num_experts, moe.top_k

    router = FP32 * num_experts + INDEX * k  # fp32 probabilities, top-k indices
    if backend == "transformers":
        if moe.scoring in ("softmax", "softmax_renorm", "sigmoid") and moe.norm_topk_prob:
            router += FP32 * k + FP32  # renormalisation keeps the k weights and their sum
        weight_bytes = act_bytes
        if moe.router_fp32 and act_bytes != FP32:
            router += FP32 * h  # fp32 copy of the router input
            weight_bytes = FP32  # gate values stay fp32 into the expert combine
        per_copy = act_bytes * (h + (4 if arch.gated_mlp else 2) * moe.expert_intermediate + h)
        per_copy += weight_bytes + 3 * INDEX  # routing weight, three index tensors per copy
    else:
        router += FP32 * num_experts  # logits kept fp32 as well
        if probs not in PROBS:
            raise ValueError(f"probs must be one of {PROBS}, not {probs!r}")
        per_copy = act_bytes * (h + (3 if arch.gated_mlp else 2) * moe.expert_intermediate)  # permuted input, fc1 out, activation out
        per_copy += act_bytes * h if probs == "unpermute" else FP32  # fc2 output, or the copy's probability
    shared = 0.0
    if moe.shared_intermediate:
        shared = _mlp_saved(arch, moe.shared_intermediate, act_bytes, backend)
        if moe.shared_gate:
            shared += act_bytes * (1 + h)  # sigmoid gate value and the shared output it scales
    dense = _mlp_saved(arch, arch.dense_intermediate, act_bytes, backend) if arch.dense_intermediate else 0.0
    linear = _linear_mixer(arch, act_bytes, backend) if arch.linear is not None else 0.0

    if recompute == "selective" or (recompute == "moe" and backend == "megatron"):
        # recompute norms and the routed SwiGLU: drop the normalised outputs and the SwiGLU output
        attention -= act_bytes * h
        linear -= act_bytes * h if linear else 0.0
        post_norm -= act_bytes * h
        per_copy -= act_bytes * moe.expert_intermediate
    if recompute == "moe":
        # the MoE layer checkpointed: nothing inside it stays. Its input is the post-attention
        # norm's output, which Megatron's layernorm recompute rebuilds too (dropped above) and
        # transformers' checkpoint of the block keeps (post_norm keeps it)
        router = per_copy = shared = 0.0
    return LayerActivations(
        attention=attention + post_norm,
        moe_fixed=router + shared,
        routed_per_copy=per_copy,
        dense=dense,
        layer_input=act_bytes * h,
        linear=linear + post_norm if linear else 0.0,
        post_norm=post_norm,
    )


def output_activation_bytes(arch: Architecture, *, act_bytes: int, backend: str, logits: bool = True) -> float:
    """Per token after the last layer: final norm, lm_head input, and (`logits`) the fp32
    log-probabilities over the vocabulary the RL loss gathers from (log_softmax keeps its fp32
    result; Megatron's vocab-parallel log-prob also keeps the logits). A caller whose loss reads
    the vocabulary on some tokens only passes logits=False and counts its own."""
    h, v = arch.hidden_size, arch.vocab_size
    final = _rmsnorm(h, act_bytes, backend) + act_bytes * h
    vocab = (FP32 * v if backend == "transformers" else (FP32 + act_bytes) * v) if logits else 0.0
    return final + vocab + INDEX  # token ids of the embedding lookup
