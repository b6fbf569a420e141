"""Cost-model paths no other test reached: Llama-4's chunked attention, a rollout capped by its KV
pool, DAPO's extra sampling rounds, a baseline job whose proxies' job does not fit, an hours budget
end to end. Each against a hand calculation or transformers, not the module's own formula."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from planner.arch import Architecture
from planner.catalog import load_accelerator, load_model_config
from planner.cli import main
from planner.cost.evaluate import evaluate
from planner.cost.layouts import RolloutCandidates
from planner.cost.model import CostModel
from planner.specs import Job, Lengths


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _arch(model: str) -> Architecture:
    name, config = load_model_config(model)
    return Architecture.from_config(config, name=name)


def test_llama4_chunked_layers_are_transformers_and_their_pairs_are_the_hand_count():
    """Llama-4-Scout: transformers' own config types every 4th layer full attention and the others
    chunked (8192-token chunks). A 20,000-token sequence then attends, per chunked layer, two whole
    chunks of 8192 (8192 x 8193 / 2 pairs each) and a last chunk of 3616 (3616 x 3617 / 2); per
    full layer 20000 x 20001 / 2."""
    from transformers import Llama4TextConfig

    _, config = load_model_config("llama-4-scout")
    arch = _arch("llama-4-scout")
    hf = Llama4TextConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
    assert [w is not None for w in arch.layer_windows] == [t == "chunked_attention" for t in hf.layer_types]
    assert {w for w in arch.layer_windows if w} == {("chunked", 8192)}
    chunked = sum(w is not None for w in arch.layer_windows)
    full = arch.num_layers - chunked
    assert (chunked, full) == (36, 12)  # 48 layers
    model = CostModel(arch, load_accelerator("h100-sxm"), Job())
    per_chunked = 2 * 8192 * 8193 / 2 + 3616 * 3617 / 2
    per_full = 20000 * 20001 / 2
    assert float(model._pairs([20000])[0]) == pytest.approx(chunked * per_chunked + full * per_full, rel=1e-12)


def test_kv_per_token_is_the_hand_count_and_a_batch_beyond_the_pool_waits():
    """Qwen3-30B-A3B's cache: 48 layers x (K and V) x 4 KV heads x 128 x 2 bytes = 98,304 bytes a
    token at TP1 (published config.json: num_hidden_layers 48, num_key_value_heads 4, head_dim 128);
    at TP8 each rank keeps one KV head. When a DP rank holds more sequences than its pool, it
    decodes only as many at once as fit, and the output says so."""
    arch = _arch("qwen3-30b-a3b")
    model = CostModel(arch, load_accelerator("ascend-910b2"), Job())
    cand = RolloutCandidates.of([(8, 1, 8, 1), (8, 8, 1, 8)])
    per_token = model.kv_bytes_per_token(cand)
    assert list(per_token) == [48 * 2 * 4 * 128 * 2, 48 * 2 * 1 * 128 * 2]
    r = model.rollout(cand)
    assert all(r.concurrency < r.sequences_per_rank)  # 4096 sequences per rank, the pool holds fewer
    result = evaluate(arch, load_accelerator("ascend-910b2"), Job(), 16)  # its minimum count
    assert result.feasible and any(n.startswith("rollout is KV-bound") for n in result.notes)
    small = evaluate(arch, load_accelerator("ascend-910b2"), replace(Job(), prompts_per_step=8, samples_per_prompt=2), 16)
    assert not any(n.startswith("rollout is KV-bound") for n in small.notes)  # 16 sequences fit at once


def test_dapo_oversampling_repeats_the_rollout_and_nothing_else():
    """DAPO's dynamic sampling generates rollout_oversampling rounds for each kept batch: at fixed
    layouts, twice the rounds is twice the rollout time, and the training phases are unchanged."""
    arch = _arch("qwen3-30b-a3b")
    accel = load_accelerator("ascend-910b2")
    fixed = {"train_layout": {"tp": 2, "pp": 1, "ep": 8, "cp": 1, "etp": 1}, "rollout_layout": {"tp": 4, "dp": 4, "ep": 16}}
    grpo = Job.from_dict({**fixed, "algorithm": "grpo"})
    dapo = Job.from_dict({**fixed, "algorithm": "dapo", "rollout_oversampling": 2.0})
    a, b = evaluate(arch, accel, grpo, 16), evaluate(arch, accel, dapo, 16)
    assert a.feasible and b.feasible
    assert b.phase_times_s["rollout"] == pytest.approx(2 * a.phase_times_s["rollout"], rel=1e-9)
    for phase in a.phase_times_s:
        if phase != "rollout":
            assert b.phase_times_s[phase] == pytest.approx(a.phase_times_s[phase], rel=1e-12), phase


def test_a_baseline_whose_devices_do_not_hold_the_proxies_job(tmp_path):
    """The original ran a short-response job on 16 NPUs without recompute; the proxies run 128K-token
    responses that do not fit the original on 16 with those settings (its update phase needs more than
    an NPU holds there, context parallelism included). The hours reduction is then not split into
    'smaller job' and 'step time': it is stated as one factor, and the product still equals the
    reduction."""
    ran = tmp_path / "ran.yaml"
    ran.write_text("response_tokens: {mean: 400, max: 1024}\nrecompute: none\n")
    long = tmp_path / "long.yaml"
    long.write_text("response_tokens: {mean: 65536, max: 131072}\n")
    held = ("--job-bounds", "batch=1,length=1")  # the proxies at the long job itself
    result = run_cli("suggest", "--budget", "16npu", "--job", long, "--baseline-cards", "16", "--baseline-job", ran, *held, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["plans"]
    for plan in data["plans"]:
        m, r = plan["reduction"]["by_mechanism"], plan["reduction"]
        assert m["smaller_job"] is None
        assert m["layout"] == 1.0 and m["fewer_devices"] * m["step_time"] == pytest.approx(r["accelerator_hours"], rel=1e-9)
    text = run_cli("suggest", "--budget", "16npu", "--job", long, "--baseline-cards", "16", "--baseline-job", ran, *held).output
    assert "this plan's job does not fit the baseline's npus" in text


def test_an_hours_budget_end_to_end(tmp_path):
    """`--budget 60npu-h` for 20 steps: the plan written holds a point whose 20 steps cost at most
    60 NPU-hours, with the budget it was chosen under."""
    from planner.plan import load_plan

    out = tmp_path / "plan.yaml"
    result = run_cli("suggest", "--budget", "60npu-h", "--steps", "20", "-o", out)
    assert result.exit_code == 0, result.output
    d = load_plan(out).deployment
    assert d["budget"] == "60npu-h" and d["predicted"]["accelerator_hours_per_step"] * 20 <= 60.0
    under = run_cli("suggest", "--budget", "1npu-h", "--steps", "20")
    assert under.exit_code == 1 and "smallest budget that would do" in under.output


def test_lengths_of_a_job_reach_the_kv_count():
    """A job's max prompt + response is the cache a sequence can reach (256 + 3072 by default)."""
    assert Job().max_sequence_tokens == 256 + 3072
    assert replace(Job(), response_tokens=Lengths(mean=100, max=1000)).max_sequence_tokens == 256 + 1000


