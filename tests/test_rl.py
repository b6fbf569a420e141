"""The GRPO harness on a small real upcycled MoE: recipes fire, K = E proxies are exact, margins
bracket the critical knob, runs are deterministic, and the CLI writes what `calibrate add` reads."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from planner.cli import main

pytestmark = pytest.mark.slow
SMALL = dict(prompts=4, group=4, new_tokens=8)  # the reduced run size of these tests
VOLATILE = {"wall_s", "peak_mem_bytes"}


def run_cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def models(rl_model):
    from planner.rl.grpo import Models

    return Models(rl_model[0])


def same_rows(a: list[dict], b: list[dict]) -> bool:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        keys = set(x) - VOLATILE
        assert keys == set(y) - VOLATILE
        for k in keys:
            if not (x[k] == y[k] or (isinstance(x[k], float) and np.isnan(x[k]) and np.isnan(y[k]))):
                return False
    return True


def test_upcycled_experts_are_partly_redundant(rl_model):
    sims = rl_model[1]["expert_cosine_similarity"]
    assert 0.3 < sims["p5"] <= sims["p50"] <= sims["p95"] < 0.999  # redundant, yet not copies


@pytest.mark.parametrize("name", ["fp16-overflow", "rollout-mismatch", "entropy-collapse", "grad-blowup", "router-collapse"])
def test_each_recipe_fires_at_its_bracket_top_and_not_at_its_bottom(models, name):
    from planner.rl.grpo import GRPO
    from planner.rl.recipes import recipe

    r = recipe(name)
    if name == "fp16-overflow":
        trainer = GRPO(models, r.config(r.lo, seed=0, **SMALL))
        batch = trainer._batch(0)
        fired = {k: trainer.probe_overflow(batch, k) for k in (r.lo, r.hi)}
    elif name == "rollout-mismatch":
        fired = {k: GRPO(models, r.config(k, seed=0, **SMALL)).probe_mismatch(0) > r.threshold for k in (r.lo, r.hi)}
    elif name == "router-collapse":
        # a trained router drifts towards imbalance even without anti-balance pressure (the top-k share
        # climbs ~0.03 a step at the bracket's floor): what the knob guarantees is the order, the top
        # of the bracket collapses first and further
        runs = {k: GRPO(models, r.config(k, seed=0, steps=10, **SMALL)).run() for k in (r.lo, r.hi)}
        onset = {k: r.onset(rows) for k, rows in runs.items()}
        peak = {k: max(row["collapse_max"] for row in rows) for k, rows in runs.items()}
        assert onset[r.hi] is not None and (onset[r.lo] is None or onset[r.lo] > onset[r.hi]), onset
        assert peak[r.lo] < peak[r.hi], peak
        return
    else:
        fired = {k: r.onset(GRPO(models, r.config(k, seed=0, steps=10, **SMALL)).run()) is not None for k in (r.lo, r.hi)}
    assert fired == {r.lo: False, r.hi: True}


def test_mismatch_is_the_kl_of_rollout_to_trainer():
    """The k3 estimate on samples of the rollout distribution converges to KL(rollout || train)."""
    import torch

    from planner.rl.grpo import _mismatch

    q = torch.tensor([0.5, 0.3, 0.2])  # rollout
    p = torch.tensor([0.4, 0.4, 0.2])  # trainer
    tokens = torch.multinomial(q, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    k3, _ = _mismatch(q.log()[tokens], p.log()[tokens])
    assert k3 == pytest.approx(float((q * (q / p).log()).sum()), rel=0.03)


def test_fp16_overflow_is_a_skipped_step_in_a_run(models):
    from planner.rl.grpo import GRPO
    from planner.rl.recipes import recipe

    rows = GRPO(models, recipe("fp16-overflow").config(40.0, seed=0, steps=2, **SMALL)).run()
    assert all(r["overflow"] > 0 and r["skipped_total"] > 0 and r["loss_scale_log2"] == 40.0 for r in rows)


def test_one_norm_per_gradient_tells_finite_updates_and_the_norms(models):
    """The update's finiteness check reads each gradient's norm: a NaN or an inf anywhere makes the
    update non-finite; finite gradients whose squares overflow (norm inf) still count as finite."""
    import torch

    from planner.rl.grpo import GRPO, RLConfig

    run = GRPO(models, RLConfig(steps=1, **SMALL))
    params = list(run.policy.parameters())
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, 0.5 + i)
    norms, finite = run._grad_norms()
    assert finite and all(float(norms[id(p)]) == float(p.grad.norm()) for p in params)
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in run.expert_params]))
    assert run._norm(run.expert_params, norms) == float(want) > 0
    params[0].grad.view(-1)[-1] = 1e30  # finite, but its square is not
    norms, finite = run._grad_norms()
    assert finite and math.isinf(float(norms[id(params[0])]))
    for bad in (math.inf, -math.inf, math.nan):
        params[-1].grad.view(-1)[0] = bad
        assert not run._grad_norms()[1]
    params[-1].grad = None  # a parameter without a gradient is left out
    assert run._grad_norms()[1] and id(params[-1]) not in run._grad_norms()[0]


def test_grad_norms_of_an_fp16_update_are_those_of_its_unscaled_gradients(models):
    """One fp16 update at a static loss scale: the row's three grad norms are those of the gradients
    the optimizer stepped with (unscaled, not clipped), the router's and experts' of their subsets."""
    import torch

    from planner.rl.grpo import GRPO, RLConfig

    config = RLConfig(steps=1, precision="fp16", rollout_precision="fp16", loss_scale_log2=3.0, grad_clip=None, ppo_epochs=1,
                      mini_batches=1, **SMALL)  # fmt: skip
    run = GRPO(models, config)
    row = run.run()[0]
    assert row["nonfinite"] == 0  # 2^3 is far below where fp16 overflows on these models

    def norm(params):
        return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))

    assert row["grad_norm"] == norm(run.policy.parameters()) > 0
    assert row["grad_norm_router"] == norm(run.router_params) > 0
    assert row["grad_norm_experts"] == norm(run.expert_params) > 0


def test_runs_are_deterministic_and_a_keep_all_proxy_is_identical(rl_model, tmp_path):
    from planner.checkpoint import Checkpoint, build
    from planner.plan import Plan
    from planner.rl.grpo import GRPO, RLConfig

    ckpt = Checkpoint(rl_model[0])
    e = ckpt.arch.original_num_experts
    plan = Plan(model=str(rl_model[0]), experts=e, original_experts=e, layers={i: tuple(range(e)) for i in ckpt.moe_layers})
    build(ckpt, plan, tmp_path / "proxy", verify="never")
    config = RLConfig(steps=3, precision="bf16", rollout_precision="bf16", **SMALL)
    original = GRPO(rl_model[0], config).run()
    again = GRPO(rl_model[0], config).run()
    proxy = GRPO(tmp_path / "proxy", config).run()
    assert same_rows(original, again)
    assert same_rows(original, proxy)
    other = RLConfig(steps=3, seed=1, precision="bf16", rollout_precision="bf16", **SMALL)
    assert not same_rows(original, GRPO(rl_model[0], other).run())  # seeds matter


@pytest.mark.parametrize("name", ["fp16-overflow", "rollout-mismatch"])
def test_margin_brackets_the_critical_knob(models, name):
    from planner.rl.grpo import GRPO
    from planner.rl.margin import critical_knob
    from planner.rl.recipes import recipe

    r = recipe(name)
    iters = 4
    margin = critical_knob(models, r, [0, 1], iters=iters)
    resolution = (r.hi - r.lo) / 2 ** (iters + 1)
    assert not all(margin.censored)
    for seed, value, censored in zip((0, 1), margin.values, margin.censored):
        trainer = GRPO(models, r.config(r.lo, seed=seed))
        if name == "fp16-overflow":
            batch = trainer._batch(seed)
            fires = lambda k: trainer.probe_overflow(batch, k)  # noqa: E731
        else:
            fires = lambda k: GRPO(models, r.config(k, seed=seed)).probe_mismatch(seed) > r.threshold  # noqa: E731
        if censored:  # no fault anywhere in the bracket: reported at its top, and flagged
            assert value == r.hi and not fires(r.hi)
        else:
            assert fires(value + resolution) and not fires(value - resolution)


def test_overflow_probe_reuses_the_forward_bit_for_bit(models):
    """critical_knob's fp16 bisection runs one forward per seed and a backward per knob: each knob's
    gradients are those of a fresh forward and backward, bit for bit, below and above the crossing."""
    import torch

    from planner.rl.grpo import GRPO
    from planner.rl.recipes import recipe

    r = recipe("fp16-overflow")
    trainer = GRPO(models, r.config(r.lo, seed=0, **SMALL))
    batch = trainer._batch(0)
    shared = trainer.overflow_probe(batch)
    params = [(n, p) for n, p in trainer.policy.named_parameters() if p.requires_grad]

    def grads(probe, knob):
        seen: dict = {}
        hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: seen.__setitem__(n, p.grad.clone())) for n, p in params]
        try:
            fault = probe(knob)
        finally:
            for h in hooks:
                h.remove()
        return fault, seen

    faults = set()
    for knob in (r.hi, r.lo, 0.5 * (r.lo + r.hi), r.hi):  # out of order, and one knob twice
        fault, kept = grads(shared, knob)
        fresh_fault, fresh = grads(trainer.overflow_probe(batch), knob)
        assert fault == fresh_fault == trainer.probe_overflow(batch, knob)
        assert kept.keys() == fresh.keys() and len(kept) == len(params)
        assert all(torch.equal(kept[n].view(torch.int32), fresh[n].view(torch.int32)) for n in kept)  # NaN and inf bits too
        faults.add(fault)
    assert faults == {True, False}  # both sides of the crossing were compared


@pytest.mark.slow
def test_margin_brackets_a_dynamic_recipe(models):
    """entropy collapse: each bisection probe is a short GRPO run (seeded, so a re-run repeats it)."""
    from planner.rl.grpo import GRPO
    from planner.rl.margin import critical_knob
    from planner.rl.recipes import recipe

    r, iters, steps = recipe("entropy-collapse"), 3, 6
    margin = critical_knob(models, r, [0], iters=iters, steps=steps)
    (value,), (censored,) = margin.values, margin.censored
    resolution = (r.hi - r.lo) / 2 ** (iters + 1)

    def fires(knob):
        return r.onset(GRPO(models, r.config(knob, seed=0, steps=steps)).run()) is not None

    assert not censored and r.lo < value < r.hi, margin  # the fault lies inside the bracket
    assert fires(value + resolution) and not fires(value - resolution)


def test_rl_cli_run_margin_and_errors(rl_model, tmp_path):
    model = rl_model[0]
    result = run_cli("rl", "run", model, "--recipe", "rollout-mismatch", "--knob", "21", "--steps", "2",
                     "--set", "prompts=4", "--set", "new_tokens=8", "-o", tmp_path / "a")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output
    header = (tmp_path / "a" / "metrics.csv").read_text().splitlines()[0].split(",")
    design = {"loss", "grad_norm", "grad_norm_router", "grad_norm_experts", "entropy", "kl_ref", "clip_frac", "reward_mean",
              "reward_std", "response_len", "overflow", "skipped_total", "loss_scale_log2", "max_logit", "mismatch_k3",
              "aux_loss", "load_cv_max", "topk_share_max", "collapse_max", "router_entropy_0", "peak_mem_bytes"}  # fmt: skip
    assert design <= set(header)
    info = json.loads((tmp_path / "a" / "run.json").read_text())
    assert info["recipe"] == "rollout-mismatch" and info["config"]["rollout_mantissa_bits"] == 2.0 and info["versions"]["torch"]

    again = run_cli("rl", "run", model, "--steps", "1", "-o", tmp_path / "a")
    assert again.exit_code == 2 and "--force" in again.output  # never overwritten silently

    margin = run_cli("rl", "margin", model, "--recipe", "rollout-mismatch", "--seeds", "0", "--iters", "3", "-o", tmp_path / "a", "--json")
    assert margin.exit_code == 0, margin.output
    data = json.loads((tmp_path / "a" / "margin.json").read_text())
    assert data["recipe"] == "rollout-mismatch" and data["bracket"] == [0.0, 23.0] and len(data["values"]) == 1

    for args, words in [
        (("rl", "run", model, "--device", "npu", "--steps", "1", "-o", tmp_path / "n"), "torch_npu"),
        (("rl", "run", model, "--set", "bogus=1", "-o", tmp_path / "b"), "bogus"),
        (("rl", "run", model, "--set", "seed=1", "-o", tmp_path / "b"), "--seed"),
        (("rl", "run", model, "--knob", "3", "-o", tmp_path / "b"), "--recipe"),
        (("rl", "run", model, "--set", "new_tokens=0", "-o", tmp_path / "b"), "at least 1"),
        (("rl", "run", model, "--set", "group=1", "-o", tmp_path / "g"), "group >= 2"),
        (("rl", "margin", model, "--recipe", "fp16-overflow", "--seeds", ""), "at least one seed"),
        (("rl", "make-models", tmp_path / "m", "--families", "olmoe"), "qwen3_moe"),
    ]:
        bad = run_cli(*args)
        assert bad.exit_code == 2 and words in bad.output, (args, bad.output)


def test_make_models_is_deterministic(tmp_path):
    args = ("rl", "make-models", "--families", "deepseek_v3", "--dense-steps", "3", "--moe-steps", "3", "--json")
    first = run_cli(*args[:1], args[1], tmp_path / "a", *args[2:])
    second = run_cli(*args[:1], args[1], tmp_path / "b", *args[2:])
    assert first.exit_code == 0 and second.exit_code == 0, first.output
    a = (tmp_path / "a" / "deepseek_v3" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "deepseek_v3" / "model.safetensors").read_bytes()
    report = json.loads(first.stdout)["deepseek_v3"]
    assert report["parameters"] > 0 and set(report["expert_cosine_similarity"]) >= {"p5", "p50", "p95"}
    assert run_cli(*args[:1], args[1], tmp_path / "a", *args[2:]).exit_code == 2  # exists: needs --force


@pytest.mark.slow
def test_router_collapse_detector_and_balance_loss_do_not_depend_on_k(rl_model, tmp_path):
    """Both run from 0 (balanced) to 1 (collapsed) whatever E is; at K = top_k, where every token
    uses every expert, there is nothing to balance (the loss is constant) and nothing can collapse."""
    from planner.rl.grpo import GRPO
    from planner.rl.recipes import recipe

    model = rl_model[0]
    assert run_cli("build", model, tmp_path / "k4", "--experts", "4", "--method", "kmeans").exit_code == 0
    collapse = recipe("router-collapse")
    original = GRPO(model, collapse.config(-1.0, seed=0, steps=2)).run()
    assert all(0.0 <= r["aux_loss"] <= 1.0 and 0.0 <= r["collapse_max"] <= 1.0 for r in original)
    dense = GRPO(tmp_path / "k4", collapse.config(2.0, seed=0, steps=2)).run()  # the strongest anti-balance push of the bracket
    assert all(r["aux_loss"] == 0.0 and math.isnan(r["collapse_max"]) and r["topk_share_max"] == pytest.approx(1.0) for r in dense)
    assert collapse.onset(dense) is None


@pytest.mark.parametrize("family", ["deepseek_v3-e256", "gpt_oss-e32", "nemotron_h-e128"])
def test_fast_eager_experts_train_bitwise_as_transformers_eager(family):
    """The unbind hooks change the time of a training step through the eager experts, never its
    values: the same weights after two AdamW steps, with gated, biased and gate-less experts."""
    import torch
    import transformers

    from planner.families import family_config
    from planner.rl.experts import fast_eager_experts

    config = transformers.AutoConfig.for_model(**family_config(family))

    def trained(fast: bool) -> dict:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
        if fast:
            assert fast_eager_experts(model) == sum(hasattr(m, "_is_expert_parallel") for m in model.modules()) > 0
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randint(0, 256, (4, 32), generator=gen)
            opt.zero_grad(set_to_none=True)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
        with torch.no_grad():  # no hook's view outlives a pass, with or without gradients
            model(input_ids=x)
        assert not any(type(v).__name__ == "_Rows" for m in model.modules() for v in vars(m).values())
        return model.state_dict()

    fast, eager = trained(True), trained(False)
    assert fast.keys() == eager.keys() and all(torch.equal(fast[k], eager[k]) for k in eager)


def test_mamba_scan_chunks_fitted_to_the_sequence_give_the_same_gradients(request):
    """Nemotron-H's scan pads 32 tokens to its config's chunk of 128; fitted to the sequence it
    runs one chunk of 32: the same loss and gradients, bit for bit, on one thread as the harness
    runs (threads split a reduction by its shape). A longer run gets the config's chunk back."""
    import torch
    import transformers

    from planner.families import family_config
    from planner.rl.experts import fit_scan_chunks

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    config = transformers.AutoConfig.for_model(**family_config("nemotron_h-e128"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    mixers = [m for m in model.modules() if type(m).__name__ == "NemotronHMamba2Mixer"]
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))

    def gradients() -> dict:
        model.zero_grad(set_to_none=True)
        model(input_ids=x, labels=x).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    padded = gradients()
    assert mixers and all(m.chunk_size == config.chunk_size == 128 for m in mixers)
    assert fit_scan_chunks(model, 32) == len(mixers) and all(m.chunk_size == 32 for m in mixers)
    fitted = gradients()
    assert padded.keys() == fitted.keys() and all(torch.equal(padded[n], fitted[n]) for n in padded)
    assert fit_scan_chunks(model, 512) == 0 and all(m.chunk_size == 128 for m in mixers)


