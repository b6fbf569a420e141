"""Scale transfer on planted points: the fitted slope recovers the planted one within its interval,
the widening grows with the distance beyond the measured scale, and an unmeasured shape says so."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from planner.fidelity.transfer import fit_transfer, nearest_fit, widening


def planted(slope_h: float, slope_l: float, noise: float = 0.05, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    points = []
    for hidden in (64, 128, 256):
        for layers in (3, 6):
            for s in range(3):
                shift = 0.1 + slope_h * math.log2(hidden / 64) + slope_l * math.log2(layers / 3) + rng.normal(scale=noise)
                points.append({"recipe": "fp16-overflow", "shape": "softmax/top8of128/renorm", "hidden": hidden, "layers": layers,
                               "original": f"h{hidden}-l{layers}-s{s}", "shift_log2": shift, "shift_se": noise, "censored": False,
                               "kept_fraction": 0.25})  # fmt: skip
    return points


def test_the_fit_recovers_planted_slopes_and_the_widening_grows_with_distance():
    fits = fit_transfer(planted(-0.2, 0.1))
    fit = fits["fp16-overflow|softmax/top8of128/renorm"]
    assert fit["fitted"] and fit["points"] == 18 and fit["hidden"] == [64, 128, 256] and fit["layers"] == [3, 6]
    assert abs(fit["coef"]["log2_hidden"] + 0.2) < 0.05 and abs(fit["coef"]["log2_layers"] - 0.1) < 0.05
    # the 90% intervals cover the planted slopes about 90% of the time
    covered = []
    for seed in range(40):
        f = fit_transfer(planted(-0.2, 0.1, seed=seed))["fp16-overflow|softmax/top8of128/renorm"]
        covered.append([f["interval"]["log2_hidden"][0] < -0.2 < f["interval"]["log2_hidden"][1],
                        f["interval"]["log2_layers"][0] < 0.1 < f["interval"]["log2_layers"][1]])  # fmt: skip
    assert 0.75 <= np.mean(covered) <= 1.0
    near = widening(fits, "fp16-overflow", "softmax/top8of128/renorm", 128, 3, 0.25)
    inside = widening(fits, "fp16-overflow", "softmax/top8of128/renorm", 256, 6, 0.25)
    far = widening(fits, "fp16-overflow", "softmax/top8of128/renorm", 2048, 48, 0.25)
    assert 0 < near["halfwidth"] < inside["halfwidth"] < far["halfwidth"]
    # the trend predicts held-out points better than hidden 64's label, so the prediction follows it to the measured
    # edge (-0.2 x 2 + 0.1 x 1 = -0.3 at hidden 256, 6 layers) and widens beyond it: the planted change to the target,
    # -0.2 x 5 + 0.1 x 4 = -0.6, lies inside
    held = fit["holdout"]
    assert held["points"] == 15 and held["mae_moved"] < held["mae_base"] and "held out over 15 points" in far["text"]
    assert near["shift"] == pytest.approx(-0.2, abs=0.05) and far["shift"] == inside["shift"] == pytest.approx(-0.3, abs=0.08)
    assert far["shift"] - far["halfwidth"] < -0.6 < far["shift"] + far["halfwidth"] and "beyond the measured hidden 256" in far["text"]
    assert "beyond" not in inside["text"] and "follows the fitted trend by" in inside["text"]
    # a trend that does not predict held-out points better is not followed: the label stays and the interval takes the change
    unhelpful = {k: dict(v, holdout=dict(v["holdout"], mae_moved=v["holdout"]["mae_base"] + 0.1)) for k, v in fits.items()}
    stays = widening(unhelpful, "fp16-overflow", "softmax/top8of128/renorm", 256, 6, 0.25)
    assert stays["shift"] == 0.0 and stays["halfwidth"] == pytest.approx(abs(inside["change"]) + inside["halfwidth"]) and "follows" not in stays["text"]
    # nor for a plan keeping another share of the experts than the measured rule's
    other_k = widening(fits, "fp16-overflow", "softmax/top8of128/renorm", 256, 6, 0.5)
    assert other_k["shift"] == 0.0 and other_k["halfwidth"] == pytest.approx(stays["halfwidth"])
    assert "the trend is measured for plans keeping 0.25 of the experts, not 0.5" in other_k["text"]
    # slopes planted clear of zero are said to move the label, and a flat one is not
    assert far["moves_with"] == ["width", "depth"] and "the label moves with width and depth on this shape" in far["text"]
    flat = widening(fit_transfer(planted(0.0, 0.0)), "fp16-overflow", "softmax/top8of128/renorm", 2048, 48)
    assert flat["moves_with"] == [] and flat["shift"] == 0.0 and "follows" not in flat["text"]  # no trend: the label stays, the interval widens
    assert flat["halfwidth"] >= abs(flat["change"])


def test_points_of_originals_trained_with_their_published_balancing_are_fitted_apart():
    """The estimator's grid originals were trained without load balancing: points of balanced
    originals never move that fit, and get their own under recipe|shape|published."""
    plain = planted(-0.2, 0.1)
    balanced = [dict(p, balancing="published", shift_log2=p["shift_log2"] + 3.0) for p in planted(0.0, 0.0, seed=1)]
    fits = fit_transfer(plain + balanced)
    alone = fit_transfer(plain)["fp16-overflow|softmax/top8of128/renorm"]
    key = "fp16-overflow|softmax/top8of128/renorm"
    assert fits[key]["coef"] == alone["coef"] and fits[key]["balancing"] == "none" and fits[key]["points"] == 18
    apart = fits[key + "|published"]
    assert apart["balancing"] == "published" and apart["points"] == 18 and abs(apart["coef"]["intercept"] - 3.1) < 0.1
    said = widening(fits, "fp16-overflow", "softmax/top8of128/renorm", 256, 6, 0.25)
    assert said["change"] == pytest.approx(widening(fit_transfer(plain), "fp16-overflow", "softmax/top8of128/renorm", 256, 6, 0.25)["change"])
    # and the prediction says what the balanced originals measured, point by point, with their own width slope
    first = apart["measured"][0]
    assert (first["hidden"], first["layers"], first["kept_fraction"]) == (64, 3, 0.25) and len(apart["measured"]) == 18
    assert "on originals trained with the shape's published load balancing, which start near balanced, the shift measures K/E 0.25: " \
           f"{first['shift']:+.2f} at hidden 64" in said["text"] and "(18 points; width slope" in said["text"]
    assert "published load balancing" not in widening(fit_transfer(plain), "fp16-overflow", "softmax/top8of128/renorm", 256, 6, 0.25)["text"]
    # a calibration family of balanced originals reads their own fit, and nothing is set beside it
    own = widening(fits, "fp16-overflow", "softmax/top8of128/renorm", 256, 6, 0.25, "published")
    assert own["change"] == pytest.approx(widening({key: apart}, "fp16-overflow", "softmax/top8of128/renorm", 256, 6, 0.25)["change"])
    assert own["text"].startswith("transfer on originals trained with the shape's published load balancing measured at hidden 64, 128, 256")
    assert "the shift measures" not in own["text"]
    none = widening(fit_transfer(plain), "fp16-overflow", "softmax/top8of128/renorm", 256, 6, 0.25, "published")
    assert none["halfwidth"] is None and none["text"].startswith(
        "transfer not measured beyond hidden 64 on originals trained with the shape's published load balancing")


def test_an_unmeasured_shape_or_direction_is_said_not_measured():
    fits = fit_transfer(planted(0.0, 0.0))
    # a shape without a trend of its own: said not measured, its interval widened as the nearest measured shape's
    # trend widens it at the target (assumed and said so), its label not moved
    other = widening(fits, "fp16-overflow", "sigmoid/top8of256/renorm", 7168, 61)
    there = widening(fits, "fp16-overflow", "softmax/top8of128/renorm", 7168, 61)
    assert other["text"].startswith("transfer not measured beyond hidden 64") and not other["measured"] and "shift" not in other
    assert other["borrowed"] == "softmax/top8of128/renorm" and other["halfwidth"] == pytest.approx(there["halfwidth"] + abs(there["shift"]))
    assert f"interval widened by {other['halfwidth']:.2f} log2, as the transfer of the nearest measured shape (softmax/top8of128/renorm)" in other["text"]
    assert "assumed, not measured, for this shape" in other["text"]
    # with no other shape's trend of the recipe, nothing to borrow
    alone = widening(fits, "rollout-mismatch", "sigmoid/top8of256/renorm", 7168, 61)
    assert alone["halfwidth"] is None and alone["text"].startswith("transfer not measured beyond hidden 64")
    few = fit_transfer([p for p in planted(0.0, 0.0) if (p["hidden"], p["layers"]) in ((64, 3), (64, 6), (128, 3)) and p["original"].endswith("-s0")])
    (key, entry), = few.items()
    sparse = widening(few, *key.split("|"), 7168, 61)  # too few points for a slope: where they lie, and why none
    assert sparse["halfwidth"] is None and not entry["fitted"]
    assert sparse["text"].startswith(f"transfer not fitted (points at hidden {', '.join(map(str, entry['hidden']))}") and entry["reason"] in sparse["text"]
    widths_only = fit_transfer([p for p in planted(0.0, 0.0) if p["layers"] == 3])
    fit = widths_only["fp16-overflow|softmax/top8of128/renorm"]
    assert fit["interval"]["log2_layers"] is None
    deeper = widening(widths_only, "fp16-overflow", "softmax/top8of128/renorm", 128, 12)
    assert deeper["halfwidth"] is None and "layers not measured" in deeper["text"]
    assert widening(widths_only, "fp16-overflow", "softmax/top8of128/renorm", 128, 3)["halfwidth"] is not None
    depths_only = fit_transfer([p for p in planted(0.0, 0.0) if p["hidden"] == 64])
    assert "(one width)" in widening(depths_only, "fp16-overflow", "softmax/top8of128/renorm", 64, 12)["text"]


def test_the_between_original_variance_is_paule_mandel_and_weights_the_points():
    """With no slope, tau^2 is statsmodels' Paule-Mandel estimate; points whose originals scatter by
    more than their margin seeds' errors get a tau that the slope intervals carry, and a point with a
    tiny error no longer steers the slope."""
    from statsmodels.stats.meta_analysis import combine_effects

    from planner.fidelity.transfer import between_variance

    rng = np.random.default_rng(3)
    variance = rng.uniform(0.01, 0.1, 12)
    y = rng.normal(0.0, 0.4, 12) + rng.normal(0.0, np.sqrt(variance))
    assert math.isclose(between_variance(y, np.ones((12, 1)), variance), combine_effects(y, variance, method_re="pm").tau2, rel_tol=1e-6)
    assert between_variance(np.zeros(6), np.ones((6, 1)), np.full(6, 0.04)) == 0.0  # no scatter beyond the errors

    def seeded(seed: int, tau: float) -> list[dict]:  # one original per point, each off the planted line by N(0, tau)
        r = np.random.default_rng(seed)
        out = planted(0.3, -0.2, noise=0.1, seed=seed)
        for p in out:
            p["shift_se"] = float(r.uniform(0.05, 0.3))
            p["shift_log2"] += float(r.normal(0.0, tau) + r.normal(0.0, p["shift_se"]))
        return out

    fits = [fit_transfer(seeded(s, 0.6))["fp16-overflow|softmax/top8of128/renorm"] for s in range(40)]
    assert 0.35 < np.median([f["tau"] for f in fits]) < 0.85
    covered = [f["interval"]["log2_hidden"][0] < 0.3 < f["interval"]["log2_hidden"][1] for f in fits]
    assert np.mean(covered) >= 0.75
    # one point with a margin-seed error of 0.01 and a wild original: with tau in the weights it is one point among 18
    points = seeded(0, 0.6)
    points[-1].update(shift_se=0.01, shift_log2=points[-1]["shift_log2"] + 3.0)
    steered = fit_transfer(points)["fp16-overflow|softmax/top8of128/renorm"]
    assert abs(steered["coef"]["log2_hidden"] - 0.3) < 0.6 and steered["tau"] > 0.35  # 1/se^2 alone: +1.07


def test_training_length_is_its_own_direction_and_the_width_slope_is_taken_at_the_grids_length():
    """Points trained longer at one width fit a training-length slope beside the width slope, so a
    trend that is training's is not read as width's; the target is taken at the grid's length."""
    points = planted(0.0, 0.0)
    rng = np.random.default_rng(5)
    for s in range(3):  # hidden 64 trained 4x longer: the planted training slope is +0.3 per doubling
        for layers in (3, 6):
            points.append({"recipe": "fp16-overflow", "shape": "softmax/top8of128/renorm", "hidden": 64, "layers": layers, "steps": 1200,
                           "original": f"h64-l{layers}-s{s}-t1200", "shift_log2": 0.1 + 0.6 + rng.normal(scale=0.05), "shift_se": 0.05})  # fmt: skip
    fit = fit_transfer(points)["fp16-overflow|softmax/top8of128/renorm"]
    assert fit["steps"] == [300, 1200] and fit["originals"] == 24
    lo, hi = fit["interval"]["log2_steps"]
    assert lo < 0.3 < hi and lo > 0.1
    assert abs(fit["coef"]["log2_hidden"]) < 0.05
    said = widening({"fp16-overflow|softmax/top8of128/renorm": fit}, "fp16-overflow", "softmax/top8of128/renorm", 256, 6)
    assert "300-1200 training steps" in said["text"] and "per doubling of training length" in said["text"]
    assert said["moves_with"] == ["training length"] and "P holds for an original trained as long as the grid's (300 steps)" in said["text"]
    # the training direction adds nothing to the target's widening: the same as the fit without those points
    alone = widening(fit_transfer(planted(0.0, 0.0)), "fp16-overflow", "softmax/top8of128/renorm", 256, 6)
    assert abs(said["halfwidth"] - alone["halfwidth"]) < 0.1


