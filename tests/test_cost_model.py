"""Properties of the cost model that follow from its formulas' sources."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from planner.arch import Architecture
from planner.catalog import load_accelerator, load_model, load_model_config
from planner.cost.evaluate import evaluate, min_devices
from planner.cost.layouts import TrainCandidates
from planner.cost.model import CostModel
from planner.specs import Job, Lengths, Offload, TrainLayout


def test_tied_head_still_costs_its_matmul():
    _, config = load_model_config("qwen3-30b-a3b")
    untied = CostModel(Architecture.from_config(config), load_accelerator("h100-sxm"), Job())
    tied = CostModel(Architecture.from_config({**config, "tie_word_embeddings": True}), load_accelerator("h100-sxm"), Job())
    assert tied.matmul_flops_per_token == pytest.approx(untied.matmul_flops_per_token)


def test_megatron_state_bytes_per_parameter():
    """6 + 12/DP bytes per parameter with the distributed optimizer (Megatron-LM)."""
    arch = load_model("mixtral-8x7b")
    for dp in (1, 4):
        model = CostModel(arch, load_accelerator("h100-sxm"), Job(distributed_optimizer=True, recompute="full"))
        te = model.train(TrainCandidates.single(dp * 8, TrainLayout(tp=8, etp=8)))
        per_param = (te.weights_bytes[0] + te.grads_bytes[0] + te.optimizer_bytes[0]) / (te.weights_bytes[0] / 2)
        assert per_param == pytest.approx(6 + 12 / dp, rel=1e-6)


def test_pruning_keeps_update_flops_and_cuts_states():
    accel, job = load_accelerator("ascend-910b2"), Job()
    full = CostModel(load_model("qwen3-30b-a3b"), accel, job)
    proxy = CostModel(load_model("qwen3-30b-a3b", experts=32), accel, job)
    # the router shrinks with K; everything a token multiplies otherwise stays
    assert proxy.update_model_flops() == pytest.approx(full.update_model_flops(), rel=0.01)
    def states(m: CostModel) -> float:
        return sum(m.model_state_bytes().values())

    assert states(proxy) / states(full) == pytest.approx(
        (full.counts.total - full.counts.routed_experts * 0.75) / full.counts.total, rel=0.02
    )


def test_minimum_devices_fall_with_k_and_results_are_consistent():
    accel, job = load_accelerator("ascend-910b2"), Job()
    counts = [min_devices(load_model("qwen3-30b-a3b", experts=k), accel, job).num_devices for k in (128, 64, 32, 16)]
    assert counts == sorted(counts, reverse=True) and counts[-1] < counts[0]
    result = evaluate(load_model("qwen3-30b-a3b"), accel, job, counts[0])
    assert result.feasible
    assert result.memory_per_device_bytes[result.peak_phase]["total"] <= accel.usable_bytes
    smaller = evaluate(load_model("qwen3-30b-a3b"), accel, job, counts[0] // 2)
    assert not smaller.feasible and smaller.reasons


def test_longer_responses_cost_more_rollout_and_update():
    accel = load_accelerator("h100-sxm")
    arch = load_model("qwen3-30b-a3b")
    short = evaluate(arch, accel, Job(), 32)
    long = evaluate(arch, accel, dataclasses.replace(Job(), response_tokens=Lengths(mean=3000, max=6144)), 32)
    assert long.phase_times_s["rollout"] > short.phase_times_s["rollout"]
    assert long.phase_times_s["update"] > short.phase_times_s["update"]


def test_pipeline_layers_per_stage_as_published():
    """Published runs set per-stage layer counts (cann-recipes' DeepSeek-R1: [7,7,8,8,8,8,8,7] over
    61 layers). Given in the job, the stages hold those layers: a split that loads the last stage
    makes it the busiest (more memory, a slower update), the result names the counts, and a list that
    does not add up to the model's layers or has another stage count is refused with its numbers."""
    from planner.errors import LayoutError, SpecError

    arch, accel = load_model("deepseek-v3"), load_accelerator("atlas-a3")
    layout = {"tp": 4, "pp": 8, "ep": 8, "cp": 1}

    def cost(pipeline_layers):
        lay = {**layout, **({"pipeline_layers": pipeline_layers} if pipeline_layers else {})}
        job = Job.from_dict({"train_layout": lay, "rollout_layout": {"tp": 2, "dp": 64, "ep": 128}, "offload": True, "optimizer_swap": True})
        return evaluate(arch, accel, job, 256, memory_margin=0.0)

    balanced, given, heavy = cost(None), cost([7, 7, 8, 8, 8, 8, 8, 7]), cost([5, 7, 8, 8, 8, 8, 8, 9])
    assert given.train_layout.pipeline_layers == (7, 7, 8, 8, 8, 8, 8, 7) and "layers 7,7,8,8,8,8,8,7" in given.train_layout.describe()
    update = [r.memory_per_device_bytes["update"]["total"] for r in (balanced, given, heavy)]
    assert update[1] < update[0] < update[2]  # the published split keeps a layer off the head's stage
    assert heavy.phase_times_s["update"] > 1.1 * balanced.phase_times_s["update"]
    assert any("pipeline stages hold [5, 7, 8, 8, 8, 8, 8, 9] layers" in n for n in heavy.notes)
    assert Job.from_dict(yaml.safe_load(yaml.safe_dump(given.job.to_dict()))) == given.job  # written and read back as a job file
    assert given.to_json()["train_layout"]["pipeline_layers"] == [7, 7, 8, 8, 8, 8, 8, 7]
    with pytest.raises(SpecError, match=r"pipeline_layers has 2 stages \[30, 31\]; pp is 8"):
        TrainLayout.from_dict({**layout, "pipeline_layers": [30, 31]})
    with pytest.raises(LayoutError, match=r"pipeline_layers \[7, 7, 7, 7, 7, 7, 7, 7\] hold 56 layers; the model has 61"):
        cost([7] * 8)