def test_context_parallel_ring_passes_are_the_hand_count():
    """Qwen3-235B-A22B (4 KV heads of 128: K and V 1,024 wide per token), 32,768-token micro-batches
    on 128 Atlas A3 dies as TP4 PP4 EP32 CP4, no recompute: per attention layer of a stage (24 of
    94 layers) each rank passes 32768 / 4 tokens x 1024 / 4 x 2 bytes x 3 hops forward, twice that
    backward, over the 16-die scale-up links; CP1 passes nothing."""
    from planner.cost.layouts import TrainCandidates
    from planner.specs import TrainLayout

    arch, accel = _arch("qwen3-235b-a22b"), load_accelerator("atlas-a3")
    job = Job(prompts_per_step=64, samples_per_prompt=16, prompt_tokens=Lengths(mean=512, max=2048),
              response_tokens=Lengths(mean=8192, max=30720), micro_batch_tokens=32768, recompute="none")  # fmt: skip
    model = CostModel(arch, accel, job)
    cand = TrainCandidates.of([(128, 4, 4, 32, 4, 1), (128, 4, 4, 32, 1, 1)])
    te = model.train(cand)
    g, mb = model._grid(cand), model._micro_batches(model._grid(cand))
    hop = 32768 / 4 * 1024 / 4 * 2.0
    per_pass = mb.micro_all[0] * 24 * hop * 3 / accel.link_bytes_per_s(16)
    assert te.update_cp_s[0] == pytest.approx(3 * per_pass, rel=1e-9) and te.update_cp_s[1] == 0.0
    assert g.layers_stage[0] == 24 and float(accel.link_bytes_per_s(16)) == accel.intra_node_bytes_per_s


