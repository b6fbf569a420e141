"""The committed calibration dataset and estimator, and `calibrate add` + refit on top of them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.families import built_name, how_built, trained_name
from planner.fidelity.estimator import FULL_FEATURES, LOCAL_ORIGINALS, FidelityEstimator
from planner.fidelity.labels import OUTCOMES

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "calibration" / "fidelity_dataset.csv"


def assert_same_numbers(got, want, path="models"):
    """Nested JSON equal in structure and strings, floats equal to 1e-9 relative (1e-12 absolute)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for key in want:
            assert_same_numbers(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_numbers(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), path
    else:
        assert got == want, path


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_ridge_optima(recipes: dict, rows: list[dict]) -> None:
    """Each pooled shift model is what its documented fit makes of the dataset, checked here with numpy
    rather than by refitting: ridge regression of shift_log2 on the features standardised by their mean
    and population SD, the intercept the mean shift, over the recipe's labelled rows (finite, uncensored
    shift; finite features; the negative control `mis-sliced` left out), the penalty one of 0.1, 1, 10,
    100, 1000, and sign constraints where the mechanism fixes a sign (router-collapse: routing mass
    dropped <= 0; fp16-overflow: K/E >= 0). At such an optimum, with g = Z'(Zc - (y - mean y)), every
    free coefficient has g_j + alpha c_j = 0, so each implies the same alpha; a coefficient held at 0
    by its sign has g_j pushing across the bound."""
    signs = {"router-collapse": {"frequency_dropped_mean": -1}, "fp16-overflow": {"kept_fraction": +1}}
    for recipe, entry in recipes.items():
        for variant, names in (("full", entry["features"]), ("K/E only", ["kept_fraction"]), ("recipe mean", [])):
            model = entry["models"][variant]
            used = [r for r in rows if r["recipe"] == recipe and math.isfinite(r["shift_log2"]) and r["censored"] != 1
                    and r["method"] != "mis-sliced" and all(math.isfinite(r[n]) for n in names)]  # fmt: skip
            y = np.array([r["shift_log2"] for r in used])
            x = np.array([[r[n] for n in names] for r in used]) if names else np.ones((len(used), 1))
            scale = np.where(x.std(0) > 0, x.std(0), 1.0)
            where = f"{recipe} {variant}"
            assert len(model["residuals"]) == len(used), where  # one held-out residual per training row
            assert np.allclose(model["mean"], x.mean(0), rtol=1e-9) and np.allclose(model["scale"], scale, rtol=1e-9), where
            assert model["intercept"] == pytest.approx(float(y.mean()), rel=1e-9), where
            z, coef = (x - x.mean(0)) / scale, np.array(model["coef"])
            grad = z.T @ (z @ coef - (y - y.mean()))
            free = np.abs(coef) > 1e-12
            implied = -grad[free] / coef[free]
            if free.any():
                assert np.allclose(implied, implied[0], rtol=1e-5) and min(abs(implied[0] / a - 1) for a in (0.1, 1, 10, 100, 1000)) < 1e-5, \
                    (where, implied)  # fmt: skip
            for n, c, g in zip(names, coef, grad):
                sign = signs.get(recipe, {}).get(n, 0)
                assert c * sign >= 0, (where, n, c)
                if not abs(c) > 1e-12 and sign:
                    assert g * sign >= -1e-9, (where, n, g)  # held at 0: the free optimum lies across the bound
                elif not abs(c) > 1e-12 and names:
                    assert abs(g) < 1e-6, (where, n, g)


# ---- calibrate add, fit, report; the committed dataset --------------------------------------------

def _rounded(value, digits: int = 6):
    """A JSON-like value with its floats rounded (a refit on another machine's BLAS moves the last digits)."""
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v, digits) for v in value]
    if isinstance(value, float):
        return round(value, digits) if math.isfinite(value) else None  # NaN equals nothing, itself included
    return value


