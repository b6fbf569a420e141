"""`Architecture`: the shape facts of one MoE causal LM, read from an HF config.json.

Built by `Architecture.from_config(config_dict)`; `with_experts(K)` gives the proxy that keeps K
routed experts per MoE layer (everything else unchanged, docs/proxy-rules.md section "What a proxy
keeps"). Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

from planner.arch.families import FAMILIES, TEXT_CONFIG_WRAPPERS, Family, supported_model_types
from planner.errors import ConfigError

__all__ = ["Attention", "LinearMixer", "MoE", "Architecture", "LayerWindow", "config_with_experts"]

# ("sliding", w): each token sees the w most recent positions; ("chunked", w): positions of its own
# w-token chunk (Llama-4 local attention).
LayerWindow = tuple[str, int]

_MISSING = object()


@dataclass(frozen=True, kw_only=True)
class Attention:
    kind: str  # gqa | mla
    num_heads: int
    num_kv_heads: int
    head_dim: int  # gqa: per-head q/k/v width; mla: qk_nope + qk_rope
    q_bias: bool = False
    kv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"
    sinks: bool = False
    output_gate: bool = False  # q_proj emits q and a per-head-dim sigmoid gate on the output
    # MLA only
    q_lora_rank: int = 0  # 0: no q low-rank (q_proj straight from hidden)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def q_proj_width(self) -> int:
        """Output width of q_proj: the queries, and the output gate where the family has one."""
        return self.q_width * (2 if self.output_gate else 1)

    @property
    def kv_width(self) -> int:
        """Width of K (and of V for GQA) after projection, as attention consumes it."""
        return self.num_kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.kind == "mla" else self.head_dim


@dataclass(frozen=True, kw_only=True)
class LinearMixer:
    """The linear-time token mixer of a hybrid family's non-attention layers.

    gdn (gated DeltaNet, Qwen3-Next): `num_heads` value heads of `head_dim`, `num_key_heads` query/key
    heads of `key_head_dim`; per head a key_head_dim x head_dim state. mamba2 (Nemotron-H):
    `num_heads` heads of `head_dim` channels, `num_key_heads` groups of B/C projections of width
    `key_head_dim` (the SSM state size); per head a head_dim x state-size state. Both run a causal
    depthwise convolution of `conv_kernel` taps over their `conv_dim` input channels first.
    """

    kind: str  # gdn | mamba2
    num_heads: int
    head_dim: int
    num_key_heads: int
    key_head_dim: int
    conv_kernel: int
    conv_bias: bool = False
    proj_bias: bool = False
    state_bytes: int = 2  # bytes per recurrent-state element as the inference engine keeps it
    chunk: int = 64  # tokens per chunk of the chunked scan that training runs

    @property
    def scan_flops_per_token(self) -> float:
        """Forward FLOPs per token of the chunked scan beyond the projections (gated DeltaNet's
        chunked delta rule, Mamba-2's SSD): per head, the causal product inside a chunk,
        2 x chunk x (key + value width), and reading and updating the state carried between
        chunks, 4 x key width x value width."""
        return self.num_heads * (2.0 * self.chunk * (self.key_head_dim + self.head_dim) + 4.0 * self.key_head_dim * self.head_dim)

    @property
    def inner(self) -> int:
        """Width of the mixer's output before out_proj (values of all heads)."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        if self.kind == "gdn":
            return 2 * self.num_key_heads * self.key_head_dim + self.inner  # q, k, v
        return self.inner + 2 * self.num_key_heads * self.key_head_dim  # x, B, C

    @property
    def in_proj_width(self) -> int:
        if self.kind == "gdn":  # q, k, v, the output gate z; then beta and alpha per value head
            return 2 * self.num_key_heads * self.key_head_dim + 2 * self.inner + 2 * self.num_heads
        return self.inner + self.conv_dim + self.num_heads  # the gate z, x|B|C, dt per head

    @property
    def state_elements(self) -> int:
        """Recurrent-state elements per sequence and layer (the SSM or delta-rule state)."""
        return self.num_heads * self.head_dim * self.key_head_dim

    @property
    def conv_state_elements(self) -> int:
        """Elements of the convolution's rolling window per sequence and layer."""
        return self.conv_dim * (self.conv_kernel - 1)


@dataclass(frozen=True, kw_only=True)
class MoE:
    num_experts: int
    top_k: int
    expert_intermediate: int
    expert_bias: bool
    shared_intermediate: int  # total intermediate width of the shared expert(s); 0 when none
    shared_gate: bool
    router_bias: bool
    router_fp32: bool
    correction_bias: str  # none | buffer | param
    scoring: str
    norm_topk_prob: bool
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    experts_key: str

    @property
    def grouped(self) -> bool:
        return self.n_group > 1

    def routing_type(self) -> str:
        """Human-readable routing description for reports."""
        base = {
            "softmax": "softmax over all experts, top-k",
            "softmax_renorm": "softmax over all experts, top-k",
            "softmax_topk": "top-k on logits, softmax over the k",
            "sigmoid": "sigmoid per expert, top-k",
            "sigmoid_topk": "top-k on logits, sigmoid of the k",
            "sparsemixer": "sparsemixer top-2",
        }[self.scoring]
        parts = [base]
        if self.scoring in ("softmax", "softmax_renorm", "sigmoid"):
            parts.append("renormalised" if self.norm_topk_prob else "not renormalised")
        if self.grouped:
            parts.append(f"grouped ({self.n_group} groups, top-{self.topk_group} groups)")
        if self.correction_bias != "none":
            parts.append("correction bias")
        if self.routed_scaling_factor != 1.0:
            parts.append(f"scaled x{self.routed_scaling_factor:g}")
        return ", ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Architecture:
    name: str
    model_type: str
    hf_class: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    tie_embeddings: bool
    lm_head_bias: bool
    norm: str  # rms | layernorm
    attention: Attention
    moe: MoE
    moe_layers: tuple[int, ...]
    dense_intermediate: int
    mlp_bias: bool
    mtp_layers: int
    layer_windows: tuple[LayerWindow | None, ...]  # per layer; None: full causal attention
    original_num_experts: int
    dtype: str
    # hybrid families: the token mixer of each layer (attention | linear | none), the linear one's
    # shape, the layers that have no MLP at all (Nemotron-H's mixer blocks), norms per layer
    layer_mixers: tuple[str, ...] = ()
    linear: LinearMixer | None = None
    ffn_free_layers: tuple[int, ...] = ()
    norms_per_layer: int = 2
    gated_mlp: bool = True

    def __post_init__(self) -> None:
        if not self.layer_mixers:
            object.__setattr__(self, "layer_mixers", ("attention",) * self.num_layers)

    # ---- derived facts ----------------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - len(self.moe_layers) - len(self.ffn_free_layers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        skip = set(self.moe_layers) | set(self.ffn_free_layers)
        return tuple(i for i in range(self.num_layers) if i not in skip)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.layer_mixers) if m == "attention")

    @property
    def num_linear_layers(self) -> int:
        return sum(m == "linear" for m in self.layer_mixers)

    @property
    def is_hybrid(self) -> bool:
        return self.linear is not None

    @property
    def is_pruned(self) -> bool:
        return self.moe.num_experts != self.original_num_experts

    def with_experts(self, num_experts: int) -> "Architecture":
        """The proxy keeping `num_experts` routed experts in every MoE layer.

        Only the expert count changes; top-k, routing, shared experts and the backbone stay. Legality
        (top_k <= K, group divisibility) is checked here because a count that breaks it does not
        describe a model that runs.
        """
        k = int(num_experts)
        moe = self.moe
        problems = []
        if k < 1 or k > self.original_num_experts:
            problems.append(f"K={k} must lie in 1..{self.original_num_experts} (the original's experts)")
        if k < moe.top_k:
            problems.append(f"top_k={moe.top_k} > K={k}: every token needs top_k distinct experts")
        if moe.grouped:
            if k % moe.n_group:
                problems.append(f"K={k} is not a multiple of n_group={moe.n_group}")
            else:
                per_group = k // moe.n_group
                if per_group < 2:
                    problems.append(
                        f"K/n_group={per_group} < 2: group scores sum the top-2 experts of each group"
                    )
                if moe.topk_group * per_group < moe.top_k:
                    problems.append(
                        f"topk_group*K/n_group={moe.topk_group}*{per_group}={moe.topk_group * per_group}"
                        f" < top_k={moe.top_k}"
                    )
        if problems:
            raise ConfigError(f"{self.name}: cannot keep {k} experts: " + "; ".join(problems))
        return replace(self, moe=replace(moe, num_experts=k))

    def legal_expert_counts(self) -> list[int]:
        """Every K that `with_experts` accepts, ascending."""
        out = []
        for k in range(1, self.original_num_experts + 1):
            try:
                self.with_experts(k)
            except ConfigError:
                continue
            out.append(k)
        return out

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, name: str | None = None) -> "Architecture":
        """Read an HF config.json (already parsed). Raises ConfigError naming what is wrong."""
        if not isinstance(config, Mapping):
            raise ConfigError(f"{name or 'config'}: expected a JSON object, got {type(config).__name__}")
        model_type = config.get("model_type")
        label = name or str(model_type)
        if model_type is None:
            raise ConfigError(
                f"{label}: config.json has no 'model_type'; supported: {', '.join(supported_model_types())}"
            )
        outer = config
        if model_type in TEXT_CONFIG_WRAPPERS:
            text = config.get("text_config")
            if not isinstance(text, Mapping):
                raise ConfigError(f"{label}: model_type {model_type!r} needs a 'text_config' object")
            config = {**text, "model_type": TEXT_CONFIG_WRAPPERS[model_type]}
            model_type = config["model_type"]
        family = FAMILIES.get(model_type)
        if family is None:
            raise ConfigError(
                f"{label}: model_type {model_type!r} is not supported; supported model types: "
                f"{', '.join(supported_model_types())}"
            )
        return _Reader(family, config, outer, label).build()


