"""Runs in: the harness's runs, and the same runs written in verl, MindSpeed-RL, NeMo RL and wandb
formats by their real writers or byte for byte in their line formats, read to canonical metrics; the
fault detectors on them."""

from __future__ import annotations

import json
import math
import pprint
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from planner.cli import main

SMALL = dict(prompts=4, group=4, new_tokens=8)
# the trainers' own key names (from their sources; written here, not read from planner's mapping file)
VERL = {"grad_norm": "actor/grad_norm", "entropy": "actor/entropy", "kl_ref": "actor/kl_loss", "reward_mean": "critic/score/mean",
        "response_len": "response_length/mean", "loss": "actor/pg_loss", "clip_frac": "actor/pg_clipfrac", "lr": "actor/lr",
        "mismatch_k3": "rollout_corr/k3_kl"}  # fmt: skip
MINDSPEED = {"grad_norm": "actor/grad_norm", "entropy": "actor/entropy", "kl_ref": "actor/kl_loss", "reward_mean": "grpo/score/mean",
             "response_len": "response_length/mean", "loss": "actor/pg_loss", "clip_frac": "actor/pg_clipfrac", "lr": "actor/lr"}  # fmt: skip
NEMO = {"grad_norm": "train/grad_norm", "entropy": "train/approx_entropy", "kl_ref": "train/kl_penalty", "reward_mean": "train/reward",
        "response_len": "train/mean_gen_tokens_per_sample", "loss": "train/loss", "lr": "train/lr", "mismatch_k3": "train/gen_kl_error"}  # fmt: skip
OTHER = {"timing_s/gen": 1.25, "critic/score/max": 1.0, "perf/throughput": 812.5}  # logged too; not canonical


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def runs(rl_model):
    """Harness runs: each recipe at the top of its bracket (the fault injected) and one unperturbed run."""
    from planner.rl.grpo import GRPO, Models, RLConfig
    from planner.rl.recipes import RECIPES

    models = Models(rl_model[0])
    out = {name: (r.config(r.hi, seed=0, steps=12, **SMALL), None) for name, r in RECIPES.items()}
    out["none"] = (RLConfig(seed=0, steps=12, **SMALL), None)
    return {name: (cfg, GRPO(models, cfg).run()) for name, (cfg, _) in out.items()}


def _trainer_records(rows, keys):
    return [{"step": int(r["step"]), **{keys[k]: r[k] for k in keys if k in r}, **OTHER} for r in rows]


def write_verl_console(rows, path, old_format=False):
    """verl's console logger: `step:N - key:value - ...`; values as pprint.pformat of numpy scalars
    (numpy >= 2 prints np.float64(...)), or `key:value:.3f` before verl PR #2303."""
    lines = ["(TaskRunner pid=4242) Training Progress:  10%|#         | 1/12", "INFO worker started"]
    for rec in _trainer_records(rows, VERL):
        step = rec.pop("step")
        items = [f"{k}:{v:.3f}" if old_format else f"{k}:{pprint.pformat(np.float64(v))}" for k, v in rec.items()]
        lines.append(f"(TaskRunner pid=4242) step:{step} - " + " - ".join(items + [f"training/global_step:{step}"]))
    path.write_text("\n".join(lines) + "\n")


def write_verl_jsonl(rows, path):
    with path.open("w") as fh:
        for rec in _trainer_records(rows, VERL):
            step = rec.pop("step")
            fh.write(json.dumps({"step": step, "data": rec}) + "\n")


def write_mindspeed_console(rows, path):
    lines = []
    for rec in _trainer_records(rows, MINDSPEED):
        step = rec.pop("step") + 1
        body = "".join(f"{k} : {v:e} | " if "lr" in k else f"{k} : {v:.4f} | " for k, v in rec.items())
        lines.append(f"2026-11-30 10:00:00,123 - INFO - [2026-11-30 10:00:00] iteration: {step} / 12 | {body[:-2]}")
    path.write_text("\n".join(lines) + "\n")


def write_tensorboard(rows, path, keys, prefix=""):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(path))
    for rec in _trainer_records(rows, keys):
        step = rec.pop("step")
        for k, v in rec.items():
            writer.add_scalar(prefix + k, v, step)
    writer.close()


