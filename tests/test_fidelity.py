"""The fidelity estimator (scikit-learn conventions, JSON), its labels, the calibration grid as
Optuna trials shared by worker processes, `calibrate add` + refit, and the committed dataset."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from click.testing import CliRunner
from sklearn.utils.estimator_checks import parametrize_with_checks

from planner.cli import main
from planner.errors import SpecError
from planner.fidelity.estimator import FULL_FEATURES, SHIFT_FEATURES, FidelityEstimator, ShiftModel
from planner.fidelity.learners import ShiftRegressor

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "calibration" / "fidelity_dataset.csv"


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# ---- the estimator --------------------------------------------------------------------------------

@parametrize_with_checks([ShiftRegressor()])
def test_sklearn_conventions(estimator, check):
    check(estimator)


def test_regressor_signs_intervals_and_json():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3))
    y = x @ [1.0, -2.0, 0.5] + rng.normal(scale=0.5, size=400)
    model = ShiftRegressor(coverage=0.8).fit(x[:300], y[:300])
    low, high = model.predict_interval(x[300:])
    assert 0.7 <= np.mean((y[300:] >= low) & (y[300:] <= high)) <= 0.9
    again = ShiftModel.from_json(json.loads(json.dumps(model.model_.to_json())))  # what the estimator file holds
    assert np.array_equal(again.predict(x), model.predict(x))
    assert np.array_equal(again.predict_interval(x)[0], model.predict_interval(x)[0])
    # a sign the mechanism fixes holds even where the data pull the other way: the coefficient stops at 0
    bound = ShiftRegressor(signs=[0, 1, 0]).fit(x[:300], y[:300])
    assert bound.coef_[1] == 0.0 and bound.coef_[0] > 0.5


def test_an_offset_per_original_is_a_variance_component_that_widens_the_interval():
    """Five originals, each with its own offset (SD 1) on a shared K/E effect: the random intercept
    recovers the between-original SD, and the interval is at least its normal interval."""
    rng = np.random.default_rng(3)
    offsets = rng.normal(scale=1.0, size=5)
    x = rng.uniform(0.1, 0.5, size=(200, 1))
    groups = np.repeat([f"o{i}" for i in range(5)], 40)
    y = -2 * x[:, 0] + offsets[np.repeat(np.arange(5), 40)] + rng.normal(scale=0.1, size=200)
    model = ShiftRegressor().fit(x, y, groups=groups)
    assert 0.4 < model.original_sd_ < 2.0 and 0.05 < model.within_sd_ < 0.2
    assert model.halfwidth_ >= 1.2815 * np.hypot(model.original_sd_, model.within_sd_) - 1e-9
    same = ShiftRegressor().fit(x, -2 * x[:, 0] + rng.normal(scale=0.1, size=200), groups=groups)  # no offsets
    assert same.original_sd_ < 0.05 and same.halfwidth_ < model.halfwidth_


def test_p_reproduced_follows_the_predictive_distribution():
    residuals = np.linspace(-0.5, 0.5, 101)
    model = ShiftModel(np.zeros(1), np.ones(1), np.array([1.0]), 0.0, 0.5, residuals, np.repeat(["a", "b"], [50, 51]))
    p, low, high = model.p_within(np.array([[0.0], [0.8], [3.0]]), tolerance=1.0)
    assert p[0] == 1.0 and p[2] == 0.0  # all of the distribution inside, then all outside the tolerance
    # |0.8 + r| < 1 for r = -0.5 + 0.01 i < 0.2, i = 0..69: 70 of the 101 residuals
    assert p[1] == pytest.approx(70 / 101, abs=1e-12)
    # the interval spans the shares of each original's residuals alone: "a" (i = 0..49) all 50 inside, "b"
    # (i = 50..100) 20 of 51; the 10th to 90th percentile lies between them and holds P
    assert 20 / 51 <= low[1] < p[1] < high[1] <= 1.0


def test_p_over_a_scale_move_finds_the_peak_inside_a_wide_range():
    """A label that may move by up to w at the target's scale: P's interval spans every value P takes
    over the move, and a predicted shift far from zero is reproduced somewhere inside a wide move."""
    rng = np.random.default_rng(3)
    residuals = rng.normal(scale=0.4, size=300)
    model = ShiftModel(np.zeros(1), np.ones(1), np.array([1.0]), 0.0, 0.5, residuals, np.repeat(["a", "b", "c"], 100))
    x = np.array([[-2.85], [0.3]])
    lowest, highest = model.p_range(x, 1.0, -32.0, 32.0)
    # at an offset cancelling the shift nearly all residuals fall inside the tolerance; at the ends none
    assert lowest.tolist() == [0.0, 0.0] and (highest > 0.95).all()
    assert model.p_within(x[:1], 1.0, offset=2.85)[2][0] <= highest[0]
    # exact against a grid fine enough to see every change, and never beyond what p_within can give
    grid = np.linspace(-5.0, 3.0, 8001)
    shares = [model.p_within(x, 1.0, offset=o) for o in grid]
    lo, hi = model.p_range(x, 1.0, -5.0, 3.0)
    assert np.allclose(lo, np.min([s[1] for s in shares], axis=0)) and np.allclose(hi, np.max([s[2] for s in shares], axis=0))
    # a range that is one point gives p_within's own interval
    p, low, high = model.p_within(x, 1.0, offset=0.7)
    assert np.array_equal(model.p_range(x, 1.0, 0.7, 0.7)[0], low) and np.array_equal(model.p_range(x, 1.0, 0.7, 0.7)[1], high)


def test_estimator_file_is_json_and_rejects_other_files(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"schema": "planner.stats/1"}))
    with pytest.raises(SpecError, match="not a fidelity estimator"):
        FidelityEstimator.load(path)
    with pytest.raises(SpecError, match="calibrate fit"):
        FidelityEstimator.load(tmp_path / "missing.json")


def _synthetic(signal: str, seed: int = 0) -> list[dict]:
    """Rows of 4 originals x 3 K x 10 plans for one recipe; the shift follows the routing mass
    dropped within each K ("plan"), or K/E alone ("k"), plus measurement noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for o in range(4):
        for kf in (0.25, 0.375, 0.5):
            for plan in range(10):
                dropped = (1 - kf) * rng.uniform(0.3, 1.3)
                row = {f: float(rng.normal()) for f in FULL_FEATURES}
                row.update(sigmoid_router=0.0, grouped=0.0, norm_topk=1.0, log2_experts=5.0, top_k_over_k=4 / (32 * kf))  # one routing type
                row.update(kept_fraction=kf, frequency_dropped_mean=dropped, family="f", routing_shape="softmax/top4of32/renorm",
                           original=f"f-s{o}", recipe="router-collapse",
                           model=f"K{kf}-{plan}", method="m", experts=int(32 * kf), top_k=4, original_experts=32, censored=0)  # fmt: skip
                truth = -6.0 * (dropped - (1 - kf)) if signal == "plan" else -2.0 * (1 - kf)
                row["shift_log2"] = truth + rng.normal(scale=0.2)
                row["shift_se"] = row["noise_log2"] = 0.2
                row["reproduced"] = float(abs(truth) < 0.7) if abs(abs(truth) - 1.0) > 0.3 else float("nan")
                rows.append(row)
    return rows