def test_delta_rule_chunks_fitted_to_the_sequence_give_the_same_gradients(request, monkeypatch):
    """Qwen3-Next's chunked delta rule pads 32 tokens to its default chunk of 64; fitted to the
    sequence, each gated-DeltaNet layer hands the rule a chunk of 32: the same loss and gradients,
    bit for bit, on one thread as the harness runs. A longer run gets the default back."""
    import functools

    import torch
    import transformers
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next

    from planner.families import family_config
    from planner.rl.experts import fit_scan_chunks

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    chunks, rule = [], qwen3_next.torch_chunk_gated_delta_rule

    @functools.wraps(rule)
    def seen(*args, **kwargs):  # the rule itself, noting the chunk it was handed
        chunks.append(kwargs.get("chunk_size"))
        return rule(*args, **kwargs)

    monkeypatch.setattr(qwen3_next, "torch_chunk_gated_delta_rule", seen)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**family_config("qwen3_next-e512")))
    layers = [m for m in model.modules() if type(m).__name__ == "Qwen3NextGatedDeltaNet"]
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))

    def gradients() -> dict:
        chunks.clear()
        model.zero_grad(set_to_none=True)
        model(input_ids=x, labels=x).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    padded = gradients()
    assert layers and chunks == [None] * len(layers)  # the rule's default, 64
    assert fit_scan_chunks(model, 32) == len(layers)
    fitted = gradients()
    assert chunks == [32] * len(layers)
    assert padded.keys() == fitted.keys() and all(torch.equal(padded[n], fitted[n]) for n in padded)
    assert fit_scan_chunks(model, 512) == 0 and fit_scan_chunks(model, 64) == 0
    gradients()
    assert chunks == [None] * len(layers)
    assert all(len(layer._forward_pre_hooks) == 1 for layer in layers)  # one hook, whatever the calls


def test_fast_eager_experts_release_the_rows_when_a_forward_raises():
    import torch
    import transformers

    from planner.families import family_config
    from planner.rl.experts import fast_eager_experts

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**family_config("qwen3_moe-e128")),
                                                          experts_implementation="eager")  # fmt: skip
    fast_eager_experts(model)
    experts = next(m for m in model.modules() if hasattr(m, "_is_expert_parallel"))
    with pytest.raises(RuntimeError):  # an expert index past E
        experts(torch.zeros(3, model.config.hidden_size), torch.full((3, 8), 999), torch.ones(3, 8))
    assert "gate_up_proj" not in vars(experts) and isinstance(experts.gate_up_proj, torch.nn.Parameter)