def write_wandb_csv(rows, path):
    import pandas as pd

    recs = _trainer_records(rows, VERL)
    frame = pd.DataFrame([{"_step": r.pop("step"), "_runtime": 10.0 * i, "_timestamp": 1.7e9 + i, **r} for i, r in enumerate(recs)])
    frame.to_csv(path, index=False)


def write_wandb_jsonl(rows, path):
    with path.open("w") as fh:
        for i, rec in enumerate(_trainer_records(rows, NEMO)):
            fh.write(json.dumps({"_step": rec.pop("step"), "_runtime": 10.0 * i, **rec}) + "\n")


def assert_same_metrics(run, rows, keys, rel=1e-6, abs_tol=0.0):
    assert list(run.steps) == [int(r["step"]) for r in rows]
    for canonical in keys:
        got, want = run.metrics[canonical].to_numpy(), np.array([r[canonical] for r in rows])
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(got), finite), canonical
        np.testing.assert_allclose(got[finite], want[finite], rtol=rel, atol=abs_tol, err_msg=canonical)


@pytest.mark.slow
def test_every_format_reads_to_the_canonical_metrics(runs, tmp_path):
    from planner.rl.grpo import write_metrics
    from planner.runs.read import read_run

    cfg, rows = runs["entropy-collapse"]
    write_metrics(rows, tmp_path / "planner", cfg, {"recipe": "entropy-collapse"})
    run = read_run(tmp_path / "planner")
    assert (run.kind, run.trainer, run.info["recipe"]) == ("planner", "planner", "entropy-collapse")
    assert_same_metrics(run, rows, ["grad_norm", "entropy", "kl_ref", "reward_mean", "loss", "mismatch_k3", "overflow", "collapse_max"])

    cases = [
        ("verl.log", write_verl_console, {}, "verl-console", "verl", VERL, 1e-12, 0),
        ("verl-old.log", lambda r, p: write_verl_console(r, p, old_format=True), {}, "verl-console", "verl", VERL, 0, 5e-4),
        ("verl.jsonl", write_verl_jsonl, {}, "jsonl", "verl", VERL, 1e-12, 0),
        ("ms.log", write_mindspeed_console, {}, "mindspeed-console", "mindspeed-rl", MINDSPEED, 0, 5e-5),
        ("wandb.csv", write_wandb_csv, {}, "csv", "verl", VERL, 1e-12, 0),
        ("wandb.jsonl", write_wandb_jsonl, {}, "jsonl", "nemo-rl", NEMO, 1e-12, 0),
    ]
    for name, writer, _, kind, trainer, keys, rel, atol in cases:
        writer(rows, tmp_path / name)
        run = read_run(tmp_path / name)
        assert (run.kind, run.trainer) == (kind, trainer), name
        expected = [dict(r, step=r["step"] + (1 if trainer == "mindspeed-rl" else 0)) for r in rows]
        assert_same_metrics(run, expected, keys, rel=rel, abs_tol=atol)
        assert set(run.sources) == set(keys) and run.sources["grad_norm"] == keys["grad_norm"]

    for sub, keys, prefix, trainer in (("tb-verl", VERL, "", "verl"), ("tb-ms", MINDSPEED, "train/", "mindspeed-rl"), ("tb-nemo", NEMO, "", "nemo-rl")):
        write_tensorboard(rows, tmp_path / sub / "run1", keys, prefix)
        run = read_run(tmp_path / sub)  # the event file is found below the folder given
        assert (run.kind, run.trainer) == ("tensorboard", trainer)
        assert_same_metrics(run, rows, keys, rel=1e-6)  # TensorBoard stores float32


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp16-overflow", "rollout-mismatch", "entropy-collapse", "grad-blowup", "router-collapse"])
def test_detect_finds_the_injected_fault_and_its_onset(runs, name, tmp_path):
    from planner.rl.recipes import recipe
    from planner.runs.signature import signature

    cfg, rows = runs[name]
    onset = recipe(name).onset(rows)
    assert onset is not None
    from planner.rl.grpo import write_metrics

    write_metrics(rows, tmp_path / "run", cfg, {"recipe": name})
    sig = signature(tmp_path / "run")
    by = {d["fault"]: d for d in sig["detectors"]}
    assert abs(by[name]["onset_step"] - onset) <= 1
    assert any(e["step"] == by[name]["onset_step"] for e in by[name]["evidence"])
    assert_first_is_earliest(sig)
    # the same run as verl logs it: verl has no overflow or routing metric; an overflow shows as a
    # non-finite grad norm, router collapse is not logged. What else this small model does first
    # (a learning-rate ramp that blows up its grad norm may collapse its entropy or router a step
    # earlier, depending on the CPU's float kernels) is not asserted: the injected fault's detector
    # finds it at its onset, and the signature names whichever fault fired first.
    write_verl_console(rows, tmp_path / "verl.log")
    sig = signature(tmp_path / "verl.log")
    by = {d["fault"]: d for d in sig["detectors"]}
    if name == "router-collapse":
        assert not by["router-collapse"]["logged"]
    else:
        found = by["non-finite" if name == "fp16-overflow" else name]
        assert found["logged"] and abs(found["onset_step"] - onset) <= 1
        assert_first_is_earliest(sig)
        if name == "fp16-overflow":
            assert found["source_key"] == "actor/grad_norm"