def test_skill_gate_switches_p_on_and_off(tmp_path):
    from planner.fidelity.validate import cross_validate, render_report

    skilled = FidelityEstimator.fit(_synthetic("plan"))
    gate = skilled.recipes["router-collapse"]["gate"]
    assert gate["skill"] and gate["mae"] < gate["mae_ke"], gate
    good, dead = ({**_synthetic("plan")[0], "frequency_dropped_mean": d, "experts": 8} for d in (0.75, 0.95))
    good["kept_fraction"] = dead["kept_fraction"] = 0.25
    g, d = (skilled.predict(r, "router-collapse") for r in (good, dead))
    assert g["status"] == d["status"] == "calibrated" and g["p_reproduced"] > d["p_reproduced"]
    assert d["shift_log2"] < g["shift_log2"]  # the plan that drops more routing mass collapses earlier
    assert g["interval"][0] <= g["p_reproduced"] <= g["interval"][1]
    again = FidelityEstimator.from_json(json.loads(json.dumps(skilled.to_json())))
    assert again.predict(good, "router-collapse") == g
    # the file holds 12 significant digits (a refit elsewhere changes only what moved): the same predictions
    skilled.save(tmp_path / "fidelity.json")
    def floats(obj):
        if isinstance(obj, float):
            yield obj
        elif isinstance(obj, (dict, list)):
            for v in obj.values() if isinstance(obj, dict) else obj:
                yield from floats(v)

    written = list(floats(json.loads((tmp_path / "fidelity.json").read_text())))
    assert written and all(float(f"{v:.12g}") == v for v in written if math.isfinite(v))
    saved = FidelityEstimator.load(tmp_path / "fidelity.json").predict(good, "router-collapse")
    assert saved["status"] == g["status"] and saved["p_reproduced"] == pytest.approx(g["p_reproduced"], abs=1e-9)
    assert saved["shift_log2"] == pytest.approx(g["shift_log2"], rel=1e-9)

    # shifts that follow K/E alone: no plan-level skill, and the P that stands is K/E's own, validated on
    # the family's held-out originals (it ranks no plan within a K)
    k_only = FidelityEstimator.fit(_synthetic("k"))
    f = k_only.predict(good, "router-collapse")
    assert not k_only.recipes["router-collapse"]["gates"]["f"]["skill"] and k_only.recipes["router-collapse"]["ke_gates"]["f"]["ok"]
    assert f["status"] == "calibrated" and f["basis"] == "K/E + routing" and "no plan-level skill" in f["reason"]
    assert f["p_reproduced"] == k_only.predict({**good, "frequency_dropped_mean": 0.95}, "router-collapse")["p_reproduced"]
    report = cross_validate(_synthetic("k"))
    assert "no plan-level skill" in render_report(report) and set(report["recipes"]["router-collapse"]) >= {"original", "family"}

    # two originals: a model fitted on one cannot be validated on the other, so neither P stands: no
    # skill, and the measured shift at the nearest K instead
    two = FidelityEstimator.fit([r for r in _synthetic("k") if r["original"] in ("f-s0", "f-s1")])
    f = two.predict(good, "router-collapse")
    assert not two.recipes["router-collapse"]["ke_gates"]["f"]["ok"] and "too few originals" in f["reason"]
    assert f["status"] == "no-skill" and f["p_reproduced"] is None and f["shift_log2"] is None
    assert f["measured_by_k"]["kept_fraction"] == 0.25 and f["measured_by_k"]["family"] == "f"


def test_a_measured_scale_trend_moves_the_prediction_of_its_plan_rule_only():
    """Transfer points whose width slope clears zero and predicts held-out points: a plan at the
    measured K/E is predicted along the trend at a wider target (the point moves, P is read there);
    a plan at another K/E keeps the calibration scale's label with the symmetric widening."""
    rng = np.random.default_rng(1)
    points = [{"recipe": "router-collapse", "shape": "softmax/top4of32/renorm", "hidden": h, "layers": n, "original": f"h{h}-l{n}-s{s}",
               "shift_log2": 0.6 * math.log2(h / 64) + float(rng.normal(scale=0.1)), "shift_se": 0.1, "kept_fraction": 0.25}
              for h in (64, 128, 256) for n in (3, 6) for s in range(2)]  # fmt: skip
    rows = _synthetic("plan")
    moved, still = FidelityEstimator.fit(rows, transfer_points=points), FidelityEstimator.fit(rows, transfer_points=[])
    for kept, follows in ((0.25, True), (0.5, False)):
        row = {**rows[0], "kept_fraction": kept, "experts": int(32 * kept), "hidden_size": 1024, "num_layers": 6}
        scale = moved.scale(row, "router-collapse")
        a, b = moved.predict(row, "router-collapse"), still.predict(row, "router-collapse")
        assert a["status"] == b["status"] == "calibrated"
        if follows:  # to the measured edge, hidden 256: +0.6 x 2
            assert scale["shift"] == pytest.approx(1.2, abs=0.15) and "follows the fitted trend" in a["family"]["scale"]
            assert a["shift_log2"] == pytest.approx(b["shift_log2"] + scale["shift"])
        else:
            assert scale["shift"] == 0.0 and "not 0.5" in a["family"]["scale"] and a["shift_log2"] == pytest.approx(b["shift_log2"])
        low, high = a["shift_interval"]
        assert low <= a["shift_log2"] - scale["halfwidth"] + 1e-9 and high >= a["shift_log2"] + scale["halfwidth"] - 1e-9


def test_a_shape_with_originals_trained_with_their_published_balancing_is_read_on_those():
    """A real model trained with its shape's load balancing: where the shape has a calibration family
    of originals trained so (names ending in -bal), with LOCAL_ORIGINALS or more, its rows, gates,
    start and scale trend speak; with fewer, the family trained without does."""
    plain = _synthetic("plan")
    balanced = [{**r, "family": "f-bal", "original": r["original"] + "-bal", "shift_log2": r["shift_log2"] - 0.6,
                 "reproduced": float(abs(r["shift_log2"] - 0.6) < 1.0)} for r in _synthetic("plan", seed=1)]  # fmt: skip
    points = [{"recipe": "router-collapse", "shape": "softmax/top4of32/renorm", "hidden": h, "layers": n, "original": f"h{h}-l{n}-s{s}-bal",
               "shift_log2": -1.0 + 0.01 * s, "shift_se": 0.1, "kept_fraction": 0.25, "balancing": "published"}
              for h in (64, 128, 256) for n in (3, 6) for s in range(2)]  # fmt: skip
    est = FidelityEstimator.fit(plain + balanced, transfer_points=points)
    row = {**plain[0], "hidden_size": 1024, "num_layers": 6}
    assert est.family(row, "router-collapse") == "f-bal" and est.recipes["router-collapse"]["shapes"]["softmax/top4of32/renorm"] == ["f", "f-bal"]
    got = est.predict(row, "router-collapse")
    assert got["family"]["name"] == "f-bal" and got["family"]["balancing"] == "published" and got["family"]["originals"] == 4
    assert got["family"]["scale"].startswith("transfer on originals trained with the shape's published load balancing measured at hidden 64")
    alone = FidelityEstimator.fit(plain, transfer_points=[])
    assert got["status"] == "calibrated" and got["shift_log2"] < alone.predict(row, "router-collapse")["shift_log2"] - 0.3  # its own level
    few = FidelityEstimator.fit(plain + [r for r in balanced if r["original"] in ("f-s0-bal", "f-s1-bal")], transfer_points=points)
    kept = few.predict(row, "router-collapse")
    assert few.family(row, "router-collapse") == "f" and kept["family"]["balancing"] == "none"
    assert "transfer not measured beyond hidden 64" in kept["family"]["scale"]  # the unbalanced originals' trend: none measured
    # leaving a family out leaves its twin out with it: one shape's originals, whichever way trained
    from planner.fidelity.transfer import fit_transfer
    from planner.fidelity.validate import cross_validate, render_report

    assert cross_validate(plain + balanced, schemes=("family",))["recipes"]["router-collapse"]["family"] == {"groups": 1}
    # and the report gives each family the scale trend of originals trained as its own were
    report = cross_validate(plain + balanced, schemes=("original",)) | {"transfer": fit_transfer(points)}
    text = render_report(report)
    assert "scale transfer, f: not measured" in text and re.search(r"scale transfer, f-bal: [+-]\d\.\d+ \[", text)