@pytest.mark.slow
def test_committed_dataset_meets_the_grid_spec_and_reports():
    from planner.fidelity.dataset import production_rows, read_dataset
    from planner.fidelity.validate import cross_validate, skill_gate, variants

    rows = read_dataset(DATASET)
    production = production_rows(rows)  # a job grid's rows at smaller jobs (the original's own among them) aside
    grid_rows = [r for r in production if r["source"] == "grid"]
    labelled = [r for r in grid_rows if math.isfinite(r["shift_log2"])]
    assert len(labelled) >= 400 and all(r["outcome"] in OUTCOMES for r in grid_rows)
    originals: dict[str, set] = {}
    for r in grid_rows:
        originals.setdefault(r["family"], set()).add(r["original"])
    assert len(originals) >= 3 and all(len(v) >= 3 for v in originals.values()), originals
    methods: dict[tuple, set] = {}
    for r in grid_rows:
        methods.setdefault((r["original"], r["experts"]), set()).add(r["method"].split("-")[0] if r["method"].startswith("random-") else r["method"])
    for key, kinds in methods.items():  # every K spans plan quality: clustered, ranked, random and deliberately bad plans
        assert {"agglomerative", "saliency", "random", "least-used", "one-cluster"} <= kinds, (key, kinds)
    meta = json.loads(DATASET.with_suffix(".json").read_text())
    assert meta["rows"] == len(rows) and meta["versions"]["torch"] and meta["command"].startswith("planner calibrate run")
    noise = {(n["original"], n["recipe"]) for n in meta["noise_floor"]}
    assert {(r["original"], r["recipe"]) for r in labelled} <= noise and min(len(n["values"]) for n in meta["noise_floor"]) >= 4

    report = cross_validate(rows, schemes=("original",))
    estimator = FidelityEstimator.load(ROOT / "calibration" / "fidelity.json")
    assert estimator.info["rows"] == len(production)
    for recipe, entry in estimator.recipes.items():
        assert set(report["recipes"][recipe]["original"]["variants"]) == set(variants(recipe)) >= {"full", "K/E only", "recipe mean"}
        assert _rounded(report["recipes"][recipe]["job_holdout"]) == _rounded(entry["job_holdout"])  # the report's job scores are the fit's
        assert entry["gate"]["skill"] == skill_gate(report, recipe)["skill"]
    committed = json.loads((ROOT / "calibration" / "fidelity.json").read_text())["recipes"]
    # the committed numbers are the optima of the documented fit on the committed data (checked by numpy,
    # not by the code that made them)
    assert_ridge_optima(committed, production)
    refit = json.loads(json.dumps(FidelityEstimator.fit(rows, report=report).to_json()))  # the gates from the report above
    # and regenerable: the same fit on another machine may differ in the last digits (BLAS summation
    # order), so every fitted number must agree to 1e-9 relative, far below any printed figure
    assert_same_numbers(refit["recipes"], committed, "recipes")
    for recipe, entry in estimator.recipes.items():
        for family, gate in entry["gates"].items():
            row = next(r for r in labelled if r["recipe"] == recipe and r["family"] == family and not estimator.outside(r, recipe))
            row = {**row, "proxy_build": how_built(family)[1]}  # a plan built as the family's proxies were
            assert estimator.predict({**row, "routing_shape": "sigmoid/top8of512/renorm"}, recipe)["status"] == "uncalibrated"
            if estimator.family(row, recipe) != family:  # its shape rests on its twin trained with the published balancing
                twin = estimator.family(row, recipe)
                unbuilt, build = how_built(family)
                assert twin == built_name(trained_name(unbuilt, "published"), build) and entry["families"][twin]["originals"] >= LOCAL_ORIGINALS
                continue
            # a calibrated model and plan: the plan-level P where its family's gate found skill, else K/E's where
            # that is validated on the family, else none
            f = estimator.predict(row, recipe)
            ke = entry["ke_gates"][family]
            assert f["status"] == ("calibrated" if gate["skill"] or ke["ok"] else "no-skill") and f["family"]["name"] == family
            assert f.get("basis") == ("plan statistics" if gate["skill"] else ke["variant"] if ke["ok"] else None)
            assert (f["p_reproduced"] is None) == (f["status"] != "calibrated")
            if not gate["skill"] and entry["every_plan_reproduced"].get(family):
                assert f"every legal plan reproduces this fault on the calibration data of {family}" in f["reason"]
    # where the originals start is the committed starts file's, as the fit summarises it
    from planner.fidelity.starts import load_starts, summarise

    assert estimator.info["starts"] == summarise(load_starts())


def test_a_router_collapse_answer_says_how_its_originals_were_trained():
    """DeepSeek-V3's router-collapse P rests on the family whose originals were trained with the
    shape's published load balancing, once it has 3 originals: the answer names it, says where its
    originals start, and where an original trained without balancing starts."""
    result = CliRunner().invoke(main, ["suggest", "--model", "deepseek-v3", "--hardware", "atlas-a3", "--budget", "64npu",
                                       "--fault", "router-collapse"])  # fmt: skip
    assert result.exit_code in (0, 1), result.output
    text = " ".join(result.output.split())
    assert "rests on family deepseek_v3-e256-bal " in text
    assert "its originals were trained with the shape's published load balancing and start" in text
    assert "trained without load balancing an original starts at" in text
    assert "transfer on originals trained with the shape's published load balancing measured at" in text


