"""`planner report` renders real figures; `planner check` runs a tiny real proxy on CPU and compares
predicted with measured memory, and computes fidelity labels against the original's run."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.report import FIGURE_SIZE_PX


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_report_writes_markdown_html_and_figures(tmp_path):
    out = tmp_path / "report"
    result = run_cli("report", "--budget", "8npu", "--trials", "60", "-o", out)
    assert result.exit_code == 0, result.output
    for name in ("memory.png", "phases.png", "scaling.png", "pareto.png"):
        assert png_size(out / "figures" / name) == FIGURE_SIZE_PX
    md = (out / "report.md").read_text()
    for section in ("## Original and proxies", "## The cheapest proxy within the budget", "## Inputs and versions", "figures/pareto.png"):
        assert section in md
    notes = md[md.index("## Notes"):].splitlines()[2:]
    assert notes[0] and all(line.startswith(("- original (16 npus)", "- K=")) for line in notes if line)  # each note names its rows
    html = (out / "report.html").read_text()
    assert html.count("<img") == 4 and "<table>" in html
    data = json.loads((out / "report.json").read_text())
    assert data["costs"]["original"]["num_cards"] == 16 and data["suggestion"]["plans"]
    assert run_cli("report", "--budget", "8npu", "-o", out).exit_code == 2  # exists: needs --force
    assert not (tmp_path / "report.tmp").exists()
    none = run_cli("report", "--budget", "1npu", "--trials", "20", "-o", tmp_path / "none")
    assert none.exit_code == 1 and "no proxy clears every constraint" in none.output  # as suggest, though the report is written
    md = (tmp_path / "none" / "report.md").read_text()
    assert "smallest budget that would do" in md and "No proxy clears every constraint within 1 npu: " in md
    assert png_size(tmp_path / "none" / "figures" / "pareto.png") == FIGURE_SIZE_PX  # drawn, saying that nothing fits
    as_json = run_cli("report", "--budget", "8npu", "--trials", "60", "-o", tmp_path / "json", "--json")
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.stdout)
    assert data["suggestion"]["plans"] and str(tmp_path / "json" / "report.md") in data["files"]


@pytest.mark.slow
def test_an_interrupted_report_leaves_nothing_and_a_killed_ones_leftover_is_replaced(tmp_path, monkeypatch):
    """Ctrl-C while the figures are drawn removes OUT.tmp (a rerun, with or without --force, is not
    refused by it); a leftover OUT.tmp holding only a report's own files (a run killed outright) is
    replaced, while one holding anything else is refused."""
    import planner.report

    out = tmp_path / "rep"

    def interrupted(r, path):
        path.write_bytes(b"half a figure")
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setitem(planner.report.FIGURES, "memory.png", interrupted)
        result = run_cli("report", "--budget", "8npu", "--trials", "20", "-o", out)
    assert result.exit_code == 130 and "interrupted (SIGINT)" in result.output, result.output
    assert not out.exists() and not (tmp_path / "rep.tmp").exists()
    (tmp_path / "rep.tmp" / "figures").mkdir(parents=True)  # what a SIGKILL leaves
    assert run_cli("report", "--budget", "8npu", "--trials", "20", "-o", out).exit_code == 0 and (out / "report.md").is_file()
    (tmp_path / "other.tmp").mkdir()
    (tmp_path / "other.tmp" / "notes.txt").write_text("mine")
    refused = run_cli("report", "--budget", "8npu", "--trials", "20", "-o", tmp_path / "other")
    assert refused.exit_code == 2 and "not a report directory" in refused.output


def test_check_predicts_memory_and_labels_the_proxy(rl_model, tmp_path):
    model = rl_model[0]
    assert run_cli("plan", model, "--experts", "16", "-o", tmp_path / "plan.yaml").exit_code == 0
    common = ("--recipe", "entropy-collapse", "--knob", "-1.5", "--steps", "5")
    assert run_cli("rl", "run", model, *common, "-o", tmp_path / "ref").exit_code == 0
    assert run_cli("rl", "run", model, *common, "--gen-seed", "7", "-o", tmp_path / "replica").exit_code == 0
    dataset = tmp_path / "dataset.csv"
    result = run_cli("check", tmp_path / "plan.yaml", "--checkpoint", model, "--reference-metrics", tmp_path / "ref",
                     "--replica", tmp_path / "replica", "-o", tmp_path / "check", "--add-to", dataset, "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["built"] and Path(report["proxy_dir"], "expert_map.json").is_file()
    assert 0.85 <= report["memory_predicted_over_measured"] <= 1.15
    assert report["steps"] == 5 and report["step_time_s"] > 0
    labels = report["labels"]
    assert labels["experts"] == 16 and labels["recipe"] == "entropy-collapse"
    assert math.isfinite(labels["curve_agreement"]) and math.isfinite(labels["spearman_grad_norm"])
    assert len(dataset.read_text().splitlines()) == 2  # header + the pair
    again = run_cli("check", tmp_path / "plan.yaml", "--checkpoint", model, "-o", tmp_path / "check")
    assert again.exit_code == 2 and "--force" in again.output

    # fp16 autocast over fp32 masters, longer responses than prompts: the same proxy, reused
    half = run_cli("check", tmp_path / "plan.yaml", "--checkpoint", model, "--recipe", "fp16-overflow", "--knob", "8", "--steps", "2",
                   "-o", tmp_path / "check", "--force", "--json")  # fmt: skip
    assert half.exit_code == 0, half.output
    half = json.loads(half.stdout)
    assert not half["built"] and 0.85 <= half["memory_predicted_over_measured"] <= 1.15, half["memory_predicted_over_measured"]

    run_cli("plan", model, "--experts", "8", "-o", tmp_path / "other.yaml")
    shutil.rmtree(tmp_path / "check" / "run")  # a proxy left without its run, as by an interrupted check
    other = run_cli("check", tmp_path / "other.yaml", "--checkpoint", model, "-o", tmp_path / "check", "--steps", "2")
    assert other.exit_code == 2 and "not built by this plan" in other.output  # never a stale proxy


@pytest.mark.slow
def test_check_refuses_what_would_fail_late_before_building(rl_model, tmp_path):
    """A missing device adapter, a plan for another model, a reference run with no recipe and no fault:
    refused before anything is built or run, and no output folder is left behind."""
    model = rl_model[0]
    assert run_cli("plan", model, "--experts", "16", "-o", tmp_path / "plan.yaml").exit_code == 0
    npu = run_cli("check", tmp_path / "plan.yaml", "--checkpoint", model, "--device", "npu", "-o", tmp_path / "a")
    assert npu.exit_code == 2 and "torch_npu" in npu.output and not (tmp_path / "a").exists()
    assert run_cli("suggest", "--budget", "8npu", "--trials", "20", "-o", tmp_path / "big.yaml").exit_code == 0  # Qwen3-30B-A3B: 128 experts
    other = run_cli("check", tmp_path / "big.yaml", "--checkpoint", model, "-o", tmp_path / "b")  # a plan of 128 experts
    # the plan's K=32 proxy has this model's 32 experts: refused, naming the plan's original and what the checkpoint lacks
    said = "the plan is for qwen3-30b-a3b (128 experts per layer) and its K=32 proxy;"
    assert other.exit_code == 2 and said in other.output and "no expert_map.json, so it is neither" in other.output
    assert not (tmp_path / "b").exists()
    assert run_cli("rl", "run", model, "--steps", "3", "--set", "prompts=2", "--set", "new_tokens=4", "-o", tmp_path / "plain").exit_code == 0
    plain = run_cli("check", tmp_path / "plan.yaml", "--checkpoint", model, "--reference-metrics", tmp_path / "plain", "-o", tmp_path / "c")
    assert plain.exit_code == 2 and "names no recipe and shows no fault" in plain.output and not (tmp_path / "c").exists()


@pytest.mark.slow
def test_a_plan_suggested_without_stats_builds(rl_model, tmp_path):
    """suggest on a checkpoint's config writes a deferred plan; build chooses its experts then."""
    from planner.checkpoint import Checkpoint
    from planner.plan import load_plan

    model = rl_model[0]
    result = run_cli("suggest", "--model", model, "--budget", "1npu", "--fault", "entropy-collapse", "--min-fidelity", "0", "--min-k-ratio", "2",
                     "-o", tmp_path / "plan.yaml")  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = load_plan(tmp_path / "plan.yaml")
    assert plan.deferred and plan.deployment["num_cards"] == 1
    assert run_cli("build", model, tmp_path / "proxy", "--plan", tmp_path / "plan.yaml").exit_code == 0
    built = Checkpoint(tmp_path / "proxy")
    assert built.arch.original_num_experts == plan.experts
    emap = json.loads((tmp_path / "proxy" / "expert_map.json").read_text())
    assert emap["method"] == plan.method and emap["experts"] == plan.experts