def assert_first_is_earliest(sig):
    """The signature's fault is the detector that fired first, at its onset."""
    fired = [d for d in sig["detectors"] if d["onset_step"] is not None]
    assert fired and sig["fault"]["onset_step"] == min(d["onset_step"] for d in fired)
    assert sig["fault"]["fault"] in {d["fault"] for d in fired if d["onset_step"] == sig["fault"]["onset_step"]}


@pytest.mark.slow
def test_an_unperturbed_run_has_no_fault_and_the_cli_says_so(runs, tmp_path):
    cfg, rows = runs["none"]
    write_verl_jsonl(rows, tmp_path / "verl.jsonl")
    result = run_cli("detect", tmp_path / "verl.jsonl", "--json")
    assert result.exit_code == 0, result.output
    sig = json.loads(result.output)
    assert sig["fault"] is None and sig["trainer"] == "verl" and sig["steps"] == 12
    assert {d["fault"] for d in sig["detectors"] if not d["logged"]} == {"fp16-overflow", "router-collapse"}
    text = run_cli("detect", tmp_path / "verl.jsonl").output
    assert "fault: none found" in text and "not logged" in text


def test_detectors_on_constructed_signals():
    """Each rule on hand-made series: fires where it should, and only there."""
    from planner.runs.detect import detect, first_fault

    steps = np.arange(20)
    flat = np.ones(20)
    grad = flat.copy()
    grad[12] = 6.0  # 6 x the median of the first 5
    entropy = np.linspace(2.0, 0.2, 20)  # 2 - 1.8 i / 19: below 0.2 x 2.0 = 0.4 from step 17
    kl = np.full(20, 0.01)
    kl[15] = 0.5
    reward = np.r_[np.linspace(0.2, 0.8, 10), np.full(10, 0.1)]
    m = {"grad_norm": grad, "entropy": entropy, "kl_ref": kl, "reward_mean": reward}
    found = {f.fault: f.onset for f in detect(steps, m)}
    assert found["grad-blowup"] == 12 and found["entropy-collapse"] == 17 and found["kl-blowup"] == 15
    assert found["reward-collapse"] in (10, 11) and found["rollout-mismatch"] is None and found["non-finite"] is None
    assert first_fault(detect(steps, m)).fault == "reward-collapse"
    nan_grad = flat.copy()
    nan_grad[7] = math.nan
    absent = {"grad_norm": nan_grad, "grad_norm:logged_nonfinite": np.zeros(20, bool)}
    logged = {"grad_norm": nan_grad, "grad_norm:logged_nonfinite": steps == 7}
    assert {f.fault: f.onset for f in detect(steps, absent)}["non-finite"] is None  # a missing value is not a NaN
    assert {f.fault: f.onset for f in detect(steps, logged)}["non-finite"] == 7
    everywhere = {"grad_norm": np.full(20, math.nan), "grad_norm:logged_nonfinite": np.ones(20, bool)}  # NaN from the first step
    assert {f.fault: f.onset for f in detect(steps, everywhere)}["non-finite"] == steps[0]
    never = {"grad_norm": np.full(20, math.nan), "grad_norm:logged_nonfinite": np.zeros(20, bool)}  # never logged: no metric
    assert {f.fault: f.onset for f in detect(steps, never)}["non-finite"] is None
    ratio = np.r_[np.full(8, 1.01), np.full(12, 1.2)]  # NeMo's multiplicative error: ideal 1
    assert {f.fault: f.onset for f in detect(steps, {"mismatch_prob_ratio": ratio}, ideal={"mismatch_prob_ratio": 1.0})}["rollout-mismatch"] == 8
    # NeMo RL's documented line, 1.05: a steady 1.04 is no fault however noisy the start, 1.06 is one at once
    assert {f.fault: f.onset for f in detect(steps, {"mismatch_prob_ratio": np.full(20, 1.04)})}["rollout-mismatch"] is None
    assert {f.fault: f.onset for f in detect(steps, {"mismatch_prob_ratio": np.r_[np.full(3, 1.0), np.full(17, 1.06)]})}["rollout-mismatch"] == 3