def test_small_expert_gemms_cost_time_so_big_moes_choose_expert_parallelism():
    """Without EP one expert sees few tokens per micro-batch, and expert tensor parallelism slices
    its width: small GEMMs run below the dense layers' efficiency (Calculon's op-size curve). The
    same devices and pipeline, TP16 EP1 against TP4 EP4, differ in update time by that alone, and
    the layouts chosen for DeepSeek-V3 and Qwen3-235B on Atlas A3 use expert parallelism (before the
    curve, DeepSeek-V3's was TP16 PP16 EP1, faster on paper than the published TP4 PP8 EP8)."""
    arch, accel = load_model("deepseek-v3"), load_accelerator("atlas-a3")
    job = Job.from_dict({"offload": True, "optimizer_swap": True, "expert_imbalance": 1.0})  # no imbalance: the GEMMs alone
    # (devices, tp, pp, ep, cp, etp): TP16 EP1 ETP16 against TP4 EP4 ETP4, both PP16 on 256 dies
    te = CostModel(arch, accel, job).train(TrainCandidates.of([(256, 16, 16, 1, 1, 16), (256, 4, 16, 4, 1, 4)]))
    assert te.update_compute_s[0] > 1.5 * te.update_compute_s[1], te.update_compute_s
    for name in ("deepseek-v3", "qwen3-235b-a22b"):
        chosen = min_devices(load_model(name), accel, Job())
        assert chosen.train_layout.ep > 1, (name, chosen.train_layout)


def test_explain_lists_the_terms_that_make_each_phase():
    """`planner cost --explain`: every phase is the sum of its printed terms, and the update's
    compute term names the expert GEMM size and efficiency that separate EP from EP1 layouts."""
    from click.testing import CliRunner

    from planner.cli import main

    result = evaluate(load_model("deepseek-v3"), load_accelerator("atlas-a3"), Job(), 256)
    ppo = evaluate(load_model("qwen3-30b-a3b"), load_accelerator("h100-sxm"),
                   Job(algorithm="ppo", skip_old_logprob=False, optimizer_offload_fraction=0.5, weight_sync="shard"), 32)
    for r in (result, ppo):  # GRPO; PPO (a critic updated like the actor) with a host optimizer
        by_phase: dict[str, float] = {}
        for t in r.terms:
            by_phase[t["phase"]] = by_phase.get(t["phase"], 0.0) + t["seconds"]
        for phase, seconds in r.phase_times_s.items():
            assert by_phase.get(phase, 0.0) == pytest.approx(seconds, rel=1e-9, abs=1e-9), (r.job.algorithm, phase)
    compute = next(t for t in result.terms if t["term"] == "compute")
    assert "expert GEMMs of" in compute["inputs"] and "train_mfu" in compute["inputs"]
    text = CliRunner().invoke(main, ["cost", "deepseek-v3", "--hardware", "atlas-a3", "--cards", "256", "--explain"]).output
    assert "where the time goes" in text and "expert all-to-all" in text and "decode_step_overhead_s" in text