@pytest.mark.parametrize("model, family, measured", [("glm-4.5-air", "glm4_moe-e128-bal", True),
                                                     ("nemotron-3-nano-30b-a3b", "nemotron_h-e128-bal", False)])
def test_a_balanced_family_carries_its_shape_and_its_balanced_transfer(model, family, measured):
    """GLM-4.5-Air's and Nemotron-3-Nano's balanced families have their 5 originals, so their
    router-collapse P rests on them. GLM-4.5-Air's shape has transfer points of its own on balanced
    originals at three widths and two depths, so its interval widens by that trend; Nemotron-3-Nano's
    has none, so its interval takes the widening of the nearest measured shape trained the same way
    (DeepSeek-V3's balanced), and says it is assumed."""
    from planner.catalog import load_model_config
    from planner.fidelity.dataset import plan_row
    from planner.fidelity.estimator import FidelityEstimator, default_estimator_path, family_text

    estimator = FidelityEstimator.load(default_estimator_path())
    f = estimator.predict(plan_row(load_model_config(model)[1], 64, None), "router-collapse")
    assert f["status"] == "calibrated" and f["family"]["name"] == family and f["family"]["originals"] == 5
    text = " ".join(family_text(f["family"]).split())
    published = "on originals trained with the shape's published load balancing"
    if measured:
        assert f"transfer {published} measured at hidden 64, 128, 256 and 3, 6 layers" in text
        assert "beyond the measured hidden 256 / 6 layers" in text and "assumed" not in text
    else:
        assert f"transfer not measured beyond hidden 64 {published}" in text
        assert "as the transfer of the nearest measured shape (sigmoid/top8of256/renorm/groups8keep4/corrbias/shared/dense/x2.5)" in text
        assert "(assumed, not measured, for this shape)" in text
    low, high = f["interval"]
    assert 0.0 <= low <= f["p_reproduced"] <= high <= 1.0