def test_unreadable_runs_are_usage_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.log").write_text("nothing to see\n")
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "a.jsonl").write_text("")
    (tmp_path / "two" / "b.csv").write_text("step,x\n0,1\n")
    (tmp_path / "odd.csv").write_text("step,foo/bar\n0,1\n1,2\n")
    (tmp_path / "bad.jsonl").write_text('{"step": 0, "data": {"actor/grad_norm": 1.0}}\nnot json\n{"step": 1, "data": {"actor/grad_norm": 1.0}}\n')
    (tmp_path / "huge.csv").write_text("step,actor/grad_norm\n1,1.0\n1e31,50\n")  # would wrap round as an int64 step
    (tmp_path / "half.csv").write_text("step,actor/grad_norm\n1,1.0\n1.5,1.0\n")
    for target, words in (("missing", "no such run"), ("empty", "no run metrics here"), ("notes.log", "no step metrics found"),
                          ("two", "2 candidate metric files"), ("odd.csv", "no known metric"), ("bad.jsonl", "bad.jsonl:2: not a JSON line"),
                          ("huge.csv", "step 1e+31 is not a step number"), ("half.csv", "step 1.5 is not a step number")):  # fmt: skip
        result = run_cli("detect", tmp_path / target)
        assert result.exit_code == 2 and words in result.output, (target, result.output)


