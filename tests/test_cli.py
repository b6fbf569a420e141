"""The command line: happy paths print what users need; bad input gives a clear message and exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from planner.cli import main


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def write_job(tmp_path, **fields) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(fields))
    return str(path)


# ---- happy paths --------------------------------------------------------------------------------

def test_models_lists_catalog_and_accelerators():
    result = run("models", "--json")
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert len(data["models"]) >= 11
    assert {a["id"] for a in data["accelerators"]} >= {"ascend-910b2", "atlas-a3", "a100-80g", "h100-sxm", "h800", "h20", "h200"}
    assert all(m["source"] for m in data["models"])
    text = run("models").output
    assert "qwen3-30b-a3b" in text and "atlas-a3" in text


def test_inspect_original_and_proxy():
    data = json.loads(run("inspect", "qwen3-30b-a3b", "--experts", "32", "--json").output)
    original, proxy = data["parameters"]["original"], data["parameters"]["K=32"]
    assert original["total"] == 30_532_122_624
    assert proxy["routed_experts"] * 4 == original["routed_experts"]
    assert data["model"]["moe"]["routing"].startswith("softmax")
    text = run("inspect", "deepseek-v3").output
    assert "MLA" in text and "grouped (8 groups" in text and "MTP" in text


def test_inspect_reads_a_checkpoint_directory(tmp_path):
    config = json.loads(run("inspect", "mixtral-8x7b", "--json").output)["model"]
    assert config["num_layers"] == 32
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "mixtral", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4})
    )
    result = run("inspect", str(tmp_path), "--json")
    assert result.exit_code == 0
    assert json.loads(result.output)["model"]["moe"]["num_experts"] == 4


def test_cost_json_has_every_field(tmp_path):
    job = write_job(tmp_path, train_layout={"tp": 1, "pp": 8, "ep": 1, "cp": 1})
    result = run("cost", "qwen3-30b-a3b", "--hardware", "ascend-910b2", "--cards", "16", "--job", job, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    for key in ("feasible", "num_cards", "step_time_s", "phase_times_s", "memory_per_card_bytes", "peak_phase",
                "host_memory_bytes", "accelerator_hours_per_step", "tokens_per_s_per_card", "train_layout", "rollout_layout"):
        assert key in data, key
    assert data["feasible"] and data["num_cards"] == 16
    assert set(data["phase_times_s"]) >= {"rollout", "reference", "old_logprob", "update", "switch"}
    assert data["step_time_s"] == pytest.approx(sum(data["phase_times_s"].values()))
    assert data["accelerator_hours_per_step"] == pytest.approx(16 * data["step_time_s"] / 3600)
    assert data["peak_phase"] in data["memory_per_card_bytes"]
    for parts in data["memory_per_card_bytes"].values():
        assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"), rel=1e-9) or len(parts) == 1
    assert data["train_layout"]["pp"] == 8


def test_cost_min_cards_on_atlas_a3_reports_both_units():
    result = run("cost", "deepseek-v3", "--hardware", "atlas-a3", "--min-cards", "--json")
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["feasible"] and data["devices_per_card"] == 2
    assert data["physical_cards"] * 2 == data["num_cards"]
    assert "units" in data and "die" in data["units"]
    text = run("cost", "deepseek-v3", "--hardware", "atlas-a3", "--min-cards").output
    assert "physical cards" in text and "card-hours" in text


def test_cost_says_what_backs_its_step_times(tmp_path):
    """The leave-one-run-out check of the knobs in use, for the accelerator's family, and whether any
    of those runs ran on the accelerator; none: uncalibrated."""
    from planner.cost.fit import load_runs

    knobs = json.loads((Path(__file__).resolve().parents[1] / "calibration" / "knobs.json").read_text())
    steps = [r for r in knobs["leave_one_out"] if r["phase"] == "step" and r["family"] == "ascend"]
    within = sum(abs(r["ratio"] - 1) <= 0.25 for r in steps)
    text = run("cost", "deepseek-v3", "--hardware", "atlas-a3", "--min-cards").output
    assert f"step times out of sample: {within} of {len(steps)} published ascend runs within 25%" in text
    data = json.loads(run("cost", "deepseek-v3", "--hardware", "atlas-a3", "--min-cards", "--json").output)
    assert data["step_time_validation"]["runs"] == len(steps) and data["step_time_validation"]["runs_within_25"] == within
    assert data["step_time_validation"]["accelerator_measured"] and "none of them ran on" not in text
    ran_on = sorted({r.hardware for r in load_runs() if r.family == "nvidia"})
    text = run("cost", "qwen3-30b-a3b", "--hardware", "h800", "--cards", "16").output
    assert f"none of them ran on h800 (they ran on {', '.join(ran_on)})" in text
    (tmp_path / "k.json").write_text(json.dumps({k: v for k, v in knobs.items() if k != "leave_one_out"}))
    text = run("cost", "deepseek-v3", "--hardware", "atlas-a3", "--min-cards", "--knobs", tmp_path / "k.json").output
    assert "step times: uncalibrated" in text


def test_proxy_needs_fewer_cards():
    full = json.loads(run("cost", "qwen3-30b-a3b", "--min-cards", "--json").output)
    proxy = json.loads(run("cost", "qwen3-30b-a3b", "--min-cards", "--experts", "32", "--json").output)
    assert proxy["num_cards"] < full["num_cards"]
    assert proxy["experts"] == 32 and any("not faithful" in n for n in proxy["notes"])


def test_demo_json():
    data = json.loads(run("demo", "--experts", "64", "--json").output)
    original = data["original"]
    (proxy,) = data["proxies"]
    assert original["feasible"] and proxy["feasible"] and (original["experts"], proxy["experts"]) == (128, 64)
    # A lower bound by hand. Megatron's distributed optimizer keeps 2 B (bf16 weight) + 4 B (fp32 grad) + 12 B
    # (fp32 master copy and Adam's two moments) per parameter; sharded perfectly over every device that is
    # 18 B/param at least. Qwen3-30B-A3B: 30.53e9 parameters (Qwen's model card: 30.5B), 549.6 GB; its routed
    # experts are 48 layers x 128 x 3 x 2048 x 768 = 28.99e9, so K=64 keeps 30.53e9 - 14.50e9 = 16.03e9, 288.5 GB.
    # A 910B2 holds 60.97 GiB usable, 90% of it = 58.92 GB: the original needs more than 549.6 / 58.92 = 9.3 npus,
    # the proxy more than 288.5 / 58.92 = 4.9; 910B2 allocations go 1, 2, 4, 8, 16, 24 npus: at least 16 and 8
    assert original["num_cards"] >= 16 and proxy["num_cards"] >= 8
    # and no more: the demo's minimum is feasible at those counts (the cost model fits both with room to spare)
    assert (original["num_cards"], proxy["num_cards"]) == (16, 8)
    assert proxy["card_reduction"] == 2.0 and proxy["card_saving_fraction"] == 0.5
    assert proxy["hours_reduction"] == pytest.approx(original["accelerator_hours_per_step"] / proxy["accelerator_hours_per_step"])


# ---- bad input: clear message, exit code 2 -------------------------------------------------------

def test_unknown_model_suggests_close_matches():
    result = CliRunner().invoke(main, ["inspect", "qwen3-30b-a4b"])
    assert result.exit_code == 2
    assert "unknown model 'qwen3-30b-a4b'" in result.output
    assert "did you mean" in result.output and "qwen3-30b-a3b" in result.output


def test_malformed_config_names_missing_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3_moe", "vocab_size": 10, "num_hidden_layers": 2, "num_attention_heads": 4}))
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 2
    assert "missing required field 'hidden_size'" in result.output


def test_non_finite_numbers_in_a_config_are_usage_errors(tmp_path):
    """Python's JSON reader takes NaN and Infinity: a size or factor that is one is named, not a traceback."""
    from planner.catalog import load_model_config

    config = load_model_config("qwen3-30b-a3b")[1]
    path = tmp_path / "config.json"
    for key, value, said in (("hidden_size", "NaN", "'hidden_size' must be an integer, got nan"),
                             ("num_experts", "Infinity", "'num_experts' must be an integer, got inf")):  # fmt: skip
        path.write_text(json.dumps({**config, key: 0}).replace(f'"{key}": 0', f'"{key}": {value}'))
        for args in (["inspect", str(path)], ["cost", str(path), "--cards", "16", "--json"]):
            result = CliRunner().invoke(main, args)
            assert result.exit_code == 2 and said in result.output, result.output
        assert json.loads(result.stdout)["exit_code"] == 2
    path.write_text(json.dumps({**config, "model_type": "deepseek_v3", "routed_scaling_factor": -1.0, "n_routed_experts": 8,
                                "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2}))
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 2 and "'routed_scaling_factor' must be a positive number, got -1.0" in result.output, result.output


def test_option_errors_under_json_are_json(tmp_path):
    """A value click refuses while reading the options comes, under --json, as the JSON object of
    every other error (exit 2); without --json, click's usage text as before."""
    for args, said in ((["cost", "qwen3-30b-a3b", "--cards", "0", "--json"], "'--cards': 0 is not in the range"),
                       (["suggest", "--budget", "16npu", "--stats", str(tmp_path / "missing"), "--json"], "'--stats'")):  # fmt: skip
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and said in json.loads(result.stdout)["error"], result.output
        assert json.loads(result.stdout)["exit_code"] == 2
    plain = CliRunner().invoke(main, ["cost", "qwen3-30b-a3b", "--cards", "0"])
    assert plain.exit_code == 2 and "Usage: " in plain.output


def test_a_key_given_twice_and_a_release_written_as_a_number_are_refused(tmp_path):
    """PyYAML keeps the last of two equal keys and reads 0.10 as 0.1: a job file with either is
    refused with the key and its line, or with the quoting that keeps the release's digits."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("prompts_per_step: 64\nsamples_per_prompt: 8\nprompts_per_step: 32\n")
    result = CliRunner().invoke(main, ["cost", "qwen3-30b-a3b", "--cards", "16", "--job", str(twice)])
    assert result.exit_code == 2 and "key 'prompts_per_step' is given twice" in result.output and "line 3" in result.output
    spec = tmp_path / "spec.yaml"
    spec.write_text("speculative: {method: sam, draft_tokens: 3, accept_length: 9}\n")
    result = CliRunner().invoke(main, ["cost", "qwen3-30b-a3b", "--cards", "16", "--job", str(spec)])
    assert result.exit_code == 2 and f"{spec}.speculative.accept_length: must lie in [1.0, 4.0], got 9 (at most draft_tokens + 1" in result.output
    merged = tmp_path / "merged.yaml"  # YAML merge keys still merge, an override after them included
    merged.write_text("base: &b {tp: 1, pp: 1, ep: 8, cp: 1}\ntrain_layout:\n  <<: *b\n  tp: 2\n")
    from planner.files import read_yaml

    assert read_yaml(merged, "job")["train_layout"] == {"tp": 2, "pp": 1, "ep": 8, "cp": 1}
    number = tmp_path / "number.yaml"
    number.write_text("trainer: verl\ntrainer_version: 0.10\n")
    result = CliRunner().invoke(main, ["cost", "qwen3-30b-a3b", "--cards", "16", "--job", str(number)])
    assert result.exit_code == 2 and "quoted ('0.10')" in result.output


def test_an_empty_model_name_and_no_k_values_are_usage_errors():
    result = CliRunner().invoke(main, ["cost", "", "--cards", "8"])
    assert result.exit_code == 2 and "no model given (an empty name)" in result.output
    result = CliRunner().invoke(main, ["demo", "--experts", ",,"])
    assert result.exit_code == 2 and "give the proxies' K values" in result.output


def test_seeds_are_distinct_and_non_negative(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    result = CliRunner().invoke(main, ["probe", str(tmp_path / "a"), str(tmp_path / "b"), "--recipe", "rollout-mismatch", "--seeds=-1,2"])
    assert result.exit_code == 2 and "seeds are non-negative integers, got -1" in result.output
    result = CliRunner().invoke(main, ["rl", "margin", str(tmp_path / "a"), "--recipe", "rollout-mismatch", "--seeds", "0,0"])
    assert result.exit_code == 2 and "a seed is given twice" in result.output


def test_knobs_and_counts_of_the_rl_commands_are_bounded(tmp_path):
    """A recipe's knob that overflows a float or leaves the number format, and counts of zero, are
    usage errors naming the bound (were tracebacks, or a run at -7 mantissa bits)."""
    from planner.errors import SpecError
    from planner.rl.recipes import recipe

    for name, knob, said in (("fp16-overflow", 1e300, "not a finite number"), ("fp16-overflow", float("nan"), "not a finite number"),
                             ("router-collapse", 1e9, "not a finite number"), ("rollout-mismatch", 30.0, "rollout_mantissa_bits must lie in [0, 23]"),
                             ("fp16-overflow", 200.0, "loss_scale_log2 must lie in [-126, 127]")):  # fmt: skip
        with pytest.raises(SpecError, match=re.escape(said)):
            recipe(name).config(knob, seed=0)
    (tmp_path / "m").mkdir()
    for args in (["rl", "make-models", str(tmp_path / "mm"), "--dense-steps", "0"], ["rl", "margin", str(tmp_path / "m"), "--recipe",
                                                                                     "rollout-mismatch", "--iters", "0"]):  # fmt: skip
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and "Invalid value" in result.output, result.output
    assert not (tmp_path / "mm").exists()


def test_invalid_json_config_says_where(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "mixtral", "hidden_size": }')
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 2 and "not valid JSON (line 1" in result.output


def test_unsupported_model_type_lists_supported(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 2
    assert "'llama' is not supported" in result.output and "deepseek_v3" in result.output and "phimoe" in result.output


def test_unknown_job_key_names_allowed_keys(tmp_path):
    job = write_job(tmp_path, algorithm="grpo", prompt_per_step=512)
    result = CliRunner().invoke(main, ["cost", "qwen3-30b-a3b", "--cards", "16", "--job", job])
    assert result.exit_code == 2
    assert "unknown key(s) 'prompt_per_step'" in result.output and "prompts_per_step" in result.output


def test_invalid_layout_names_every_factor(tmp_path):
    job = write_job(tmp_path, train_layout={"tp": 3, "pp": 3, "ep": 5, "cp": 1})
    result = CliRunner().invoke(main, ["cost", "qwen3-30b-a3b", "--cards", "16", "--job", job])
    assert result.exit_code == 2
    out = result.output
    assert "tp=3 does not divide the 32 attention heads" in out
    assert "tp=3 neither divides nor is a multiple of the 4 kv heads" in out
    assert "tp*pp*cp = 3*3*1 = 9 does not divide 16 devices" in out
    assert "ep=5 does not divide K=128 experts" in out


def test_too_few_cards_says_the_minimum():
    result = CliRunner().invoke(main, ["cost", "qwen3-30b-a3b", "--hardware", "ascend-910b2", "--cards", "4"])
    assert result.exit_code == 2
    minimum = json.loads(run("cost", "qwen3-30b-a3b", "--min-cards", "--json").output)["num_cards"]
    assert f"the smallest feasible count is {minimum} npus" in result.output
    assert "GiB" in result.output and "usable" in result.output
    data = json.loads(CliRunner().invoke(main, ["cost", "qwen3-30b-a3b", "--cards", "4", "--json"]).output)
    assert data["feasible"] is False and data["reasons"]


def test_unknown_accelerator_and_bad_options():
    result = CliRunner().invoke(main, ["cost", "qwen3-30b-a3b", "--hardware", "ascend-910b", "--cards", "8"])
    assert result.exit_code == 2 and "did you mean" in result.output and "ascend-910b2" in result.output
    result = CliRunner().invoke(main, ["cost", "qwen3-30b-a3b", "--cards", "8", "--min-cards"])
    assert result.exit_code == 2 and "exactly one of --cards N or --min-cards" in result.output
    result = CliRunner().invoke(main, ["inspect", "qwen3-30b-a3b", "--experts", "4"])
    assert result.exit_code == 2 and "top_k=8 > K=4" in result.output


def test_a3_device_count_must_be_whole_cards():
    result = CliRunner().invoke(main, ["cost", "deepseek-v3", "--hardware", "atlas-a3", "--cards", "3"])
    assert result.exit_code == 2
    assert "3 dies is not a whole number of atlas-a3 cards (2 dies per card)" in result.output


def test_min_cards_json_when_nothing_fits():
    result = CliRunner().invoke(main, ["cost", "deepseek-v3", "--hardware", "h100-sxm", "--min-cards", "--max-cards", "16", "--json"])
    assert result.exit_code == 2
    data = json.loads(result.stdout)  # one JSON object: the verdict, its error and exit code
    assert data["feasible"] is False and "does not fit on up to 16 gpus" in data["reasons"][0] and data["exit_code"] == 2


def test_ppo_costs_a_critic(tmp_path):
    job = write_job(tmp_path, algorithm="ppo", recompute="selective", optimizer_swap=True,
                    offload={"params": False, "grads": False, "optimizer": True})
    data = json.loads(run("cost", "qwen3-30b-a3b", "--hardware", "h200", "--min-cards", "--job", job, "--json").output)
    assert data["feasible"]
    assert data["phase_times_s"]["values"] == pytest.approx(data["phase_times_s"]["reference"])
    update = data["memory_per_card_bytes"]["update"]
    assert update["critic_kept"] > 0 and update["optimizer"] == 0  # swapped optimizer lives on the host
    assert any("swapped" in n for n in data["notes"])


# ---- stats, plan, build -----------------------------------------------------------------------

@pytest.mark.slow
def test_stats_plan_build_flow(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from checkpoints import family_config, save_tiny

    source = save_tiny(tmp_path / "src", family_config("deepseek_v3"), sharded=True)
    stats = tmp_path / "stats.json"
    result = run("stats", str(source), "--experts", "4", "--methods", "agglomerative,saliency", "--calib-tokens", "256",
                 "--seq-len", "64", "-o", str(stats))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "K=4/agglomerative" in result.output and "KL(orig||proxy)" in result.output
    plan = tmp_path / "plan.yaml"
    assert run("plan", str(source), "--experts", "4", "--method", "saliency", "--stats", str(stats), "-o", str(plan)).exit_code == 0
    again = CliRunner().invoke(main, ["plan", str(source), "--experts", "4", "--stats", str(stats), "-o", str(plan)])
    assert again.exit_code == 2 and "exists; pass --force" in again.output
    built = run("build", str(source), str(tmp_path / "proxy"), "--plan", str(plan), "--json")
    data = json.loads(built.output[built.output.index("{"):])
    assert data["experts"] == 4 and data["verification"]["load"].startswith("every tensor feeds a parameter")
    direct = run("build", str(source), str(tmp_path / "proxy2"), "--experts", "4", "--method", "kmeans")
    assert direct.exit_code == 0 and "of dropped experts not copied" in direct.output and "(choosing the experts" in direct.output
    # keep-all: nothing to choose, so no expert is read for statistics (sketches); shown by making the statistics
    # fail, not by a timing (the build's speed is measured by benchmarks/checkpoint_io.py, build against cp, and
    # weight-only statistics against a sequential read; no benchmark times a keep-all plan's choosing on its own)
    import planner.stats.compute

    def no_statistics(*args, **kwargs):
        raise AssertionError("a keep-all build computed expert statistics")

    monkeypatch.setattr(planner.stats.compute, "compute_stats", no_statistics)
    keep_all = run("build", str(source), str(tmp_path / "proxy3"), "--experts", "8", "--json")
    built_all = json.loads(keep_all.output[keep_all.output.index("{"):])
    assert built_all["verification"]["logits"] == "bit-identical to the original" and built_all["experts"] == 8


def test_plan_errors_exit_2(tmp_path):
    pytest.importorskip("torch")
    from checkpoints import family_config, save_tiny

    source = save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False)
    result = CliRunner().invoke(main, ["plan", str(source), "--experts", "4", "--method", "saliency", "-o", str(tmp_path / "p.yaml")])
    assert result.exit_code == 2 and "ranks experts by calibration statistics" in result.output
    result = CliRunner().invoke(main, ["build", str(source), str(tmp_path / "out"), "--experts", "1"])
    assert result.exit_code == 2 and "top_k" in result.output and not (tmp_path / "out").exists()
    result = CliRunner().invoke(main, ["build", str(tmp_path / "nowhere"), str(tmp_path / "out"), "--experts", "4"])
    assert result.exit_code == 2 and "not a checkpoint directory" in result.output
    (tmp_path / "afile").write_text("not a folder")
    result = CliRunner().invoke(main, ["build", str(source), str(tmp_path / "afile" / "sub"), "--experts", "4"])
    assert result.exit_code == 2 and f"{tmp_path / 'afile'} is a file, not a folder" in result.output
    result = CliRunner().invoke(main, ["build", str(source), str(tmp_path / "out"), "--experts", "4", "--method", "saliency"])
    assert result.exit_code == 2 and "planner stats" in result.output and "--weights-only" not in result.output  # an option build lacks
    assert not (tmp_path / "out").exists()


def test_out_of_range_numbers_are_usage_errors(tmp_path):
    """Values no run can use stop before any work with the option's name and its range (exit 2)."""
    pytest.importorskip("torch")
    from checkpoints import family_config, save_tiny

    source = str(save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    (tmp_path / "inf.yaml").write_text("prompts_per_step: .inf\n")
    (tmp_path / "nan.yaml").write_text("response_tokens: {mean: .nan, max: 3072}\n")
    accel = yaml.safe_load((Path(__file__).resolve().parents[1] / "models" / "accelerators.yaml").read_text())["accelerators"]["ascend-910b2"]
    (tmp_path / "hw.yaml").write_text(yaml.safe_dump({**accel, "hbm_gib": float("inf")}))
    out = str(tmp_path / "s.json")
    for args, words in [
        (["stats", source, "--seq-len", "0", "-o", out], "--seq-len"),
        (["stats", source, "--calib-tokens", "-5", "-o", out], "--calib-tokens"),
        (["stats", source, "--seed", "-1", "-o", out], "--seed"),
        (["stats", source, "--calib-text", str(empty), "-o", out], "is empty"),
        (["suggest", "--budget", "8npu", "--min-k-ratio", "-1"], "--min-k-ratio"),
        (["suggest", "--budget", "8npu", "--seed", "-1"], "--seed"),
        (["suggest", "--budget", "8npu", "--trials", "0"], "--trials"),
        (["suggest", "--budget", "1000000000000npu"], "beyond the largest allocation"),
        (["suggest", "--budget", "8npu", "-o", str(tmp_path / ("x" * 300))], "File name too long"),  # the OS's words, no traceback
        (["cost", "qwen3-30b-a3b", "--cards", "1000000000000"], "--cards"),
        (["cost", "qwen3-30b-a3b", "--min-cards", "--max-cards", "1000000000000"], "--max-cards"),
        (["cost", "qwen3-30b-a3b", "--cards", "16", "--job", str(tmp_path / "inf.yaml")], "expected an integer, got inf"),
        (["cost", "qwen3-30b-a3b", "--cards", "16", "--job", str(tmp_path / "nan.yaml")], "must be a finite number, got nan"),
        (["cost", "qwen3-30b-a3b", "--cards", "16", "--hardware", str(tmp_path / "hw.yaml")], "hbm_gib must be a finite"),
    ]:
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and words in result.output, (args, result.output)
        assert not Path(out).exists()


def test_users_own_knobs_and_estimator_files_are_used_and_named(tmp_path):
    """--knobs and --estimator take a user's own fits; every output names the files; a bad file is a usage error."""
    root = Path(__file__).resolve().parents[1] / "calibration"
    knobs = json.loads((root / "knobs.json").read_text())
    knobs["knobs"]["ascend"]["train_mfu"] = knobs["knobs"]["ascend"]["train_mfu"] / 2  # a slower fit of the training phase
    mine = tmp_path / "my-knobs.json"
    mine.write_text(json.dumps(knobs))
    packaged = json.loads(run("cost", "qwen3-30b-a3b", "--cards", "16", "--json").output)
    own = json.loads(run("cost", "qwen3-30b-a3b", "--cards", "16", "--json", "--knobs", str(mine)).output)
    assert own["knobs_file"] == str(mine.resolve()) and packaged["knobs_file"].endswith("knobs.json") and packaged["knobs_file"] != own["knobs_file"]
    assert own["step_time_s"] > packaged["step_time_s"]
    again = json.loads(run("cost", "qwen3-30b-a3b", "--cards", "16", "--json").output)
    assert again["step_time_s"] == packaged["step_time_s"]  # the user's file was for that command only

    estimator = tmp_path / "my-estimator.json"
    estimator.write_text((root / "fidelity.json").read_text())
    result = run("suggest", "--budget", "8npu", "--trials", "20", "--knobs", str(mine), "--estimator", str(estimator), "--json")
    files = json.loads(result.output)["calibration_files"]
    assert files == {"knobs": str(mine.resolve()), "estimator": str(estimator.resolve())}
    text = run("suggest", "--budget", "8npu", "--trials", "20", "--estimator", str(estimator)).output
    assert f"fidelity estimator {estimator.resolve()}" in text and "knobs.json" in text

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"knobs": {"ascend": {"train_mfu": 3.0}}}))
    result = run("suggest", "--budget", "8npu", "--knobs", str(bad))
    assert result.exit_code == 2 and "ascend.train_mfu = 3.0 is outside [0.02, 0.6]" in result.output
    result = run("preflight", str(tmp_path / "r.yaml"), "--estimator", str(mine))
    assert result.exit_code == 2 and "not a fidelity estimator file" in result.output
    bad.write_text("[1, 2]")
    result = run("suggest", "--budget", "8npu", "--estimator", str(bad))
    assert result.exit_code == 2 and "not a fidelity estimator file (a JSON list, not an object)" in result.output


def test_storage_and_published_runs_errors_are_one_line(tmp_path):
    """A database without its driver, a file that is not a database, a published-runs file of the wrong shape: exit 2, no traceback."""
    pg = run("suggest", "--budget", "8npu", "--trials", "5", "--storage", "postgresql://user@localhost/planner")
    assert pg.exit_code == 2 and "no driver for postgresql is installed: pip install psycopg2-binary" in pg.output
    junk = tmp_path / "notes.db"
    junk.write_text("not a database\n")
    bad = run("suggest", "--budget", "8npu", "--trials", "5", "--storage", f"sqlite:///{junk}")
    assert bad.exit_code == 2 and "not an Optuna database" in bad.output and junk.read_text() == "not a database\n"
    job = write_job(tmp_path, prompts_per_step=64)
    runs = run("fit-knobs", "--runs", job)
    assert runs.exit_code == 2 and "not a published-runs file" in runs.output and "fitting" not in runs.output


def test_input_that_is_not_utf8_text_or_not_integers_is_a_usage_error(tmp_path):
    """Bytes that are not UTF-8 in any file a user hands over, and a K list with a word in it: one
    line naming the file and the byte, exit 2, no traceback."""
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage\x81")
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("prompts_per_step: 512  # caf\xe9\n".encode("latin-1"))
    for args, what in ((("preflight", binary), "request"), (("suggest", "--budget", "8npu", "--job", latin), "job file"),
                       (("job", "--from", "verl", latin), "trainer config"), (("cost", binary, "--cards", "8"), ""),
                       (("cost", "qwen3-30b-a3b", "--hardware", binary, "--cards", "8"), "")):  # fmt: skip
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 2 and "UTF-8" in result.output and what in result.output, (args, result.output)
        assert not isinstance(result.exception, UnicodeDecodeError)
    for experts in ("abc", "64,x"):
        result = CliRunner().invoke(main, ["demo", "--experts", experts])
        assert result.exit_code == 2 and "comma-separated integers" in result.output, result.output


def test_calibrate_report_and_fit_run_from_any_folder(tmp_path, monkeypatch):
    """The shipped dataset is found through the package, not the working folder (report and fit
    resolve it by the same function; the fit, which reads it and writes, is run here, the report's
    figures on the same dataset are test_calibration_data's)."""
    monkeypatch.chdir(tmp_path)
    fit = CliRunner().invoke(main, ["calibrate", "fit", "-o", str(tmp_path / "est.json")])
    assert fit.exit_code == 0 and (tmp_path / "est.json").is_file(), fit.output[-300:]
    missing = CliRunner().invoke(main, ["calibrate", "report", "--dataset", "nope.csv"])
    assert missing.exit_code == 2 and "nope.csv: no such file" in missing.output


def test_errors_under_json_are_a_json_object_with_the_exit_code():
    for args in (["suggest", "--budget", "8xpu", "--json"], ["cost", "nosuchmodel", "--cards", "8", "--json"], ["detect", "missing.log", "--json"]):
        result = CliRunner().invoke(main, args)
        error = json.loads(result.stdout)
        assert result.exit_code == 2 and error["exit_code"] == 2 and error["error"], (args, result.output)
    plain = CliRunner().invoke(main, ["cost", "nosuchmodel", "--cards", "8"])
    assert plain.exit_code == 2 and plain.stdout == "" and plain.stderr.startswith("error: unknown model")