@pytest.mark.slow
def test_calibrate_add_updates_the_dataset_and_a_refit_changes_predictions(rl_model, tmp_path):
    from planner.checkpoint import Checkpoint
    from planner.fidelity.dataset import read_dataset, write_dataset
    from planner.stats.compute import compute_stats, plan_from_stats

    model = rl_model[0]
    ckpt = Checkpoint(model)
    stats = compute_stats(ckpt, experts=[8], methods=("agglomerative",), calib_tokens=512, seq_len=64)
    plan = plan_from_stats(stats, 8, "agglomerative", model=str(model))
    assert plan.statistics and "frequency_dropped" in plan.statistics
    (tmp_path / "plan.yaml").write_text(plan.to_yaml())
    assert run_cli("build", model, tmp_path / "proxy", "--plan", tmp_path / "plan.yaml").exit_code == 0
    for name, target in (("a", model), ("b", tmp_path / "proxy")):
        out = tmp_path / name
        assert run_cli("rl", "run", target, "--recipe", "rollout-mismatch", "--knob", "21", "--steps", "2",
                       "--set", "prompts=4", "--set", "new_tokens=8", "-o", out).exit_code == 0  # fmt: skip
        assert run_cli("rl", "margin", target, "--recipe", "rollout-mismatch", "--seeds", "0,1", "--iters", "3", "-o", out).exit_code == 0

    # the three small families' rows (the added pair is of one of them): each fit cross-validates, and
    # the whole committed dataset would cost this test a minute more for the same assertions
    dataset = tmp_path / "dataset.csv"
    small = [r for r in read_dataset(DATASET) if r["family"] in ("qwen3_moe", "mixtral", "deepseek_v3")]
    write_dataset(small, dataset, json.loads(DATASET.with_suffix(".json").read_text()))
    n = len(read_dataset(dataset))
    assert run_cli("calibrate", "fit", "--dataset", dataset, "-o", tmp_path / "before.json").exit_code == 0
    added = run_cli("calibrate", "add", "--original", tmp_path / "a", "--proxy", tmp_path / "b", "--plan", tmp_path / "plan.yaml",
                    "--dataset", dataset, "--json")  # fmt: skip
    assert added.exit_code == 0, added.output
    row = json.loads(added.stdout)
    assert row["recipe"] == "rollout-mismatch" and row["experts"] == 8 and row["original_experts"] == 32
    # the labels by hand from the two margin files (the knob, mantissa bits removed, is in log2 units already):
    # the shift is the proxy's mean critical knob minus the original's; the noise floor the original's seed SD,
    # raised to the bisection's resolution where the seeds agree more closely than it resolves
    margins = {side: json.loads((tmp_path / side / "margin.json").read_text()) for side in ("a", "b")}
    o, p = (np.array(margins[side]["values"], dtype=float) for side in ("a", "b"))
    assert (row["critical_original"], row["critical_proxy"]) == (margins["a"]["mean"], margins["b"]["mean"])
    assert row["shift_log2"] == pytest.approx(p.mean() - o.mean(), abs=1e-12)
    resolution = max(margins["a"]["resolution"], margins["b"]["resolution"])
    assert row["resolution_log2"] == resolution and row["noise_log2"] == pytest.approx(max(float(np.std(o, ddof=1)), resolution))
    censored = any(margins["a"]["censored"] + margins["b"]["censored"])
    assert row["censored"] == int(censored)
    # the decision is an equivalence test against a factor of two (+-1 log2) on the interval around the shift:
    # inside it "reproduced", beyond it "not reproduced", else "undetermined"; a censored side decides nothing
    # but a "not reproduced" its bound settles
    low, high = row["shift_low"], row["shift_high"]
    assert low < row["shift_log2"] < high and high - row["shift_log2"] == pytest.approx(row["shift_log2"] - low)
    decided = "reproduced" if -1 < low and high < 1 else "not reproduced" if low > 1 or high < -1 else "undetermined"
    if any(margins["a"]["censored"]) or (censored and decided != "not reproduced"):
        decided = "undetermined"
    assert row["outcome"] == decided, row
    rows = read_dataset(dataset)
    assert len(rows) == n + 1 and rows[-1]["source"].startswith("add:")
    assert all(math.isfinite(rows[-1][f]) for f in FULL_FEATURES)  # the plan's statistics are the features
    assert json.loads(dataset.with_suffix(".json").read_text())["added"][-1]["plan"] == str(tmp_path / "plan.yaml")
    kept = (tmp_path / "before.json").read_text()
    refused = run_cli("calibrate", "fit", "--dataset", dataset, "-o", tmp_path / "before.json")
    assert refused.exit_code == 2 and "--force" in refused.output and (tmp_path / "before.json").read_text() == kept
    assert run_cli("calibrate", "fit", "--dataset", dataset, "-o", tmp_path / "after.json").exit_code == 0
    before, after = (FidelityEstimator.load(tmp_path / p) for p in ("before.json", "after.json"))
    assert after.info["rows"] == before.info["rows"] + 1  # the refit read the added row
    # whether one measured row moves the fit depends on the run (a censored bisection is left out of
    # it), so that the refit learns from the rows it reads is shown on planted data: the added row
    # with a shift 4 log2 units above the fit's prediction, uncensored, pulls the refit's prediction
    # for that plan up
    names = before.features("rollout-mismatch")
    x = np.array([[rows[-1][n] for n in names]])
    predicted = float(after.recipes["rollout-mismatch"]["models"]["full"].predict(x)[0])
    planted = rows[:-1] + [dict(rows[-1], shift_log2=predicted + 4.0, censored=0.0)]
    write_dataset(planted, tmp_path / "planted.csv", json.loads(dataset.with_suffix(".json").read_text()))
    refit = run_cli("calibrate", "fit", "--dataset", tmp_path / "planted.csv", "-o", tmp_path / "planted-fit.json")
    assert refit.exit_code == 0, refit.output
    moved = FidelityEstimator.load(tmp_path / "planted-fit.json").recipes["rollout-mismatch"]["models"]["full"]
    assert float(moved.predict(x)[0]) > predicted + 1e-3
    report = run_cli("calibrate", "report", "--dataset", dataset)
    assert report.exit_code == 0 and "leave one original out" in report.output and "K/E only" in report.output

    bad = run_cli("calibrate", "add", "--original", tmp_path / "a", "--proxy", tmp_path / "b", "--plan", tmp_path / "plan.yaml",
                  "--recipe", "entropy-collapse", "--dataset", dataset)  # fmt: skip
    assert bad.exit_code == 2 and "--recipe entropy-collapse, but the runs' records name ['rollout-mismatch']" in bad.output
    assert len(read_dataset(dataset)) == n + 1  # nothing half-written
    # another CSV, or another JSON beside it, is not a dataset to add to: refused, left as it was
    people = tmp_path / "people.csv"
    people.write_text("name,score\nx,1\n")
    other = run_cli("calibrate", "add", "--original", tmp_path / "a", "--proxy", tmp_path / "b", "--plan", tmp_path / "plan.yaml",
                    "--dataset", people)  # fmt: skip
    assert other.exit_code == 2 and "not a calibration dataset" in other.output and people.read_text() == "name,score\nx,1\n"
    fresh = tmp_path / "fresh.csv"
    fresh.with_suffix(".json").write_text('{"name": "my notes"}')
    other = run_cli("calibrate", "add", "--original", tmp_path / "a", "--proxy", tmp_path / "b", "--plan", tmp_path / "plan.yaml",
                    "--dataset", fresh)  # fmt: skip
    assert other.exit_code == 2 and "not the dataset's provenance file" in other.output and not fresh.exists()
    assert fresh.with_suffix(".json").read_text() == '{"name": "my notes"}'
    cut = tmp_path / "cut.csv"
    cut.write_text(dataset.read_text()[:3000])
    report = run_cli("calibrate", "report", "--dataset", cut)
    assert report.exit_code == 2 and "fields where the header has" in report.output


