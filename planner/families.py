"""The calibration families: one small real MoE per routing shape, as data (calibration/families.yaml).

A family made `from:` a catalog model keeps that model's config.json in every routing key
(planner.arch.routing) and shrinks only width, depth and vocabulary (`small_config`); the first
grid's three families are written out there. planner.rl.models trains their models, the fidelity
grid measures them, the estimator and `planner models` name a model's family by its shape. Pure
Python: no torch.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import yaml

from planner.errors import ConfigError, SpecError

__all__ = ["family_configs", "family_config", "family_architecture", "family_of_shape", "small_config", "scaled_backbone",
           "scaled_family_config", "arch_family", "family_balancing", "BALANCE_KEYS", "NO_BALANCING", "BALANCINGS", "built_name", "how_built", "BUILT",
           "TRAINED", "trained_name", "how_trained"]  # fmt: skip

# a family's published load balancing (`balance:` in families.yaml), as planner.rl.models applies it
# when it trains the MoE stage: the balance loss's coefficient (1 at an even load) and whether it is
# taken over the batch or per sequence, the router z-loss's, and the correction bias's update speed
BALANCE_KEYS = {"loss": float, "scope": str, "z_loss": float, "bias_rate": float, "source": str}
NO_BALANCING = {"loss": 0.0, "scope": "batch", "z_loss": 0.0, "bias_rate": 0.0}  # what a key left out means
# how an original's MoE stage may be trained: with no balancing (the grids measured so far) or its published one
BALANCINGS = ("none", "published")
TRAINED = {"none": "without load balancing", "published": "with the shape's published load balancing"}  # the words for each
BALANCED_MARK = "-bal"  # ends the name of an original, or a calibration family, trained with its published balancing
SETTLED_MARK = "-settled"  # ends the name of a calibration family whose proxies' correction bias is settled again
BUILT = {"sliced": "with sliced proxies", "settled": "with proxies whose correction bias is settled again"}  # the words for each


def trained_name(name: str, balancing: str) -> str:
    """A family's or an original's name as trained: BALANCED_MARK appended where its MoE stage
    trained with the shape's published balancing (another model from the same seed, and another
    calibration family: its rows must never meet those of the originals trained without)."""
    return name + (BALANCED_MARK if balancing == "published" else "")


def how_trained(name: str) -> tuple[str, str]:
    """(the name without the marks, how it trained: "none" or "published") of a `trained_name`
    (and of a `built_name` of one)."""
    name = how_built(name)[0]
    if name.endswith(BALANCED_MARK):
        return name[: -len(BALANCED_MARK)], "published"
    return name, "none"


def built_name(name: str, build: str) -> str:
    """A calibration family's name as its proxies are built (planner.plan.PROXY_BUILDS): SETTLED_MARK
    appended where their correction bias is settled again after pruning (the same originals' other
    proxies: a family of its own, never taken for the sliced one's)."""
    return name + (SETTLED_MARK if build == "settled" else "")


def how_built(name: str) -> tuple[str, str]:
    """(the name without the mark, how its proxies are built: "sliced" or "settled") of a `built_name`."""
    if name.endswith(SETTLED_MARK):
        return name[: -len(SETTLED_MARK)], "settled"
    return name, "sliced"


# keys of a published config.json that a small model does not carry over: its precision, quantisation
# and the special token ids of a vocabulary it does not have (none of them routing)
_DROPPED = ("architectures", "torch_dtype", "dtype", "quantization_config", "transformers_version", "auto_map")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # set to None: the byte vocabulary has no special tokens


@lru_cache(maxsize=1)
def _families_file() -> dict[str, Any]:
    path = Path(str(resources.files("planner._calibration"))) / "families.yaml"
    return yaml.safe_load(path.read_text())


def small_config(config: Mapping[str, Any], backbone: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json of `config`'s routing shape at `backbone`'s width, depth and vocabulary.

    Every routing key stays as published (planner.arch.routing.RoutingShape: E, top-k, scoring,
    renormalisation, groups, biases, shared experts and their gate, dense layers, scaling); the
    hidden size, heads, expert and dense widths, layer count and vocabulary shrink; positions (RoPE
    and its scaling) stay as published. A wrapped
    config (Llama-4's text_config) gives its text model. Dense first layers keep one dense layer,
    multi-token prediction layers are dropped."""
    from planner.arch import Architecture
    from planner.arch.families import FAMILIES, TEXT_CONFIG_WRAPPERS

    arch = Architecture.from_config(config)
    text = dict(config)
    if text.get("model_type") in TEXT_CONFIG_WRAPPERS:
        text = {**config["text_config"], "model_type": TEXT_CONFIG_WRAPPERS[text["model_type"]]}
    family = FAMILIES[text["model_type"]]
    out = {k: v for k, v in text.items() if k not in _DROPPED} | dict.fromkeys(_TOKEN_IDS)
    layers = int(backbone["num_hidden_layers"])
    mha = arch.attention.num_kv_heads == arch.attention.num_heads
    heads = int(backbone["num_attention_heads"])
    out.update(vocab_size=int(backbone["vocab_size"]), hidden_size=int(backbone["hidden_size"]), num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=heads if mha else int(backbone["num_key_value_heads"]))  # fmt: skip
    if family.attention == "mla":
        out.update({k: v for k, v in backbone["mla"].items() if not (k == "q_lora_rank" and text.get(k) is None)})
    elif family.head_dim_key and family.head_dim_key in out:
        out[family.head_dim_key] = int(backbone["head_dim"])
    # a power of two (grouped_mm wants 16-byte strides): 256 / top_k rounded down, at least 32
    width = max(32, 2 ** int(np.log2(int(backbone["expert_width"]) / arch.moe.top_k)))
    out[family.expert_intermediate_key] = width
    if family.dense_intermediate_key != family.expert_intermediate_key:
        out[family.dense_intermediate_key] = int(backbone["intermediate_size"])
    sized = family.shared == "sized" or (family.shared == "single" and family.shared_size_key != family.expert_intermediate_key)
    if sized and arch.moe.shared_intermediate:  # the shared expert's width relative to a routed one's
        out[family.shared_size_key] = int(round(width * arch.moe.shared_intermediate / arch.moe.expert_intermediate))
    if int(out.get("first_k_dense_replace") or 0) > 0:
        out["first_k_dense_replace"] = 1
    if out.get("mlp_only_layers"):
        out["mlp_only_layers"] = [0]
    for key in ("layer_types", "no_rope_layers"):
        if isinstance(out.get(key), list):
            out[key] = out[key][:layers]
    if out.get("moe_layers") is not None:
        out["moe_layers"] = None
    if family.mixer_rule != "attention":
        out.update(_small_hybrid(family.mixer_rule, layers, backbone["linear"]))
        for key in ("hybrid_override_pattern", "full_attention_interval"):
            out.pop(key, None)
    if "num_nextn_predict_layers" in out:
        out["num_nextn_predict_layers"] = 0
    return out


def _small_hybrid(rule: str, layers: int, linear: Mapping[str, int]) -> dict[str, Any]:
    """A hybrid's layer pattern and linear-layer shape at the backbone's size: one attention layer
    in three, the last of each three (Qwen3-Next); or `layers` Nemotron-H mixer + MLP pairs, Mamba-2
    blocks but for one attention block in the last pair."""
    if rule == "layer_types":
        types = ["full_attention" if (i + 1) % 3 == 0 else "linear_attention" for i in range(layers)]
        return {"layer_types": types, "linear_num_value_heads": linear["heads"], "linear_num_key_heads": linear["key_heads"],
                "linear_key_head_dim": linear["head_dim"], "linear_value_head_dim": linear["head_dim"]}  # fmt: skip
    blocks = [b for i in range(layers) for b in ("full_attention" if i == layers - 1 else "linear_attention", "moe")]
    return {"layers_block_type": blocks, "num_hidden_layers": len(blocks), "mamba_num_heads": linear["heads"],
            "n_groups": linear["key_heads"], "mamba_head_dim": linear["head_dim"], "ssm_state_size": linear["state"]}  # fmt: skip


def scaled_backbone(hidden: int, layers: int) -> dict[str, Any]:
    """The families' backbone at another width and depth (the scale-transfer study): every width in
    proportion to the hidden size, heads of 16 x hidden/64 up to 128 wide, the routed experts'
    combined width 4 x hidden; at hidden 64 and 3 layers, the backbone itself."""
    base = _families_file()["backbone"]
    if hidden < 64 or hidden % 64 or layers < 2:
        raise SpecError(f"scaled backbone: hidden {hidden} must be a multiple of 64 and layers {layers} at least 2")
    s = hidden // 64
    head_dim = min(128, int(base["head_dim"]) * s)
    mla = {"q_lora_rank": hidden // 2, "kv_lora_rank": hidden // 4, "qk_nope_head_dim": head_dim, "qk_rope_head_dim": head_dim // 2,
           "v_head_dim": head_dim}  # fmt: skip
    return {**base, "hidden_size": hidden, "num_hidden_layers": layers, "head_dim": head_dim, "num_attention_heads": hidden // head_dim,
            "num_key_value_heads": max(1, int(base["num_key_value_heads"]) * (hidden // head_dim) // int(base["num_attention_heads"])),
            "intermediate_size": int(base["intermediate_size"]) * s, "expert_width": int(base["expert_width"]) * s, "mla": mla}  # fmt: skip


def scaled_family_config(family: str, hidden: int, layers: int) -> dict[str, Any]:
    """A family's small-model config at another width and depth (families made from a catalog model)."""
    from planner.catalog import load_model_config

    entry = _families_file()["families"].get(family)
    if entry is None or "from" not in entry:
        raise SpecError(f"family {family!r} is not made from a catalog model; scaled families: "
                        f"{', '.join(n for n, e in _families_file()['families'].items() if 'from' in e)}")  # fmt: skip
    return small_config(load_model_config(entry["from"])[1], scaled_backbone(hidden, layers))


@lru_cache(maxsize=1)
def family_configs() -> dict[str, dict[str, Any]]:
    """Every calibration family's config.json (small model), by family name."""
    from planner.catalog import load_model_config

    data = _families_file()
    out = {}
    for name, entry in data["families"].items():
        if "config" in entry:
            out[name] = dict(entry["config"])
        else:
            out[name] = small_config(load_model_config(entry["from"])[1], data["backbone"])
    return out


def family_config(family: str) -> dict[str, Any]:
    configs = family_configs()
    if family not in configs:
        raise SpecError(f"unknown calibration family {family!r}; one of {', '.join(configs)}")
    return dict(configs[family])


def family_balancing(family: str) -> dict[str, Any]:
    """The load balancing `family`'s original was trained with, as published (families.yaml `balance:`):
    every key of BALANCE_KEYS, absent ones 0 (scope "batch")."""
    family_config(family)  # an unknown family's error
    entry = _families_file()["families"][family].get("balance")
    if not isinstance(entry, Mapping) or not entry.get("source"):
        raise ConfigError(f"families.yaml: family {family!r} states no published load balancing (`balance:` with its `source`)")
    bad = sorted(set(entry) - set(BALANCE_KEYS))
    if bad:
        raise ConfigError(f"families.yaml: family {family!r} balance has unknown keys {bad}; known: {', '.join(BALANCE_KEYS)}")
    out = NO_BALANCING | dict(entry)
    try:
        out = {k: BALANCE_KEYS[k](v) for k, v in out.items()}
    except (TypeError, ValueError) as e:
        raise ConfigError(f"families.yaml: family {family!r} balance {dict(entry)}: {e}") from None
    if out["scope"] not in ("batch", "sequence") or any(not 0.0 <= out[k] < 10.0 for k in ("loss", "z_loss", "bias_rate")):
        raise ConfigError(f"families.yaml: family {family!r} balance {dict(entry)}: scope must be batch or sequence and the "
                          "coefficients and rate in [0, 10)")  # fmt: skip
    return out


def family_architecture(family: str):
    """The planner Architecture of a family's small model (no weights needed)."""
    from planner.arch import Architecture

    return Architecture.from_config(family_config(family))


def family_of_shape(shape, mechanism: bool = False) -> str | None:
    """The calibration family whose routing shape equals `shape` (or, with `mechanism`, routes alike
    at another E), or None. Where several do, the one made from a catalog model comes first."""
    from planner.arch.routing import routing_shape

    want = shape.mechanism if mechanism else shape
    found = []
    for name in family_configs():
        got = routing_shape(family_architecture(name))
        if (got.mechanism if mechanism else got) == want:
            found.append(name)
    made = [n for n in found if "from" in _families_file()["families"][n]]
    return (made or found or [None])[0]


def arch_family(config: Mapping[str, Any]):
    """The planner.arch.families entry of a (text) config.json."""
    from planner.arch.families import FAMILIES

    family = FAMILIES.get(str(config.get("model_type")))
    if family is None:
        raise ConfigError(f"model_type {config.get('model_type')!r} has no family entry")
    return family
