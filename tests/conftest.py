"""Shared fixtures: one small upcycled MoE made by the RL harness's own recipe, once per session."""

from __future__ import annotations

import pytest

# trained long enough that every fault recipe's bracket holds its critical knob (the recipes'
# brackets were fixed on the 300-step grid models; a 60-step model's router collapses at any knob)
RL_MODEL_STEPS = 150


@pytest.fixture(scope="session")
def rl_model(tmp_path_factory):
    pytest.importorskip("transformers")
    from planner.rl.models import ModelRecipe, make_model

    out = tmp_path_factory.mktemp("rl") / "qwen3_moe"
    report = make_model("qwen3_moe", out, ModelRecipe(dense_steps=RL_MODEL_STEPS, moe_steps=RL_MODEL_STEPS))
    return out, report