@pytest.mark.slow
def test_a_dead_expert_plan_is_predicted_worse_and_never_suggested(rl_model, tmp_path):
    """The K least-used experts (the dead ones) against a clustered plan of the same K, on a small
    model the grid never saw: the router-collapse shift model puts the dead-expert plan below the
    clustered plan (it collapses earlier; the sign is fixed by the mechanism), and suggest never
    proposes it: the method is not in its space, and the routing mass it drops breaks the hard rule."""
    from planner.fidelity.dataset import plan_row
    from planner.fidelity.estimator import default_estimator_path
    from planner.search.suggest import Request, Suggester
    from planner.stats.store import load_stats, plan_statistics

    model = rl_model[0]
    stats_path = tmp_path / "stats.json"
    made = run_cli("stats", model, "--experts", "8,16", "--methods", "agglomerative,least-used", "--calib-tokens", "512", "--seq-len", "64",
                   "-o", stats_path)  # fmt: skip
    assert made.exit_code == 0, made.output
    stats = load_stats(stats_path)
    config = json.loads((model / "config.json").read_text())
    summaries = {m: plan_statistics(stats, f"K=8/{m}") for m in ("least-used", "agglomerative")}
    dropped = {m: summaries[m]["frequency_dropped"]["mean"] for m in summaries}
    # the 8 least-used of 32 experts carry at most 8/32 of the routing mass: more than a random plan drops
    assert dropped["least-used"] > 1 - 8 / 32 and dropped["agglomerative"] < dropped["least-used"]

    estimator = FidelityEstimator.load(default_estimator_path())
    rows = {m: plan_row(config, 8, s) for m, s in summaries.items()}
    model_of = estimator.recipes["router-collapse"]["models"]["full"]
    x = {m: np.array([[r[n] for n in estimator.features("router-collapse")]]) for m, r in rows.items()}
    assert model_of.predict(x["least-used"])[0] < model_of.predict(x["agglomerative"])[0]

    suggester = Suggester(Request(model=str(model), budget="1npu", fault="router-collapse", stats=stats, min_k_ratio=1.0, min_fidelity=0.0))
    assert "least-used" not in suggester.methods  # a deliberately bad plan is never in the space
    # the hard rule, whatever mass this CPU's trained weights leave the clustered plan: rejected exactly
    # when it drops more than a random plan of its K would
    assert bool(suggester.fidelity(8, "agglomerative").get("rejected")) == (dropped["agglomerative"] > 1 - 8 / 32)
    assert "keeps rarely used experts" in suggester.fidelity(8, "least-used")["rejected"]
    # the CLI on a stats file whose clustered plans sit below the random-plan line (planted: how much mass
    # this CPU's trained weights leave them is borderline), so a proxy qualifies on any machine
    doc = json.loads(stats_path.read_text())
    for k in (8, 16):
        doc["plans"][f"K={k}/agglomerative"]["summary"]["frequency_dropped"]["mean"] = 0.5 * (1 - k / 32)
    planted = tmp_path / "planted.json"
    planted.write_text(json.dumps(doc))
    result = run_cli("suggest", "--model", model, "--budget", "1npu", "--stats", planted, "--fault", "router-collapse", "--min-k-ratio", "1",
                     "--min-fidelity", "0", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["plans"] and all(p["method"] == "agglomerative" and p["experts"] > 4 for p in data["plans"] + data["pareto"] if p["experts"] < 32)