def test_the_search_tries_context_parallelism_where_a_micro_batch_is_long():
    """CP is searched while each rank keeps at least 4,096 tokens of a micro-batch, up to 8: the
    default job (3,328-token micro-batches) stays at CP1; the published Qwen3-235B 32K GRPO run
    (34,816-token micro-batches) fits on no more than its published 128 Atlas A3 dies with CP, and
    on none of that size without it (where the search had stopped before: 768 dies)."""
    from planner.cost.evaluate import _max_cp, min_devices
    from planner.cost.fit import load_runs

    assert _max_cp(Job()) == 1 and _max_cp(Job(micro_batch_tokens=8192)) == 2 and _max_cp(Job(micro_batch_tokens=34816)) == 8
    run = next(r for r in load_runs() if r.id == "qwen3-235b-a3-32k")
    job = replace(run.job, train_layout=None, rollout_layout=None)
    arch, accel = _arch(run.model), load_accelerator(run.hardware)
    found = min_devices(arch, accel, job)
    assert found.feasible and found.num_devices <= run.devices and found.train_layout.cp > 1
    assert evaluate(arch, accel, replace(job, train_layout=replace(found.train_layout, cp=1)), found.num_devices).feasible is False


def test_fp8_per_phase_against_the_hand_count_and_refused_without_fp8():
    """rollout_precision fp8: the linear layers' weights in one byte (attention projections, dense
    and shared MLPs, routed experts over the instance), embeddings, head, norms and router in two,
    matmuls at the FP8 peak (1,979 TFLOPS on an H100); precision fp8 times the update's compute at the
    measured MoE speed-up, 242.9 / 240.5, not the FP8 peak; a device with no FP8 figure refuses both."""
    from planner.arch.params import count_parameters
    from planner.cost.layouts import RolloutCandidates, TrainCandidates
    from planner.errors import SpecError

    arch, accel = _arch("qwen3-30b-a3b"), load_accelerator("h100-sxm")
    c = count_parameters(arch)
    cand = RolloutCandidates.of([(8, 1, 8, 8)])  # one instance of 8: TP1, experts over 8
    fp8 = CostModel(arch, accel, Job(rollout_precision="fp8"))
    linear = c.attention + c.shared_experts + c.dense_mlp + c.routed_experts / 8  # attention's q/k norms go with it (a few KB)
    other = c.embeddings + c.lm_head + c.norms + c.router
    assert float(fp8.rollout_weight_bytes(cand)[0]) == pytest.approx(linear * 1.0 + other * 2.0, rel=1e-12)
    bf16 = CostModel(arch, accel, Job())
    assert float(bf16.rollout_weight_bytes(cand)[0]) == pytest.approx((linear + other) * 2.0, rel=1e-12)
    assert fp8.rollout_peak_flops() == 1979e12 and bf16.rollout_peak_flops() == 989e12
    train = TrainCandidates.of([(16, 1, 2, 8, 1, 1)])
    slow, fast = CostModel(arch, accel, Job()).train(train), CostModel(arch, accel, Job(precision="fp8")).train(train)
    assert float(slow.update_compute_s[0]) / float(fast.update_compute_s[0]) == pytest.approx(242.9 / 240.5, rel=1e-12)
    for job in (Job(rollout_precision="fp8"), Job(precision="fp8")):
        with pytest.raises(SpecError, match="ascend-910b2 .* has no FP8"):
            evaluate(arch, load_accelerator("ascend-910b2"), job, 16)


def test_speculative_decoding_shortens_only_the_speculated_steps():
    """A verification step yields accept_length tokens for the price of one step over draft_tokens + 1
    tokens a sequence: with speculation always on, more accepted tokens never cost more; a switch at
    max_batch sequences a rank speculates only in the tail (so saves less than always-on); a job file
    round-trips it and an accept length beyond the draft + bonus is refused."""
    from planner.specs import Speculative

    arch, accel = _arch("qwen3-30b-a3b"), load_accelerator("h100-sxm")
    cand = RolloutCandidates.of([(8, 2, 4, 8)])
    base = Job(prompts_per_step=64, samples_per_prompt=16, response_tokens=Lengths(mean=4000, max=16384))

    def rollout_s(spec):
        return float(CostModel(arch, accel, replace(base, speculative=spec)).rollout(cand, kept_train_bytes=0.0).rollout_s[0])

    plain = rollout_s(None)
    always = [rollout_s(Speculative(draft_tokens=3, accept_length=a)) for a in (1.0, 2.0, 3.0, 4.0)]
    assert always == sorted(always, reverse=True) and always[0] >= plain and always[-1] < plain
    tail = rollout_s(Speculative(draft_tokens=3, accept_length=3.0, max_batch=8))
    assert always[2] < tail < plain
    job = Job.from_dict({**base.to_dict(), "speculative": {"method": "sam", "draft_tokens": 3, "accept_length": 1.35, "max_batch": 8}})
    assert job.speculative == Speculative(method="sam", draft_tokens=3, accept_length=1.35, max_batch=8)
    with pytest.raises(Exception, match="accept_length"):
        Job.from_dict({"speculative": {"draft_tokens": 3, "accept_length": 5}})