class _Reader:
    """Reads one family's keys with transformers' defaults; errors name the missing field."""

    def __init__(self, family: Family, config: Mapping[str, Any], outer: Mapping[str, Any], label: str):
        self.family = family
        self.config = config
        self.outer = outer
        self.label = label

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The config's value (an explicit null stays None, as transformers keeps it), else the
        family default, else `default`; a required key with none of these is an error."""
        if key in self.config:
            return self.config[key]
        for alias, canonical in self.family.aliases.items():
            if canonical == key and alias in self.config:
                return self.config[alias]
        if self.family.defaults.get(key) is not None:
            return self.family.defaults[key]
        if default is not _MISSING:
            return default
        raise ConfigError(
            f"{self.label}: config.json ({self.family.model_type}) is missing required field {key!r}"
        )

    def int_(self, key: str, default: Any = _MISSING, *, minimum: int = 0) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or int(value) != value:
            raise ConfigError(f"{self.label}: field {key!r} must be an integer, got {value!r}")
        if value < minimum:
            raise ConfigError(f"{self.label}: field {key!r} must be >= {minimum}, got {value}")
        return int(value)

    def _positive(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{self.label}: field {key!r} must be a positive number, got {value!r}")
        return float(value)

    def flag(self, key: str | None, default: bool = False) -> bool:
        if key is None:
            return default
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.label}: field {key!r} must be true or false, got {value!r}")
        return value

    def build(self) -> Architecture:
        f = self.family
        hidden = self.int_("hidden_size", minimum=1)
        block_types = self._block_types() if f.mixer_rule == "block_types" else None
        num_layers = len(block_types) if block_types is not None else self.int_("num_hidden_layers", minimum=1)
        heads = self.int_("num_attention_heads", minimum=1)
        vocab = self.int_("vocab_size", minimum=1)
        attention = self._attention(hidden, heads)
        num_experts = self.int_(f.experts_key, minimum=1)
        top_k = self.int_(f.top_k_key, minimum=1)
        if top_k > num_experts:
            raise ConfigError(f"{self.label}: {f.top_k_key}={top_k} exceeds {f.experts_key}={num_experts}")
        moe_layers = self._moe_layers(num_layers, block_types)
        mixers, ffn_free = self._mixers(num_layers, block_types)
        if f.mixer_rule == "block_types" and self.config.get("moe_latent_size") is not None:
            raise ConfigError(f"{self.label}: moe_latent_size (latent MoE projections) is not modelled yet")
        expert_intermediate = self.int_(f.expert_intermediate_key, minimum=1)
        moe = MoE(
            num_experts=num_experts,
            top_k=top_k,
            expert_intermediate=expert_intermediate,
            expert_bias=f.expert_bias,
            shared_intermediate=self._shared_intermediate(expert_intermediate),
            shared_gate=f.shared_gate,
            router_bias=f.router_bias,
            router_fp32=f.router_fp32,
            correction_bias=f.correction_bias,
            scoring=self._scoring(),
            norm_topk_prob=self._norm_topk(),
            n_group=self._group("n_group"),
            topk_group=self._group("topk_group"),
            routed_scaling_factor=self._positive("routed_scaling_factor", 1.0),
            experts_key=f.experts_key,
        )
        if moe.grouped and num_experts % moe.n_group:
            raise ConfigError(f"{self.label}: {f.experts_key}={num_experts} not divisible by n_group={moe.n_group}")
        dense_needed = len(moe_layers) + len(ffn_free) < num_layers
        dense_intermediate = self.int_(f.dense_intermediate_key, minimum=1) if dense_needed else int(
            self.get(f.dense_intermediate_key, 0) or 0
        )
        dtype = str(self.config.get("torch_dtype") or self.config.get("dtype") or "bfloat16")
        tie = self.config.get(
            "tie_word_embeddings", self.outer.get("tie_word_embeddings", f.defaults.get("tie_word_embeddings", False))
        )
        return Architecture(
            name=self.label,
            model_type=f.model_type,
            hf_class=f.hf_class,
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=num_layers,
            tie_embeddings=bool(tie),
            lm_head_bias=self.flag(f.lm_head_bias_key),
            norm=f.norm,
            attention=attention,
            moe=moe,
            moe_layers=moe_layers,
            dense_intermediate=dense_intermediate,
            mlp_bias=self.flag(f.mlp_bias_key),
            mtp_layers=self.int_(f.mtp_key, 0) if f.mtp_key else 0,
            layer_windows=self._windows(num_layers),
            original_num_experts=num_experts,
            dtype=dtype,
            layer_mixers=mixers,
            linear=self._linear(dtype) if "linear" in mixers else None,
            ffn_free_layers=ffn_free,
            norms_per_layer=1 if block_types is not None else 2,
            gated_mlp=f.gated_mlp,
        )

    def _attention(self, hidden: int, heads: int) -> Attention:
        f = self.family
        if f.attention == "mla":
            q_lora = self.get("q_lora_rank", None)
            nope = self.int_("qk_nope_head_dim", minimum=1)
            rope = self.int_("qk_rope_head_dim", minimum=1)
            return Attention(
                kind="mla",
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=nope + rope,
                q_bias=self.flag("attention_bias"),
                kv_bias=self.flag("attention_bias"),
                o_bias=self.flag("attention_bias"),
                q_lora_rank=0 if q_lora is None else self.int_("q_lora_rank", minimum=1),
                kv_lora_rank=self.int_("kv_lora_rank", minimum=1),
                qk_nope_head_dim=nope,
                qk_rope_head_dim=rope,
                v_head_dim=self.int_("v_head_dim", minimum=1),
            )
        kv_heads = self.int_("num_key_value_heads", heads, minimum=1)
        if heads % kv_heads:
            raise ConfigError(
                f"{self.label}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        head_dim = hidden // heads
        if f.head_dim_key and self.config.get(f.head_dim_key) is not None:
            head_dim = self.int_(f.head_dim_key, minimum=1)
        elif f.head_dim_key and f.defaults.get(f.head_dim_key) is not None:
            head_dim = int(f.defaults[f.head_dim_key])
        qk_norm = f.qk_norm
        if f.qk_norm_key is not None and not self.flag(f.qk_norm_key):
            qk_norm = "none"
        return Attention(
            kind="gqa",
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            q_bias=self.flag(f.qkv_bias_key),
            kv_bias=self.flag(f.qkv_bias_key),
            o_bias=self.flag(f.o_bias_key),
            qk_norm=qk_norm,
            sinks=f.attention_sinks,
            output_gate=f.attention_output_gate,
        )

    _BLOCK_CODES = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
    _BLOCK_TYPES = ("linear_attention", "full_attention", "moe", "mlp")

    def _block_types(self) -> list[str]:
        """Nemotron-H's one block per layer: layers_block_type (transformers 5 saves it under its
        attribute name layer_types too), else the published files' hybrid_override_pattern."""
        types = self.config.get("layers_block_type", self.config.get("layer_types"))
        if types is None:
            pattern = self.config.get("hybrid_override_pattern")
            if not isinstance(pattern, str) or not pattern:
                raise ConfigError(f"{self.label}: config.json ({self.family.model_type}) needs layers_block_type "
                                  "or hybrid_override_pattern")
            bad = sorted(set(pattern) - set(self._BLOCK_CODES))
            if bad:
                raise ConfigError(f"{self.label}: hybrid_override_pattern has unknown block codes {bad}; "
                                  f"known: {', '.join(f'{k}={v}' for k, v in self._BLOCK_CODES.items())}")
            types = [self._BLOCK_CODES[c] for c in pattern]
        bad = sorted({str(t) for t in types} - set(self._BLOCK_TYPES))
        if bad:
            raise ConfigError(f"{self.label}: layers_block_type has unknown types {bad}; known: {', '.join(self._BLOCK_TYPES)}")
        return [str(t) for t in types]

    def _mixers(self, num_layers: int, block_types: list[str] | None) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Each layer's token mixer (attention | linear | none) and the layers without an MLP."""
        rule = self.family.mixer_rule
        if rule == "attention":
            return ("attention",) * num_layers, ()
        if rule == "block_types":
            kinds = {"full_attention": "attention", "linear_attention": "linear", "moe": "none", "mlp": "none"}
            mixers = tuple(kinds[t] for t in block_types)
            return mixers, tuple(i for i, m in enumerate(mixers) if m != "none")
        types = self.config.get("layer_types")
        if types is None:
            interval = self.int_("full_attention_interval", minimum=1)
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
        if len(types) < num_layers or any(t not in ("full_attention", "linear_attention") for t in types[:num_layers]):
            raise ConfigError(f"{self.label}: layer_types must name full_attention or linear_attention for each of "
                              f"the {num_layers} layers, got {types!r}")
        return tuple("attention" if t == "full_attention" else "linear" for t in types[:num_layers]), ()

    def _linear(self, dtype: str) -> LinearMixer:
        f = self.family
        cache = str(self.get("mamba_ssm_cache_dtype", dtype))
        state_bytes = 4 if cache in ("float32", "fp32") else 2
        if f.linear_mixer == "gdn":
            return LinearMixer(
                kind="gdn",
                num_heads=self.int_("linear_num_value_heads", minimum=1),
                head_dim=self.int_("linear_value_head_dim", minimum=1),
                num_key_heads=self.int_("linear_num_key_heads", minimum=1),
                key_head_dim=self.int_("linear_key_head_dim", minimum=1),
                conv_kernel=self.int_("linear_conv_kernel_dim", minimum=1),
                state_bytes=state_bytes,
            )
        return LinearMixer(
            kind="mamba2",
            num_heads=self.int_("mamba_num_heads", minimum=1),
            head_dim=self.int_("mamba_head_dim", minimum=1),
            num_key_heads=self.int_("n_groups", minimum=1),
            key_head_dim=self.int_("ssm_state_size", minimum=1),
            conv_kernel=self.int_("conv_kernel", minimum=1),
            chunk=self.int_("chunk_size", minimum=1),
            conv_bias=self.flag("use_conv_bias"),
            proj_bias=self.flag("use_bias"),
            state_bytes=state_bytes,
        )

    def _moe_layers(self, num_layers: int, block_types: list[str] | None = None) -> tuple[int, ...]:
        rule = self.family.moe_layer_rule
        if rule == "block_types":
            return tuple(i for i, t in enumerate(block_types) if t == "moe")
        if rule == "all":
            return tuple(range(num_layers))
        if rule == "sparse_step":
            step = self.int_("decoder_sparse_step", minimum=1)
            dense = set(self.get("mlp_only_layers", []) or [])
            return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        if rule == "first_k_dense":
            first = self.int_("first_k_dense_replace", minimum=0)
            return tuple(range(first, num_layers))
        if rule == "moe_layers":
            explicit = self.config.get("moe_layers")
            if explicit is not None:
                return tuple(sorted(int(i) for i in explicit if 0 <= int(i) < num_layers))
            step = self.int_("interleave_moe_layer_step", minimum=1)
            return tuple(range(step - 1, num_layers, step))
        if rule == "start_end_interval":
            start = self.int_("moe_layer_start_index", minimum=0)
            end = int(self.get("moe_layer_end_index"))
            end = num_layers - 1 if end == -1 else end
            interval = self.int_("moe_layer_interval", minimum=1)
            return tuple(i for i in range(num_layers) if (i + 1) % interval == 0 and start <= i <= end)
        raise AssertionError(f"unknown layer rule {rule}")  # family table bug, not user input

    def _shared_intermediate(self, expert_intermediate: int) -> int:
        f = self.family
        if f.shared == "none":
            return 0
        if f.shared == "per_expert":
            return self.int_(f.shared_count_key, 0) * expert_intermediate
        return self.int_(f.shared_size_key, minimum=1)

    def _scoring(self) -> str:
        f = self.family
        if f.scoring_key is None:
            return f.scoring
        scoring = str(self.get(f.scoring_key, f.scoring))
        if scoring not in ("softmax", "sigmoid"):
            raise ConfigError(f"{self.label}: {f.scoring_key} {scoring!r} is not softmax or sigmoid")
        return scoring

    def _norm_topk(self) -> bool:
        f = self.family
        if f.norm_topk_key is None:
            return bool(f.norm_topk_fixed)
        return self.flag(f.norm_topk_key)

    def _group(self, key: str) -> int:
        if not self.family.grouped:
            return 1
        value = self.config.get(key, self.family.defaults.get(key))
        return 1 if value is None else max(1, int(value))

    def _windows(self, num_layers: int) -> tuple[LayerWindow | None, ...]:
        rule = self.family.window_rule
        if rule == "layer_types":
            types = self.config.get("layer_types")
            window = self.config.get("sliding_window", self.family.defaults.get("sliding_window"))
            if types is None or window is None:
                return (None,) * num_layers
            return tuple(("sliding", int(window)) if t == "sliding_attention" else None for t in types[:num_layers])
        if rule == "sliding_all":
            window = self.config.get("sliding_window")
            return (("sliding", int(window)) if window else None,) * num_layers
        if rule == "chunked":
            chunk = self.config.get("attention_chunk_size", self.family.defaults.get("attention_chunk_size"))
            no_rope = self.config.get("no_rope_layers")
            if not chunk:
                return (None,) * num_layers
            if no_rope is None:  # transformers: every 4th layer (no RoPE) attends globally
                no_rope = [int((i + 1) % 4 != 0) for i in range(num_layers)]
            return tuple(("chunked", int(chunk)) if no_rope[i] else None for i in range(num_layers))
        return (None,) * num_layers


def config_with_experts(config: Mapping[str, Any], num_experts: int) -> dict:
    """A copy of an HF config.json with the routed-expert count set to `num_experts`.

    Exactly the family's own key changes (num_experts, num_local_experts, n_routed_experts,
    moe_num_experts), inside text_config for wrapped configs; aliases transformers also reads are
    updated only where the file already has them.
    """
    out = dict(config)
    model_type = out.get("model_type")
    wrapped = model_type in TEXT_CONFIG_WRAPPERS
    family = FAMILIES.get(TEXT_CONFIG_WRAPPERS.get(model_type, str(model_type)))
    if family is None:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}")
    target = dict(out["text_config"]) if wrapped else out
    keys = [family.experts_key, *(a for a, c in family.aliases.items() if c == family.experts_key)]
    present = [k for k in keys if k in target] or [family.experts_key]
    for key in present:
        target[key] = int(num_experts)
    if wrapped:
        out["text_config"] = target
    return out