def test_statuses_not_applicable_and_uncalibrated():
    est = FidelityEstimator.fit(_synthetic("plan"))
    row = _synthetic("plan")[0]
    assert est.predict({**row, "experts": 4, "top_k": 4}, "router-collapse")["status"] == "not-applicable"
    # the routing shape decides which family's gate speaks; a shape never calibrated gets no number
    far = est.predict({**row, "original_experts": 128, "routing_shape": "softmax/top8of128/renorm"}, "router-collapse")
    assert far["status"] == "uncalibrated" and far["p_reproduced"] is None
    assert "routing shape softmax/top8of128/renorm was never calibrated" in far["reason"] and "softmax/top4of32/renorm (f)" in far["reason"]
    assert est.predict({k: v for k, v in row.items() if k != "routing_shape"}, "router-collapse")["status"] == "uncalibrated"
    assert est.predict(row, "entropy-collapse")["status"] == "uncalibrated"  # a recipe never calibrated
    outside = est.predict({**row, "frequency_dropped_mean": 5.0}, "router-collapse")
    assert outside["status"] == "uncalibrated" and "frequency_dropped_mean" in outside["reason"]
    sigmoid = est.predict({**row, "sigmoid_router": 1.0}, "router-collapse")
    assert sigmoid["status"] == "uncalibrated" and "sigmoid_router 1 (calibrated 0 to 0)" in sigmoid["reason"]
    calibrated = est.predict(row, "router-collapse")
    assert calibrated["status"] == "calibrated" and calibrated["family"]["name"] == "f" and calibrated["family"]["originals"] == 4
    assert "transfer not measured beyond hidden" in calibrated["family"]["scale"]
    no_stats = est.predict({k: row[k] for k in ("kept_fraction", "experts", "top_k", "original_experts", "routing_shape",
                                                "sigmoid_router", "grouped", "top_k_over_k")}, "router-collapse")  # fmt: skip
    # shifts that follow the plan's routing mass: K/E alone separates nothing (its AUC is below the floor), so
    # without the plan's statistics there is no P
    assert not est.recipes["router-collapse"]["ke_gates"]["f"]["ok"]
    assert no_stats["status"] == "no-skill" and "--stats" in no_stats["reason"] and "not validated" in no_stats["reason"]


# ---- labels ---------------------------------------------------------------------------------------

def test_labels():
    from planner.fidelity.labels import applicable, curve_agreement, curve_deviation, knob_shift, spearman

    same = knob_shift("fp16-overflow", [19.0, 19.2, 18.9, 19.1], [19.05, 19.1, 18.95, 19.2])
    assert same.outcome == "reproduced" and abs(same.shift) < 0.1
    assert math.isclose(same.noise, np.std([19.0, 19.2, 18.9, 19.1], ddof=1))  # the original's seed SD: the noise floor
    early = knob_shift("router-collapse", [-1.0, -1.1, -0.9, -1.05], [-2.0, -2.1, -1.95, -2.05])
    assert early.outcome == "not reproduced" and math.isclose(early.shift, -1.0125 * math.log2(10))  # log10 knobs in log2 units
    assert early.shift_sd < -10  # far beyond the original's own seed spread
    noisy = knob_shift("fp16-overflow", [18.0, 20.0, 19.0, 21.0], [19.0, 21.0, 20.5, 22.0])
    assert noisy.outcome == "undetermined"  # too noisy to say either way
    floor = knob_shift("fp16-overflow", [19.0] * 4, [19.0] * 4, resolution=0.05)
    assert floor.noise == 0.05 and floor.outcome == "reproduced"  # a spread below the resolution is the resolution
    bound = knob_shift("fp16-overflow", [19.0, 19.1, 19.0, 19.1], [40.0] * 4, proxy_censored=[True] * 4)
    assert bound.outcome == "not reproduced"  # never faults in the bracket: the bound settles it
    assert knob_shift("fp16-overflow", [40.0] * 4, [19.0] * 4, original_censored=[True] * 4).outcome == "undetermined"
    assert not applicable("router-collapse", 4, 4) and applicable("router-collapse", 8, 4) and applicable("fp16-overflow", 4, 4)
    rng = np.random.default_rng(0)
    keys = ("grad_norm", "entropy", "kl_ref", "reward_mean", "load_cv_max")
    run = [{k: float(v) for k, v in zip(keys, rng.uniform(0.1, 1, 5))} for _ in range(12)]
    replicas = [[{k: v + rng.normal(scale=0.05) for k, v in r.items()} for r in run] for _ in range(2)]
    far = [{k: v + rng.normal(scale=0.5) for k, v in r.items()} for r in run]
    assert curve_deviation(run, run, run) == 0.0 and curve_agreement(run, run, replicas) == 0.0
    assert curve_agreement(far, run, replicas) > 3 * curve_agreement(replicas[0], run, replicas)  # further from it than its noise
    flat = [{"grad_norm": 1.0} for _ in range(6)]
    assert math.isnan(spearman(flat, flat))  # a constant curve ranks nothing
    ties = [{"grad_norm": v} for v in (1, 1, 2, 2, 3, 3)]
    assert math.isclose(spearman(ties, [{"grad_norm": v} for v in (1, 2, 3, 4, 5, 6)]), 0.9562, abs_tol=1e-4)  # ranks 1.5,1.5,3.5,3.5,5.5,5.5 vs 1..6


def test_pair_row_labels_censoring_and_not_applicable():
    from planner.fidelity.dataset import pair_row

    def margin(values, censored=None):
        censored = censored or [False] * len(values)
        return {"margin": {"values": values, "mean": float(np.mean(values)), "censored": censored, "resolution": 0.035}}

    row = pair_row("fp16-overflow", margin([19.0, 19.5, 19.2, 19.3]), margin([18.0, 18.5, 18.2, 18.3]), experts=8, top_k=4)
    # by hand: shift -1.0; each side's seed variance (0.0625 + 0.0625 + 0.0025 + 0.0025) / 3 = 0.04333 (SD 0.2082, above
    # the 0.035 resolution); Welch SE sqrt(2 x 0.04333 / 4) = 0.14720 on 6 degrees of freedom, t(0.95, 6) = 1.943180:
    # the 90% interval is -1 +- 0.28603 = [-1.28603, -0.71397]. It straddles -1, the edge of the factor-of-two
    # equivalence margin: neither inside (reproduced) nor wholly beyond it (not reproduced)
    assert row["shift_log2"] == pytest.approx(-1.0) and row["censored"] == 0
    assert row["shift_se"] == pytest.approx(0.147196, abs=1e-6)
    assert (row["shift_low"], row["shift_high"]) == (pytest.approx(-1.28603, abs=1e-5), pytest.approx(-0.71397, abs=1e-5))
    assert row["outcome"] == "undetermined"
    assert row["noise_log2"] == pytest.approx(np.std([19.0, 19.5, 19.2, 19.3], ddof=1)) and row["resolution_log2"] == 0.035
    na = pair_row("router-collapse", margin([-1.0, -1.1]), margin([-1.0, -1.2]), experts=4, top_k=4)
    assert na["outcome"] == "not applicable" and math.isnan(na["shift_log2"])
    assert math.isnan(pair_row("fp16-overflow", {"margin": None}, margin([1.0, 2.0]), experts=8, top_k=4)["shift_log2"])


def test_held_out_validation_never_fits_on_the_held_out_original():
    from planner.fidelity.validate import cross_validate

    rows = _synthetic("plan")
    rng = np.random.default_rng(1)
    for r in rows:  # one original's shifts follow a feature no other original shares: only a leak could learn it
        if r["original"] == "f-s3":
            r["shift_log2"] = 5 * r["reconstruction_error_mean"] + rng.normal(scale=0.1)
    scores = cross_validate(rows)["recipes"]["router-collapse"]["original"]["variants"]
    assert scores["full"]["n"] == 120
    held = [r for r in rows if r["original"] != "f-s3"]
    fitted = FidelityEstimator.fit(held, validate=False).recipes["router-collapse"]["models"]["full"]
    assert abs(fitted.coef[SHIFT_FEATURES.index("reconstruction_error_mean")]) < 0.1
    assert scores["full"]["mae"] > scores["full"]["noise_mae"]  # the leaked original cannot be predicted from the others


# ---- the grid on Optuna storage -------------------------------------------------------------------