@pytest.mark.slow
def test_a_pair_of_trainer_runs_becomes_a_labelled_row(rl_model, tmp_path):
    """calibrate add and check --proxy-metrics take the original's and the proxy's runs as verl logs:
    the model comes from the plan."""
    from scipy.stats import spearmanr

    from planner.rl.grpo import read_metrics

    model, plan = rl_model[0], tmp_path / "plan.yaml"
    assert run_cli("plan", model, "--experts", "16", "-o", plan).exit_code == 0
    assert run_cli("build", model, tmp_path / "proxy-model", "--plan", plan).exit_code == 0
    common = ("--recipe", "entropy-collapse", "--knob", "-1.0", "--steps", "8", "--set", "prompts=4", "--set", "new_tokens=8")
    for name, where, extra in (("orig", model, ()), ("replica", model, ("--gen-seed", "7")), ("proxy", tmp_path / "proxy-model", ())):
        result = run_cli("rl", "run", where, *common, *extra, "-o", tmp_path / name)
        assert result.exit_code == 0, result.output
        write_verl_console(read_metrics(tmp_path / name), tmp_path / f"{name}.log")

    # the recipe is named: which fault this small model shows first in a verl log is its training's
    # outcome (the inference from the original's log is tested on planted logs below)
    result = run_cli("calibrate", "add", "--original", tmp_path / "orig.log", "--proxy", tmp_path / "proxy.log", "--replica",
                     tmp_path / "replica.log", "--plan", plan, "--recipe", "entropy-collapse", "--dataset", tmp_path / "d.csv",
                     "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert row["recipe"] == "entropy-collapse" and row["original"] == str(model) and row["experts"] == 16
    # the labels against the runs' own metrics, by the rules as documented (not by the code that labels): the
    # onset is the first step whose entropy is below 0.2 x the first logged entropy (planner detect's table);
    # whether the runs collapse within 8 steps is this CPU's training, so each onset is whatever the rule finds
    curves = {name: read_metrics(tmp_path / name) for name in ("orig", "replica", "proxy")}

    def collapse_step(rows):
        return next((int(r["step"]) for r in rows if r["entropy"] < 0.2 * rows[0]["entropy"]), None)

    onset_original, onset_proxy = collapse_step(curves["orig"]), collapse_step(curves["proxy"])
    assert (row["onset_original"], row["onset_proxy"]) == (onset_original, onset_proxy)
    if onset_original is None:  # the original shows no collapse: there is nothing for the proxy to reproduce
        assert row["run_reproduced"] is None
    else:
        assert row["run_reproduced"] == float(onset_proxy is not None)
    grad = {name: [r["grad_norm"] for r in rows] for name, rows in curves.items()}
    assert row["spearman_grad_norm"] == pytest.approx(spearmanr(grad["proxy"], grad["orig"]).statistic, abs=1e-12)
    assert row["curve_agreement"] >= 0  # over the curves verl logs (no routing load)
    assert row["shift_log2"] is None  # a single run per side has no critical knob: no shift label
    assert len((tmp_path / "d.csv").read_text().splitlines()) == 2
    # curve agreement is the proxy's deviation from the original in units of the replica's: the original's own
    # log as the proxy is 0 from it, the replica's log as the proxy exactly 1 (the noise floor itself)
    for proxy_log, agreement in (("orig.log", 0.0), ("replica.log", 1.0)):
        same = run_cli("calibrate", "add", "--original", tmp_path / "orig.log", "--proxy", tmp_path / proxy_log, "--replica",
                       tmp_path / "replica.log", "--plan", plan, "--recipe", "entropy-collapse", "--dataset",
                       tmp_path / f"{proxy_log}.csv", "--json")  # fmt: skip
        assert same.exit_code == 0, same.output
        labels = json.loads(same.stdout)
        assert labels["curve_agreement"] == pytest.approx(agreement, abs=1e-12), (proxy_log, labels["curve_agreement"])
    assert labels["onset_proxy"] == collapse_step(curves["replica"])

    refused = run_cli("check", plan, "--checkpoint", model, "--reference-metrics", tmp_path / "orig.log", "-o", tmp_path / "c2")
    assert refused.exit_code == 2 and "--proxy-metrics" in refused.output and not (tmp_path / "c2").exists()
    result = run_cli("check", plan, "--checkpoint", model, "--reference-metrics", tmp_path / "orig.log", "--proxy-metrics",
                     tmp_path / "proxy.log", "--replica", tmp_path / "replica.log", "--steps", "2", "-o", tmp_path / "check", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    labels = json.loads(result.stdout)["labels"]
    assert labels["onset_proxy"] == row["onset_proxy"] and labels["curve_agreement"] == pytest.approx(row["curve_agreement"])
    # the two logs alone: no checkpoint, no harness run, the same labels
    alone = run_cli("check", plan, "--reference-metrics", tmp_path / "orig.log", "--proxy-metrics", tmp_path / "proxy.log", "--replica",
                    tmp_path / "replica.log", "--recipe", "entropy-collapse", "-o", tmp_path / "c3", "--json")  # fmt: skip
    assert alone.exit_code == 0, alone.output
    report = json.loads(alone.stdout)
    assert report["proxy_dir"] is None and report["run_dir"] is None and not (tmp_path / "c3").exists()
    assert report["labels"]["onset_proxy"] == row["onset_proxy"] and report["labels"]["curve_agreement"] == pytest.approx(row["curve_agreement"])
    text = run_cli("check", plan, "--reference-metrics", tmp_path / "orig.log", "--proxy-metrics", tmp_path / "proxy.log", "--recipe",
                   "entropy-collapse").output  # fmt: skip
    assert "from the two trainer logs alone" in text and "curve_agreement" in text
    missing = run_cli("check", plan, "--reference-metrics", tmp_path / "orig.log")
    assert missing.exit_code == 2 and "--checkpoint is needed" in missing.output


def planted_rows(steps: int = 12, **series) -> list[dict]:
    """Run rows with flat, healthy metrics, and the series given by name in their place."""
    rows = [{"step": i, "grad_norm": 1.0, "entropy": 2.0, "kl_ref": 0.01, "reward_mean": 0.5, "response_len": 8.0, "loss": 0.1,
             "clip_frac": 0.05, "lr": 1e-5, "mismatch_k3": 1e-4} for i in range(steps)]  # fmt: skip
    for name, values in series.items():
        for row, value in zip(rows, values):
            row[name] = float(value)
    return rows


@pytest.mark.parametrize("fault, series", [
    ("entropy-collapse", {"entropy": [2.0, 2.0, 1.0, 0.3, 0.2, 0.1] + [0.1] * 6}),
    ("grad-blowup", {"grad_norm": [1.0] * 7 + [40.0] * 5}),
    ("rollout-mismatch", {"mismatch_k3": [1e-4] * 4 + [0.05] * 8}),
])  # fmt: skip
def test_a_pair_without_a_recipe_takes_the_fault_the_originals_log_shows(fault, series, tmp_path):
    from planner.fidelity.calibrate import pair_recipe

    write_verl_console(planted_rows(**series), tmp_path / "orig.log")
    assert pair_recipe(tmp_path / "orig.log", None) == fault
    write_verl_console(planted_rows(), tmp_path / "calm.log")
    with pytest.raises(Exception, match="names no recipe and shows no fault"):
        pair_recipe(tmp_path / "calm.log", None)


# ---- runs as verl writes them: its own console formatter and file logger, at its defaults ---------

def verl_loggers():
    """verl's console formatter (concat_dict_to_str) and FileLogger, loaded from the installed verl
    package's files (its package __init__ imports ray; these two modules need only orjson)."""
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed (make installs verl==0.9.1 without its dependencies)")
    pytest.importorskip("orjson", reason="verl's file logger serialises with orjson")
    root = Path(spec.submodule_search_locations[0])
    out = {}
    for name, rel in (("tracking", "utils/tracking.py"), ("console", "utils/logger/aggregate_logger.py")):
        module_spec = importlib.util.spec_from_file_location(f"verl_{name}_for_tests", root / rel)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        out[name] = module
    return out["console"].concat_dict_to_str, out["tracking"].FileLogger


def verl_run(rows, tmp_path, monkeypatch, name="run"):
    """The rows as verl 0.9.1's trainer logs them at its defaults: `trainer.val_before_train: true`
    logs a validation-only record at step 0, then training steps from 1; the console through its
    formatter, the JSONL through its FileLogger (NaN becomes null there)."""
    concat, file_logger = verl_loggers()
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / f"{name}.jsonl"))
    jsonl = file_logger(project_name="p", experiment_name=name)
    lines = []
    val = {"val-core/openai/gsm8k/reward/mean@1": 0.41, "val-aux/openai/gsm8k/score/mean@1": 0.41}
    for step, data in [(0, val)] + [(int(r["step"]) + 1, {VERL[k]: r[k] for k in VERL if k in r}) for r in rows]:
        jsonl.log(data=data, step=step)
        lines.append(concat(data, step=step))
    jsonl.finish()
    (tmp_path / f"{name}.log").write_text("\n".join(lines) + "\n")
    return tmp_path / f"{name}.log", tmp_path / f"{name}.jsonl"


