"""Layout rules as the frameworks apply them, and the enumeration that feeds the search."""

from __future__ import annotations

import pytest

from planner.catalog import load_model
from planner.cost.layouts import (
    enumerate_rollout,
    enumerate_train,
    rollout_layout_problems,
    train_layout_problems,
)
from planner.specs import RolloutLayout, TrainLayout


def test_published_layouts_are_valid():
    ds = load_model("deepseek-v3")
    assert train_layout_problems(ds, 256, TrainLayout(tp=4, pp=8, ep=8)) == []  # etp defaults to tp
    assert rollout_layout_problems(ds, 256, RolloutLayout(tp=2, dp=64, ep=128)) == []
    qwen = load_model("qwen3-235b-a22b")
    assert train_layout_problems(qwen, 128, TrainLayout(tp=4, pp=4, ep=32, cp=4, etp=1)) == []
    assert rollout_layout_problems(qwen, 128, RolloutLayout(tp=4, dp=32, ep=128)) == []


def test_expert_parallelism_borrows_ranks_instead_of_multiplying_world():
    qwen = load_model("qwen3-235b-a22b")
    problems = train_layout_problems(qwen, 128, TrainLayout(tp=4, pp=4, ep=32, cp=4))  # etp = tp = 4
    assert problems == ["ep*etp = 32*4 = 128 does not divide tp*cp*dp = 128/4 = 32 (expert parallelism borrows ranks from tp*cp*dp)"]


def test_ep_must_divide_pruned_expert_count():
    proxy = load_model("qwen3-30b-a3b", experts=24)
    assert "ep=16 does not divide K=24 experts" in train_layout_problems(proxy, 16, TrainLayout(ep=16))
    assert any("ep=16 does not divide K=24" in p for p in rollout_layout_problems(proxy, 16, RolloutLayout(tp=1, dp=16, ep=16)))


def test_rollout_kv_heads_may_replicate_beyond_tp():
    qwen = load_model("qwen3-30b-a3b")  # 4 kv heads
    assert rollout_layout_problems(qwen, 8, RolloutLayout(tp=8, dp=1, ep=8)) == []
    # training: Megatron-Core 0.16+ sub-shards QKV where tp is a multiple of the kv heads; the search
    # stays with layouts where tp divides them (older cores, as MindSpeed's, accept only those)
    assert train_layout_problems(qwen, 8, TrainLayout(tp=8)) == []
    assert train_layout_problems(qwen, 16, TrainLayout(tp=16)) == []  # 32 heads, 4 kv heads
    assert train_layout_problems(load_model("qwen3-235b-a22b"), 24, TrainLayout(tp=6))[-1].startswith("tp=6 neither divides nor is a multiple of the 4 kv heads")
    assert max(enumerate_train(qwen, 16, max_tp=16).tp) == 4


@pytest.mark.parametrize("devices", [8, 16, 48])
def test_enumeration_yields_only_valid_layouts(devices):
    for k in (128, 32):
        arch = load_model("qwen3-30b-a3b", experts=k)
        train = enumerate_train(arch, devices, max_tp=8)
        rollout = enumerate_rollout(arch, devices, max_tp=8)
        assert len(train) > 0 and len(rollout) > 0
        for i in range(len(train)):
            assert train_layout_problems(arch, devices, train.layout(i)) == []
        for i in range(len(rollout)):
            assert rollout_layout_problems(arch, devices, rollout.layout(i)) == []
        assert max(train.ep) <= k


def _megatron_accepts(tp: int, pp: int, ep: int, etp: int, *, devices: int = 8) -> bool:
    """Megatron-Core's parallel-state rules written out for Qwen3-30B-A3B pruned to 16 experts (its config:
    32 attention heads, 4 kv heads, 48 layers, expert width moe_intermediate_size 768), cp = 1: tp divides the
    heads and the query groups; tp*pp divides the world, leaving dp = world / (tp*pp); the expert grid
    ep x etp is carved out of the tp*dp = world / pp ranks of one stage; ep divides the 16 experts, etp the
    expert width; pp at most the layers."""
    return (32 % tp == 0 and 4 % tp == 0 and devices % (tp * pp) == 0 and (devices // pp) % (ep * etp) == 0
            and 16 % ep == 0 and 768 % etp == 0 and pp <= 48)  # fmt: skip


def test_enumeration_is_complete_for_a_small_case():
    """Every valid (tp, pp, ep, etp) with tp a power of two and etp 1 or tp appears exactly once, checked
    against Megatron's rules written out in this test (not the module's own checker)."""
    arch = load_model("qwen3-30b-a3b", experts=16)
    train = enumerate_train(arch, 8, max_tp=8)
    rows = [tuple(int(x) for x in row) for row in zip(train.tp, train.pp, train.ep, train.etp)]
    assert len(rows) == len(set(rows))  # each layout once
    want = {(tp, pp, ep, etp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) for ep in (1, 2, 4, 8, 16) for etp in {1, tp}
            if _megatron_accepts(tp, pp, ep, etp)}  # fmt: skip
    assert set(rows) == want
    # counted by hand, per pp (dp*tp = 8/pp ranks per stage; tp 8 is out: 4 kv heads):
    # pp 1: tp 1: ep 1,2,4,8 (4); tp 2: etp 1 (4) + etp 2, ep 1,2,4 (3); tp 4: etp 1 (4) + etp 4, ep 1,2 (2) -> 17
    # pp 2: tp 1 (3); tp 2: 3 + 2; tp 4: 3 + 1 -> 12.  pp 4: tp 1 (2); tp 2: 2 + 1 -> 5.  pp 8: tp 1, ep 1 -> 1
    assert len(want) == 17 + 12 + 5 + 1


def test_independent_rollout_engines_are_written_dp_1():
    """verl's DeepSeek-V3 run on 96 H20: three independent TP32 vLLM engines. In planner's terms that
    is tp 32, dp 1 (the device count makes the engines); dp 3 would be one engine of 96 devices with
    the MoE spread over all of them, which the expert width refuses, and the message says how to
    write independent engines."""
    arch = load_model("deepseek-v3")
    assert rollout_layout_problems(arch, 96, RolloutLayout(tp=32, dp=1)) == []
    problems = rollout_layout_problems(arch, 96, RolloutLayout(tp=32, dp=3))
    assert any("does not divide the expert width 2048" in p for p in problems)
    assert any("independent engines of tp=32 devices each" in p and "dp: 1" in p and "96 devices then run 3 of them" in p for p in problems)