def _trials(storage: str, grid, phase: str):
    """Every trial of the phase's studies (one per recipe and original)."""
    import optuna

    from planner.fidelity.grid import grid_storage, study_name

    out = []
    for recipe in grid.recipes:
        for base in (f"{family}-s{seed}" for family in grid.families for seed in range(grid.originals)):
            try:
                study = optuna.load_study(study_name=study_name(grid, recipe, phase, base), storage=grid_storage(storage))
            except KeyError:  # not made yet
                continue
            out += study.get_trials(deepcopy=False)
    return out


def _units(grid, work, phase):
    from planner.fidelity.grid import grid_units as units_of

    records = json.loads((work / "models.json").read_text())
    return [u for recipe in grid.recipes for units in units_of(grid, records, recipe, phase).values() for u in units]


def _completed_once(trials, units):
    done = [t.params["unit"] for t in trials if t.state.name == "COMPLETE"]
    assert sorted(done) == sorted(units), "every grid point completes exactly once"
    assert all("result" in t.user_attrs for t in trials if t.state.name == "COMPLETE")


@pytest.fixture(scope="module")
def mini_grid(tmp_path_factory):
    from planner.fidelity.grid import Grid, prepare

    grid = Grid(families=("qwen3_moe",), originals=1, recipes=("fp16-overflow", "rollout-mismatch"), kept_fractions=(0.5,),
                methods=("agglomerative",), random_draws=1, margin_seeds=(0, 1), resolution_static=2.0, calib_tokens=256, dense_steps=10,
                moe_steps=10)  # fmt: skip
    root = tmp_path_factory.mktemp("grid")
    path = root / "grid.yaml"
    path.write_text(grid.to_yaml())
    records = prepare(grid, root / "work")
    assert len(records) == 3  # the original and two proxies
    return grid, path, root / "work"


@pytest.mark.slow
def test_a_grid_of_originals_trained_with_their_published_balancing_is_a_family_of_its_own(tmp_path):
    """Its originals are other models than the same seeds' trained without (names ending in -bal),
    and its rows form the calibration family FAMILY-bal, which the estimator reads for the shape."""
    from planner.fidelity.calibrate import run
    from planner.fidelity.grid import Grid

    grid = Grid(families=("qwen3_moe",), originals=1, recipes=("rollout-mismatch",), kept_fractions=(0.5,), methods=("agglomerative",),
                random_draws=0, margin_seeds=(0, 1), resolution_static=2.0, calib_tokens=128, dense_steps=5, moe_steps=5,
                balancing="published")  # fmt: skip
    path = tmp_path / "grid.yaml"
    path.write_text(grid.to_yaml())
    rows = run(Grid.load(path), str(path), f"sqlite:///{tmp_path / 'b.db'}", tmp_path / "work", 1, tmp_path / "d.csv")
    assert rows and {(r["family"], r["original"]) for r in rows} == {("qwen3_moe-bal", "qwen3_moe-s0-bal")}
    made = json.loads((tmp_path / "work" / "models.json").read_text())
    assert {r["original"] for r in made.values()} == {"qwen3_moe-s0-bal"}


@pytest.mark.slow
def test_a_grid_of_settled_proxies_shares_its_originals_and_is_a_family_of_its_own(tmp_path):
    """`proxy_build: settled`: every proxy is built with its correction bias settled again (as `build
    --settle-bias`), on the sliced grid's originals, whose studies it shares (the originals' phase is
    keyed without the build: measured once); its rows form FAMILY-bal-settled, and merging it keeps the
    sliced family's rows of the same originals."""
    from dataclasses import replace

    from planner.fidelity.calibrate import merged, run
    from planner.fidelity.dataset import read_dataset
    from planner.fidelity.grid import Grid, collect, study_name

    sliced = Grid(families=("deepseek_v3",), originals=1, recipes=("rollout-mismatch",), kept_fractions=(0.5,), methods=("agglomerative",),
                  random_draws=0, margin_seeds=(0, 1), resolution_static=2.0, calib_tokens=128, dense_steps=5, moe_steps=5,
                  balancing="published")  # fmt: skip
    settled = replace(sliced, proxy_build="settled")
    assert settled.key() != sliced.key() and settled.key("originals") == sliced.key("originals") == sliced.key()
    assert study_name(settled, "rollout-mismatch", "originals", "o") == study_name(sliced, "rollout-mismatch", "originals", "o")
    storage = f"sqlite:///{tmp_path / 's.db'}"
    rows = {}
    for grid in (sliced, settled):
        path = tmp_path / f"{grid.proxy_build}.yaml"
        path.write_text(grid.to_yaml())
        rows[grid.proxy_build] = run(Grid.load(path), str(path), storage, tmp_path / grid.proxy_build, 1, tmp_path / f"{grid.proxy_build}.csv")
    assert {(r["family"], r["original"]) for r in rows["settled"]} == {("deepseek_v3-bal-settled", "deepseek_v3-s0-bal")}
    assert {(r["family"], r["original"]) for r in rows["sliced"]} == {("deepseek_v3-bal", "deepseek_v3-s0-bal")}
    import optuna

    trials = optuna.load_study(study_name=study_name(settled, "rollout-mismatch", "originals", "deepseek_v3-s0-bal"), storage=storage).trials
    assert len(trials) == 1  # the original measured once, by the sliced grid
    assert collect(storage, settled, "originals") == collect(storage, sliced, "originals")
    (model,) = [r for r in json.loads((tmp_path / "settled" / "models.json").read_text()).values() if r["model"] != "original"]
    expert_map = json.loads((Path(model["path"]) / "expert_map.json").read_text())
    assert sorted(expert_map["correction_bias_settled"]["layers"]) == sorted(int(i) for i in expert_map["layers"])
    # the settled grid merged into the sliced grid's dataset: both families' rows of the one original stay
    both, meta, kept = merged(tmp_path / "sliced.csv", rows["settled"], {"grid_key": settled.key(), "noise_floor": [], "command": "y",
                                                                         "grid": {}, "storage": storage, "seeds": {}}, settled)  # fmt: skip
    assert kept == len(read_dataset(tmp_path / "sliced.csv")) == len(rows["sliced"]) and len(both) == len(rows["sliced"]) + len(rows["settled"])


def test_a_settled_plan_is_read_on_the_family_of_settled_proxies_only():
    """A plan that settles its correction bias (proxy_build "settled") is read on its shape's family of
    settled proxies (names ending in -settled), a sliced plan never on it; a settled plan of a shape
    with none is uncalibrated, and says the shape was calibrated with proxies built otherwise."""
    plain = _synthetic("plan")
    settled = [{**r, "family": "f-settled", "shift_log2": r["shift_log2"] + 0.5, "reproduced": float(abs(r["shift_log2"] + 0.5) < 1.0)}
               for r in _synthetic("plan", seed=1)]  # fmt: skip
    est = FidelityEstimator.fit(plain + settled, transfer_points=[])
    row = dict(plain[0])
    assert est.family(row, "router-collapse") == "f" == est.family({**row, "proxy_build": "sliced"}, "router-collapse")
    assert est.family({**row, "proxy_build": "settled"}, "router-collapse") == "f-settled"
    got = est.predict({**row, "proxy_build": "settled"}, "router-collapse")
    assert got["family"]["name"] == "f-settled" and got["family"]["build"] == "settled" and est.predict(row, "router-collapse")["family"]["build"] == "sliced"
    assert got["family"]["scale"].endswith("the transfer was measured with sliced proxies, settled ones at hidden 64 only")
    # with a trend measured on settled proxies of the shape, a settled plan reads that one (fitted apart), a sliced plan never
    points = [{"recipe": "router-collapse", "shape": row["routing_shape"], "hidden": h, "layers": n, "original": f"h{h}-l{n}-s{s}",
               "shift_log2": -1.0 + 0.4 * math.log2(h / 64) + 0.01 * s, "shift_se": 0.1, "kept_fraction": 0.25, "proxy_build": "settled"}
              for h in (64, 128, 256) for n in (3, 6) for s in range(2)]  # fmt: skip
    measured = FidelityEstimator.fit(plain + settled, transfer_points=points)
    target = {**row, "hidden_size": 1024, "num_layers": 6}
    own = measured.predict({**target, "proxy_build": "settled"}, "router-collapse")["family"]["scale"]
    assert own.startswith("transfer with proxies whose correction bias is settled again measured at hidden 64, 128, 256") and "sliced" not in own
    sliced = measured.predict(target, "router-collapse")["family"]["scale"]
    assert sliced.startswith("transfer not measured beyond hidden 64") and "nearest measured shape" not in sliced  # settled points lend it nothing
    alone = FidelityEstimator.fit(plain, transfer_points=[])
    status, reason, _ = alone.status({**row, "proxy_build": "settled"}, "router-collapse")
    assert status == "uncalibrated" and "calibrated for router-collapse with proxies built otherwise (f)" in reason
    assert "none with proxies whose correction bias is settled again" in reason


