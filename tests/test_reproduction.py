"""The reproduction as part of the plan: its job (held at the production value where the fidelity data
do not support shrinking it), the steps to the fault, and the accelerator-hours to the fault split by
mechanism (planner.search.reproduction)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from planner.cli import main
from planner.errors import SpecError
from planner.fidelity.estimator import FidelityEstimator, _onsets, default_estimator_path
from planner.search.reproduction import JobBounds, JobScale, job_scales, onset, run_steps, split
from planner.specs import Job, Lengths


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


ALL = {dim: {"ok": True} for dim in ("prompts", "samples", "length")}


def test_job_bounds_parse_and_refuse():
    assert JobBounds.parse(None) == JobBounds(batch=1 / 16, length=1 / 4)
    assert JobBounds.parse("batch=1/8, length=0.5") == JobBounds(batch=0.125, length=0.5)
    assert JobBounds.parse("length=1") == JobBounds(batch=1 / 16, length=1.0)
    for bad, words in (("batch=0", "in (0, 1]"), ("batch=2", "in (0, 1]"), ("steps=4", "expected batch=SHARE"),
                       ("batch=x", "'x' is not a number"), ("batch=1/0", "is not a number")):  # fmt: skip
        with pytest.raises(SpecError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
            JobBounds.parse(bad)
    r = run_cli("suggest", "--budget", "8npu", "--job-bounds", "batch=0")
    assert r.exit_code == 2 and "--job-bounds batch=0: a share of the production job" in r.output


def test_job_scales_halve_each_supported_dimension_down_to_its_bound():
    job = Job()  # 512 x 16, response <= 3072
    assert job_scales(job, JobBounds(), {}) == [JobScale()]  # nothing supported: the production job alone
    scales = job_scales(job, JobBounds(), ALL)
    # (prompts, samples) divisors, powers of two, p x s <= 16 and at least 2 samples left of 16: by hand
    # p=1: s 1,2,4,8; p=2: s 1,2,4,8; p=4: 1,2,4; p=8: 1,2; p=16: 1 -> 14 pairs, x 3 lengths (1, 1/2, 1/4)
    assert len(scales) == 42 and len(set(scales)) == 42
    assert JobScale(16, 1, 4) in scales and JobScale(1, 8, 1) in scales and JobScale(1, 16, 1) not in scales  # 1 sample is no group
    assert all(1 / (s.prompts * s.samples) >= 1 / 16 and s.length <= 4 for s in scales)
    # a measured range narrower than the bound wins; an unsupported dimension stays at 1
    narrow = job_scales(job, JobBounds(), {"length": {"ok": True, "min_share": 0.5}, "prompts": {"ok": False}})
    assert narrow == [JobScale(1, 1, 1), JobScale(1, 1, 2)]
    ppo = Job(algorithm="ppo", prompts_per_step=4, samples_per_prompt=2)
    assert JobScale(1, 2, 1) in job_scales(ppo, JobBounds(), ALL)  # PPO needs no group: one sample per prompt
    single = Job(samples_per_prompt=1, algorithm="ppo", skip_old_logprob=True)
    assert job_scales(Job(prompts_per_step=2, samples_per_prompt=3), JobBounds(), ALL)[0] == JobScale()  # the production job always stays
    assert JobScale(1, 1, 1) in job_scales(single, JobBounds(), ALL) and job_scales(Job(samples_per_prompt=1), JobBounds(), ALL)[0] == JobScale()
    few = Job(prompts_per_step=4, samples_per_prompt=2, mini_batches=4, skip_old_logprob=False)
    assert all((4 // s.prompts) * (2 // s.samples) >= 4 for s in job_scales(few, JobBounds(), ALL))  # as many sequences as mini-batches


def test_a_shorter_cap_keeps_the_length_distribution_truncated_there():
    """The response cap halves; the mean is that of the same gamma-distributed lengths cut at the new
    cap: recomputed here with scipy from the gamma whose cut at 3072 has mean 1577."""
    from scipy import integrate, optimize, stats

    job = Job()
    short = JobScale(1, 1, 2).apply(job)
    assert (short.prompts_per_step, short.samples_per_prompt, short.response_tokens.max) == (512, 16, 1536)

    def capped_mean(scale, cap):
        return integrate.quad(lambda x: stats.gamma.sf(x, 2.0, scale=scale), 0, cap)[0]

    scale = optimize.brentq(lambda s: capped_mean(s, 3072) - 1577, 10, 1e5)
    assert short.response_tokens.mean == pytest.approx(capped_mean(scale, 1536), rel=0.01)
    assert short.response_tokens.mean < job.response_tokens.mean and short.prompt_tokens == job.prompt_tokens
    at_cap = Job(response_tokens=Lengths(mean=1024, max=1024))  # every response runs to the cap: it stays there
    assert JobScale(1, 1, 4).apply(at_cap).response_tokens == Lengths(mean=256, max=256)
    assert JobScale(4, 2, 1).apply(job).num_sequences == 512 * 16 // 8


def test_steps_to_the_fault():
    assert [run_steps(h) for h in (0, 5, 19.2, 40)] == [2, 7, 22, 44]  # past the onset by 10%, at least 2 steps
    unknown = onset(None, None, 20)
    assert (unknown.steps, unknown.original_steps, unknown.proxy) == (20, 20, None) and "--fault-step" in unknown.basis
    measured = onset(40, {"ok": True, "median": 0.5, "low": 0.3, "high": 0.8, "rows": 50, "where": "F, K/E 0.25"}, 20)
    assert measured.proxy == 20 and measured.interval == pytest.approx((12, 32)) and measured.steps == run_steps(32) == 36
    assert measured.original_steps == 44 and "ratio 0.50 [0.30, 0.80] measured on 50 calibration curves" in measured.basis
    static = onset(40, {"ok": False, "reason": "a static recipe"}, 20)
    assert static.proxy == 40 and static.steps == static.original_steps == 44 and "taken as the original's: a static recipe" in static.basis


def test_the_split_is_a_product_of_its_factors():
    r = split(2.0, 8, 30, 64.0, 256, 44, layout=1.17, job=4.0, step_s=1300.0)
    m = r["by_mechanism"]
    assert r["accelerator_hours"] == 32.0 and r["reproduction_hours"] == pytest.approx(32.0 * 44 / 30)
    # 32x per step: 32x fewer devices, the baseline's layout 1.17 and its 4x job leave 1 / (1.17 x 4) to the step time
    assert (m["fewer_devices"], m["layout"], m["smaller_job"]) == (32.0, 1.17, 4.0) and m["step_time"] == pytest.approx(1 / (1.17 * 4.0))
    assert r["accelerator_hours"] * m["steps_to_fault"] == pytest.approx(r["reproduction_hours"], rel=1e-12)
    assert m["baseline_step_s"] == pytest.approx(1300.0 * m["step_time"])
    unfit = split(2.0, 8, 30, 64.0, 256, 44, job=None, step_s=1300.0)["by_mechanism"]  # the job does not fit the baseline's devices
    assert unfit["smaller_job"] is None and unfit["step_time"] == pytest.approx(1.0)  # 32x per step, all from 32x fewer devices
    from planner.search.reproduction import split_text

    assert "the smaller job, fewer experts and this layout together" in split_text({"accelerator_hours": 32.0, "reproduction_hours": 47.0,
                                                                                    "by_mechanism": unfit}, "npu")  # fmt: skip


def test_onset_ratios_are_quantiles_of_the_calibration_curves():
    """Planted curves: ratios 0.2, 0.4, ..., 1.0 at one K/E; a proxy whose curve never faults counts as
    never, and makes the range open; controls and added pairs are left out."""
    rows = [{"recipe": "router-collapse", "family": "F", "kept_fraction": 0.25, "method": "agglomerative", "source": "grid",
             "onset_original": 10, "onset_proxy": 2 * i} for i in range(1, 6)]  # fmt: skip
    rows += [{**rows[0], "method": "mis-sliced", "onset_proxy": 40}, {**rows[0], "source": "add:a|b", "onset_proxy": 40}]
    got = _onsets(rows, "router-collapse")["F"][0]
    assert (got["rows"], got["never"], got["low"], got["median"], got["high"]) == (5, 0, 0.2, 0.6, 1.0)
    rows.append({**rows[0], "onset_proxy": float("nan")})
    assert math.isinf(_onsets(rows, "router-collapse")["F"][0]["high"])
    assert _onsets(rows, "fp16-overflow") == {}


def test_a_smaller_jobs_onset_factor_is_measured_against_the_same_model_at_the_production_job():
    """Planted job-grid curves: each proxy's onset at half the prompts over its own onset at the job
    grid's production job (the original's own row: over its production curve); a curve that never
    faults opens the range; a proxy with no production-job onset has no factor; a second shrunk
    dimension multiplies its own factor in, and one never measured leaves the onset unknown."""
    from planner.fidelity.jobs import _job_onsets, job_onset

    base = {"recipe": "router-collapse", "family": "F", "job_grid": "g", "original": "F-s0", "method": "agglomerative",
            "onset_original": 10.0, "kept_fraction": 0.25}  # fmt: skip
    rows = [{**base, "model": f"p{i}", "onset_proxy": 4.0 * i} for i in range(1, 5)]  # production job: 4, 8, 12, 16
    rows += [{**base, "model": f"p{i}", "onset_proxy": 6.0 * i, "job_prompts_share": 0.5} for i in range(1, 5)]  # x1.5 each
    rows += [{**base, "model": "original", "method": "original", "onset_proxy": 20.0, "job_prompts_share": 0.5}]  # x2 against 10
    rows += [{**base, "model": "p1", "method": "mis-sliced", "onset_proxy": 99.0, "job_prompts_share": 0.5}]  # a control: aside
    rows += [{**base, "model": "p9", "onset_proxy": 5.0, "job_prompts_share": 0.5}]  # no production-job curve of p9: no factor
    rows += [{**base, "model": "p1", "onset_proxy": 8.0, "job_length_share": 0.5}]  # x2
    got = _job_onsets(rows, "router-collapse")["F"]
    assert [(lv["share"], lv["rows"], lv["never"], lv["median"], lv["high"]) for lv in got["prompts"]] == [(0.5, 5, 0, 1.5, 2.0)]
    assert got["length"][0]["median"] == 2.0 and "samples" not in got
    assert _job_onsets(rows, "fp16-overflow") == {}
    assert job_onset(got, {}) is None  # the production job
    both = job_onset(got, {"job_prompts_share": 0.5, "job_length_share": 0.5})
    assert both["ok"] and both["median"] == pytest.approx(3.0) and both["high"] == pytest.approx(4.0) and "multiplied" in both["job"]
    for unmeasured, words in (({"job_samples_share": 0.5}, "samples per prompt"), ({"job_prompts_share": 0.25}, "0.25 of the production prompts")):
        unknown = job_onset(got, unmeasured)  # a dimension never measured; a share below every measured one
        assert not unknown["ok"] and words in unknown["reason"]
    never = _job_onsets(rows + [{**rows[5], "model": "p2", "onset_proxy": float("nan")}], "router-collapse")["F"]["prompts"][0]
    assert never["never"] == 1 and math.isinf(never["high"])


def test_the_onset_at_a_smaller_job_is_the_production_ratio_times_the_jobs_factor():
    """The shipped estimator with a planted job-grid factor for the default case's shape: at half the
    prompts the production job's ratio is multiplied by it, and the basis names both; at a job whose
    factor was never measured, or one whose curves did not all fault, the onset is not known."""
    from planner.catalog import load_model_config
    from planner.fidelity.dataset import plan_row

    est = FidelityEstimator.load(default_estimator_path())
    row = plan_row(load_model_config("qwen3-30b-a3b")[1], 32, None)
    production = est.onset(row, "router-collapse")
    family = production["where"].split(",")[0]
    level = {"share": 0.5, "rows": 6, "never": 0, "low": 1.2, "median": 1.5, "high": 2.0}
    est.recipes["router-collapse"]["job_onsets"] = {family: {"prompts": [level], "length": [{**level, "high": math.inf, "never": 1}]}}
    half = est.onset({**row, **JobScale(2, 1, 1).columns()}, "router-collapse")
    assert half["ok"] and half["rows"] == production["rows"] + 6
    assert [half[k] for k in ("low", "median", "high")] == pytest.approx([production[k] * level[k] for k in ("low", "median", "high")])
    assert f"measured on {family}'s job grid at prompts per step x0.5" in half["job"]
    assert est.onset(row, "router-collapse")["job"] == "at the production job"
    basis = onset(40, half, 20).basis
    assert "at the smaller job, the production job's ratio x the onset factor" in basis
    for scale, words in ((JobScale(1, 2, 1), "samples per prompt"), (JobScale(1, 1, 2), "never showed the fault")):
        unknown = est.onset({**row, **scale.columns()}, "router-collapse")
        assert not unknown["ok"] and "the onset at this smaller job is not known" in unknown["reason"] and words in unknown["reason"]
        assert "the proxy's onset is taken as the original's" in onset(40, unknown, 20).basis


def test_the_shipped_estimator_says_what_it_measured():
    """Router collapse on the default case's shape: an onset ratio from the family's curves; the static
    recipes measure none; each job dimension the job grid measured at half its production value
    (grids/jobs-rc-qwen3_moe-e128.yaml) is supported only where the label stayed within the band,
    and a held one says by how much it moved; the onset at a half carries the measured factor."""
    from planner.catalog import load_model_config
    from planner.fidelity.dataset import plan_row

    est = FidelityEstimator.load(default_estimator_path())
    row = plan_row(load_model_config("qwen3-30b-a3b")[1], 32, None)
    rc = est.onset(row, "router-collapse")
    assert rc["ok"] and 0 <= rc["low"] <= rc["median"] <= rc["high"] < np.inf and rc["where"] == "qwen3_moe-e128, K/E 0.25"
    assert not est.onset(row, "rollout-mismatch")["ok"] and "static recipe" in est.onset(row, "rollout-mismatch")["reason"]
    support = est.job_support(row, "router-collapse")
    assert set(support) == {"prompts", "samples", "length"}
    for dim, v in support.items():
        (level,) = v["levels"]  # the halves alone
        assert level["share"] == 0.5 and level["originals"] == 3
        lo, hi = level["delta_interval"]
        assert v["ok"] == (-0.5 < lo and hi < 0.5)
        if not v["ok"]:
            assert "at 0.5 of the production value the label moves by" in v["reason"] and f"[{lo:+.2f}, {hi:+.2f}] over 3 originals" in v["reason"]
    factors = est.recipes["router-collapse"]["job_onsets"]["qwen3_moe-e128"]
    half = est.onset({**row, **JobScale(2, 1, 1).columns()}, "router-collapse")
    assert half["ok"] and half["median"] == pytest.approx(rc["median"] * factors["prompts"][0]["median"]) and "job grid" in half["job"]


def test_suggest_prices_the_reproduction_to_the_fault():
    """Router collapse with the original's fault at step 40: each plan runs past its predicted onset,
    the original 44 steps; the JSON carries the job, the onset and the hours to the fault, and the
    split's factors multiply to its reduction."""
    out = run_cli("suggest", "--budget", "8npu", "--fault", "router-collapse", "--fault-step", "40", "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["original"]["steps"] == 44
    assert data["original"]["reproduction_hours"] == pytest.approx(data["original"]["cheapest"]["accelerator_hours_per_step"] * 44)
    assert not any(d["ok"] for d in data["job_search"]["dimensions"].values()) and len(data["job_search"]["jobs"]) == 1
    for plan in data["plans"]:
        o, r, m = plan["onset_step"], plan["reduction"], plan["reduction"]["by_mechanism"]
        assert plan["job"]["production"] and plan["job"]["prompts_per_step"] == 512
        assert o["original_step"] == 40 and o["interval"][0] <= o["proxy_step"] <= o["interval"][1]
        assert plan["steps"] == o["steps"] == run_steps(max(o["interval"][1], 1.0))
        assert plan["reproduction_hours"] == pytest.approx(plan["accelerator_hours_per_step"] * plan["steps"], rel=1e-12)
        assert plan["reproduction_wall_s"] == pytest.approx(plan["step_time_s"] * plan["steps"], rel=1e-12)
        assert m["smaller_job"] == 1.0 and m["layout"] == 1.0 and m["steps_to_fault"] == pytest.approx(44 / plan["steps"])
        product = m["fewer_devices"] * m["layout"] * m["smaller_job"] * m["step_time"] * m["steps_to_fault"]
        assert product == pytest.approx(r["reproduction_hours"], rel=1e-9)
        assert r["reproduction_hours"] == pytest.approx(data["original"]["reproduction_hours"] / plan["reproduction_hours"], rel=1e-9)
    text = run_cli("suggest", "--budget", "8npu", "--fault", "router-collapse", "--fault-step", "40").output
    assert "onset: the original showed the fault at step 40; the proxy's is predicted at step" in text
    assert "held at the production value, since the fidelity of a smaller job is not known" in text
    assert "fewer npu-hours to the fault" in text and "(steps to the fault:" in text


def test_a_named_run_with_its_own_layout_is_no_smaller_job(tmp_path):
    """DeepSeek-V3 against the published 256-die run on Atlas A3: with the job held, the proxies run
    the same workload, so the smaller-job factor is exactly 1 and the published layout against the
    planner's on those 256 dies is a factor of its own; with the job searched (rollout mismatch's job
    support, borrowed from the measured families), the smaller job is a factor apart from the layout."""
    runs = yaml.safe_load((default_estimator_path().parent / "published_runs.yaml").read_text())["runs"]
    published = next(r for r in runs if r["id"] == "ds-r1-a3-real")["job"]
    ran, free = tmp_path / "ran.yaml", tmp_path / "free.yaml"
    ran.write_text(yaml.safe_dump(published))
    free.write_text(yaml.safe_dump({k: v for k, v in published.items() if k not in ("train_layout", "rollout_layout", "dispatch_s")}))
    command = ("suggest", "--model", "deepseek-v3", "--hardware", "atlas-a3", "--budget", "64npu", "--job", free, "--baseline-cards", "256",
               "--baseline-job", ran, "--fault", "rollout-mismatch", "--json")  # fmt: skip
    out = run_cli(*command, "--job-bounds", "batch=1,length=1")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["plans"] and data["original"]["num_cards"] == 256 and data["original"]["layout_factor"] != 1.0
    for plan in data["plans"]:
        m, r = plan["reduction"]["by_mechanism"], plan["reduction"]
        assert m["smaller_job"] == 1.0 and m["layout"] == data["original"]["layout_factor"] and m["steps_to_fault"] == 1.0
        assert m["fewer_devices"] * m["layout"] * m["step_time"] == pytest.approx(r["accelerator_hours"], rel=1e-9)
    searched = json.loads(run_cli(*command).stdout)
    best = searched["plans"][0]
    m = best["reduction"]["by_mechanism"]
    assert not best["job"]["production"] and m["smaller_job"] > 1.0 and m["layout"] == searched["original"]["layout_factor"]
    assert m["fewer_devices"] * m["layout"] * m["smaller_job"] * m["step_time"] * m["steps_to_fault"] == pytest.approx(
        best["reduction"]["reproduction_hours"], rel=1e-9)


def test_a_supported_job_dimension_is_searched(tmp_path):
    """Planted support (the shipped estimator with the response cap of qwen3_moe-e128's rollout
    mismatch marked as measured down to a quarter): the search proposes a shorter job, whose
    smaller-job factor is the original's step with the production job over its step with that one."""
    data = json.loads(default_estimator_path().read_text())
    levels = [{"share": 0.5, "rows": 20, "originals": 5, "delta_mean": 0.1, "delta_interval": [-0.1, 0.3], "ok": True},
              {"share": 0.25, "rows": 20, "originals": 5, "delta_mean": -0.2, "delta_interval": [-0.4, 0.0], "ok": True}]
    support = data["recipes"]["rollout-mismatch"]["job"]["qwen3_moe-e128"]
    support["length"] = {"ok": True, "min_share": 0.25, "rows": 40, "levels": levels}
    for dim in ("prompts", "samples"):  # the length alone, whatever the shipped data support
        support[dim] = {"ok": False, "rows": 0, "reason": "held at the production value for this test"}
    planted = tmp_path / "fidelity.json"
    planted.write_text(json.dumps(data))
    out = run_cli("suggest", "--budget", "8npu", "--estimator", planted, "--json")
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    assert [j["divisors"]["length"] for j in got["job_search"]["jobs"]] == [1, 2, 4]
    best = got["plans"][0]
    assert best["job"]["divisors"] == {"prompts": 1, "samples": 1, "length": 4} and best["job"]["response_max"] == 768
    from planner.catalog import load_model_config
    from planner.fidelity.dataset import plan_row

    f = best["fidelity"]
    assert f["job_shift_log2"] == pytest.approx([-0.4, 0.0])  # the quarter cap's measured extra shift, -0.2 +- 0.2
    at_production = FidelityEstimator.load(planted).predict(plan_row(load_model_config("qwen3-30b-a3b")[1], best["experts"], None),
                                                            "rollout-mismatch")  # fmt: skip
    assert "job_shift_log2" not in at_production and f["shift_log2"] == pytest.approx(at_production["shift_log2"] - 0.2)
    assert f["shift_interval"][1] - f["shift_interval"][0] == pytest.approx(at_production["shift_interval"][1] - at_production["shift_interval"][0] + 0.4)
    m = best["reduction"]["by_mechanism"]
    assert m["smaller_job"] > 1.5
    assert m["fewer_devices"] * m["smaller_job"] * m["step_time"] == pytest.approx(best["reduction"]["accelerator_hours"], rel=1e-9)
    assert "job searched: 3 reproduction jobs (length shrunk within batch down to 1/16, response cap down to 1/4)" in got["job_search"]["text"]
    held = json.loads(run_cli("suggest", "--budget", "8npu", "--job-bounds", "batch=1,length=1", "--json").stdout)
    production, production_text = held["plans"][0], held["job_search"]["text"]
    assert production["job"]["divisors"] == {"prompts": 1, "samples": 1, "length": 1}
    assert production_text.startswith("job: the production job (512 x 16, response <= 3072") and "held there by --job-bounds" in production_text
    assert best["reduction"]["accelerator_hours"] > production["reduction"]["accelerator_hours"]


def test_a_job_dimension_is_supported_down_to_the_share_that_keeps_the_label():
    """Planted rows of one family, three originals: halving the response cap moves each proxy's label by
    0.05-0.15 log2 against its production row (and the original's own by about as much), a quarter
    cap by about 1: the length is supported down to 1/2; the batch was never measured. The family
    grid's rows of the same names (other weights: a shift 2 log2 away) are no reference for the job
    grid's: each job row is compared with its own grid's production row."""
    from planner.fidelity.jobs import _job_support, job_offset

    rows = []
    for i, original in enumerate(("F-s0", "F-s1", "F-s2")):
        for model, base in (("K8-a", -0.3), ("K8-b", -0.6)):
            family_grid = {"recipe": "fp16-overflow", "family": "F", "original": original, "model": model, "method": "agglomerative", "censored": 0}
            rows.append({**family_grid, "shift_log2": base + 2.0})
            common = {**family_grid, "job_grid": "J"}
            rows.append({**common, "shift_log2": base})
            rows.append({**common, "shift_log2": base + 0.05 + 0.05 * i, "job_length_share": 0.5})
            rows.append({**common, "shift_log2": base - 1.0 - 0.02 * i, "job_length_share": 0.25})
        rows.append({"recipe": "fp16-overflow", "family": "F", "original": original, "model": "original", "method": "original",
                     "censored": 0, "shift_log2": 0.1, "job_length_share": 0.5, "job_grid": "J"})  # fmt: skip
    support = _job_support(rows, "fp16-overflow")["F"]
    length = support["length"]
    assert length["ok"] and length["min_share"] == 0.5 and length["rows"] == 15
    half, quarter = length["levels"]
    assert (half["share"], half["originals"], half["ok"]) == (0.5, 3, True) and quarter["ok"] is False
    # per original: the mean of its two proxies' extra shifts and its own original's 0.1
    per = [np.mean([0.05 + 0.05 * i, 0.05 + 0.05 * i, 0.1]) for i in range(3)]
    assert half["delta_mean"] == pytest.approx(np.mean(per))
    from scipy import stats

    half_width = stats.t.ppf(0.95, 2) * np.std(per, ddof=1) / np.sqrt(3)
    assert half["delta_interval"] == pytest.approx([np.mean(per) - half_width, np.mean(per) + half_width])
    assert support["prompts"] == {"ok": False, "rows": 0, "levels": []}
    offset, width = job_offset(support, {"job_length_share": 0.5, "job_prompts_share": 0.5})  # the batch is unsupported: no term
    assert offset == pytest.approx(np.mean(per)) and width == pytest.approx(half_width)
    assert job_offset(support, {"job_length_share": 1.0}) == (0.0, 0.0)


@pytest.mark.parametrize("joint_extra, additive", [(0.3, True), (1.4, False)])
def test_a_jointly_shrunk_job_is_checked_against_the_summed_shifts(joint_extra, additive):
    """Planted rows, three originals: a quarter of the prompts, half the group and a quarter of the
    length each move the label by 0.1 alone. Shrunk together they move it by 0.3 (the sum stands:
    the search may shrink them together) or by 1.4 (the sum misses by 1.1: one dimension shrinks at a
    time)."""
    from planner.fidelity.jobs import _job_joint, _job_support
    from planner.search.reproduction import JobBounds, job_scales
    from planner.specs import Job

    rows = []
    single = ({"job_prompts_share": 0.25}, {"job_samples_share": 0.5}, {"job_length_share": 0.25})
    joint = {"job_prompts_share": 0.25, "job_samples_share": 0.5, "job_length_share": 0.25}
    for i, original in enumerate(("F-s0", "F-s1", "F-s2")):
        for model, base in (("K8-a", -0.3), ("K8-b", -0.6)):
            common = {"recipe": "rollout-mismatch", "family": "F", "original": original, "model": model, "method": "agglomerative", "censored": 0,
                      "job_grid": "J"}  # fmt: skip
            rows.append({**common, "shift_log2": base})
            rows += [{**common, "shift_log2": base + 0.1 + 0.01 * i, **shares} for shares in single]
            rows.append({**common, "shift_log2": base + joint_extra + 0.01 * i, **joint})
    support = _job_support(rows, "rollout-mismatch")["F"]
    assert all(support[dim]["ok"] for dim in ("prompts", "samples", "length"))
    (level,) = _job_joint(rows, "rollout-mismatch", {"F": support})["F"]
    assert level["shares"] == {"prompts": 0.25, "samples": 0.5, "length": 0.25} and (level["rows"], level["originals"]) == (6, 3)
    assert level["summed"] == pytest.approx(3 * 0.11) and level["delta_mean"] == pytest.approx(joint_extra + 0.01)
    assert level["difference_mean"] == pytest.approx(joint_extra + 0.01 - 0.33) and level["ok"] is additive
    scales = job_scales(Job(), JobBounds(), support, [level])
    shrunk = [sum(d > 1 for d in (s.prompts, s.samples, s.length)) for s in scales]
    assert max(shrunk) == (3 if additive else 1) and len(scales) > 3
    from planner.search.output import joint_text

    text = joint_text([level])
    assert text.startswith("dimensions shrunk together add their extra shifts" if additive else "one dimension shrinks at a time")
    assert f"{level['delta_mean']:+.2f}" in text and f"{level['summed']:+.2f} summed" in text


def test_the_shipped_fit_carries_the_joint_jobs_measured_and_suggest_quotes_them():
    """grids/jobs-joint-qwen3_moe-e128.yaml measured rollout mismatch at two jobs shrunk in all three
    dimensions: the shipped fit holds each with its measured and summed extra shift, and the default
    case's suggest text quotes both (and whether the search may shrink dimensions together follows
    their verdicts)."""
    from planner.catalog import load_model_config
    from planner.fidelity.dataset import plan_row

    row = plan_row(load_model_config("qwen3-30b-a3b")[1], 32, None)
    joint = FidelityEstimator.load(default_estimator_path()).job_joint(row, "rollout-mismatch")
    assert sorted(tuple(level["shares"].values()) for level in joint) == [(0.25, 0.5, 0.25), (0.5, 0.5, 0.5)]
    assert all(level["originals"] == 3 and level["rows"] == 27 for level in joint)
    out = json.loads(run_cli("suggest", "--budget", "8npu", "--fault", "rollout-mismatch", "--json").stdout)
    assert out["job_search"]["joint"] == joint
    from planner.search.output import holdout_text

    held = FidelityEstimator.load(default_estimator_path()).job_holdout(row, "rollout-mismatch")  # the smaller jobs' held-out scores, quoted
    assert held["family"] == "qwen3_moe-e128" and out["job_search"]["held_out"] == held
    assert holdout_text(held) in out["job_search"]["text"]
    for level in joint:
        assert f"{level['delta_mean']:+.2f} [{level['delta_interval'][0]:+.2f}, {level['delta_interval'][1]:+.2f}] measured" in out["job_search"]["text"]
    shrunk = max(sum(d > 1 for d in j["divisors"].values()) for j in out["job_search"]["jobs"])
    assert shrunk == (3 if all(level["ok"] for level in joint) else 1)


def _planted_job_family(n_originals: int, rng) -> list[dict]:
    """A family grid (8 plans per original, shift -1.2 x (1 - K/E) plus noise) and a job grid of the
    same names on other weights (shift 0.1 higher), measured again at half and a quarter of the prompts,
    where the fault moves by -0.5 log2 per halving: the proxies and the original itself."""
    from planner.fidelity.model import SHIFT_FEATURES

    rows = []
    for o in range(n_originals):
        original = f"F-s{o}"
        for k, kept in enumerate((0.25, 0.25, 0.25, 0.25, 0.5, 0.5, 0.5, 0.5)):
            features = {n: float(rng.uniform(0, 1)) for n in SHIFT_FEATURES}
            features["kept_fraction"] = kept
            common = {"recipe": "fp16-overflow", "family": "F", "original": original, "model": f"K{int(kept * 32)}-{k}",
                      "method": "agglomerative", "censored": 0, "shift_se": 0.02, "experts": int(kept * 32), **features}  # fmt: skip
            shift = -1.2 * (1 - kept) + rng.normal(0, 0.02)
            rows.append({**common, "shift_log2": shift})
            for share in (1.0, 0.5, 0.25):
                moved = shift + 0.1 - 0.5 * np.log2(1 / share) + rng.normal(0, 0.02)
                rows.append({**common, "shift_log2": moved, "job_grid": "J", "job_prompts_share": share, "job_samples_share": 1.0,
                             "job_length_share": 1.0})  # fmt: skip
        for share in (0.5, 0.25):
            rows.append({"recipe": "fp16-overflow", "family": "F", "original": original, "model": "original", "method": "original",
                         "censored": 0, "shift_se": 0.02, "job_grid": "J", "job_prompts_share": share,
                         "shift_log2": -0.5 * np.log2(1 / share) + rng.normal(0, 0.02)})  # fmt: skip
    return rows


def test_the_job_term_is_scored_on_held_out_originals():
    """Planted: the fault moves by -0.5 log2 per halving of the prompts on every original. Held out one
    original at a time, the job term measured on the others predicts that move (MAE near the planted
    noise, where predicting no move errs by 0.75 on average), and plan + job beats the production-job
    prediction on every held-out original; a family measured on 2 originals is not scored, and says why."""
    from planner.fidelity.job_validate import job_holdout, render_job_holdout

    rng = np.random.default_rng(0)
    result = job_holdout(_planted_job_family(4, rng), "fp16-overflow")["F"]
    assert (result["originals"], result["rows"]) == (4, 4 * 8 * 2)
    term = result["job_term"]
    assert term["rows"] == 4 * 9 * 2 and term["mae"] < 0.1 and term["mae_zero"] == pytest.approx(0.75, abs=0.05)
    full, production = result["variants"]["plan + job"], result["variants"]["production job"]
    assert full["mae"] < 0.25 < 0.6 < production["mae"] and result["difference"][2] < 0
    assert full["coverage"] > production["coverage"]
    (line,) = render_job_holdout("fp16-overflow", {"F": result})
    assert f"plan + job MAE {full['mae']:.3f}" in line and f"against {term['mae_zero']:.3f} for no term" in line
    few = job_holdout(_planted_job_family(2, rng), "fp16-overflow")["F"]
    assert few == {"originals": 2, "reason": "2 originals measured at smaller jobs: 3 or more needed"}


def test_the_shipped_fit_scores_the_job_rows_of_two_families_on_held_out_originals():
    """The committed job grids (the default case's shape and the sigmoid-grouped DeepSeek-V3-like
    one): for every recipe and both families, the fit carries the held-out scores of the job term,
    of plan + job and of both baselines, in the lines `planner calibrate report` prints."""
    estimator = FidelityEstimator.load(default_estimator_path())
    for recipe, least in (("fp16-overflow", 120), ("rollout-mismatch", 120), ("router-collapse", 30)):  # router collapse: the halves only
        held = estimator.recipes[recipe]["job_holdout"]
        assert {"qwen3_moe-e128", "deepseek_v3"} <= set(held)
        for family in ("qwen3_moe-e128", "deepseek_v3"):
            e = held[family]
            assert e["originals"] == 3 and e["rows"] >= least and set(e["variants"]) == {"plan + job", "production job", "K/E + job"}
            assert e["job_term"]["rows"] > e["rows"] and math.isfinite(e["job_term"]["mae"]) and len(e["difference"]) == 3
    from planner.fidelity.job_validate import render_job_holdout

    lines = render_job_holdout("rollout-mismatch", estimator.recipes["rollout-mismatch"]["job_holdout"])
    assert len(lines) == len(estimator.recipes["rollout-mismatch"]["job_holdout"]) and all("the job term alone on" in line for line in lines)


def test_a_family_no_job_grid_measured_borrows_only_what_every_measured_family_keeps():
    """Planted, three originals each: families F and G measured at half the prompts (extra shift about
    +0.05 on both) and half the length (+0.1 on F, +0.9 on G); family H only at the production job.
    H borrows the prompts (kept on both, the mean of their levels, the hull of their intervals) with
    the transfer validated one family out, and not the length (G moves), saying why; F and G keep
    their own support."""
    from planner.fidelity.jobs import _job_support, _job_transfer

    rows = []
    for family, length_extra in (("F", 0.1), ("G", 0.9)):
        for i in range(3):
            for model, base in (("K8-a", -0.3), ("K8-b", -0.6)):
                common = {"recipe": "rollout-mismatch", "family": family, "original": f"{family}-s{i}", "model": model, "method": "agglomerative",
                          "censored": 0, "job_grid": family}  # fmt: skip
                rows.append({**common, "shift_log2": base})
                rows.append({**common, "shift_log2": base + 0.05 + 0.01 * i, "job_prompts_share": 0.5})
                rows.append({**common, "shift_log2": base + length_extra + 0.01 * i, "job_length_share": 0.5})
    rows += [{"recipe": "rollout-mismatch", "family": "H", "original": f"H-s{i}", "model": "K8-a", "method": "agglomerative", "censored": 0,
              "shift_log2": -0.4} for i in range(3)]  # fmt: skip
    support = _job_support(rows, "rollout-mismatch")
    assert support["F"]["length"]["ok"] and not support["G"]["length"]["ok"] and not support["H"]["prompts"]["ok"]
    transfer = _job_transfer(rows, "rollout-mismatch", support, {})
    assert transfer["families"] == ["F", "G"]
    prompts = transfer["dims"]["prompts"]
    assert prompts["ok"] and prompts["min_share"] == 0.5 and prompts["levels"][0]["delta_mean"] == pytest.approx(0.06)
    lo = min(support[f]["prompts"]["levels"][0]["delta_interval"][0] for f in "FG")
    assert prompts["levels"][0]["delta_interval"][0] == lo
    assert transfer["dims"]["length"] == {"ok": False, "rows": 0, "reason": "not kept on G"}
    held = transfer["held_out"]["G"]  # G's rows predicted by F's levels: the prompts right, the length off by about 0.8
    assert held["from"] == ["F"] and held["rows"] == 12 and held["mae"] == pytest.approx((6 * 0.0 + 6 * 0.8) / 12, abs=0.02)
    estimator = FidelityEstimator({"rollout-mismatch": {"job": support, "job_transfer": transfer, "job_joint": {},
                                                        "shapes": {"f": ["F"], "h": ["H"]}}}, {})  # fmt: skip
    borrowed = estimator.job_support({"routing_shape": "h"}, "rollout-mismatch")
    assert borrowed["prompts"]["ok"] and borrowed["prompts"]["transferred"].startswith("no job grid measured H: its job support is borrowed")
    assert not borrowed["length"]["ok"] and "no job grid measured rollout-mismatch on H" in borrowed["length"]["reason"]
    own = estimator.job_support({"routing_shape": "f"}, "rollout-mismatch")
    assert own["length"]["ok"] and "transferred" not in own["length"]


def test_the_shipped_fit_lends_deepseek_v3_the_job_support_both_measured_families_share():
    """No job grid measured DeepSeek-V3's own shape; the two that were measured both keep rollout
    mismatch's label at 1/4 prompts, 1/2 group, 1/4 length, and both move fp16 overflow with the batch's
    tokens: suggest may shrink the first's job on DeepSeek-V3, not the second's, and says so. Both are
    attention-only: Nemotron-3-Nano's hybrid backbone borrows nothing."""
    from planner.catalog import load_model_config
    from planner.fidelity.dataset import plan_row

    estimator = FidelityEstimator.load(default_estimator_path())
    row = plan_row(load_model_config("deepseek-v3")[1], 32, None)
    rollout = estimator.job_support(row, "rollout-mismatch")
    assert {d: (v["ok"], v.get("min_share")) for d, v in rollout.items()} == {"prompts": (True, 0.25), "samples": (True, 0.5), "length": (True, 0.25)}
    assert all(v["transferred"].startswith("no job grid measured deepseek_v3-e256") for v in rollout.values())
    fp16 = estimator.job_support(row, "fp16-overflow")
    assert not fp16["prompts"]["ok"] and "no job grid measured fp16-overflow on deepseek_v3-e256" in fp16["prompts"]["reason"]
    # a hybrid backbone (Mamba-2 mixers) borrows nothing from attention-only families
    hybrid = estimator.job_support(plan_row(load_model_config("nemotron-3-nano-30b-a3b")[1], 32, None), "rollout-mismatch")
    assert not any(v["ok"] for v in hybrid.values()) and all("its token mixer (mamba2) differs" in v["reason"] for v in hybrid.values())


def test_translate_knob_shrinks_a_dimension_that_moves_the_fault_by_a_validated_amount(tmp_path):
    """fp16 overflow on the default case's shape moves by about half a log2 unit per halving of the
    prompts (beyond the tolerance, so held at production), and its job term is validated on held-out
    originals: with --translate-knob the prompts shrink, the shift at the original's knob moves by the
    measured level, P is the proxy's at the translated knob (the production job's), and the output
    states the move. A job term whose held-out difference crosses 0 translates nothing."""
    from planner.catalog import load_model_config
    from planner.fidelity.dataset import plan_row

    est = FidelityEstimator.load(default_estimator_path())
    row = plan_row(load_model_config("qwen3-30b-a3b")[1], 32, None)
    levels = est.job_support(row, "fp16-overflow")["prompts"]["levels"]
    assert not est.job_support(row, "fp16-overflow")["prompts"]["ok"]  # it moves the label: held without translation
    moved = est.job_support(row, "fp16-overflow", translate=True)["prompts"]
    assert moved["ok"] and moved["translated"] and moved["min_share"] == min(lv["share"] for lv in levels) and "plan + job beats" in moved["reason"]
    production = est.predict(row, "fp16-overflow")
    quarter = {**row, **JobScale(4, 1, 1).columns()}
    held = est.predict(quarter, "fp16-overflow")  # not translated: the dimension is unsupported, nothing moves
    assert "job_translation" not in held and held["shift_log2"] == pytest.approx(production["shift_log2"])
    level = next(lv for lv in levels if lv["share"] == 0.25)
    got = est.predict(quarter, "fp16-overflow", translate=True)
    assert got["job_translation"]["log2"] == pytest.approx(level["delta_mean"]) and "run the proxy at X" in got["job_translation"]["text"]
    assert got["shift_log2"] == pytest.approx(production["shift_log2"] + level["delta_mean"])
    assert got["p_reproduced"] == pytest.approx(production["p_reproduced"])  # at the translated knob the proxy sees the production job's shift
    low, high = level["delta_interval"]
    widened = max(level["delta_mean"] - low, high - level["delta_mean"])
    assert got["shift_interval"][1] - got["shift_interval"][0] == pytest.approx(production["shift_interval"][1] - production["shift_interval"][0] + 2 * widened)
    est.recipes["fp16-overflow"]["job_holdout"]["qwen3_moe-e128"]["difference"] = [-0.2, -0.5, 0.1]  # not validated
    assert not est.job_support(row, "fp16-overflow", translate=True)["prompts"]["ok"]

    job = tmp_path / "fp16.yaml"
    job.write_text("precision: fp16\n")
    out = run_cli("suggest", "--budget", "8npu", "--fault", "grad-overflow", "--job", job, "--translate-knob", "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["job_search"]["dimensions"]["prompts"]["translated"] and "--translate-knob: prompts per step" in data["job_search"]["text"]
    assert any(j["divisors"]["prompts"] == 4 for j in data["job_search"]["jobs"])
    for plan in data["plans"]:
        shrunk = plan["job"]["divisors"]["prompts"] > 1 or plan["job"]["divisors"]["length"] > 1
        assert ("job_translation" in plan["fidelity"]) == shrunk
    plain = json.loads(run_cli("suggest", "--budget", "8npu", "--fault", "grad-overflow", "--job", job, "--json").stdout)
    assert all(j["divisors"]["prompts"] == 1 and j["divisors"]["length"] == 1 for j in plain["job_search"]["jobs"])