def test_groups_are_charged_by_the_devices_they_span():
    """Megatron's expert rank order (etp-ep-edp-pp) puts EP ranks etp apart: EP4 x ETP8 on 8-NPU
    910B2 nodes spans 32 NPUs, four nodes, and its all-to-all runs at the network's speed; EP4 x ETP1
    stays in one node. The dispatcher's all-gather over the expert-TP group costs time only at ETP > 1."""
    a2 = load_accelerator("ascend-910b2")
    assert float(a2.a2a_bytes_per_s(4, "dispatch", 4)) == a2.intra_node_bytes_per_s
    assert float(a2.a2a_bytes_per_s(4, "dispatch", 32)) == a2.inter_node_bytes_per_s
    h800 = load_accelerator("h800")  # measured table: EP8 in one node, 153 GB/s; EP8 x ETP2 leaves it
    assert float(h800.a2a_bytes_per_s(8, "dispatch")) == pytest.approx(153e9)
    assert float(h800.a2a_bytes_per_s(8, "dispatch", 16)) == h800.inter_node_bytes_per_s
    model = CostModel(load_model("qwen3-30b-a3b"), a2, Job())
    te = model.train(TrainCandidates.of([(32, 8, 1, 4, 1, 8), (32, 8, 1, 4, 1, 1)]))
    assert te.update_a2a_s[0] > 5 * te.update_a2a_s[1]
    assert te.update_etp_s[0] > 0 and te.update_etp_s[1] == 0


def test_decode_pays_eager_launches_and_collective_latency_by_span():
    """Eager mode (verl's enforce_eager) pays every layer's launches per decode step; a TP group
    across nodes pays the network's collective latency, one inside a node NVLink's."""
    from planner.cost.layouts import RolloutCandidates
    from planner.specs import RolloutLayout

    arch, accel = load_model("deepseek-v3"), load_accelerator("h20")
    # 48 prompts x 2 responses, every one 1024 tokens long (a mean at the cap): each of the three TP32 engines
    # on 96 GPUs decodes its 32 sequences at once, 1024 decode steps
    job = Job(prompts_per_step=48, samples_per_prompt=2, response_tokens=Lengths(mean=1024, max=1024))
    graphs, eager = (CostModel(arch, accel, dataclasses.replace(job, rollout_graphs=g)) for g in (True, False))
    cand = RolloutCandidates.single(96, RolloutLayout(tp=32, dp=1, ep=1))
    rg, re_ = graphs.rollout(cand), eager.rollout(cand)
    assert float(rg.decode_steps[0]) == float(re_.decode_steps[0]) == 1024
    # by hand: 1024 steps x 61 layers (DeepSeek-V3's num_hidden_layers) x 0.32 ms per layer launched eagerly (the
    # H20's eager_layer_us, from vllm-omni#7960: (22 - 13) ms / 28 layers) = 19.988 s more decode time
    assert float(re_.decode_s[0] - rg.decode_s[0]) == pytest.approx(1024 * 61 * 0.32e-3, rel=1e-6)
    # TP32 spans four 8-GPU nodes: per layer the attention all-reduce and the MLP's or MoE's all-reduce, each at
    # the scale-out latency, 20 us (nccl-tests#150): 2 x 61 x 20 us = 2.44 ms per decode step
    per_step = float(rg.decode_overhead_s[0] / rg.decode_steps[0]) - graphs.knobs.decode_step_overhead_s
    assert per_step == pytest.approx(2 * 61 * 20e-6)
    # TP8 stays in a node: the same 122 collectives at NVLink's 10 us, 1.22 ms
    inside = graphs.rollout(RolloutCandidates.single(96, RolloutLayout(tp=8, dp=1, ep=1)))
    per_step_inside = float(inside.decode_overhead_s[0] / inside.decode_steps[0]) - graphs.knobs.decode_step_overhead_s
    assert per_step_inside == pytest.approx(2 * 61 * 10e-6)