@pytest.mark.slow
def test_two_runs_prepare_one_work_directory_at_once(tmp_path):
    """Two processes preparing the same fresh work directory (two `calibrate run` workers started
    together): each original is made by one of them while the other makes another or waits, both
    finish, and both return the same records."""
    from planner.fidelity.grid import Grid

    grid = Grid(families=("qwen3_moe",), originals=2, recipes=("fp16-overflow",), kept_fractions=(0.5,), methods=("agglomerative",),
                random_draws=0, calib_tokens=128, dense_steps=5, moe_steps=5)  # fmt: skip
    path = tmp_path / "grid.yaml"
    path.write_text(grid.to_yaml())
    code = ("import json, sys; from pathlib import Path; from planner.fidelity.grid import Grid, prepare; "
            "records = prepare(Grid.load(sys.argv[1]), Path(sys.argv[2]), progress=lambda b: print('ready', b, flush=True)); "
            "print(json.dumps(sorted(records)))")  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([sys.executable, "-c", code, str(path), str(tmp_path / "work")], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for _ in range(2)]  # fmt: skip
    outputs = [r.communicate(timeout=600)[0] for r in runs]
    assert [r.returncode for r in runs] == [0, 0], outputs
    assert outputs[0].splitlines()[-1] == outputs[1].splitlines()[-1]
    keys = json.loads(outputs[0].splitlines()[-1])
    assert [k.split("/")[0] for k in keys] == ["qwen3_moe-s0"] * 2 + ["qwen3_moe-s1"] * 2  # an original and its proxy each
    for seed in (0, 1):
        assert json.loads((tmp_path / "work" / "models" / f"qwen3_moe-s{seed}" / "original" / "make_report.json").read_text())["family"] == "qwen3_moe"


@pytest.mark.slow
def test_portable_numerics_make_the_same_models_whatever_kernels_the_parent_runs(tmp_path):
    """`numerics: portable`: originals, statistics and proxies are made in a child process pinned to
    one AVX2 code path, so a `calibrate run` started with other kernels (ATen's generic ones, MKL's
    compatible branch, two threads: what another kind of CPU would pick) makes the same bytes, and a
    grid's points carry over between such machines. The setting stamps the work directory, not the
    grid's key (the points' fingerprints tell which models they were measured on)."""
    from dataclasses import replace

    from planner.checkpoint import Checkpoint
    from planner.fidelity.grid import Grid, prepare

    grid = Grid(families=("qwen3_moe",), originals=1, recipes=("fp16-overflow",), kept_fractions=(0.5,), methods=("agglomerative",),
                random_draws=1, calib_tokens=128, dense_steps=5, moe_steps=5, controls=("mis-sliced",), numerics="portable")  # fmt: skip
    assert grid.key() == replace(grid, numerics="native").key()
    path = tmp_path / "grid.yaml"
    path.write_text(grid.to_yaml())
    here = {key: Checkpoint(r["path"]).fingerprint() for key, r in prepare(grid, tmp_path / "here").items()}
    assert len(here) == 4  # the original, the clustered and random proxies, the control
    code = ("import json, sys; from pathlib import Path; from planner.checkpoint import Checkpoint; "
            "from planner.fidelity.grid import Grid, prepare; records = prepare(Grid.load(sys.argv[1]), Path(sys.argv[2])); "
            "print(json.dumps({k: Checkpoint(r['path']).fingerprint() for k, r in records.items()}))")  # fmt: skip
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "there")], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == here
    with pytest.raises(SpecError, match="other grid settings"):  # native models do not join a portable work directory
        prepare(replace(grid, numerics="native"), tmp_path / "here")


@pytest.mark.slow
def test_two_workers_share_one_sqlite_study(mini_grid, tmp_path):
    from planner.fidelity.calibrate import export
    from planner.fidelity.grid import Grid, run_workers

    grid, path, work = mini_grid
    assert Grid.load(path) == grid
    storage = f"sqlite:///{tmp_path / 'c.db'}"
    for phase in ("originals", "proxies"):
        run_workers(storage, grid, str(path), work, phase, workers=2)
        trials = _trials(storage, grid, phase)
        _completed_once(trials, _units(grid, work, phase))
        assert not [t for t in trials if t.state.name in ("FAIL", "RUNNING", "WAITING")]
    rows, noise = export(storage, grid, work)
    assert len(rows) == 4 and all(math.isfinite(r["shift_log2"]) for r in rows)
    for r in rows:  # whether a proxy reproduces is this CPU's training; the outcome is the one its interval decides
        low, high = r["shift_low"], r["shift_high"]
        assert low <= r["shift_log2"] <= high
        decided = "reproduced" if -1 < low and high < 1 else "not reproduced" if low > 1 or high < -1 else "undetermined"
        if r["censored"]:  # a bound settles nothing but a "not reproduced" it reaches (and not when the original's)
            assert r["outcome"] == "undetermined" or r["outcome"] == decided == "not reproduced", r
        else:
            assert r["outcome"] == decided, r
    assert len(noise) == 2 and all(n["original"] == "qwen3_moe-s0" and len(n["values"]) == 2 for n in noise)
    assert all(r["frequency_dropped_mean"] > 0 for r in rows)  # the plan statistics became features
    before = len(_trials(storage, grid, "proxies"))
    run_workers(storage, grid, str(path), work, "proxies", workers=2)  # all done: nothing is run again
    assert len(_trials(storage, grid, "proxies")) == before
    status = run_cli("calibrate", "status", "--grid", path, "--storage", storage, "--workdir", work, "--json")
    progress = json.loads(status.stdout)
    assert status.exit_code == 0 and len(progress) == 4
    assert all(p["complete"] == p["points"] and p["left_s"] == 0 and p["pace"] == "own" for p in progress)
    assert "6 of 6 grid points complete" in run_cli("calibrate", "status", "--grid", path, "--storage", storage, "--workdir", work).output
    one = run_cli("calibrate", "status", "--grid", path, "--storage", storage, "--workdir", work, "--recipes", "rollout-mismatch").output
    assert "3 of 3 grid points complete" in one and "fp16-overflow" not in one  # a run of some recipes, as `calibrate run --recipes`
    typo = f"sqlite:///{tmp_path / 'typo.db'}"  # a read never makes a new, empty database and reports 0 points done
    missing = run_cli("calibrate", "status", "--grid", path, "--storage", typo, "--workdir", work)
    assert missing.exit_code == 2 and "no such database file" in missing.output and not (tmp_path / "typo.db").exists()

    # a family's grid merged into a dataset of other families: theirs stay, this family's grid rows are replaced
    from planner.fidelity.calibrate import merged
    from planner.fidelity.dataset import write_dataset

    other = [dict(rows[0], family="mixtral", original="mixtral-s0"), dict(rows[1], family="qwen3_moe", model="stale")]
    write_dataset(other, tmp_path / "d.csv", {"grid_key": "old", "noise_floor": [{"original": "mixtral-s0"}], "command": "x"})
    new_rows, meta, kept = merged(tmp_path / "d.csv", rows, {"grid_key": grid.key(), "noise_floor": noise, "command": "y", "grid": {},
                                                             "storage": storage, "seeds": {}}, grid)  # fmt: skip
    assert kept == 1 and {r["family"] for r in new_rows} == {"mixtral", "qwen3_moe"} and "stale" not in {r["model"] for r in new_rows}
    assert [g["grid_key"] for g in meta["grids"]] == ["old", grid.key()] and len(meta["noise_floor"]) == 1 + len(noise)


