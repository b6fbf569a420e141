"""`planner inspect`: a model's shape facts and exact parameter breakdown, original and proxy."""

from __future__ import annotations

from typing import Any

from planner.arch import Architecture, count_parameters, expert_params
from planner.render import count, table

__all__ = ["describe", "render_description"]

_ROWS = (
    ("embeddings", "embeddings"),
    ("lm_head", "lm_head"),
    ("attention", "attention (incl. norms of q/k/latents)"),
    ("norms", "layer norms"),
    ("router", "router weight + biases"),
    ("routed_experts", "routed experts"),
    ("shared_experts", "shared experts + gate"),
    ("dense_mlp", "dense MLP layers"),
    ("total", "total"),
    ("active", "active per token"),
    ("mtp", "MTP layers (not in total)"),
)


def _arch_facts(arch: Architecture) -> dict[str, Any]:
    a, m = arch.attention, arch.moe
    attention: dict[str, Any] = {
        "kind": a.kind,
        "num_heads": a.num_heads,
        "num_kv_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "qk_norm": a.qk_norm,
        "output_gate": a.output_gate,
        "biases": {"q": a.q_bias, "kv": a.kv_bias, "o": a.o_bias},
    }
    if a.kind == "mla":
        attention.update(
            q_lora_rank=a.q_lora_rank or None,
            kv_lora_rank=a.kv_lora_rank,
            qk_nope_head_dim=a.qk_nope_head_dim,
            qk_rope_head_dim=a.qk_rope_head_dim,
            v_head_dim=a.v_head_dim,
        )
    return {
        "name": arch.name,
        "model_type": arch.model_type,
        "hf_class": arch.hf_class,
        "num_layers": arch.num_layers,
        "num_moe_layers": arch.num_moe_layers,
        "num_dense_layers": arch.num_dense_layers,
        "hidden_size": arch.hidden_size,
        "vocab_size": arch.vocab_size,
        "tie_embeddings": arch.tie_embeddings,
        "attention": attention,
        "moe": {
            "experts_key": m.experts_key,
            "num_experts": m.num_experts,
            "original_num_experts": arch.original_num_experts,
            "top_k": m.top_k,
            "expert_intermediate_size": m.expert_intermediate,
            "params_per_expert": expert_params(arch),
            "shared_intermediate_size": m.shared_intermediate,
            "scoring": m.scoring,
            "norm_topk_prob": m.norm_topk_prob,
            "n_group": m.n_group,
            "topk_group": m.topk_group,
            "routed_scaling_factor": m.routed_scaling_factor,
            "router_fp32": m.router_fp32,
            "correction_bias": m.correction_bias,
            "routing": m.routing_type(),
        },
        "mtp_layers": arch.mtp_layers,
        "num_attention_layers": len(arch.attention_layers),
        "linear_mixer": None if arch.linear is None else {
            "kind": arch.linear.kind,
            "num_layers": arch.num_linear_layers,
            "num_heads": arch.linear.num_heads,
            "head_dim": arch.linear.head_dim,
            "num_key_heads": arch.linear.num_key_heads,
            "key_head_dim": arch.linear.key_head_dim,
            "conv_kernel": arch.linear.conv_kernel,
            "state_elements_per_layer": arch.linear.state_elements,
        },
        "mlp_free_layers": len(arch.ffn_free_layers),
    }


def describe(arch: Architecture, experts: int | None = None) -> dict[str, Any]:
    """Facts and parameter breakdowns of the original and, with `experts`, of the K-expert proxy."""
    original = arch.with_experts(arch.original_num_experts)
    out: dict[str, Any] = {
        "model": _arch_facts(original),
        "parameters": {"original": count_parameters(original).as_dict()},
    }
    if experts is not None:
        proxy = original.with_experts(experts)
        out["proxy"] = {"experts": experts, "kept_fraction": experts / original.original_num_experts}
        out["parameters"][f"K={experts}"] = count_parameters(proxy).as_dict()
    return out


def render_description(info: dict[str, Any]) -> str:
    m, a, moe = info["model"], info["model"]["attention"], info["model"]["moe"]
    if a["kind"] == "mla":
        attn = (
            f"MLA, {a['num_heads']} heads, q_lora {a['q_lora_rank']}, kv_lora {a['kv_lora_rank']}, "
            f"qk {a['qk_nope_head_dim']}+{a['qk_rope_head_dim']} rope, v {a['v_head_dim']}"
        )
    else:
        attn = f"GQA, {a['num_heads']} q heads / {a['num_kv_heads']} kv heads x {a['head_dim']}"
        if a["qk_norm"] != "none":
            attn += f", q/k norm ({a['qk_norm']})"
    shared = f"shared width {moe['shared_intermediate_size']}" if moe["shared_intermediate_size"] else "no shared expert"
    if a.get("output_gate"):
        attn += ", gated output"
    lin = m.get("linear_mixer")
    hybrid = []
    if lin:
        kind = {"gdn": "gated DeltaNet", "mamba2": "Mamba-2"}[lin["kind"]]
        keys = "k heads" if lin["kind"] == "gdn" else "groups, state"
        hybrid = [
            f"  mixers     {m['num_attention_layers']} attention, {lin['num_layers']} {kind}"
            f"{', ' + str(m['mlp_free_layers']) + ' without an MLP' if m['mlp_free_layers'] else ''}",
            f"  linear     {lin['num_heads']} heads x {lin['head_dim']}, {lin['num_key_heads']} {keys} {lin['key_head_dim']}, "
            f"conv {lin['conv_kernel']}; {lin['state_elements_per_layer']:,} state elements per sequence and layer",
        ]
    lines = [
        f"{m['name']}  ({m['model_type']}, {m['hf_class']})",
        f"  layers     {m['num_layers']} ({m['num_moe_layers']} MoE, {m['num_dense_layers']} dense)"
        f"{', +' + str(m['mtp_layers']) + ' MTP' if m['mtp_layers'] else ''}",
        f"  hidden     {m['hidden_size']}, vocab {m['vocab_size']:,}, embeddings {'tied' if m['tie_embeddings'] else 'untied'}",
        f"  attention  {attn}",
        *hybrid,
        f"  experts    {moe['num_experts']} routed per MoE layer ({moe['experts_key']}), top-{moe['top_k']}, "
        f"width {moe['expert_intermediate_size']}, {shared}",
        f"  routing    {moe['routing']}{', router fp32' if moe['router_fp32'] else ''}",
        "",
    ]
    columns = list(info["parameters"])
    breakdowns = [info["parameters"][c] for c in columns]
    rows = []
    for key, label in _ROWS:
        if key == "mtp" and not any(b[key] for b in breakdowns):
            continue
        rows.append([label, *(count(b[key]) for b in breakdowns)])
    lines.append(table(["parameters", *columns], rows))
    if "proxy" in info:
        o, p = breakdowns[0], breakdowns[1]
        lines.append("")
        lines.append(
            f"  proxy keeps {info['proxy']['experts']}/{moe['original_num_experts']} experts: "
            f"total {o['total'] / p['total']:.2f}x smaller, active {o['active'] / p['active']:.3f}x"
        )
    return "\n".join(lines)