def test_a_censored_point_points_the_way_its_censored_seeds_do():
    from planner.fidelity.transfer import censored_bound

    lo, hi = -4.0, 2.0
    clean = ([-1.0, -1.5], [False, False])
    assert censored_bound(([lo, -1.0], [True, False]), clean, lo, hi) == "lower"  # the original faults already at the floor
    assert censored_bound(clean, ([hi, -1.0], [True, False]), lo, hi) == "lower"  # the proxy never faults inside the bracket
    assert censored_bound(([hi, -1.0], [True, False]), clean, lo, hi) == "upper"
    assert censored_bound(clean, ([lo, -1.0], [True, False]), lo, hi) == "upper"
    assert censored_bound(([lo, -1.0], [True, False]), ([lo, -1.0], [True, False]), lo, hi) is None  # both ways: no bound
    assert censored_bound(clean, clean, lo, hi) is None


def test_a_bound_enters_the_fit_as_a_tail_probability():
    """No bounds: the fit is the weighted least squares. A bound far on its consistent side changes
    nothing; one beyond the exact points' trend pulls the slope its way; the coefficients are the
    likelihood's maximum (checked against a general-purpose optimiser); a bound is no held-out target."""
    import statsmodels.api as sm
    from scipy.optimize import minimize
    from scipy.stats import norm

    key = "fp16-overflow|softmax/top8of128/renorm"
    points = planted(0.3, 0.0, noise=0.2, seed=3)
    exact = fit_transfer(points)[key]
    x = np.column_stack([np.ones(len(points)), [math.log2(p["hidden"] / 64) for p in points], [math.log2(p["layers"] / 3) for p in points]])
    y = np.array([p["shift_log2"] for p in points])
    s2 = np.array([p["shift_se"] for p in points]) ** 2 + exact["tau"] ** 2
    wls = sm.WLS(y, x, weights=1 / s2).fit()
    assert [exact["coef"][n] for n in ("intercept", "log2_hidden", "log2_layers")] == pytest.approx(list(wls.params), abs=1e-9)
    assert exact["bounds"] == 0

    def bound(shift: float, way: str | None) -> dict:
        return {**points[-1], "original": "h256-l6-censored", "shift_log2": shift, "censored": True, **({"bound": way} if way else {})}

    line = exact["coef"]["intercept"] + 2 * exact["coef"]["log2_hidden"]  # the trend at hidden 256, 3 layers ... and 6
    top = line + exact["coef"]["log2_layers"]
    assert fit_transfer(points + [bound(top + 3, None)])[key]["points"] == len(points)  # no recorded direction: left out
    alone = fit_transfer(points + [{**bound(top + 3, "lower"), "steps": 1200}])[key]  # the only point at its training length
    assert alone["points"] == len(points) and alone["interval"]["log2_steps"] is None and alone["coef"] == exact["coef"]
    other_rule = fit_transfer(points + [{**bound(top + 3, "lower"), "kept_fraction": 0.5}])[key]  # the only point of its plan rule
    assert other_rule["points"] == len(points) and other_rule["coef"] == exact["coef"]
    below = fit_transfer(points + [bound(top - 10, "lower")])[key]
    assert below["bounds"] == 1 and below["coef"]["log2_hidden"] == pytest.approx(exact["coef"]["log2_hidden"], abs=1e-6)
    up = fit_transfer(points + [bound(top + 3, "lower")])[key]
    down = fit_transfer(points + [bound(top - 3, "upper")])[key]
    assert up["coef"]["log2_hidden"] > exact["coef"]["log2_hidden"] + 0.01 and down["coef"]["log2_hidden"] < exact["coef"]["log2_hidden"] - 0.01
    assert up["dof"] == exact["dof"] and up["holdout"]["points"] == exact["holdout"]["points"]  # a bound is no value to predict
    # the maximum of the same likelihood found by a general optimiser
    xb, yb = np.vstack([x, [1.0, 2.0, 1.0]]), np.append(y, top + 3)
    sb = np.sqrt(np.append(s2, points[-1]["shift_se"] ** 2 + exact["tau"] ** 2))
    nll = lambda b: -(norm.logpdf(yb[:-1], xb[:-1] @ b, sb[:-1]).sum() + norm.logcdf((xb[-1] @ b - yb[-1]) / sb[-1]))  # noqa: E731
    best = minimize(nll, wls.params, method="Nelder-Mead", options={"xatol": 1e-9, "fatol": 1e-12, "maxiter": 20000}).x
    assert [up["coef"][n] for n in ("intercept", "log2_hidden", "log2_layers")] == pytest.approx(list(best), abs=1e-5)


