"""Hybrid families (Qwen3-Next: gated DeltaNet and gated attention; Nemotron-H: Mamba-2 blocks):
what the cost model charges for their linear layers, checked against the shapes' own arithmetic.

Parameter counts are checked against transformers in tests/test_params.py (catalog and tiny
variants); here: the KV cache comes from the attention layers only, each linear layer keeps a fixed
state per sequence, causal attention's pairs are those of the attention layers, and the per-layer
activation sums equal the old per-kind formula on a model without linear layers.
"""

from __future__ import annotations

import numpy as np
import pytest

from planner.arch import Architecture, count_parameters
from planner.catalog import load_accelerator, load_model
from planner.cost.activations import layer_activation_bytes
from planner.cost.layouts import RolloutCandidates
from planner.cost.model import CostModel
from planner.errors import ConfigError
from planner.specs import Job

H100 = load_accelerator("h100-sxm")
TP1_TP2 = RolloutCandidates.of([(1, 1, 1, 1), (2, 2, 1, 1)])


def test_layer_kinds_of_the_catalog_hybrids():
    nxt, nano = load_model("qwen3-next-80b-a3b"), load_model("nemotron-3-nano-30b-a3b")
    # Qwen3-Next: every 4th layer attends (full_attention_interval 4), every layer is MoE
    assert nxt.attention_layers == tuple(range(3, 48, 4)) and nxt.num_linear_layers == 36
    assert nxt.num_moe_layers == 48 and nxt.linear.kind == "gdn" and nxt.attention.output_gate
    # Nemotron-3-Nano: 52 single blocks, MEMEM*E...: 23 Mamba-2, 23 MoE, 6 attention, no MLP in mixer blocks
    assert (nano.num_layers, nano.num_linear_layers, nano.num_moe_layers, len(nano.attention_layers)) == (52, 23, 23, 6)
    assert len(nano.ffn_free_layers) == 29 and nano.num_dense_layers == 0
    assert nano.layer_mixers[:6] == ("linear", "none", "linear", "none", "linear", "attention")
    assert nano.linear.kind == "mamba2" and nano.linear.state_bytes == 4  # mamba_ssm_cache_dtype float32
    assert not nano.gated_mlp and nano.norms_per_layer == 1


def test_kv_cache_counts_attention_layers_only_and_state_is_fixed_per_sequence():
    """Qwen3-Next: 12 attention layers x K and V x 2 kv heads x 256 x 2 B = 24,576 B per token at TP1;
    per sequence, 36 gated-DeltaNet layers x (32 heads x 128 x 128 state x 2 B + the conv window,
    (2 x 16 x 128 + 32 x 128) channels x 3 taps x 2 B)."""
    cm = CostModel(load_model("qwen3-next-80b-a3b"), H100, Job())
    kv = cm.kv_bytes_per_token(TP1_TP2)
    assert kv[0] == 12 * 2 * 2 * 256 * 2 and kv[1] == kv[0] / 2  # 2 kv heads split over TP2
    state = cm.state_bytes_per_sequence(TP1_TP2)
    assert state[0] == 36 * (32 * 128 * 128 * 2 + (2 * 16 * 128 + 32 * 128) * 3 * 2) and state[1] == state[0] / 2
    # a sequence's cache: the state at no context, then the KV of each token on top
    empty, long = cm.kv_sequence_bytes(TP1_TP2, 0.0), cm.kv_sequence_bytes(TP1_TP2, 1000.0)
    np.testing.assert_allclose(empty, state)
    np.testing.assert_allclose(long - empty, kv * 1000.0)


def test_nemotron_state_in_fp32_and_attention_pairs_from_six_layers():
    """Nemotron-3-Nano: 23 Mamba-2 layers x (64 heads x 64 x 128 state x 4 B + (64 x 64 + 2 x 8 x 128)
    channels x 3 taps x 2 B) per sequence; causal attention over 6 layers, n(n+1)/2 pairs each."""
    cm = CostModel(load_model("nemotron-3-nano-30b-a3b"), H100, Job())
    assert cm.state_bytes_per_sequence(TP1_TP2)[0] == 23 * (64 * 64 * 128 * 4 + (64 * 64 + 2 * 8 * 128) * 3 * 2)
    n = np.array([1.0, 100.0, 4096.0])
    np.testing.assert_array_equal(cm._pairs(n), 6 * n * (n + 1) / 2)
    np.testing.assert_array_equal(cm._span(n), 6 * n)


def test_scan_flops_add_to_the_projections():
    """Matmul FLOPs per token: 2 per active parameter (the mixers' projections and convolution
    included) plus each linear layer's chunked scan."""
    arch = load_model("qwen3-next-80b-a3b")
    cm = CostModel(arch, H100, Job())
    counts = count_parameters(arch)
    m = arch.linear
    scan = 32 * (2 * 64 * (128 + 128) + 4 * 128 * 128)
    assert m.scan_flops_per_token == scan
    assert cm.matmul_flops_per_token == 2 * (counts.active - counts.embeddings) + 36 * scan