def test_weight_sync_gathers_the_full_model_or_sends_shards():
    """verl and NeMo RL gather every full tensor over the training groups (DeepSeek-V3: 1.34 TB
    through the network at PP > 1, plus a cost per tensor); cann-recipes' all-to-all-v sends each
    device its rollout shard only."""
    arch, accel = load_model("deepseek-v3"), load_accelerator("h20")
    layouts = {"train_layout": {"tp": 8, "pp": 12, "ep": 8, "etp": 1}, "rollout_layout": {"tp": 32, "dp": 1}, "optimizer_offload_fraction": 1.0}
    gather = evaluate(arch, accel, Job.from_dict({**layouts, "weight_sync": "gather"}), 96, memory_margin=0.0)
    shard = evaluate(arch, accel, Job.from_dict({**layouts, "weight_sync": "shard"}), 96, memory_margin=0.0)
    model = CostModel(arch, accel, gather.job)
    # by hand. Bytes: DeepSeek-V3's 671e9 parameters (its model card: 671B total, the 14B MTP module aside) in
    # bf16 through one 48 GB/s NIC per H20 (nccl-tests#267): 671e9 x 2 / 48e9 = 27.96 s.
    # Tensors: Megatron-Core's grouped experts hold fc1 (gate and up fused) and fc2 per routed expert,
    # 2 x 58 MoE layers x 256 = 29,696; the rest as DeepSeek-V3's Hugging Face checkpoint names them: per layer
    # 9 for attention and norms (input and post-attention norms, q_a_proj, q_a_layernorm, q_b_proj,
    # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj), plus the dense MLP's 3 (layers 0-2) or the
    # router's 2 and the shared expert's 3 (layers 3-60), and embedding, final norm and head:
    # 3 x 12 + 58 x 14 + 3 = 851; 30,547 in all, each paying switch_tensor_s (the fitted knob).
    # The shard sync instead sends each GPU its 1/32 of a TP32 engine's weights: 671e9 x 2 / 32 / 48e9 = 0.87 s.
    # How the non-expert tensors are grouped and what a TP shard replicates are the model's to choose: 1%.
    tensors = 2 * 58 * 256 + 3 * 12 + 58 * 14 + 3
    assert model.weight_tensors == pytest.approx(tensors, rel=0.01)
    expected = 671e9 * 2 / 48e9 + tensors * model.knobs.switch_tensor_s - 671e9 * 2 / 32 / 48e9
    assert gather.phase_times_s["switch"] - shard.phase_times_s["switch"] == pytest.approx(expected, rel=0.01)


def test_optimizer_offload_fraction_moves_state_and_step_to_the_host():
    """Megatron's hybrid device optimizer: the offloaded fraction of the optimizer state leaves the
    device for host memory, and the update pays the host's Adam and the transfers each step."""
    from planner.errors import SpecError

    arch, accel = load_model("qwen3-30b-a3b"), load_accelerator("h100-sxm")
    cand = TrainCandidates.single(32, TrainLayout(tp=2, ep=8))
    kept = Offload(params=False, grads=False, optimizer=False)  # nothing moved around the rollout
    on_device, half = (CostModel(arch, accel, Job(offload=kept, optimizer_offload_fraction=f)).train(cand) for f in (0.0, 0.5))
    assert half.optimizer_bytes[0] == pytest.approx(on_device.optimizer_bytes[0] * 0.5)
    assert half.host_bytes_per_node[0] > on_device.host_bytes_per_node[0]
    assert on_device.update_host_adam_s[0] == 0 and half.update_host_adam_s[0] > 0
    assert half.update_s[0] == pytest.approx(on_device.update_s[0] + half.update_host_adam_s[0])
    with pytest.raises(SpecError, match="set one of them"):
        Job(optimizer_offload_fraction=0.5, optimizer_swap=True)
    with pytest.raises(SpecError, match=r"optimizer_offload_fraction.*\[0.0, 1.0\], got 1.5"):
        Job.from_dict({"optimizer_offload_fraction": 1.5})