@pytest.mark.slow
def test_ctrl_c_during_check_leaves_no_output_folder(rl_model, tmp_path):
    """Interrupted once the run has begun (its metrics folder exists), `check -o DIR` exits 130 and
    leaves no DIR behind (it made DIR, so nothing that was there before is lost)."""
    import signal
    import subprocess
    import sys
    import time

    model = rl_model[0]
    assert run_cli("plan", model, "--experts", "16", "-o", tmp_path / "plan.yaml").exit_code == 0
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "planner.cli", "check", str(tmp_path / "plan.yaml"), "--checkpoint", str(model),
                             "--steps", "500", "-o", str(out)], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.time() + 300
    while not (out / "proxy").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the check finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT and "interrupted (SIGINT)" in err, err
    assert not out.exists()
    # run to its end, the check's own output holds no line of the profiler's native chatter
    done = subprocess.run([sys.executable, "-m", "planner.cli", "check", str(tmp_path / "plan.yaml"), "--checkpoint", str(model),
                           "--steps", "3", "-o", str(out)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    for chatter in ("profiler_start", "profiler_stop", "CPUAllocator", "Memory block of unknown size"):
        assert chatter not in done.stdout + done.stderr, chatter
    assert "(median of 1 step)" in done.stdout  # 3 steps: the first two are warm-up and the measured one
