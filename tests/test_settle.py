"""A proxy's correction bias settled again after pruning: the settling, the stats that hold it, the
plan that carries it and the checkpoint that is built from it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from checkpoints import family_config, save_tiny  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from planner.arch.routing import load_cv  # noqa: E402
from planner.checkpoint import EXPERT_MAP_NAME, Checkpoint, build  # noqa: E402
from planner.errors import CheckpointError, PlanError, SpecError  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.stats.compute import choose_plan, compute_stats, plan_from_stats  # noqa: E402
from planner.stats.settle import BIAS_RATE, SETTLE_PASSES, SETTLE_WINDOW, balance_bias, settle  # noqa: E402


def test_settling_evens_a_planted_imbalance():
    """Top-2 of 8 experts by score plus bias, one expert's scores lifted by 0.3: settling moves
    its bias down by about that much and the load evens out; it stops at the rate, undrifting."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(4000, 8, generator=gen)
    scores[:, 3] += 0.3
    bias = torch.zeros(8)

    def counts():
        return torch.bincount((scores + bias).topk(2, dim=-1).indices.reshape(-1), minlength=8).float()

    before = load_cv(counts())
    info = settle(lambda step: balance_bias(bias, counts(), step), [bias])
    assert before > 0.4 and load_cv(counts()) < 0.05
    assert -0.4 < float(bias[3] - bias.mean()) < -0.2
    assert info["passes"] < SETTLE_PASSES and info["drift"] < SETTLE_WINDOW * BIAS_RATE / 2


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A one-layer DeepSeek-V3 checkpoint whose correction bias spans -0.5..0.5 over the experts: any
    K of them, sliced, keep biases that balanced all E and load the kept ones unevenly."""
    path = save_tiny(tmp_path_factory.mktemp("planted") / "src", family_config("deepseek_v3", num_hidden_layers=1, first_k_dense_replace=0),
                     sharded=False)  # fmt: skip
    tensors = load_file(path / "model.safetensors")
    (name,) = [n for n in tensors if n.endswith("e_score_correction_bias")]
    tensors[name] = torch.linspace(-0.5, 0.5, tensors[name].numel())
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    ckpt = Checkpoint(path)
    k = next(x for x in sorted(ckpt.arch.legal_expert_counts()) if ckpt.arch.moe.top_k < x < ckpt.arch.original_num_experts)
    return ckpt, k, compute_stats(ckpt, experts=[k], calib_tokens=512, seq_len=64, settle_bias=True)


def test_stats_settle_each_plan_and_the_build_carries_it(planted, tmp_path):
    from transformers import AutoModelForCausalLM

    from planner.rl.routers import Routers
    from planner.stats.text import calibration_ids

    ckpt, k, stats = planted
    entry = stats["plans"][f"K={k}/agglomerative"]
    (layer,) = entry["settled_bias"]
    after, settled = (entry["per_layer"][layer][n] for n in ("load_cv_after", "load_cv_settled"))
    assert settled < after / 2, (after, settled)
    assert entry["summary"]["load_cv_settled"]["mean"] == settled
    plan = plan_from_stats(stats, k, "agglomerative", model=str(ckpt.path), settle_bias=True)
    assert plan.correction_bias == {int(layer): tuple(entry["settled_bias"][layer]["bias"])}
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).correction_bias == plan.correction_bias  # the plan file carries it

    report = build(ckpt, plan, tmp_path / "proxy", verify="auto")
    assert report.verification["forward"] == "finite"
    proxy = Checkpoint(tmp_path / "proxy")
    built = proxy.read_float32(proxy.moe_layers[int(layer)].correction_bias)
    assert proxy.moe_layers[int(layer)].correction_bias.dtype == "F32"
    assert np.array_equal(built, np.asarray(plan.correction_bias[int(layer)], dtype=np.float32))
    emap = json.loads((tmp_path / "proxy" / EXPERT_MAP_NAME).read_text())
    assert emap["correction_bias_settled"]["layers"] == [int(layer)] and "settled again" in emap["rule"]

    # the built proxy, run as transformers' model on the calibration tokens, routes as the stats said
    ids, _ = calibration_ids(ckpt.path, ckpt.arch.vocab_size, text=None, tokens=512, seq_len=64)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "proxy", dtype=torch.float32).eval()
    routers = Routers(model)
    with torch.no_grad():
        model(input_ids=torch.from_numpy(ids))
    (call,) = routers.calls
    counts = torch.bincount(call[2].reshape(-1), minlength=k)
    # the same routing, up to a near tie or two that another kernel may break the other way
    assert load_cv(counts) == pytest.approx(settled, abs=3 / float(counts.float().mean()))

    sliced = plan_from_stats(stats, k, "agglomerative", model=str(ckpt.path))
    assert sliced.correction_bias is None and sliced.layers == plan.layers


def test_settling_is_refused_where_it_cannot_be(planted, tmp_path):
    ckpt, k, stats = planted
    qwen = Checkpoint(save_tiny(tmp_path / "qwen", family_config("qwen3_moe", num_hidden_layers=1), sharded=False))
    with pytest.raises(SpecError, match="routes without a correction bias"):
        compute_stats(qwen, experts=[4], calib_tokens=64, seq_len=32, settle_bias=True)
    with pytest.raises(SpecError, match="drop --weights-only"):
        compute_stats(ckpt, experts=[k], weights_only=True, settle_bias=True)
    with pytest.raises(SpecError, match="pass --stats"):
        choose_plan(ckpt, k, "agglomerative", settle_bias=True)
    unsettled = {**stats, "plans": {key: {n: v for n, v in p.items() if n != "settled_bias"} for key, p in stats["plans"].items()}}
    with pytest.raises(SpecError, match="--settle-bias"):
        plan_from_stats(unsettled, k, "agglomerative", model="m", settle_bias=True)
    plan = plan_from_stats(stats, k, "agglomerative", model="m", settle_bias=True)
    (layer,) = plan.correction_bias
    short = Plan.from_dict({**plan.to_dict(), "correction_bias": {layer: [0.0] * (k - 1)}})
    with pytest.raises(PlanError, match=f"must hold {k} finite values"):
        short.check(ckpt.arch)
    with pytest.raises(PlanError, match="no correction bias"):
        Plan.from_dict({**plan.to_dict(), "original_experts": qwen.arch.original_num_experts, "experts": 4,
                        "layers": {0: [0, 1, 2, 3]}, "labels": None, "correction_bias": {0: [0.0] * 4}}).check(qwen.arch)  # fmt: skip
    with pytest.raises(SpecError, match="list of numbers"):
        Plan.from_dict({**plan.to_dict(), "correction_bias": {layer: "low"}})


def test_the_commands_settle_end_to_end(planted, tmp_path):
    """planner stats --settle-bias, then plan and build --settle-bias from it; build --settle-bias
    without such stats is a usage error that says what to run."""
    from click.testing import CliRunner

    from planner.cli import main

    ckpt, k, _ = planted

    def run(*args):
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)

    stats = tmp_path / "stats.json"
    done = run("stats", ckpt.path, "--experts", k, "--calib-tokens", 512, "--seq-len", 64, "--settle-bias", "-o", stats)
    assert done.exit_code == 0, done.output
    assert "load CV settled" in done.output
    done = run("plan", ckpt.path, "--experts", k, "--stats", stats, "--settle-bias", "-o", tmp_path / "plan.yaml")
    assert done.exit_code == 0, done.output
    done = run("build", ckpt.path, tmp_path / "proxy", "--plan", tmp_path / "plan.yaml", "--json")
    assert done.exit_code == 0, done.output
    assert "correction_bias_settled" in json.loads((tmp_path / "proxy" / EXPERT_MAP_NAME).read_text())
    refused = run("build", ckpt.path, tmp_path / "other", "--experts", k, "--settle-bias", "--json")
    assert refused.exit_code == 2 and "planner stats" in refused.output and not (tmp_path / "other").exists()


def test_preflight_says_a_settled_plans_p_is_a_sliced_proxys(tmp_path):
    """Where a routing shape's calibration data hold sliced proxies only (DeepSeek-V3's for rollout
    mismatch), preflight gives a settled plan the sliced proxy's P as a warning that says so."""
    import yaml
    from click.testing import CliRunner

    from planner.catalog import load_model
    from planner.cli import main

    arch = load_model("deepseek-v3")
    ids = [g * 32 + j for g in range(8) for j in range(4)]
    layers = {i: ids for i in arch.moe_layers}

    def fidelity(**extra):
        plan = Plan(model="deepseek-v3", experts=32, original_experts=256, layers=layers, **extra)
        plan.check(arch)
        (tmp_path / "plan.yaml").write_text(plan.to_yaml())
        request = {"model": "deepseek-v3", "plan": "plan.yaml", "budget": "64npu",
                   "fault": {"type": "rollout-mismatch", "settings": {"precision": "bf16"}}}  # fmt: skip
        (tmp_path / "request.yaml").write_text(yaml.safe_dump(request))
        result = CliRunner().invoke(main, ["preflight", str(tmp_path / "request.yaml"), "--json"], catch_exceptions=False)
        return next(c for c in json.loads(result.stdout)["checks"] if c["check"] == "fidelity")

    sliced = fidelity()
    assert sliced["reason"].startswith("P(fault reproduced)"), sliced
    settled = fidelity(correction_bias={i: [0.0] * 32 for i in layers})
    assert settled["status"] == "WARN"
    head = "the plan settles its correction bias again, and the calibration data of its routing shape holds sliced proxies only: for the sliced proxy, "
    assert settled["reason"].startswith(head + "P(fault reproduced)") and sliced["reason"].startswith(settled["reason"][len(head):])


