"""What each supported model family looks like, as data.

One `Family` per transformers `model_type`. Everything the exact accounting needs to know about a
family lives here: which config key holds the expert count, which layers are MoE, where biases and
norms sit, how the router scores experts, and the defaults transformers' config class applies to
keys a config.json leaves out (read from transformers 5.x `configuration_*.py`). The counting code
(`planner.arch.params`) has no per-family branches.

Layer rules (`moe_layer_rule`):
  all                 every decoder layer is MoE (mixtral, olmoe, gpt_oss, phimoe)
  sparse_step         layer i is MoE unless i in mlp_only_layers, and (i+1) % decoder_sparse_step == 0
                      (qwen2_moe, qwen3_moe)
  first_k_dense       layer i is MoE when i >= first_k_dense_replace (deepseek_v2/v3, glm4_moe; HF
                      ignores moe_layer_freq)
  moe_layers          explicit list moe_layers, else range(step-1, L, interleave_moe_layer_step) (llama4)
  start_end_interval  (i+1) % moe_layer_interval == 0 and start <= i <= end, end -1 = last (ernie4_5_moe)
  block_types         one block per layer, typed by layers_block_type (or the legacy
                      hybrid_override_pattern, M E * -): the "moe" blocks are MoE (nemotron_h)

Token mixers (`mixer_rule`), for the hybrid families:
  attention    every layer attends (every family but the two below)
  layer_types  layer_types names full_attention or linear_attention per layer (else every
               full_attention_interval-th layer attends); linear layers are gated DeltaNet (qwen3_next)
  block_types  a layer is one block: full_attention, linear_attention (Mamba-2), moe or mlp, with one
               norm in front; only the mixer blocks mix tokens, only moe/mlp blocks have an MLP (nemotron_h)

Query/key norms (`qk_norm`): none; head (RMSNorm over head_dim, qwen3/glm4 with use_qk_norm);
full (RMSNorm over all q heads and over all kv heads, olmoe); l2 (parameter-free, llama4).

Attention windows (`window_rule`): none; sliding_all (sliding_window, when set, on every layer:
mixtral, phimoe); layer_types (sliding_window on layers typed sliding_attention: gpt_oss); chunked
(attention_chunk_size on the RoPE layers of no_rope_layers: llama4).

Aliases: transformers 5 config classes map some keys onto others (attribute_map) and save the mapped
name, so a config.json may say num_local_experts where the published file says num_experts; both
are read, and pruning rewrites whichever the file holds.

Scoring (`scoring`), i.e. how gate values come out of router logits:
  softmax           softmax over all experts, then top-k (renormalised when norm_topk_prob)
  softmax_renorm    softmax over all, top-k, always renormalised (mixtral)
  softmax_topk      top-k on logits, softmax over the k (gpt_oss)
  sigmoid           sigmoid per expert (+ correction bias for selection), optional grouped top-k
  sigmoid_topk      top-k on logits, sigmoid of the k (llama4)
  sparsemixer       PhiMoE's sparsemixer top-2
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

__all__ = ["Family", "FAMILIES", "supported_model_types"]


@dataclass(frozen=True, kw_only=True)
class Family:
    model_type: str
    hf_class: str
    experts_key: str
    top_k_key: str = "num_experts_per_tok"
    attention: str = "gqa"  # gqa | mla
    qkv_bias_key: str | None = None  # config key switching q/k/v projection biases
    o_bias_key: str | None = None  # config key switching the output-projection bias
    qk_norm: str = "none"  # none | head | full | l2
    qk_norm_key: str | None = None  # config key that switches qk_norm on (None: always as declared)
    attention_sinks: bool = False  # one learned sink logit per head (gpt_oss)
    head_dim_key: str | None = "head_dim"
    moe_layer_rule: str = "all"
    expert_intermediate_key: str = "moe_intermediate_size"
    dense_intermediate_key: str = "intermediate_size"
    expert_bias: bool = False  # gate_up_proj_bias / down_proj_bias (gpt_oss)
    mlp_bias_key: str | None = None  # bias on dense and shared-expert projections
    shared: str = "none"  # none | sized (shared_expert_intermediate_size + gate) | per_expert | single
    shared_count_key: str | None = None  # for per_expert: number of shared experts of moe size
    shared_size_key: str | None = None  # for sized/single: the shared expert's intermediate size
    shared_gate: bool = False  # sigmoid Linear(h, 1) gating the shared expert (qwen2_moe)
    router_bias: bool = False
    router_fp32: bool = False  # router weight held in fp32 (deepseek, glm4_moe, ernie)
    correction_bias: str = "none"  # none | buffer | param : e_score_correction_bias
    scoring: str = "softmax"
    scoring_key: str | None = None  # config key naming the scoring function (deepseek: scoring_func)
    norm_topk_key: str | None = "norm_topk_prob"
    norm_topk_fixed: bool | None = None  # scoring that always renormalises (or never)
    grouped: bool = False  # n_group / topk_group routing keys are read
    norm: str = "rms"  # rms | layernorm (weight and bias)
    lm_head_bias_key: str | None = None
    mtp_key: str | None = None  # num_nextn_predict_layers
    window_rule: str = "none"  # none | sliding_all | layer_types | chunked
    mixer_rule: str = "attention"  # attention | layer_types | block_types
    linear_mixer: str = "none"  # none | gdn (gated DeltaNet) | mamba2: the linear layers' kind
    attention_output_gate: bool = False  # q_proj also emits a sigmoid gate on the output (qwen3_next)
    gated_mlp: bool = True  # SwiGLU gate/up/down; False: up/down only (nemotron_h, relu2)
    aliases: Mapping[str, str] = field(default_factory=dict)  # other config.json key -> the key read here
    defaults: Mapping[str, object] = field(default_factory=dict)


_GQA_DEFAULTS = {"tie_word_embeddings": False, "attention_bias": False}

FAMILIES: Mapping[str, Family] = MappingProxyType(
    {
        f.model_type: f
        for f in (
            Family(
                model_type="qwen2_moe",
                hf_class="Qwen2MoeForCausalLM",
                experts_key="num_experts",
                qkv_bias_key="qkv_bias",
                moe_layer_rule="sparse_step",
                shared="sized",
                shared_size_key="shared_expert_intermediate_size",
                shared_gate=True,
                defaults={
                    "tie_word_embeddings": False,
                    "qkv_bias": True,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [],
                    "num_experts": 60,
                    "num_experts_per_tok": 4,
                    "moe_intermediate_size": 1408,
                    "shared_expert_intermediate_size": 5632,
                    "norm_topk_prob": False,
                },
            ),
            Family(
                model_type="qwen3_moe",
                aliases={"num_local_experts": "num_experts"},
                hf_class="Qwen3MoeForCausalLM",
                experts_key="num_experts",
                qkv_bias_key="attention_bias",
                o_bias_key="attention_bias",
                qk_norm="head",
                moe_layer_rule="sparse_step",
                defaults={
                    **_GQA_DEFAULTS,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [],
                    "num_experts": 128,
                    "num_experts_per_tok": 8,
                    "moe_intermediate_size": 768,
                    "norm_topk_prob": False,
                },
            ),
            Family(
                model_type="mixtral",
                aliases={"num_experts": "num_local_experts"},
                hf_class="MixtralForCausalLM",
                experts_key="num_local_experts",
                expert_intermediate_key="intermediate_size",
                scoring="softmax_renorm",
                norm_topk_key=None,
                norm_topk_fixed=True,
                window_rule="sliding_all",
                defaults={"tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2},
            ),
            Family(
                model_type="olmoe",
                aliases={"num_local_experts": "num_experts"},
                hf_class="OlmoeForCausalLM",
                experts_key="num_experts",
                qkv_bias_key="attention_bias",
                o_bias_key="attention_bias",
                qk_norm="full",
                head_dim_key=None,
                expert_intermediate_key="intermediate_size",
                defaults={
                    **_GQA_DEFAULTS,
                    "num_experts": 64,
                    "num_experts_per_tok": 8,
                    "norm_topk_prob": False,
                },
            ),
            Family(
                model_type="deepseek_v2",
                aliases={"num_experts": "n_routed_experts"},
                hf_class="DeepseekV2ForCausalLM",
                experts_key="n_routed_experts",
                attention="mla",
                head_dim_key=None,
                moe_layer_rule="first_k_dense",
                mlp_bias_key="mlp_bias",
                shared="per_expert",
                shared_count_key="n_shared_experts",
                router_fp32=True,
                scoring_key="scoring_func",
                grouped=True,
                defaults={
                    **_GQA_DEFAULTS,
                    "mlp_bias": False,
                    "first_k_dense_replace": 0,
                    "kv_lora_rank": 512,
                    "q_lora_rank": 1536,
                    "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64,
                    "v_head_dim": 128,
                    "n_routed_experts": 64,
                    "n_shared_experts": 2,
                    "moe_intermediate_size": 1407,
                    "norm_topk_prob": False,
                    "routed_scaling_factor": 1.0,
                    "scoring_func": "softmax",
                    "topk_method": "greedy",
                    "n_group": None,
                    "topk_group": None,
                },
            ),
            Family(
                model_type="deepseek_v3",
                aliases={"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
                hf_class="DeepseekV3ForCausalLM",
                experts_key="n_routed_experts",
                attention="mla",
                head_dim_key=None,
                moe_layer_rule="first_k_dense",
                shared="per_expert",
                shared_count_key="n_shared_experts",
                router_fp32=True,
                correction_bias="buffer",
                scoring="sigmoid",
                scoring_key="scoring_func",
                grouped=True,
                mtp_key="num_nextn_predict_layers",
                defaults={
                    **_GQA_DEFAULTS,
                    "first_k_dense_replace": 3,
                    "kv_lora_rank": 512,
                    "q_lora_rank": 1536,
                    "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64,
                    "v_head_dim": 128,
                    "n_routed_experts": 256,
                    "n_shared_experts": 1,
                    "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048,
                    "norm_topk_prob": True,
                    "routed_scaling_factor": 2.5,
                    "n_group": 8,
                    "topk_group": 4,
                    "num_nextn_predict_layers": 1,
                },
            ),
            Family(
                model_type="glm4_moe",
                aliases={"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
                hf_class="Glm4MoeForCausalLM",
                experts_key="n_routed_experts",
                qkv_bias_key="attention_bias",
                qk_norm="head",
                qk_norm_key="use_qk_norm",
                moe_layer_rule="first_k_dense",
                shared="per_expert",
                shared_count_key="n_shared_experts",
                router_fp32=True,
                correction_bias="buffer",
                scoring="sigmoid",
                grouped=True,
                mtp_key="num_nextn_predict_layers",
                defaults={
                    **_GQA_DEFAULTS,
                    "use_qk_norm": False,
                    "first_k_dense_replace": 1,
                    "n_routed_experts": 128,
                    "n_shared_experts": 1,
                    "num_experts_per_tok": 8,
                    "moe_intermediate_size": 1408,
                    "norm_topk_prob": True,
                    "routed_scaling_factor": 1.0,
                    "n_group": 1,
                    "topk_group": 1,
                    "num_nextn_predict_layers": 1,
                },
            ),
            Family(
                model_type="gpt_oss",
                aliases={"num_experts": "num_local_experts"},
                hf_class="GptOssForCausalLM",
                experts_key="num_local_experts",
                qkv_bias_key="attention_bias",
                o_bias_key="attention_bias",
                attention_sinks=True,
                expert_intermediate_key="intermediate_size",
                expert_bias=True,
                router_bias=True,
                scoring="softmax_topk",
                norm_topk_key=None,
                norm_topk_fixed=True,
                window_rule="layer_types",
                defaults={
                    "tie_word_embeddings": False,
                    "attention_bias": True,
                    "head_dim": 64,
                    "num_local_experts": 128,
                    "num_experts_per_tok": 4,
                    "sliding_window": 128,
                },
            ),
            Family(
                model_type="llama4_text",
                hf_class="Llama4ForCausalLM",
                experts_key="num_local_experts",
                qkv_bias_key="attention_bias",
                o_bias_key="attention_bias",
                qk_norm="l2",
                moe_layer_rule="moe_layers",
                expert_intermediate_key="intermediate_size",
                dense_intermediate_key="intermediate_size_mlp",
                shared="single",
                shared_size_key="intermediate_size",
                scoring="sigmoid_topk",
                norm_topk_key=None,
                norm_topk_fixed=False,
                window_rule="chunked",
                defaults={
                    **_GQA_DEFAULTS,
                    "head_dim": 128,
                    "num_local_experts": 16,
                    "num_experts_per_tok": 1,
                    "interleave_moe_layer_step": 1,
                    "moe_layers": None,
                    "intermediate_size_mlp": 16384,
                    "use_qk_norm": True,
                    "attention_chunk_size": 8192,
                },
            ),
            Family(
                model_type="qwen3_next",
                aliases={"num_local_experts": "num_experts"},
                hf_class="Qwen3NextForCausalLM",
                experts_key="num_experts",
                qkv_bias_key="attention_bias",
                o_bias_key="attention_bias",
                qk_norm="head",
                moe_layer_rule="sparse_step",
                shared="sized",
                shared_size_key="shared_expert_intermediate_size",
                shared_gate=True,
                mixer_rule="layer_types",
                linear_mixer="gdn",
                attention_output_gate=True,
                defaults={
                    **_GQA_DEFAULTS,
                    "head_dim": 256,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [],
                    "num_experts": 512,
                    "num_experts_per_tok": 10,
                    "moe_intermediate_size": 512,
                    "shared_expert_intermediate_size": 512,
                    "norm_topk_prob": True,
                    "full_attention_interval": 4,
                    "linear_conv_kernel_dim": 4,
                    "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128,
                    "linear_num_key_heads": 16,
                    "linear_num_value_heads": 32,
                },
            ),
            Family(
                model_type="nemotron_h",
                aliases={"num_local_experts": "n_routed_experts", "mamba_n_groups": "n_groups",
                         "mamba_d_conv": "conv_kernel", "mamba_conv_bias": "use_conv_bias",
                         "mamba_chunk_size": "chunk_size"},
                hf_class="NemotronHForCausalLM",
                experts_key="n_routed_experts",
                moe_layer_rule="block_types",
                expert_intermediate_key="moe_intermediate_size",
                mlp_bias_key="mlp_bias",
                shared="single",
                shared_size_key="moe_shared_expert_intermediate_size",
                router_fp32=True,
                correction_bias="buffer",
                scoring="sigmoid",
                grouped=True,
                mixer_rule="block_types",
                linear_mixer="mamba2",
                gated_mlp=False,
                defaults={
                    **_GQA_DEFAULTS,
                    "head_dim": 128,
                    "mlp_bias": False,
                    "use_bias": False,
                    "n_routed_experts": 8,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 7688,
                    "moe_shared_expert_intermediate_size": 7688,
                    "norm_topk_prob": True,
                    "routed_scaling_factor": 1.0,
                    "n_group": 1,
                    "topk_group": 1,
                    "ssm_state_size": 128,
                    "mamba_num_heads": 128,
                    "mamba_head_dim": 64,
                    "n_groups": 8,
                    "conv_kernel": 4,
                    "use_conv_bias": True,
                    "chunk_size": 128,
                    "mamba_ssm_cache_dtype": "float32",
                },
            ),
            Family(
                model_type="ernie4_5_moe",
                aliases={"num_experts": "moe_num_experts", "num_experts_per_tok": "moe_k"},
                hf_class="Ernie4_5_MoeForCausalLM",
                experts_key="moe_num_experts",
                top_k_key="moe_k",
                qkv_bias_key="use_bias",
                o_bias_key="use_bias",
                moe_layer_rule="start_end_interval",
                mlp_bias_key="use_bias",
                shared="per_expert",
                shared_count_key="moe_num_shared_experts",
                router_fp32=True,
                correction_bias="param",
                norm_topk_key=None,
                norm_topk_fixed=True,
                lm_head_bias_key="use_bias",
                defaults={
                    "tie_word_embeddings": True,
                    "use_bias": False,
                    "moe_num_experts": 64,
                    "moe_k": 6,
                    "moe_intermediate_size": 1536,
                    "moe_num_shared_experts": 2,
                    "moe_layer_start_index": 1,
                    "moe_layer_end_index": -1,
                    "moe_layer_interval": 1,
                },
            ),
            Family(
                model_type="phimoe",
                hf_class="PhimoeForCausalLM",
                experts_key="num_local_experts",
                qkv_bias_key="attention_bias",
                o_bias_key="attention_bias",
                expert_intermediate_key="intermediate_size",
                scoring="sparsemixer",
                norm_topk_key=None,
                norm_topk_fixed=False,
                norm="layernorm",
                lm_head_bias_key="lm_head_bias",
                window_rule="sliding_all",
                defaults={
                    **_GQA_DEFAULTS,
                    "lm_head_bias": False,
                    "num_local_experts": 16,
                    "num_experts_per_tok": 2,
                },
            ),
        )
    }
)

# A config.json's model_type may name a wrapper whose text part is one of the families.
TEXT_CONFIG_WRAPPERS: Mapping[str, str] = MappingProxyType({"llama4": "llama4_text"})


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)
