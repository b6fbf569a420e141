"""Published memory facts (docs/reference-figures.md section "Memory facts"; cann-recipes-train
Qwen3-235B 32K doc), within 2%."""

from __future__ import annotations

import pytest

from planner.catalog import load_accelerator, load_model
from planner.cost.layouts import RolloutCandidates
from planner.cost.model import CostModel
from planner.specs import Job, RolloutLayout

GIB = 1024**3


@pytest.fixture(scope="module")
def qwen235():
    return CostModel(load_model("qwen3-235b-a22b"), load_accelerator("atlas-a3"), Job())


def test_qwen3_235b_rollout_weights_per_die_tp4_ep128(qwen235):
    cand = RolloutCandidates.single(128, RolloutLayout(tp=4, dp=32, ep=128))
    assert qwen235.rollout_weight_bytes(cand)[0] / GIB == pytest.approx(7.09, rel=0.02)


def test_qwen3_235b_kv_cache_one_32k_sequence_tp4(qwen235):
    cand = RolloutCandidates.single(128, RolloutLayout(tp=4, dp=32, ep=128))
    assert qwen235.kv_sequence_bytes(cand, 32768)[0] / GIB == pytest.approx(1.47, rel=0.02)


def test_mla_kv_cache_is_latent_and_replicated_across_tp():
    """DeepSeek-V3: 61 layers x (512 latent + 64 rope) x 2 bytes per token, whatever the TP."""
    model = CostModel(load_model("deepseek-v3"), load_accelerator("atlas-a3"), Job())
    per_token = [model.kv_bytes_per_token(RolloutCandidates.single(256, RolloutLayout(tp=tp, dp=256 // tp, ep=256)))[0] for tp in (1, 2, 8)]
    assert per_token == [61 * 576 * 2] * 3


def test_sliding_window_layers_cap_kv():
    """gpt-oss-20b: half its layers keep only the last 128 tokens."""
    model = CostModel(load_model("gpt-oss-20b"), load_accelerator("h100-sxm"), Job())
    cand = RolloutCandidates.single(1, RolloutLayout(tp=1, dp=1, ep=1))
    full = model.kv_bytes_per_token(cand)[0] * 8192
    assert model.kv_sequence_bytes(cand, 8192)[0] == pytest.approx(full * (12 * 8192 + 12 * 128) / (24 * 8192))