def test_each_plan_rule_has_its_own_label_and_width_slope():
    """Points of two plan rules (K/E 0.25 and 0.5): each rule's label at hidden 64 and width slope are
    recovered, a plan follows its own rule's trend, the held-out test starts from the point's own rule's
    label, and a rule measured at one width keeps its label but follows no trend."""
    from planner.fidelity.transfer import slope

    key = "fp16-overflow|softmax/top8of128/renorm"
    quarter = planted(0.4, 0.1, seed=1)  # intercept 0.1, width +0.4
    half = [dict(p, kept_fraction=0.5, original=p["original"] + "-k0.5", shift_log2=p["shift_log2"] - 1.1 - 0.3 * math.log2(p["hidden"] / 64))
            for p in planted(0.4, 0.1, seed=2)]  # fmt: skip  (intercept -1.0, width +0.1)
    fit = fit_transfer(quarter + half)[key]
    assert fit["kept_fraction"] == fit["trend_rules"] == [0.25, 0.5]
    assert fit["coef"]["log2_kept"] == pytest.approx(-1.1, abs=0.1) and fit["coef"]["log2_hidden:kept"] == pytest.approx(-0.3, abs=0.05)
    (q, (qlo, qhi)), (h, (hlo, hhi)) = slope(fit, "log2_hidden", 0.0), slope(fit, "log2_hidden", 1.0)
    assert qlo < 0.4 < qhi and hlo < 0.1 < hhi and (q, (qlo, qhi)) == (fit["coef"]["log2_hidden"], tuple(fit["interval"]["log2_hidden"]))
    # the rules' labels differ by 1.1 log2: starting every held-out point from K/E 0.25's would miss half of them by that much
    assert fit["holdout"]["mae_moved"] < 0.1 < fit["holdout"]["mae_base"] < 0.9
    fits = {key: fit}
    at_quarter = widening(fits, "fp16-overflow", "softmax/top8of128/renorm", 256, 3, 0.25)
    at_half = widening(fits, "fp16-overflow", "softmax/top8of128/renorm", 256, 3, 0.5)
    assert at_quarter["shift"] == pytest.approx(0.8, abs=0.1) and at_half["shift"] == pytest.approx(0.2, abs=0.1)
    assert "per doubling of width at K/E 0.5" in at_half["text"]
    # a rule's trend is bounded by its own widths: K/E 0.5 measured to hidden 128 is extrapolated beyond it
    shorter = fit_transfer(quarter + [p for p in half if p["hidden"] < 256])[key]
    assert shorter["rule_hidden"] == {"0.25": [64, 128, 256], "0.5": [64, 128]}
    past = widening({key: shorter}, "fp16-overflow", "softmax/top8of128/renorm", 256, 3, 0.5)
    assert "beyond the measured hidden 128" in past["text"] and "beyond" not in widening({key: shorter}, *key.split("|"), 256, 3, 0.25)["text"]
    # an unmeasured rule stays at its label, its interval taking the nearest measured rule's change
    eighth = widening(fits, "fp16-overflow", "softmax/top8of128/renorm", 256, 3, 0.125)
    assert eighth["shift"] == 0.0 and eighth["halfwidth"] == pytest.approx(abs(at_quarter["change"]) + at_quarter["halfwidth"])
    # K/E 0.5 measured at hidden 64 alone: its own label, the width slope is K/E 0.25's, and its plans follow no trend
    narrow = fit_transfer(quarter + [p for p in half if p["hidden"] == 64])[key]
    assert narrow["trend_rules"] == [0.25] and narrow["interval"]["log2_hidden:kept"] is None
    assert narrow["coef"]["log2_kept"] == pytest.approx(-1.1, abs=0.1)
    unmoved = widening({key: narrow}, "fp16-overflow", "softmax/top8of128/renorm", 256, 3, 0.5)
    assert unmoved["shift"] == 0.0 and "the trend is measured for plans keeping 0.25 of the experts, not 0.5" in unmoved["text"]
    # one rule alone: its terms are not fitted, and the fit is the one-rule fit
    alone = fit_transfer(quarter)[key]
    assert alone["interval"]["log2_kept"] is None and alone["coef"]["log2_kept"] == 0.0 and alone["trend_rules"] == [0.25]


