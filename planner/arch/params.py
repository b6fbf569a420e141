"""Exact parameter accounting, per layer and per component.

The count equals `sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())`
of transformers 5.x for every supported family (tests/test_params.py builds the models on the meta
device to check it, original and pruned). Buffers (DeepSeek-V3/GLM `e_score_correction_bias`) are
not parameters; they are reported apart. MTP layers are not built by transformers and are reported
apart as well.

Per layer the parts are split the way Megatron shards them (Megatron-LM
`theoretical_memory_usage.py`): attention weights split evenly by TP; k/v projections split by
min(TP, kv heads) because kv heads replicate beyond that; latent down-projections, norms and routers
replicated; routed experts split by EP*ETP.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from planner.arch.model import Architecture

__all__ = ["LayerParams", "ParamBreakdown", "layer_params", "count_parameters", "expert_params", "linear_mixer_params"]


@dataclass(frozen=True)
class LayerParams:
    attention_sharded: int  # q / o projections (GQA); q_b, kv_b, o (MLA); sinks; a linear mixer
    attention_kv: int  # k and v projections (GQA only)
    attention_replicated: int  # MLA q_a / kv_a projections and latent norms; q/k norms
    norms: int  # input and post-attention norms
    router: int  # router weight (+ bias, + correction bias when it is a parameter)
    routed_experts: int  # every routed expert of the layer
    shared_experts: int  # shared expert(s) and their gate
    dense_mlp: int  # dense MLP of a non-MoE layer

    @property
    def attention(self) -> int:
        return self.attention_sharded + self.attention_kv + self.attention_replicated

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class ParamBreakdown:
    embeddings: int
    lm_head: int  # 0 when tied to the embeddings
    attention: int
    norms: int  # per-layer norms and the final norm
    router: int
    routed_experts: int
    shared_experts: int
    dense_mlp: int
    total: int
    active: int  # parameters a token touches: routed experts counted top_k of E
    mtp: int  # multi-token-prediction layers (not in total); embeddings/head shared with the trunk
    mtp_stored_copies: int  # embedding and head copies MTP checkpoints store besides (not in total)
    router_buffers: int  # e_score_correction_bias held as a buffer (not in total)

    def __post_init__(self) -> None:
        parts = (
            self.embeddings
            + self.lm_head
            + self.attention
            + self.norms
            + self.router
            + self.routed_experts
            + self.shared_experts
            + self.dense_mlp
        )
        if parts != self.total:  # conservation: a bug in this module, never user input
            raise AssertionError(f"parameter parts sum to {parts}, total says {self.total}")

    def active_counted(self, convention: str) -> int:
        """Active parameters as publishers count them: 'embeddings' (all a token touches),
        'no_input_embedding' (without the embedding lookup table), 'non_embedding' (without the
        embedding table and the output head)."""
        if convention == "embeddings":
            return self.active
        if convention == "no_input_embedding":
            return self.active - self.embeddings
        if convention == "non_embedding":
            return self.active - self.embeddings - self.lm_head
        raise ValueError(f"unknown convention {convention!r}")

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _projections(arch: Architecture, inter: int, bias: bool) -> int:
    """An MLP of width `inter`: gate, up, down (SwiGLU), or up and down where the family's MLPs
    are not gated (Nemotron-H's squared ReLU)."""
    into = 2 if arch.gated_mlp else 1
    n = (into + 1) * arch.hidden_size * inter
    if bias:
        n += into * inter + arch.hidden_size
    return n


def expert_params(arch: Architecture) -> int:
    """Parameters of one routed expert (its projections and their biases)."""
    return _projections(arch, arch.moe.expert_intermediate, arch.moe.expert_bias)


def _mlp(arch: Architecture, inter: int) -> int:
    """A dense or shared MLP of width `inter`."""
    return _projections(arch, inter, arch.mlp_bias) if inter else 0


def linear_mixer_params(arch: Architecture) -> int:
    """Parameters of one linear-attention layer's mixer (gated DeltaNet or Mamba-2): in_proj, the
    depthwise convolution, per-head decay and step terms, the gated norm, out_proj."""
    m, h = arch.linear, arch.hidden_size
    n = h * m.in_proj_width + m.conv_dim * m.conv_kernel + m.inner * h
    if m.kind == "gdn":
        return n + 2 * m.num_heads + m.head_dim  # dt_bias, A_log; RMSNorm over a head's values
    n += 3 * m.num_heads + m.inner  # dt_bias, A_log, D; the gated RMSNorm over all heads
    if m.conv_bias:
        n += m.conv_dim
    if m.proj_bias:
        n += m.in_proj_width + h
    return n


def _attention(arch: Architecture) -> tuple[int, int, int]:
    a, h = arch.attention, arch.hidden_size
    if a.kind == "mla":
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        replicated = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank  # kv_a + its norm
        if a.kv_bias:
            replicated += a.kv_lora_rank + a.qk_rope_head_dim
        if a.q_lora_rank:
            replicated += h * a.q_lora_rank + a.q_lora_rank  # q_a + its norm
            if a.q_bias:
                replicated += a.q_lora_rank
            sharded = a.q_lora_rank * a.num_heads * qk
        else:
            sharded = h * a.num_heads * qk
        sharded += a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim)  # kv_b
        sharded += a.num_heads * a.v_head_dim * h + (h if a.o_bias else 0)  # o
        return sharded, 0, replicated
    q, kv = a.q_width, a.kv_width
    sharded = h * a.q_proj_width + q * h + (a.q_proj_width if a.q_bias else 0) + (h if a.o_bias else 0)
    if a.sinks:
        sharded += a.num_heads
    kv_part = 2 * h * kv + (2 * kv if a.kv_bias else 0)
    replicated = 0
    if a.qk_norm == "head":
        replicated = 2 * a.head_dim
    elif a.qk_norm == "full":  # OLMoE: RMSNorm(hidden) on q, RMSNorm(kv width) on k
        replicated = h + (h // a.num_heads) * a.num_kv_heads
    return sharded, kv_part, replicated


def layer_params(arch: Architecture, index: int) -> LayerParams:
    """Parameters of decoder layer `index` (0-based), split by how parallelism shards them."""
    h, moe = arch.hidden_size, arch.moe
    mixer = arch.layer_mixers[index]
    if mixer == "attention":
        sharded, kv_part, replicated = _attention(arch)
    else:  # a linear mixer's heads split by TP like attention's; a layer without one has none
        sharded, kv_part, replicated = (linear_mixer_params(arch) if mixer == "linear" else 0), 0, 0
    norm_width = 2 if arch.norm == "layernorm" else 1
    if index in arch.ffn_free_layers:
        router = shared = routed = dense = 0
    elif index in arch.moe_layers:
        router = moe.num_experts * h + (moe.num_experts if moe.router_bias else 0)
        if moe.correction_bias == "param":
            router += moe.num_experts
        shared = _mlp(arch, moe.shared_intermediate) + (h if moe.shared_gate else 0)
        routed, dense = moe.num_experts * expert_params(arch), 0
    else:
        router = shared = routed = 0
        dense = _mlp(arch, arch.dense_intermediate)
    return LayerParams(
        attention_sharded=sharded,
        attention_kv=kv_part,
        attention_replicated=replicated,
        norms=arch.norms_per_layer * h * norm_width,
        router=router,
        routed_experts=routed,
        shared_experts=shared,
        dense_mlp=dense,
    )


def count_parameters(arch: Architecture) -> ParamBreakdown:
    h, v = arch.hidden_size, arch.vocab_size
    norm_width = 2 if arch.norm == "layernorm" else 1
    layers = [layer_params(arch, i) for i in range(arch.num_layers)]
    embeddings = v * h
    lm_head = 0 if arch.tie_embeddings else v * h + (v if arch.lm_head_bias else 0)
    attention = sum(p.attention for p in layers)
    norms = sum(p.norms for p in layers) + h * norm_width
    router = sum(p.router for p in layers)
    routed = sum(p.routed_experts for p in layers)
    shared = sum(p.shared_experts for p in layers)
    dense = sum(p.dense_mlp for p in layers)
    total = embeddings + lm_head + attention + norms + router + routed + shared + dense
    active = total - routed + arch.num_moe_layers * arch.moe.top_k * expert_params(arch)
    mtp = stored = 0
    if arch.mtp_layers and arch.moe_layers:
        # DeepSeek-V3 / GLM-4.5 MTP module: enorm, hnorm, eh_proj (2h -> h), one MoE decoder layer,
        # shared_head.norm; its embedding and output head repeat the trunk's in the checkpoint.
        one = layer_params(arch, arch.moe_layers[-1]).total + 2 * h + 2 * h * h + h
        mtp = arch.mtp_layers * one
        stored = arch.mtp_layers * (embeddings + v * h)
    buffers = arch.num_moe_layers * arch.moe.num_experts if arch.moe.correction_bias == "buffer" else 0
    return ParamBreakdown(
        embeddings=embeddings,
        lm_head=lm_head,
        attention=attention,
        norms=norms,
        router=router,
        routed_experts=routed,
        shared_experts=shared,
        dense_mlp=dense,
        total=total,
        active=active,
        mtp=mtp,
        mtp_stored_copies=stored,
        router_buffers=buffers,
    )