@pytest.mark.parametrize("model_id", ["qwen3-30b-a3b", "deepseek-v3"])
def test_per_layer_activations_equal_the_per_kind_sum_without_linear_layers(model_id):
    arch = load_model(model_id)
    act = layer_activation_bytes(arch, act_bytes=2, backend="megatron", recompute="none")
    dense = arch.num_layers - arch.num_moe_layers
    expected = arch.num_moe_layers * (act.attention + act.moe_fixed) + dense * (act.attention + act.dense)
    assert sum(act.per_layer(arch)) == pytest.approx(expected, rel=1e-12)


def test_nemotron_blocks_hold_a_mixer_or_an_mlp_behind_one_norm():
    arch = load_model("nemotron-3-nano-30b-a3b")
    act = layer_activation_bytes(arch, act_bytes=2, backend="megatron", recompute="none")
    per = act.per_layer(arch)
    mamba, moe, attention = per[0], per[1], per[5]
    assert mamba == pytest.approx(act.linear - act.post_norm)
    assert attention == pytest.approx(act.attention - act.post_norm)
    assert moe == pytest.approx(act.post_norm + act.moe_fixed)
    # squared-ReLU experts: a routed copy keeps its input, the up output and the activation's
    h, i = arch.hidden_size, arch.moe.expert_intermediate
    assert act.routed_per_copy == 2 * (h + 2 * i) + 2 * h  # and the fc2 output (Megatron < 0.13 default)


def test_hybrid_cost_runs_and_says_it_extrapolates():
    from click.testing import CliRunner

    from planner.cli import main

    out = CliRunner().invoke(main, ["cost", "nemotron-3-nano-30b-a3b", "--hardware", "h100-sxm", "--cards", "16"])
    assert out.exit_code == 0, out.output
    assert "hybrid: 23 Mamba-2 layers of 52 hold no KV cache" in out.output
    assert "no published run of a hybrid model is in the efficiency fit" in out.output


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hybrid_override_pattern": "MEX*"}, "unknown block codes ['X']"),
        ({"hybrid_override_pattern": None}, "needs layers_block_type or hybrid_override_pattern"),
        ({"moe_latent_size": 512}, "moe_latent_size"),
    ],
)
def test_malformed_nemotron_configs_name_the_problem(change, message):
    from planner.catalog import load_model_config

    _, config = load_model_config("nemotron-3-nano-30b-a3b")
    config = {**config, **change}
    if change.get("hybrid_override_pattern", "") is None:
        del config["hybrid_override_pattern"]
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Architecture.from_config(config)


def test_qwen3_next_layer_types_must_cover_every_layer():
    from planner.catalog import load_model_config

    _, config = load_model_config("qwen3-next-80b-a3b")
    with pytest.raises(ConfigError, match="layer_types must name full_attention or linear_attention"):
        Architecture.from_config({**config, "layer_types": ["full_attention"] * 10})


def test_nemotron_h_checkpoints_are_read_under_backbone_and_cut_without_a_gate_projection(tmp_path):
    """Nemotron-H stores its layers under backbone. (transformers holds them as model.) and its
    experts with up and down projections only: the reader finds its MoE blocks, router and correction
    bias there, the statistics pass runs transformers' model over them layer by layer, and a plan
    built from those statistics keeps exactly its experts (the round trip against transformers' own
    loader is in test_build)."""
    pytest.importorskip("torch")
    from checkpoints import save_tiny
    from safetensors import safe_open

    from planner.checkpoint import Checkpoint, build
    from planner.families import family_config
    from planner.stats.compute import compute_stats, plan_from_stats

    config = family_config("nemotron_h-e128")
    source = save_tiny(tmp_path / "nano", config, sharded=False)
    ckpt = Checkpoint(source)
    assert ckpt.layer_prefix == "backbone.layers"
    moe = [i for i, kind in enumerate(config["layers_block_type"]) if kind == "moe"]
    assert sorted(ckpt.moe_layers) == moe
    layer = ckpt.moe_layers[moe[0]]
    assert layer.correction_bias is not None and set(layer.experts[0]) == {"up_proj.weight", "down_proj.weight"}
    stats = compute_stats(ckpt, experts=[32], methods=("agglomerative",), calib_tokens=256, seq_len=64)
    plan = plan_from_stats(stats, 32, "agglomerative", model=str(source))
    build(ckpt, plan, tmp_path / "proxy", verify="always")
    proxy = Checkpoint(tmp_path / "proxy")
    assert proxy.arch.original_num_experts == 32
    with safe_open(tmp_path / "proxy" / "model.safetensors", "np") as out, safe_open(source / "model.safetensors", "np") as src:
        for i in moe:
            kept = sorted(plan.layers[i])  # renumbered in ascending order
            prefix = f"backbone.layers.{i}.mixer"
            assert np.array_equal(out.get_tensor(f"{prefix}.gate.weight"), src.get_tensor(f"{prefix}.gate.weight")[np.array(kept)])
            assert np.array_equal(out.get_tensor(f"{prefix}.experts.0.up_proj.weight"), src.get_tensor(f"{prefix}.experts.{kept[0]}.up_proj.weight"))