def test_verl_at_its_defaults_validation_step_and_nan_as_null(tmp_path, monkeypatch):
    """A grad-norm blow-up x20 from step 37 and a NaN loss from step 20, logged by verl's own code
    with its step-0 validation record: found at their onsets in the console log and in the JSONL,
    where NaN is null; and `calibrate add`'s reader sees what detect sees."""
    from planner.fidelity.calibrate import _load_run
    from planner.runs.detect import first_fault, detect, signals_of
    from planner.runs.signature import signature

    grad = [1.0 + 0.01 * i for i in range(60)]
    blowup = planted_rows(60, grad_norm=[g * (20 if i >= 37 else 1) for i, g in enumerate(grad)])
    nan_loss = planted_rows(60, loss=[0.1] * 20 + [math.nan] * 40)
    for rows, fault, onset in ((blowup, "grad-blowup", 38), (nan_loss, "non-finite", 21)):  # verl's steps start at 1
        console, jsonl = verl_run(rows, tmp_path, monkeypatch, name=fault)
        if fault == "non-finite":
            assert '"actor/pg_loss":null' in jsonl.read_text()  # what verl's file logger makes of NaN
        for path in (console, jsonl):
            sig = signature(path)
            assert sig["trainer"] == "verl" and sig["steps"] == 60 and sig["step_range"] == [1, 60], (path.name, sig["steps"])
            assert sig["fault"]["fault"] == fault and sig["fault"]["onset_step"] == onset, (path.name, sig["fault"])
            assert any("no training metric" in n and "step(s) 0" in n for n in sig["notes"])
            if fault == "non-finite" and path.suffix == ".jsonl":
                assert any("null" in n and "actor/pg_loss" in n for n in sig["notes"])
            pair = _load_run(path)  # the path `check --proxy-metrics` and `calibrate add` read a trainer's log by
            found = first_fault(detect(*signals_of(pair["rows"])))
            assert (found.fault, found.onset) == (fault, onset)
    healthy, _ = verl_run(planted_rows(60), tmp_path, monkeypatch, name="healthy")
    assert signature(healthy)["fault"] is None


