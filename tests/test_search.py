"""`planner suggest`: the budget grammar, the search against exhaustive enumeration, seeds, shared
storage, the JSON and the plan file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from planner.catalog import load_accelerator
from planner.cli import main
from planner.errors import SpecError
from planner.search.budget import parse_budget
from planner.search.reproduction import JobBounds
from planner.search.suggest import Option, Request, Suggester, proposable, reduction, suggest

PRODUCTION = JobBounds(batch=1, length=1)  # the reproduction job held at the production job


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# ---- budgets --------------------------------------------------------------------------------------

def test_budget_grammar():
    b2, a3, h100 = (load_accelerator(a) for a in ("ascend-910b2", "atlas-a3", "h100-sxm"))
    assert parse_budget("8npu", b2).max_devices == 8
    assert parse_budget("2x8npu", b2).max_devices == 16 and parse_budget("2x8npu", b2).nodes == 2
    assert parse_budget("64card", a3).max_devices == 128  # an A3 card holds two dies
    assert parse_budget("16gpu", h100).max_devices == 16
    assert parse_budget("1npu", b2).describe(b2) == "1 npu" and parse_budget("8npu", b2).describe(b2) == "8 npus"
    assert parse_budget("1card", a3).describe(a3) == "2 dies (1 card)"
    hours = parse_budget("40npu-h", b2)
    assert hours.max_devices is None and hours.device_hours == 40
    assert parse_budget("10card-h", a3).device_hours == 20  # card-hours -> die-hours
    assert parse_budget("64die", a3).max_devices == 64 and parse_budget("40die-h", a3).device_hours == 40  # A3's outputs are in dies
    for text, accel, words in [("8gpu", b2, "ascend"), ("8npu", h100, "nvidia"), ("eight", b2, "expected"), ("2x16npu", b2, "node holds 8"),
                               ("1.5npu", b2, "positive integer"), ("2x4npu-h", b2, "no node count"), ("8die", b2, "write '8npu'"),
                               ("1000000000000npu", b2, "beyond the largest allocation"), ("65537npu", b2, "65,536"),
                               ("-4npu", b2, "positive"), ("-40npu-h", b2, "positive"), ("0npu", b2, "positive integer")]:  # fmt: skip
        with pytest.raises(SpecError, match=words):
            parse_budget(text, accel)


# ---- the search -----------------------------------------------------------------------------------

CASES = [
    Request(model="qwen3-30b-a3b", hardware="ascend-910b2", budget="8npu", fault="grad-overflow"),
    Request(model="glm-4.5-air", hardware="h20", budget="16gpu", fault="entropy-collapse"),
    Request(model="mixtral-8x7b", hardware="h100-sxm", budget="8gpu", fault="grad-overflow", min_k_ratio=2.0),
    Request(model="deepseek-v3", hardware="atlas-a3", budget="128npu", fault="grad-overflow", trials=200),  # 528 points: enumerated
]


@pytest.mark.parametrize("request_", CASES, ids=lambda r: f"{r.model}-{r.budget}")
def test_search_finds_the_exhaustive_optimum(request_):
    space = Suggester(request_)
    baseline = space.baseline()
    exhaustive = min((o for o in space.enumerate_all() if proposable(o, baseline, request_.min_fidelity)), key=Option.rank_key)
    best = suggest(request_).best
    assert best is not None
    assert best.hours == pytest.approx(exhaustive.hours, rel=1e-12)
    assert (best.experts, best.cost.num_devices) == (exhaustive.experts, exhaustive.cost.num_devices)


def test_default_suggest_is_reproducible_and_complete():
    first = run_cli("suggest", "--budget", "8npu", "--json")  # its speed: benchmarks/suggest_search.py
    assert first.exit_code == 0, first.output
    data = json.loads(first.stdout)
    second = json.loads(run_cli("suggest", "--budget", "8npu", "--json").stdout)
    assert [(p["experts"], p["num_cards"], p["recompute"], p["offload"]) for p in data["plans"]] == \
           [(p["experts"], p["num_cards"], p["recompute"], p["offload"]) for p in second["plans"]]  # fmt: skip
    best = data["plans"][0]
    for key in ("experts", "num_cards", "layout", "memory_per_card_bytes", "step_time_s", "accelerator_hours_per_step", "fidelity", "reduction"):
        assert best[key] is not None, key
    fidelity = best["fidelity"]
    assert set(fidelity) >= {"status", "p_reproduced", "interval", "shift_log2", "shift_interval"}
    # the status the estimator gives Qwen3-30B-A3B's routing shape: a number only where calibrated
    assert fidelity["status"] in ("calibrated", "no-skill", "uncalibrated") and (fidelity["p_reproduced"] is None) == (fidelity["status"] != "calibrated")
    shape = "softmax/top8of128/renorm"
    assert fidelity["family"]["routing_shape"] == shape if "family" in fidelity else f"routing shape {shape} was never calibrated" in fidelity["reason"]
    assert data["request"]["fidelity_source"] == "prior"
    assert data["request"]["fault"] == "rollout-mismatch" and data["warnings"] == []
    assert best["num_cards"] <= 8 and best["memory_per_card_bytes"] <= 0.9 * best["usable_bytes_per_card"]
    assert best["experts"] >= 4 * 8  # K/top_k >= 4 by default
    assert best["reduction"]["cards"] == data["original"]["num_cards"] / best["num_cards"]
    assert data["pareto"] and data["original"]["num_cards"] == 16
    outcomes = [(p["experts"], p["method"], p["num_cards"], json.dumps(p["layout"]), p["memory_per_card_bytes"], p["step_time_s"]) for p in data["plans"]]
    assert len(set(outcomes)) == len(outcomes)  # a recompute/offload variant that changes nothing is listed once
    text = run_cli("suggest", "--budget", "8npu").output
    assert "cheapest proxies" in text and "Pareto set" in text and "kept for the fault" in text
    assert "WARNING" not in text
    fp16 = run_cli("suggest", "--budget", "8npu", "--fault", "grad-overflow", "--json")  # the default job trains in bf16
    assert any("fp16 loss-scale overflow" in w and "bf16" in w for w in json.loads(fp16.stdout)["warnings"])


def test_two_processes_share_one_sqlite_study(tmp_path):
    """Two workers on one SQLite study split the space between them (the trials cover it, so each
    runs the brute-force sampler, which skips points the other has done or is doing); each reports
    the study's best, which equals a single in-memory process's."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    args = [sys.executable, "-m", "planner.cli", "suggest", "--budget", "16npu", "--fault", "router-collapse", "--json", "--storage", storage]
    procs = [subprocess.Popen(args + ["--seed", str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    single = suggest(Request(budget="16npu", fault="router-collapse"))  # in memory, the default 300 trials
    assert [json.loads(o[0])["plans"][0]["accelerator_hours_per_step"] for o in outs] == [pytest.approx(single.best.hours, rel=1e-12)] * 2
    import optuna

    (summary,) = optuna.get_all_study_summaries(storage)
    space = Suggester(Request(budget="16npu", fault="router-collapse")).space_size()
    assert space <= summary.n_trials < 2 * space  # covered together, not each on its own


@pytest.mark.slow
def test_an_interrupted_stored_study_resumes_to_the_uninterrupted_result(tmp_path):
    """Ctrl-C, SIGTERM (Slurm, Kubernetes) and SIGKILL at several points of a stored suggest: the
    signalled run stops between trials with a one-line message and 128 + the signal, and the same
    command run again completes the space and prints what an uninterrupted run prints."""
    import signal

    args = [sys.executable, "-m", "planner.cli", "suggest", "--budget", "16npu", "--fault", "router-collapse"]

    def result(out: str) -> dict:
        data = json.loads(out)
        return {k: data[k] for k in ("plans", "pareto", "diagnosis", "warnings", "evaluated_points")}

    reference = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-2000:]
    for n, (signum, at) in enumerate([(signal.SIGINT, 20), (signal.SIGTERM, 60), (signal.SIGKILL, 50)]):
        stored = args + ["--storage", f"sqlite:///{tmp_path / f'study{n}.db'}"]  # shows progress; the same study with --json
        # a shell's background job starts with Ctrl-C ignored, and Python keeps an ignored SIGINT: restore it
        proc = subprocess.Popen(stored, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
        for line in proc.stderr:  # "search: N%" as the trials complete
            if line.startswith("search:") and int(line.split()[1].rstrip("%")) >= at:
                proc.send_signal(signum)
                break
        err = proc.stderr.read()
        proc.wait(timeout=120)
        assert proc.returncode == (-signum if signum == signal.SIGKILL else 128 + signum), err[-2000:]
        if signum != signal.SIGKILL:
            last = err.strip().splitlines()[-1]
            assert "Traceback" not in err and f"interrupted ({signal.Signals(signum).name})" in last and "run the same command again" in last, err
        again = subprocess.run(stored + ["--json"], capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        assert result(again.stdout) == result(reference.stdout), (signum, at)


def test_router_collapse_never_proposes_k_at_top_k():
    """At K <= top_k every token uses every kept expert: router collapse cannot occur there."""
    result = run_cli("suggest", "--budget", "8npu", "--fault", "router-collapse", "--min-k-ratio", "0", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["plans"] and all(p["experts"] > 8 for p in data["plans"] + data["pareto"])  # qwen3-30b-a3b: top-8 of 128


def test_nothing_fits_says_why_and_the_smallest_budget():
    result = run_cli("suggest", "--model", "deepseek-v3", "--hardware", "atlas-a3", "--budget", "8npu")
    assert result.exit_code == 1
    assert "no proxy clears every constraint" in result.output and "smallest budget that would do" in result.output
    wrong = run_cli("suggest", "--budget", "8gpu")
    assert wrong.exit_code == 2 and "ascend" in wrong.output
    assert run_cli("suggest", "--budget", "8npu", "--fault", "bogus").exit_code == 2


def test_plan_file_round_trips_into_preflight_and_build(tmp_path):
    from planner.plan import load_plan

    out = tmp_path / "plan.yaml"
    assert run_cli("suggest", "--budget", "8npu", "-o", out).exit_code == 0
    plan = load_plan(out)
    assert plan.deferred and plan.experts >= 32 and plan.deployment["num_cards"] <= 8
    assert plan.deployment["predicted"]["fidelity"]["status"] == json.loads(run_cli("suggest", "--budget", "8npu", "--json").stdout)["plans"][0]["fidelity"]["status"]
    assert run_cli("suggest", "--budget", "8npu", "-o", out).exit_code == 2  # never overwritten silently


def test_progress_reaches_the_end_when_the_space_is_smaller_than_the_trials():
    calls = []
    request = Request(budget="8npu", job_bounds=PRODUCTION)  # the production job: a space smaller than 300
    space = Suggester(request).space_size()
    assert space < request.trials  # the brute-force sampler covers it and stops early
    suggest(request, progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (space, space) and {total for _, total in calls} == {space}
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


def test_every_command_that_sizes_devices_finds_the_same_minimum(tmp_path):
    """cost --min-cards, demo, suggest and report keep the same memory margin by default (10%) and
    take the same --memory-margin: for one job and margin, one minimum device count."""
    from planner.cli.common import memory_margin_option
    from planner.cost.evaluate import DEFAULT_MEMORY_MARGIN

    assert memory_margin_option(lambda **kw: None).__click_params__[0].default == DEFAULT_MEMORY_MARGIN
    found = {}
    for margin in ("0.1", "0.5"):
        cost = json.loads(run_cli("cost", "qwen3-30b-a3b", "--min-cards", "--memory-margin", margin, "--json").stdout)["num_cards"]
        demo = json.loads(run_cli("demo", "--memory-margin", margin, "--json").stdout)["original"]["num_cards"]
        suggested = json.loads(run_cli("suggest", "--budget", "64npu", "--memory-margin", margin, "--trials", "20", "--json").stdout)
        report = run_cli("report", "--budget", "64npu", "--memory-margin", margin, "--trials", "20", "-o", tmp_path / margin)
        assert report.exit_code == 0, report.output
        reported = json.loads((tmp_path / margin / "report.json").read_text())["costs"]["original"]["num_cards"]
        found[margin] = {cost, demo, suggested["original"]["num_cards"], reported}
        assert len(found[margin]) == 1, (margin, found)
    default = json.loads(run_cli("cost", "qwen3-30b-a3b", "--min-cards", "--json").stdout)["num_cards"]
    assert found["0.1"] == {default} and found["0.5"] != found["0.1"]  # the margin matters, and 10% is the default


def test_reductions_against_the_baseline_the_user_names(tmp_path):
    """--baseline-cards / --baseline-job: the original as it ran (here 64 NPUs at four times the
    batch). The hours reduction is against that run and splits into a product: fewer devices x the
    smaller job x the step time; a baseline the original does not fit is a usage error."""
    prod = tmp_path / "prod.yaml"
    prod.write_text("prompts_per_step: 2048\nsamples_per_prompt: 16\n")
    named = run_cli("suggest", "--budget", "8npu", "--baseline-cards", "64", "--baseline-job", prod, "--json")
    assert named.exit_code == 0, named.output
    data = json.loads(named.stdout)
    assert data["original"]["num_cards"] == 64 and "as you ran it: 64 npus, its own job (2048 x 16" in data["original"]["baseline"]
    for plan in data["plans"]:
        r, m = plan["reduction"], plan["reduction"]["by_mechanism"]
        assert m["fewer_devices"] == pytest.approx(64 / plan["num_cards"]) and m["smaller_job"] > 1.5
        assert m["fewer_devices"] * m["smaller_job"] * m["step_time"] == pytest.approx(r["accelerator_hours"], rel=1e-9)
        assert r["accelerator_hours"] == pytest.approx(data["original"]["accelerator_hours_per_step"] / plan["accelerator_hours_per_step"])
    text = run_cli("suggest", "--budget", "8npu", "--baseline-cards", "64", "--baseline-job", prod).output
    assert "baseline: the original as you ran it" in text and "(fewer npus) x" in text and "(smaller job)" in text
    default = json.loads(run_cli("suggest", "--budget", "8npu", "--job-bounds", "batch=1,length=1", "--json").stdout)
    assert default["original"]["baseline"] == "default" and default["plans"][0]["reduction"]["by_mechanism"]["smaller_job"] == 1.0
    bad = run_cli("suggest", "--budget", "8npu", "--baseline-cards", "3")
    assert bad.exit_code == 2 and "--baseline-cards 3: the original does not fit there" in bad.output


def test_an_hours_budget_finds_what_a_device_budget_finds_and_a_larger_budget_is_never_worse():
    """The space is enumerated where it is small: `--budget 59npu-h` finds the plan `--budget 8npu`
    finds (2.93 NPU-h a step, 58.6 for 20 steps), where 300 NSGA-II trials once missed it."""
    by_devices = suggest(Request(budget="8npu", job_bounds=PRODUCTION)).best
    hours = {b: suggest(Request(budget=b, job_bounds=PRODUCTION)) for b in ("59npu-h", "200npu-h")}
    assert all(s.enumerated and s.trials == s.space_points for s in hours.values())
    assert hours["59npu-h"].best.hours == pytest.approx(by_devices.hours, rel=1e-12)
    best = [hours[b].best.hours for b in ("59npu-h", "200npu-h")]
    assert best == sorted(best, reverse=True)  # more budget: never a dearer answer


# ---- what is proposed: proxies that save, never the original -----------------------------------

def test_when_no_proxy_qualifies_it_says_which_rule_removed_each_and_writes_no_plan(tmp_path):
    """Mixtral has 8 experts, top-2: K >= 4 x 2 leaves the original alone in the space. The original
    is the baseline, not a plan: exit 1, nothing written, the rule named with the K it rules out."""
    out = tmp_path / "plan.yaml"
    result = run_cli("suggest", "--budget", "16gpu", "--hardware", "h100-sxm", "--model", "mixtral-8x7b", "-o", out)
    assert result.exit_code == 1 and not out.exists()
    assert "no proxy in the search space: --min-k-ratio 4 x top_k 2 keeps K >= 8" in result.output
    assert "search K in [2, 4]" in result.output  # the legal powers of two below E = 8
    assert "Pareto set" not in result.output and "cheapest proxies" not in result.output
    data = json.loads(run_cli("suggest", "--budget", "16gpu", "--hardware", "h100-sxm", "--model", "mixtral-8x7b", "--json").stdout)
    assert data["plans"] == []


@pytest.fixture(scope="module")
def tiny_stats(tmp_path_factory):
    """A tiny qwen3_moe checkpoint (8 experts, top-2) and its stats file with one plan, K=4/agglomerative."""
    from checkpoints import family_config, save_tiny

    where = tmp_path_factory.mktemp("tiny-stats")
    source = save_tiny(where / "src", family_config("qwen3_moe"), sharded=False)
    stats = where / "stats.json"
    made = run_cli("stats", source, "--experts", "4", "--methods", "agglomerative", "--calib-tokens", "256", "--seq-len", "64", "-o", stats)
    assert made.exit_code == 0, made.output
    return source, stats


@pytest.mark.slow
def test_a_stats_file_of_another_model_or_cut_short_is_a_usage_error(tiny_stats, tmp_path):
    """The stats of an 8-expert top-2 checkpoint given with Qwen3-30B-A3B: every field of the routing
    shape that differs is named. A file without its checkpoint record is named as cut short."""
    _, stats = tiny_stats
    result = run_cli("suggest", "--budget", "8npu", "--model", "qwen3-30b-a3b", "--stats", stats)
    assert result.exit_code == 2
    assert "the stats file is of another model" in result.output
    assert "num_experts 8 against 128" in result.output and "top_k 2 against 8" in result.output
    doc = json.loads(stats.read_text())
    del doc["checkpoint"]
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(doc))
    result = run_cli("suggest", "--budget", "8npu", "--model", "qwen3-30b-a3b", "--stats", cut, "--json")
    assert result.exit_code == 2 and "without fingerprint, path (cut short or edited?)" in json.loads(result.stdout)["error"]


@pytest.mark.slow
def test_a_rejected_plan_is_in_no_table_and_no_front(tiny_stats, tmp_path):
    """A stats file whose only plan drops more routing mass than a random plan of its K would (planted
    here: 0.9 of the mass where K=4 of 8 drops 0.5 at random): the plan is rejected, so it is neither
    ranked nor on the Pareto front, the rejection is printed, and the original is not written as the plan."""
    source, measured = tiny_stats
    stats = tmp_path / "stats.json"
    doc = json.loads(measured.read_text())
    doc["plans"]["K=4/agglomerative"]["summary"]["frequency_dropped"]["mean"] = 0.9
    stats.write_text(json.dumps(doc))
    out = tmp_path / "plan.yaml"
    args = ("suggest", "--budget", "1npu", "--model", source, "--stats", stats, "--min-k-ratio", "2")  # K in {4, 8}
    result = run_cli(*args, "-o", out)
    assert result.exit_code == 1 and not out.exists()
    assert "K=4/agglomerative: rejected: drops 0.90 of the routing mass, more than a random plan of K=4 would (0.50)" in result.output
    data = json.loads(run_cli(*args, "--json").stdout)
    assert data["plans"] == [] and all(p["experts"] == 8 for p in data["pareto"])


def test_a_plan_dearer_than_the_original_in_every_measure_is_not_proposed():
    """Qwen3-30B-A3B on up to 16 H100s: the original fits on 8, so a proxy on 16 GPUs that also
    costs more hours is no saving. Such points exist in the space; none is ranked, and every ranked
    plan needs fewer GPUs than the original's minimum or fewer hours than its cheapest."""
    request = Request(model="qwen3-30b-a3b", hardware="h100-sxm", budget="16gpu", job_bounds=PRODUCTION)
    result = suggest(request)
    base = result.baseline
    dearer = [o for o in result.options if o.experts != base.minimum.original_experts and o.fits and o.within_budget
              and o.cost.num_devices >= base.minimum.num_devices and o.hours >= base.cheapest.device_hours_per_step]  # fmt: skip
    assert dearer  # the rule has something to remove
    assert result.ranked and not set(map(id, dearer)) & set(map(id, result.ranked))
    for o in result.ranked:
        assert o.cost.num_devices < base.minimum.num_devices or o.hours < base.cheapest.device_hours_per_step


def test_one_baseline_feeds_every_line():
    """GLM-4.5-Air within 64 NPUs: the search evaluates the original on every count it visits, and
    none of those is cheaper than the baseline the reductions are taken against."""
    result = suggest(Request(model="glm-4.5-air", budget="64npu", fault="entropy-collapse"))
    originals = [o for o in result.options if o.experts == result.baseline.minimum.original_experts and o.fits]
    assert {o.cost.num_devices for o in originals} >= {64}
    assert min(o.hours for o in originals) >= result.baseline.cheapest.device_hours_per_step
    from planner.search.output import render_suggestion

    # entropy collapse has a recipe but no calibration grid on any shape: the table says what its rows
    # passed, not a threshold
    assert "cheapest proxies that pass the hard rules (none has a calibrated P)" in render_suggestion(result)
    r = reduction(result.best, result.baseline)["by_mechanism"]
    assert r["baseline_step_s"] == pytest.approx(result.baseline.cheapest.step_time_s, rel=1e-12)  # the step factor's two seconds
    assert r["step_s"] == result.best.cost.step_time_s


def test_a_custom_profile_is_named_by_its_name_and_the_plan_reads_it_back(tmp_path):
    """A user's profile file: outputs name it by its `name:` and its file; the plan stores the file,
    so `preflight` and `check` load the same profile back (its stem is no catalog id)."""
    import yaml

    from planner.catalog import load_accelerator
    from planner.plan import load_plan

    profile = tmp_path / "lab32.yaml"
    profile.write_text(yaml.safe_dump({"name": "H100 32GB (our lab)", "family": "nvidia", "hbm_gib": 32, "reserved_gib": 2.0,
                                       "hbm_tb_per_s": 3.35, "intra_node_gb_per_s": 450, "inter_node_gb_per_s": 50, "devices_per_node": 8,
                                       "peak_bf16_tflops": 989}))  # fmt: skip
    out = tmp_path / "plan.yaml"
    result = run_cli("suggest", "--budget", "16gpu", "--hardware", profile, "-o", out)
    assert result.exit_code == 0, result.output
    assert f"qwen3-30b-a3b on H100 32GB (our lab) (profile {profile.resolve()})" in result.output
    assert load_accelerator(load_plan(out).deployment["hardware"]).name == "H100 32GB (our lab)"
