"""The small real MoE models calibration runs on, made deterministically by one command.

One family per routing shape (planner.arch.routing), as data: calibration/families.yaml. A family
made `from:` a catalog model keeps that model's config in every routing key and shrinks only width,
depth and vocabulary (`small_config`); the first grid's three families are written out there.
Each is made the way production MoEs often are (sparse upcycling, Komatsuzaki et al. 2022): a dense
model of the same backbone is pretrained briefly on Python standard-library source (bytes), every
expert starts as a copy of its dense MLP plus small noise, and the MoE then trains further. Experts
end up partly redundant, as in upcycled models, rather than nearly orthogonal as from-scratch tiny
MoEs are. The pairwise cosine similarity of experts' weights is reported per family.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import yaml

from planner.errors import ConfigError, SpecError
from planner.hf import require_torch
from planner.rl.corpus import split_bytes

__all__ = ["family_configs", "family_config", "family_of_shape", "small_config", "ModelRecipe", "make_model", "expert_similarity",
           "family_architecture"]  # fmt: skip

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
    if family.shared == "sized" and arch.moe.shared_intermediate:  # the shared expert's width relative to a routed one's
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
    if "num_nextn_predict_layers" in out:
        out["num_nextn_predict_layers"] = 0
    return out


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


@dataclass(frozen=True)
class ModelRecipe:
    dense_steps: int = 300
    moe_steps: int = 300
    batch: int = 16
    seq: int = 64
    lr: float = 2e-3
    noise: float = 0.05  # relative std of the noise that breaks the symmetry between upcycled experts
    seed: int = 0


def _train(model, steps: int, recipe: ModelRecipe, seed: int, progress=None, device: str = "cpu") -> list[float]:
    torch, _ = require_torch("training the small models")
    model.to(device)
    data = split_bytes("train")
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30) * (0.1 + 0.9 * (1 - s / steps)))
    losses = []
    model.train()
    for step in range(steps):
        starts = rng.integers(0, data.size - recipe.seq - 1, size=recipe.batch)
        batch = torch.from_numpy(np.stack([data[s : s + recipe.seq] for s in starts]).astype(np.int64)).to(device)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress:
            progress(step + 1, steps)
    return losses


def arch_family(config: Mapping[str, Any]):
    """The planner.arch.families entry of a (text) config.json."""
    from planner.arch.families import FAMILIES

    family = FAMILIES.get(str(config.get("model_type")))
    if family is None:
        raise ConfigError(f"model_type {config.get('model_type')!r} has no family entry")
    return family


def expert_similarity(model) -> dict[str, float]:
    """Pairwise cosine similarity of experts' flattened weights within each MoE layer, pooled."""
    sims = []
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if experts is None or not hasattr(experts, "gate_up_proj"):
            continue
        flat = np.concatenate([experts.gate_up_proj.detach().reshape(experts.gate_up_proj.shape[0], -1).numpy(),
                               experts.down_proj.detach().reshape(experts.down_proj.shape[0], -1).numpy()], axis=1)  # fmt: skip
        unit = flat / np.linalg.norm(flat, axis=1, keepdims=True)
        cos = unit @ unit.T
        sims.append(cos[np.triu_indices(len(cos), 1)])
    values = np.concatenate(sims)
    return {f"p{q}": float(np.percentile(values, q)) for q in (5, 25, 50, 75, 95)} | {"mean": float(values.mean())}


def make_model(family: str, out_dir: Path, recipe: ModelRecipe = ModelRecipe(),
               progress: Callable[[str, int, int], None] | None = None, config: Mapping[str, Any] | None = None,
               device: str = "cpu") -> dict:  # fmt: skip
    """Pretrain dense, upcycle, train the MoE; save to `out_dir`; return a report. `config`: another
    config of the family's shape (scaled_family_config) instead of its own."""
    torch, transformers = require_torch("making the small models")
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(1)
    start = time.perf_counter()
    config = dict(config) if config is not None else family_config(family)
    fam = arch_family(config)
    # the dense stage: every token uses all of its experts (1; 2 where the router scores groups,
    # even a single group, by the sum of their top two experts), i.e. one dense MLP
    seeds = 2 if fam.grouped else 1
    keys = {fam.experts_key: seeds, fam.top_k_key: seeds}
    keys.update({alias: keys[target] for alias, target in fam.aliases.items() if target in keys and alias in config})
    dense_cfg = dict(config, **keys)
    if fam.grouped:
        dense_cfg.update(n_group=1, topk_group=1)
    dense = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**dense_cfg), experts_implementation="eager")
    dense_losses = _train(dense, recipe.dense_steps, recipe, recipe.seed, progress and (lambda d, t: progress("dense", d, t)), device)
    dense.to("cpu")
    moe = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config), experts_implementation="eager")
    dense_state = dense.state_dict()
    gen = torch.Generator().manual_seed(recipe.seed + 1)
    with torch.no_grad():
        for name, param in moe.named_parameters():
            source = dense_state.get(name)
            if ".experts." in name and source is not None:  # expert e <- dense expert e mod seeds, plus noise
                index = torch.arange(param.shape[0]) % source.shape[0]
                noise = torch.randn(param.shape, generator=gen) * source.std() * recipe.noise
                param.copy_(source[index] + noise)
            elif source is not None and source.shape == param.shape:
                param.copy_(source)
    moe_losses = _train(moe, recipe.moe_steps, recipe, recipe.seed + 2, progress and (lambda d, t: progress("moe", d, t)), device)
    moe.to("cpu").eval()
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")  # renamed to out_dir once complete
    shutil.rmtree(tmp, ignore_errors=True)
    moe.save_pretrained(tmp)
    report = {
        "family": family,
        "parameters": int(sum(p.numel() for p in moe.parameters())),
        "dense_loss": [round(dense_losses[0], 4), round(float(np.mean(dense_losses[-20:])), 4)],
        "moe_loss": [round(moe_losses[0], 4), round(float(np.mean(moe_losses[-20:])), 4)],
        "expert_cosine_similarity": expert_similarity(moe),
        "recipe": recipe.__dict__,
        "seconds": round(time.perf_counter() - start, 1),
    }
    (tmp / "make_report.json").write_text(json.dumps(report, indent=2))
    tmp.replace(out_dir)
    return report