@pytest.mark.slow
def test_a_point_at_another_rule_on_a_remade_original_measures_only_its_proxy(tmp_path):
    """benchmarks/scale_transfer.py: a model made again from its seed has the same fingerprint, so a
    point at another K/E takes the original's margins from the earlier point and bisects only the
    proxy; a different grid setting (or fingerprint) measures both sides again."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "scale_transfer.py"
    spec = importlib.util.spec_from_file_location("scale_transfer", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ("gpt_oss-e32", 64, 2, 0, ["fp16-overflow"])
    (first,) = bench.measure_point(*args, 0.25, "cpu", tmp_path / "a", 4)
    assert not first["original_reused"] and first["margins"]["original"]["values"]
    # a point stopped after a side's bisection resumes from the margins kept beside that side's model
    kept = tmp_path / "a" / bench.point_name(*args[:4], 4) / "original.fp16-overflow.cpu.margins.json"
    stored = json.loads(kept.read_text())
    planted = [v + 1.0 for v in stored["margins"]["values"]]
    kept.write_text(json.dumps({**stored, "margins": {**stored["margins"], "values": planted}}))
    (resumed,) = bench.measure_point(*args, 0.25, "cpu", tmp_path / "a", 4)
    assert resumed["margins"]["original"]["values"] == planted and resumed["margins"]["proxy"] == first["margins"]["proxy"]
    kept.write_text(json.dumps({**stored, "fingerprint": "another model", "margins": {**stored["margins"], "values": planted}}))
    (remeasured,) = bench.measure_point(*args, 0.25, "cpu", tmp_path / "a", 4)  # kept margins of another model are not taken
    assert remeasured["margins"]["original"] == first["margins"]["original"]
    # where each side starts (the router-collapse detector's statistic at the first step): the table of --balance-only
    from planner.fidelity.starts import measure_start

    start = measure_start(kept.parent / "original", "cpu", [0, 1, 2, 3])
    assert len(start) == 4 and all(0.0 <= v <= 1.0 for v in start) and start == measure_start(kept.parent / "original", "cpu", [0, 1, 2, 3])
    out = subprocess.run([sys.executable, str(path), "--balance-only", "--families", "gpt_oss-e32", "--hidden", "64", "--layers", "2",
                          "--seeds", "0", "--steps", "4", "--workdir", str(tmp_path / "a"), "--starts", str(tmp_path / "starts.json")],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    row = out.splitlines()[-1].split()
    assert row[:7] == ["gpt_oss-e32", "64", "2", "0", "4", "none", str(first["experts"])] and float(row[7]) == pytest.approx(np.mean(start), abs=6e-4)
    from planner.fidelity.starts import load_starts

    (kept_row,) = load_starts(tmp_path / "starts.json")  # and kept, as the estimator reads it
    assert kept_row["balancing"] == "none" and kept_row["original"] == pytest.approx(start, abs=1e-4) and kept_row["proxy_experts"] == first["experts"]
    known = bench.measured_originals([first])
    (second,) = bench.measure_point(*args, 0.5, "cpu", tmp_path / "b", 4, known)  # another workdir: the original is made again
    assert second["original_fingerprint"] == first["original_fingerprint"] and second["original_reused"]
    assert second["margins"]["original"] == first["margins"]["original"] and second["experts"] == 2 * first["experts"]
    assert second["critical_original"] == first["critical_original"]
    other = {(f, r, d, "another grid"): m for (f, r, d, _), m in known.items()}
    (third,) = bench.measure_point(*args, 0.5, "cpu", tmp_path / "b", 4, other)
    assert not third["original_reused"] and third["margins"]["original"] == first["margins"]["original"]


def test_the_nearest_measured_shape_shares_the_scoring_function_first():
    softmax = planted(0.0, 0.0)
    sigmoid = [dict(p, shape="sigmoid/top8of256/renorm/groups8keep4/corrbias/shared", shift_log2=p["shift_log2"] + 0.3 * math.log2(p["hidden"] / 64))
               for p in planted(0.0, 0.0, seed=1)]  # fmt: skip
    fits = fit_transfer(softmax + sigmoid)
    # GLM-4.5-Air's shape shares top-k of E with the softmax one, and the scoring, renormalisation, bias and shared expert with the other
    assert nearest_fit(fits, "fp16-overflow", "sigmoid/top8of128/renorm/corrbias/shared/dense") == "sigmoid/top8of256/renorm/groups8keep4/corrbias/shared"
    assert nearest_fit(fits, "fp16-overflow", "softmax/top4of60/raw/shared/sharedgate") == "softmax/top8of128/renorm"
    assert nearest_fit(fits, "fp16-overflow", "softmax/top8of128/renorm") == "sigmoid/top8of256/renorm/groups8keep4/corrbias/shared"  # never itself
    # only trends of originals trained alike, and of the same recipe
    assert nearest_fit(fits, "fp16-overflow", "softmax/top8of128/renorm", "published") is None
    assert nearest_fit(fits, "router-collapse", "softmax/top4of60/raw") is None


def test_settled_proxies_points_are_fitted_apart_and_read_by_their_build():
    """Points whose proxies' correction bias was settled again (proxy_build "settled") never move the
    sliced proxies' fit; a settled family reads their fit where one is fitted, else the sliced one."""
    from planner.fidelity.transfer import fit_build, fit_key

    plain = planted(-0.2, 0.1)
    settled = [dict(p, proxy_build="settled", shift_log2=p["shift_log2"] + 1.0) for p in planted(0.3, 0.0, seed=2)]
    fits = fit_transfer(plain + settled)
    key = "fp16-overflow|softmax/top8of128/renorm"
    assert fit_key("fp16-overflow", "softmax/top8of128/renorm", "none", "settled") == key + "|settled"
    assert fit_key("fp16-overflow", "softmax/top8of128/renorm", "published", "settled") == key + "|published|settled"
    assert fits[key]["coef"] == fit_transfer(plain)[key]["coef"] and fits[key]["build"] == "sliced"
    own = fits[key + "|settled"]
    assert own["build"] == "settled" and own["points"] == 18 and abs(own["coef"]["log2_hidden"] - 0.3) < 0.05
    assert fit_build(fits, "fp16-overflow", "softmax/top8of128/renorm", "none", "settled") == "settled"
    assert fit_build(fit_transfer(plain), "fp16-overflow", "softmax/top8of128/renorm", "none", "settled") == "sliced"
    # settled points at one depth give no depth slope where the sliced proxies' has one: the sliced trend stands in
    shallow = fit_transfer(plain + [p for p in settled if p["layers"] == 3])
    assert shallow[key + "|settled"]["fitted"] and shallow[key + "|settled"]["interval"]["log2_layers"] is None
    assert fit_build(shallow, "fp16-overflow", "softmax/top8of128/renorm", "none", "settled") == "sliced"
    # the plan rules measured need not match: sliced points at a second K/E give the sliced fit rule terms, not a scale axis
    rules = fit_transfer(plain + [dict(p, kept_fraction=0.5) for p in planted(-0.1, 0.1, seed=3)] + settled)
    assert rules[key]["interval"]["log2_kept"] is not None and rules[key + "|settled"]["interval"]["log2_kept"] is None
    assert fit_build(rules, "fp16-overflow", "softmax/top8of128/renorm", "none", "settled") == "settled"
    said = widening(fits, "fp16-overflow", "softmax/top8of128/renorm", 256, 6, 0.25, "none", "settled")
    assert said["change"] == pytest.approx(widening({key: own}, "fp16-overflow", "softmax/top8of128/renorm", 256, 6, 0.25)["change"])
    assert said["text"].startswith("transfer with proxies whose correction bias is settled again measured at hidden 64, 128, 256")