def test_a_knobs_file_without_a_new_knob_keeps_its_prior(tmp_path):
    import json

    from planner.cost.knobs import PRIOR, load_knobs

    path = tmp_path / "k.json"
    path.write_text(json.dumps({"knobs": {"nvidia": {"train_mfu": 0.33}}}))
    knobs = load_knobs("nvidia", path)
    assert knobs.train_mfu == 0.33 and knobs.switch_tensor_s == PRIOR["nvidia"].switch_tensor_s


def test_recompute_moe_sits_between_selective_and_full():
    """recompute moe keeps of each MoE layer only its input (less memory than selective) and reruns
    the routed experts and their all-to-all in backward (more time, less than a full recompute)."""
    arch, accel = load_model("qwen3-235b-a22b"), load_accelerator("atlas-a3")
    cand = TrainCandidates.single(128, TrainLayout(tp=4, pp=4, ep=32, cp=4, etp=1))
    job = Job(prompt_tokens=Lengths(mean=73.7, max=2048), response_tokens=Lengths(mean=7345, max=32768), micro_batch_tokens=34816)
    te = {mode: CostModel(arch, accel, dataclasses.replace(job, recompute=mode)).train(cand) for mode in ("selective", "moe", "full")}
    assert te["full"].activations_bytes[0] < te["moe"].activations_bytes[0] < te["selective"].activations_bytes[0]
    assert te["selective"].update_compute_s[0] < te["moe"].update_compute_s[0] < te["full"].update_compute_s[0]
    assert te["selective"].update_a2a_s[0] < te["moe"].update_a2a_s[0] == pytest.approx(te["full"].update_a2a_s[0])
    assert te["moe"].update_tp_s[0] == pytest.approx(te["selective"].update_tp_s[0])
    # a forward-only pass holds one whole layer's working set whatever the update recomputes
    assert te["moe"].logprob_bytes[0] == te["selective"].logprob_bytes[0] == te["full"].logprob_bytes[0]


def test_padded_log_prob_micro_batches_and_dispatch_delay():
    """Micro-batches padded to their longest sequence cost the log-prob passes E[max of n] over the
    mean length; a job's dispatch_s adds to the passes it names, and --explain shows both."""
    arch, accel = load_model("deepseek-v3"), load_accelerator("atlas-a3")
    cand = TrainCandidates.single(256, TrainLayout(tp=4, pp=8, ep=8))
    packed = Job(prompt_tokens=Lengths(mean=77.8, max=1024), response_tokens=Lengths(mean=1576.6, max=3072))
    padded = dataclasses.replace(packed, logprob_padded_seqs=8)
    model = CostModel(arch, accel, padded)
    assert 1.5 < model.logprob_padding < (77.8 + 3072) / (77.8 + 1576.6)
    a, b = (CostModel(arch, accel, j).train(cand) for j in (packed, padded))
    assert b.reference_s[0] > a.reference_s[0] and b.update_s[0] == pytest.approx(a.update_s[0])
    delayed = dataclasses.replace(padded, dispatch_s=(("reference", 57.0), ("update", 73.0)))
    c = CostModel(arch, accel, delayed).train(cand)
    assert c.reference_s[0] == pytest.approx(b.reference_s[0] + 57.0) and c.update_s[0] == pytest.approx(b.update_s[0] + 73.0)
    result = evaluate(arch, accel, delayed, 256)
    by_phase: dict[str, float] = {}
    for t in result.terms:
        by_phase[t["phase"]] = by_phase.get(t["phase"], 0.0) + t["seconds"]
    assert by_phase["update"] == pytest.approx(result.phase_times_s["update"])
    reference = next(t for t in result.terms if t["phase"] == "reference")["inputs"]
    assert "padded to their longest" in reference and "57 s data dispatch" in reference