@pytest.mark.slow
def test_a_killed_worker_is_resumed_by_a_restart(mini_grid, tmp_path, monkeypatch):
    from planner.fidelity.grid import run_workers

    grid, path, work = mini_grid
    monkeypatch.setenv("PLANNER_GRID_HEARTBEAT_S", "1")
    monkeypatch.setenv("PLANNER_GRID_GRACE_S", "2")
    storage = f"sqlite:///{tmp_path / 'c.db'}"
    run_workers(storage, grid, str(path), work, "originals", workers=1)
    worker = subprocess.Popen([sys.executable, "-m", "planner.fidelity.grid", storage, str(work), "proxies", str(path)],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline:
        running = [t for t in _trials(storage, grid, "proxies") if t.state.name == "RUNNING" and "unit" in t.params]
        if running:
            break
        time.sleep(0.2)
    assert running, "the worker never started a trial"
    os.kill(worker.pid, signal.SIGKILL)  # mid-trial: the trial is left RUNNING, its heartbeat stops
    worker.wait()
    killed = running[0]._trial_id
    state = {t._trial_id: t.state.name for t in _trials(storage, grid, "proxies")}
    assert state[killed] == "RUNNING"

    run_workers(storage, grid, str(path), work, "proxies", workers=2)
    trials = _trials(storage, grid, "proxies")
    _completed_once(trials, _units(grid, work, "proxies"))
    assert {t._trial_id: t.state.name for t in trials}[killed] == "FAIL"  # failed as stale, then retried
    assert [t.params["unit"] for t in trials if t.state.name == "COMPLETE"].count(running[0].params["unit"]) == 1


@pytest.mark.slow
def test_results_files_resume_a_grid_on_a_fresh_storage_and_refuse_another_models_points(mini_grid, tmp_path):
    """Every completed point is appended to its study's results file; a fresh storage (a new
    checkout, another machine) takes those points instead of measuring them, except one measured on
    another model (its fingerprint differs), which is measured again."""
    from planner.fidelity.calibrate import export
    from planner.fidelity.grid import read_results, run_workers

    grid, path, work = mini_grid
    results = tmp_path / "results"
    first = f"sqlite:///{tmp_path / 'a.db'}"
    for phase in ("originals", "proxies"):
        assert run_workers(first, grid, str(path), work, phase, workers=2, results=results) == 0
    files = sorted(results.glob("*.jsonl"))
    assert len(files) == 4 and sum(len(read_results(f)) for f in files) == 2 + 4  # 2 recipes x (1 original + 2 proxies)
    assert all(r["fingerprint"] for f in files for rs in read_results(f).values() for r in rs)

    proxy_file = next(f for f in files if "fp16-overflow" in f.name and f.name.endswith("proxies.jsonl"))
    lines = proxy_file.read_text().splitlines()
    moved = json.loads(lines[0])
    moved["result"]["fingerprint"] = "0" * 64  # as if measured on a model made elsewhere
    proxy_file.write_text("\n".join([json.dumps(moved), *lines[1:], '{"unit": "torn'])+ "\n")  # and a torn last line
    fresh = f"sqlite:///{tmp_path / 'b.db'}"
    imported = sum(run_workers(fresh, grid, str(path), work, phase, workers=1, results=results) for phase in ("originals", "proxies"))
    assert imported == 5  # all but the other model's point
    trials = _trials(fresh, grid, "proxies")
    measured = [t.params["unit"] for t in trials if t.state.name == "COMPLETE" and "imported_from" not in t.user_attrs]
    assert measured == [moved["unit"]]
    _completed_once(trials, _units(grid, work, "proxies"))
    assert sorted(map(str, export(fresh, grid, work)[0])) == sorted(map(str, export(first, grid, work)[0]))
    # the point measured again is appended beside the other model's: a third storage takes it, measuring nothing
    assert len(read_results(proxy_file)[moved["unit"]]) == 2
    third = f"sqlite:///{tmp_path / 'c.db'}"
    assert sum(run_workers(third, grid, str(path), work, phase, workers=1, results=results) for phase in ("originals", "proxies")) == 6


def _wait_for_running(storage, grid, phase, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        running = [t for t in _trials(storage, grid, phase) if t.state.name == "RUNNING" and "unit" in t.params]
        if running:
            return running[0]
        time.sleep(0.2)
    raise AssertionError("the worker never started a trial")


@pytest.mark.slow
def test_two_calibrate_runs_share_a_postgresql_server_and_survive_a_killed_worker(mini_grid, postgres_url, tmp_path, monkeypatch):
    """Two `planner calibrate run` processes (two machines' worth) on one real PostgreSQL server,
    after a worker was killed mid-trial: every grid point is measured once, none twice, none lost,
    and both export the same dataset."""
    from planner.fidelity.calibrate import export
    from planner.fidelity.grid import run_workers

    grid, path, work = mini_grid
    monkeypatch.setenv("PLANNER_GRID_HEARTBEAT_S", "1")
    monkeypatch.setenv("PLANNER_GRID_GRACE_S", "2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_workers(postgres_url, grid, str(path), work, "originals", workers=1)
    worker = subprocess.Popen([sys.executable, "-m", "planner.fidelity.grid", postgres_url, str(work), "proxies", str(path)], env=env, cwd=ROOT)
    killed = _wait_for_running(postgres_url, grid, "proxies")
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()

    planner = Path(sys.executable).with_name("planner")
    runs = [subprocess.Popen([str(planner), "calibrate", "run", "--grid", str(path), "--storage", postgres_url, "--workdir", str(work),
                              "--workers", "1", "-o", str(tmp_path / f"{name}.csv")], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for name in ("a", "b")]  # fmt: skip
    outputs = [r.communicate(timeout=600)[0] for r in runs]
    assert [r.returncode for r in runs] == [0, 0], outputs
    for phase in ("originals", "proxies"):
        trials = _trials(postgres_url, grid, phase)
        _completed_once(trials, _units(grid, work, phase))
    states = {t._trial_id: t.state.name for t in _trials(postgres_url, grid, "proxies")}
    assert states[killed._trial_id] == "FAIL"  # the killed worker's trial went stale and was measured again by another
    a, b = ((tmp_path / f"{n}.csv").read_text() for n in ("a", "b"))
    assert a == b and len(a.splitlines()) == 1 + 4
    rows, _ = export(postgres_url, grid, work)
    assert sorted((r["model"], r["recipe"]) for r in rows) == sorted({(r["model"], r["recipe"]) for r in rows}) and len(rows) == 4


def test_the_cli_offers_every_recipe_of_the_table():
    """planner.cli.rl keeps its own tuple of recipe names (importing the table would slow every CLI start)."""
    from planner.cli.rl import RECIPE_NAMES
    from planner.fidelity.labels import LOG10_KNOBS
    from planner.rl.recipes import RECIPES

    assert RECIPE_NAMES == tuple(RECIPES) and LOG10_KNOBS <= set(RECIPES)


def test_a_study_made_for_other_grid_points_stops_with_a_message(tmp_path):
    """A study's grid points are fixed when it is made; a grid with more points under the same name
    must stop at once with a message, not retry forever."""
    import optuna

    from planner.fidelity.grid import _work

    storage = f"sqlite:///{tmp_path / 'c.db'}"
    study = optuna.create_study(study_name="s", storage=storage, sampler=optuna.samplers.GridSampler({"unit": ["a"]}))
    _work(study, ["a"], lambda unit: {"unit": unit})
    grown = optuna.load_study(study_name="s", storage=storage, sampler=optuna.samplers.GridSampler({"unit": ["a", "b"]}))
    with pytest.raises(SpecError, match="grid points differ"):
        _work(grown, ["a", "b"], lambda unit: {"unit": unit})
    # one attempt, then the stop: the completed point and the one trial that could not draw a grid point
    assert [(t.state.name, t.params) for t in grown.trials] == [("COMPLETE", {"unit": "a"}), ("FAIL", {})]


def test_calibrate_fit_refuses_data_it_cannot_fit(tmp_path):
    """One unlabelled row fits nothing: exit 2 with the counts, and no estimator file."""
    import csv

    header = DATASET.read_text().splitlines()[0].split(",")
    row = dict(next(csv.DictReader(DATASET.open())), shift_log2="", outcome="undetermined")
    path = tmp_path / "one.csv"
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=header)
        writer.writeheader()
        writer.writerow(row)
    result = run_cli("calibrate", "fit", "--dataset", path, "-o", tmp_path / "est.json")
    assert result.exit_code == 2 and "no recipe has 20 labelled rows" in result.output and not (tmp_path / "est.json").exists()


def test_running_a_dynamic_recipe_on_more_originals_keeps_the_measured_studies():
    """Each (recipe, phase, original) is its own study and the dynamic budget is not part of the grid's
    key: raising dynamic_originals adds studies for the new originals and leaves the old ones as they
    were (their grid points unchanged, so their trials still count)."""
    from planner.fidelity.grid import Grid, grid_units, study_name

    records = {f"{f}-s{s}/{m}": {"family": f, "original": f"{f}-s{s}", "seed": s, "model": m, "experts": k, "top_k": 4}
               for f in ("qwen3_moe", "deepseek_v3") for s in range(3) for m, k in (("original", 32), ("K4-kmeans", 4), ("K8-kmeans", 8))}
    one, three = Grid(dynamic_originals=1), Grid(dynamic_originals=3)
    assert one.key() == three.key() and one.key() != Grid(margin_seeds=(0, 1, 2)).key()
    few, more = grid_units(one, records, "router-collapse", "proxies"), grid_units(three, records, "router-collapse", "proxies")
    assert set(few) == {"qwen3_moe-s0", "deepseek_v3-s0"} and len(more) == 6
    assert all(more[base] == units for base, units in few.items())
    assert few["qwen3_moe-s0"] == ["qwen3_moe-s0/K8-kmeans/router-collapse"]  # K = top_k: not applicable, not measured
    assert list(more)[:2] == ["deepseek_v3-s0", "qwen3_moe-s0"]  # seed first: a budget cut short keeps whole seeds
    assert study_name(one, "router-collapse", "proxies", "qwen3_moe-s0") == study_name(three, "router-collapse", "proxies", "qwen3_moe-s0")
    assert len(grid_units(one, records, "fp16-overflow", "originals")) == 6  # static recipes run on every original


def test_variance_components_are_the_reml_optimum():
    """The between/within SDs maximise the REML likelihood (checked from its definition): on balanced
    groups they are the one-way ANOVA estimates (REML = ANOVA there); statsmodels' MixedLM reaches the
    same point inside the parameter space and nowhere a higher likelihood (near the boundary its
    optimiser stops short)."""
    import warnings

    from statsmodels.regression.mixed_linear_model import MixedLM

    from planner.fidelity.learners import _variance_components, reml_loglik

    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(6), 20)
    y = rng.normal(0.0, 0.5, 6)[groups] + rng.normal(0.0, 0.2, groups.size)  # between SD 0.5, within 0.2
    means = y.reshape(6, 20).mean(1)
    msw = ((y.reshape(6, 20) - means[:, None]) ** 2).sum() / (120 - 6)
    msb = 20 * ((means - y.mean()) ** 2).sum() / 5
    assert _variance_components(y, groups) == pytest.approx((np.sqrt((msb - msw) / 20), np.sqrt(msw)), rel=1e-6)
    for seed, between in ((1, 1.0), (2, 0.3), (3, 0.05), (4, 0.0)):
        r = np.random.default_rng(seed)
        g = r.integers(0, 8, 90)  # unbalanced
        y = r.normal(0.0, between, 8)[g] + r.normal(0.0, 0.5, g.size)
        b, w = _variance_components(y, g)
        best = reml_loglik(y, g, b, w)
        for db, dw in ((0.01, 0), (-0.01, 0), (0, 0.01), (0, -0.01)):
            if b + db >= 0:
                assert reml_loglik(y, g, b + db, w + dw) < best + 1e-9
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit = MixedLM(y, np.ones((g.size, 1)), groups=g).fit(reml=True)
        sm = (np.sqrt(max(float(np.asarray(fit.cov_re)[0, 0]), 0.0)), np.sqrt(fit.scale))
        assert reml_loglik(y, g, *sm) <= best + 1e-9
        if between >= 0.3:
            assert (b, w) == pytest.approx(sm, rel=1e-3)


def test_a_between_original_variance_on_the_boundary_is_exactly_zero():
    """Group means planted equal: REML stops at the boundary, where the optimiser's last digits
    differ between machines; the estimate is stored as 0, so a refit gives the same file anywhere."""
    from planner.fidelity.learners import _variance_components

    groups = np.repeat(np.arange(5), 8)
    within = np.random.default_rng(1).normal(0.0, 0.3, 8)
    y = np.tile(within - within.mean(), 5)  # every original's residuals alike: no spread between them
    between, sd = _variance_components(y, groups)
    assert between == 0.0 and sd == pytest.approx(np.std(y, ddof=1), rel=1e-12)  # REML with no groups: the sample SD


@pytest.mark.slow
def test_a_grid_run_a_recipe_at_a_time_fills_the_same_studies_and_merges(mini_grid, tmp_path):
    """`calibrate run --recipes`: the cheap static recipes first, the rest later. The workers measure only
    the recipes named (the other studies get no trial), and a later run of the rest merges its rows
    beside the first run's instead of replacing them."""
    from planner.fidelity.dataset import read_dataset
    from planner.fidelity.grid import Grid

    grid, path, work = mini_grid
    assert grid.only(["rollout-mismatch"]).key() == grid.key() and grid.only(["rollout-mismatch", "fp16-overflow"]).recipes == grid.recipes
    with pytest.raises(SpecError, match="the grid measures fp16-overflow, rollout-mismatch; not router-collapse"):
        grid.only(["router-collapse"])
    storage, out = f"sqlite:///{tmp_path / 'c.db'}", tmp_path / "d.csv"
    bad = run_cli("calibrate", "run", "--grid", path, "--storage", storage, "--workdir", work, "-o", out, "--recipes", "entropy-collapse")
    assert bad.exit_code == 2 and "not entropy-collapse" in bad.output
    first = run_cli("calibrate", "run", "--grid", path, "--storage", storage, "--workdir", work, "-o", out, "--recipes", "fp16-overflow")
    assert first.exit_code == 0, first.output
    assert {r["recipe"] for r in read_dataset(out)} == {"fp16-overflow"}
    assert _trials(storage, grid.only(["rollout-mismatch"]), "proxies") == []  # nothing of the other recipe was measured
    fp16, fp16_lines = read_dataset(out), out.read_text().splitlines()
    second = run_cli("calibrate", "run", "--grid", path, "--storage", storage, "--workdir", work, "-o", out, "--recipes", "rollout-mismatch",
                     "--merge")  # fmt: skip
    assert second.exit_code == 0, second.output
    both = read_dataset(out)
    assert sorted(r["recipe"] for r in both) == ["fp16-overflow"] * 2 + ["rollout-mismatch"] * 2
    same = lambda rows: json.dumps(rows, sort_keys=True)  # noqa: E731  (NaN labels compare equal as text)
    assert same([r for r in both if r["recipe"] == "fp16-overflow"]) == same(fp16)
    assert set(fp16_lines) <= set(out.read_text().splitlines())  # the kept rows written back as they were read, integers too
    meta = json.loads(out.with_suffix(".json").read_text())
    assert sorted(n["recipe"] for n in meta["noise_floor"]) == ["fp16-overflow", "rollout-mismatch"]
    assert [g["grid"]["recipes"] for g in meta["grids"]] == [["fp16-overflow"], ["rollout-mismatch"]]  # both runs' commands
    assert Grid.load(path).recipes == grid.recipes  # the grid file is as it was


def test_grid_jobs_parse_and_name_their_units():
    from planner.fidelity.grid import Grid, job_settings, job_shares, split_unit, unit_id

    assert job_settings("1/1/1") == {"prompts": 8, "group": 4, "new_tokens": 16} and job_settings("4/2/2") == {"prompts": 2, "group": 2, "new_tokens": 8}
    for bad, words in (("1/4/1", "keep a group of 2"), ("3/1/1", "must divide"), ("1/1", "three whole divisors"), ("0/1/1", "three whole"),
                       ("a/1/1", "three whole")):  # fmt: skip
        with pytest.raises(SpecError, match=words):
            job_settings(bad)
    with pytest.raises(SpecError, match="the production job 1/1/1 first"):
        Grid(jobs=("2/1/1",))
    assert Grid(jobs=("1/1/1",)).key() == Grid().key() != Grid(jobs=("1/1/1", "2/1/1")).key()  # earlier grids keep their studies
    assert unit_id("f-s0", "K8-kmeans", "fp16-overflow") == "f-s0/K8-kmeans/fp16-overflow"
    assert split_unit(unit_id("f-s0", "K8-kmeans", "fp16-overflow", "2/1/4")) == ("f-s0", "K8-kmeans", "fp16-overflow", "2/1/4")
    assert split_unit("f-s0/original/router-collapse") == ("f-s0", "original", "router-collapse", "1/1/1")
    assert job_shares("2/1/4") == {"job_prompts_share": 0.5, "job_samples_share": 1.0, "job_length_share": 0.25}


def test_the_harness_runs_the_job_it_is_given(rl_model):
    from planner.fidelity.grid import job_settings
    from planner.rl.grpo import GRPO, Models
    from planner.rl.recipes import recipe

    path, _ = rl_model
    trainer = GRPO(Models(path), recipe("fp16-overflow").config(8.0, seed=0, **job_settings("2/2/4")))
    ids = trainer._batch(0)[0]
    assert tuple(ids.shape) == (4 * 2, trainer.cfg.prompt_len + 4)  # 4 prompts x 2 samples, 4 new tokens


@pytest.mark.slow
def test_a_grid_with_smaller_jobs_labels_each_against_the_production_original(mini_grid, tmp_path):
    """Jobs 1/1/1, 2/1/1 and 1/1/2 on the mini grid's models: every model is measured at each, the proxies'
    and the original's own rows at a smaller job are labelled against the original at the production
    job, carry the job's shares, and stay out of the plan models (production_rows)."""
    from dataclasses import replace

    from planner.fidelity.calibrate import export
    from planner.fidelity.dataset import production_rows
    from planner.fidelity.grid import run_workers

    grid, path, work = mini_grid
    jobs = replace(grid, recipes=("rollout-mismatch",), jobs=("1/1/1", "2/1/1", "1/1/2"))
    path = tmp_path / "jobs.yaml"
    path.write_text(jobs.to_yaml())
    storage = f"sqlite:///{tmp_path / 'j.db'}"
    for phase in ("originals", "proxies"):
        run_workers(storage, jobs, str(path), work, phase, workers=1)
        _completed_once(_trials(storage, jobs, phase), _units(jobs, work, phase))
    rows, noise = export(storage, jobs, work)
    shares = lambda r: (r["job_prompts_share"], r["job_samples_share"], r["job_length_share"])  # noqa: E731
    assert sorted((r["model"], shares(r)) for r in rows) == sorted(
        [(m, s) for m in ("K16-agglomerative", "K16-random-0") for s in ((1, 1, 1), (0.5, 1, 1), (1, 1, 0.5))]
        + [("original", (0.5, 1, 1)), ("original", (1, 1, 0.5))])
    assert {r["job_grid"] for r in rows} == {jobs.key()} and production_rows(rows) == []  # the job grid's rows stay out of the plan models
    production = {r["model"]: r["critical_original"] for r in rows if shares(r) == (1, 1, 1)}
    assert set(production) == {"K16-agglomerative", "K16-random-0"}
    assert all(r["critical_original"] == production["K16-agglomerative"] for r in rows)  # one reference: the production original
    assert len(noise) == 1 and noise[0]["recipe"] == "rollout-mismatch"
    # merged into a dataset that holds the family's own grid (other weights of the same names): the
    # job grid replaces only its own rows measured again and leaves the family grid's rows as they are
    from planner.fidelity.calibrate import merged
    from planner.fidelity.dataset import JOB_COLUMNS, write_dataset

    def family_row(r: dict, **changes) -> dict:
        return {**{k: v for k, v in r.items() if k not in (*JOB_COLUMNS.values(), "job_grid")}, "critical_original": -1.0, **changes}

    at_production = [r for r in rows if shares(r) == (1, 1, 1)]
    family_grid = [family_row(at_production[0], model="K16-kmeans"), family_row(at_production[0])]
    write_dataset(family_grid, tmp_path / "d.csv", {"grid_key": "family", "noise_floor": [{"original": "qwen3_moe-s0", "recipe": "x"}]})
    provenance = {"grid_key": jobs.key(), "noise_floor": noise, "command": "y", "grid": {}, "storage": storage, "seeds": {}}
    new_rows, meta, kept = merged(tmp_path / "d.csv", rows, provenance, jobs)
    assert kept == 2 and len(new_rows) == len(rows) + 2
    assert sorted(r["critical_original"] for r in production_rows(new_rows)) == [-1.0, -1.0]  # the family grid's rows, untouched
    assert meta["noise_floor"] == [{"original": "qwen3_moe-s0", "recipe": "x"}]  # the family grid's noise floors stay
    write_dataset(new_rows, tmp_path / "d.csv", meta)
    again, _, kept = merged(tmp_path / "d.csv", rows, provenance, jobs)  # the job grid exported again: no row twice
    assert kept == 2 and len(again) == len(new_rows)
    # and the family's grid run again replaces its own rows, keeping every job grid row
    again, _, kept = merged(tmp_path / "d.csv", [family_row(r) for r in at_production], {**provenance, "grid_key": grid.key()}, grid)
    assert kept == len(rows) and len(production_rows(again)) == len(at_production)


@pytest.mark.slow
def test_a_grid_that_spans_sessions_lands_its_complete_originals(mini_grid, tmp_path):
    """`calibrate run --measured-only` measures nothing: with the originals measured and one recipe's
    proxies, it exports that recipe's rows and names the recipe whose proxies are still to measure."""
    from dataclasses import replace

    from planner.fidelity.calibrate import run
    from planner.fidelity.dataset import read_dataset
    from planner.fidelity.grid import run_workers

    grid, path, work = mini_grid
    storage = f"sqlite:///{tmp_path / 'part.db'}"
    run_workers(storage, grid, str(path), work, "originals", workers=1)
    said: list[str] = []
    rows = run(grid, str(path), storage, work, 1, tmp_path / "d.csv", say=said.append, measured_only=True)
    assert rows == [] and sum(s.startswith("  not exported: ") for s in said) == 2  # both recipes' proxies are to measure
    run_workers(storage, replace(grid, recipes=("rollout-mismatch",)), str(path), work, "proxies", workers=1)
    said.clear()
    rows = run(grid, str(path), storage, work, 1, tmp_path / "d.csv", say=said.append, measured_only=True)
    assert {r["recipe"] for r in rows} == {"rollout-mismatch"} and len(rows) == 2  # the two proxies of the one original
    assert [s for s in said if s.startswith("  not exported: ")] == [
        "  not exported: fp16-overflow on qwen3_moe-s0, proxies 0 of 2 points measured"]
    assert read_dataset(tmp_path / "d.csv") and "wrote 2 rows" in said[-1]
    with pytest.raises(SpecError, match="no models.json"):
        run(grid, str(path), storage, tmp_path / "none", 1, tmp_path / "e.csv", measured_only=True)