def test_a_run_cut_mid_line_is_read_up_to_its_last_whole_record(tmp_path, monkeypatch):
    from planner.runs.signature import signature

    console, jsonl = verl_run(planted_rows(20), tmp_path, monkeypatch)
    for path in (console, jsonl):
        text = path.read_text()
        path.write_text(text[: len(text) - 40])  # killed while writing the last record
        sig = signature(path)
        assert sig["steps"] == 19 and any("cut" in n for n in sig["notes"]), (path.name, sig["notes"])
    (tmp_path / "bad.jsonl").write_text('{"step": 1, "data": {"actor/grad_norm": 1.0}}\nnot json\n{"step": 2, "data": {"actor/grad_norm": 1.0}}\n')
    assert run_cli("detect", tmp_path / "bad.jsonl").exit_code == 2  # a bad line in the middle is still an error


def write_wandb_panels(rows, folder: Path, run: str = "qwen3-grpo-1") -> None:
    """Each metric as a W&B chart's "Export panel data" CSV: Step, "<run> - <key>" and the
    downsampled bucket's __MIN/__MAX, one file per chart (written with pandas)."""
    import pandas as pd

    folder.mkdir()
    recs = _trainer_records(rows, VERL)
    for key in sorted({k for r in recs for k in r} - {"step"}):
        col = f"{run} - {key}"
        frame = pd.DataFrame([{"Step": r["step"], col: r[key], f"{col}__MIN": r[key], f"{col}__MAX": r[key]} for r in recs if key in r])
        frame.to_csv(folder / f"{key.replace('/', '_')}.csv", index=False)


def test_wandb_panel_exports_read_as_one_run(tmp_path):
    """A folder of W&B panel CSVs (one chart each) merges on the step: the grad blow-up from step 37
    is found there as in verl's own logs; one panel alone reads too; a panel of two runs is refused."""
    from planner.runs.read import read_run
    from planner.runs.signature import signature

    rows = planted_rows(60, grad_norm=[1.0 + 0.01 * i * (20 if i >= 37 else 1) for i in range(60)])
    write_wandb_panels(rows, tmp_path / "panels")
    sig = signature(tmp_path / "panels")
    assert sig["trainer"] == "verl" and sig["steps"] == 60
    assert sig["fault"]["fault"] == "grad-blowup" and sig["fault"]["onset_step"] == 37
    assert any("W&B panel export of run 'qwen3-grpo-1'" in n for n in sig["notes"])
    one = read_run(tmp_path / "panels" / "actor_grad_norm.csv")
    assert list(one.metrics.columns) == ["grad_norm"] and one.metrics["grad_norm"].iloc[37] == pytest.approx(1.0 + 0.37 * 20)
    two = tmp_path / "two.csv"
    two.write_text('Step,a - actor/grad_norm,b - actor/grad_norm\n1,1.0,1.0\n')
    result = run_cli("detect", two)
    assert result.exit_code == 2 and "a W&B panel of 2 runs (a, b)" in result.output