def test_suggest_settle_bias_reads_the_family_of_settled_proxies_and_defers_the_settling_to_build(planted, tmp_path):
    """`suggest --settle-bias` reads each plan's P on its shape's family of settled proxies (or says
    the shape has none), refuses a router without a correction bias, and writes a deferred plan that
    `build --plan` settles from the stats file it is given (and refuses without one)."""
    import yaml
    from click.testing import CliRunner

    from planner.catalog import load_model_config
    from planner.cli import main
    from planner.fidelity.dataset import plan_row
    from planner.fidelity.estimator import FidelityEstimator, default_estimator_path
    from planner.stats.compute import resolve_plan

    def run(*args):
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)

    refused = run("suggest", "--budget", "8npu", "--settle-bias", "--json")
    assert refused.exit_code == 2 and "qwen3-30b-a3b's router has no correction bias" in refused.output
    args = ("suggest", "--model", "deepseek-v3", "--hardware", "atlas-a3", "--budget", "64npu", "--fault", "router-collapse", "--trials", 30)
    done = run(*args, "--settle-bias", "--min-fidelity", 0, "--json", "-o", tmp_path / "plan.yaml")  # threshold 0: a plan is written
    out = json.loads(done.stdout)
    shown = out["plans"] + out["pareto"]  # proposed or not, every option shown carries its fidelity
    assert out["request"]["proxy_build"] == "settled" and shown
    estimator, config = FidelityEstimator.load(default_estimator_path()), load_model_config("deepseek-v3")[1]
    for p in shown:
        family = estimator.family(plan_row(config, p["experts"], None, "settled"), "router-collapse")
        if family is None:
            assert p["fidelity"]["status"] == "uncalibrated" and "none with proxies whose correction bias is settled again" in p["fidelity"]["reason"]
        else:
            assert family.endswith("-settled") and p["fidelity"]["family"]["name"] == family
    sliced = json.loads(run(*args, "--json").stdout)
    assert sliced["request"]["proxy_build"] == "sliced" and all(not (p["fidelity"].get("family") or {}).get("name", "").endswith("-settled")
                                                                for p in sliced["plans"] + sliced["pareto"])  # fmt: skip
    written = yaml.safe_load((tmp_path / "plan.yaml").read_text())  # no stats: deferred, settled at build time
    assert written["deployment"]["settle_bias"] is True and not written.get("layers")
    ckpt, k, stats = planted
    deferred = Plan(model=str(ckpt.path), experts=k, original_experts=ckpt.arch.original_num_experts, layers={}, method="agglomerative",
                    deployment={"settle_bias": True})  # fmt: skip
    assert deferred.build == "settled" and Plan(**{**deferred.__dict__, "deployment": None}).build == "sliced"
    with pytest.raises(SpecError, match="pass --stats"):
        resolve_plan(ckpt, deferred)
    from planner.stats.store import save_stats

    save_stats(stats, tmp_path / "stats.json")
    made = resolve_plan(ckpt, deferred, stats_path=tmp_path / "stats.json")
    assert made.build == "settled" and made.correction_bias == plan_from_stats(stats, k, "agglomerative", model="m", settle_bias=True).correction_bias


def test_a_two_dimensional_correction_bias_is_settled_and_built_in_its_own_shape(tmp_path):
    """ERNIE-4.5's correction bias is a [1, E] tensor: settled and written back as [1, K]."""
    src = Checkpoint(save_tiny(tmp_path / "src", family_config("ernie4_5_moe", num_hidden_layers=1, moe_layer_start_index=0), sharded=False))
    k = next(x for x in sorted(src.arch.legal_expert_counts()) if src.arch.moe.top_k < x < src.arch.original_num_experts)
    stats = compute_stats(src, experts=[k], calib_tokens=256, seq_len=64, settle_bias=True)
    plan = plan_from_stats(stats, k, "agglomerative", model=str(src.path), settle_bias=True)
    build(src, plan, tmp_path / "proxy", verify="auto")
    (layer,) = plan.correction_bias
    info = Checkpoint(tmp_path / "proxy").moe_layers[layer].correction_bias
    sliced = src.moe_layers[layer].correction_bias
    assert len(info.shape) == len(sliced.shape) == 2 and math.prod(info.shape) == k and info.dtype == sliced.dtype
    got = Checkpoint(tmp_path / "proxy").read_float32(info).reshape(-1)
    assert info.dtype == "F32" and np.array_equal(got, np.asarray(plan.correction_bias[layer], dtype=np.float32))


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "F64"])
def test_settled_values_are_written_in_the_sliced_tensors_dtype_as_torch_rounds_them(dtype):
    """A checkpoint may hold its correction bias in another float dtype: the settled values are
    encoded as torch casts float32 to it (round to nearest even), byte for byte."""
    from planner.checkpoint.build import _settled
    from planner.checkpoint.safetensors import OutTensor

    values = (1.0, 1 + 2**-8, 1 + 3 * 2**-8, -0.3, 1e-3, 65504.0)  # ties to even and back in bfloat16, the fp16 maximum
    out = _settled(OutTensor("bias", dtype, (1, len(values))), values)
    want = torch.tensor(values, dtype=torch.float32).to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                                                        "F64": torch.float64}[dtype])  # fmt: skip
    assert out.shape == (1, len(values)) and out.data == want.view(torch.uint8).numpy().tobytes()
    with pytest.raises(CheckpointError, match="cannot replace"):
        _settled(OutTensor("bias", dtype, (len(values) + 1,)), values)
