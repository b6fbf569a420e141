"""The fidelity estimator (scikit-learn conventions, JSON), its labels, the calibration grid as
Optuna trials shared by worker processes, `calibrate add` + refit, and the committed dataset."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from sklearn.utils.estimator_checks import parametrize_with_checks

from planner.cli import main
from planner.errors import SpecError
from planner.fidelity.estimator import FULL_FEATURES, FidelityEstimator, LinearModel, LogisticModel
from planner.fidelity.learners import FidelityClassifier, FidelityRegressor

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "calibration" / "fidelity_dataset.csv"


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# ---- the estimators -------------------------------------------------------------------------------

@parametrize_with_checks([FidelityRegressor(), FidelityClassifier(n_bootstrap=10)])
def test_sklearn_conventions(estimator, check):
    check(estimator)


def test_regressor_intervals_cover_and_round_trip_through_json():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3))
    y = x @ [1.0, -2.0, 0.5] + rng.normal(scale=0.5, size=400)
    model = FidelityRegressor(coverage=0.8).fit(x[:300], y[:300])
    low, high = model.predict_interval(x[300:])
    assert 0.7 <= np.mean((y[300:] >= low) & (y[300:] <= high)) <= 0.9
    again = LinearModel.from_json(json.loads(json.dumps(model.model_.to_json())))  # what the estimator file holds
    assert np.array_equal(again.predict(x), model.predict(x))
    assert np.array_equal(again.predict_interval(x)[0], model.predict_interval(x)[0])


def test_classifier_probabilities_and_json():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 2))
    y = (x[:, 0] + 0.3 * rng.normal(size=300) > 0).astype(int)
    model = FidelityClassifier(n_bootstrap=20).fit(x, y)
    p = model.predict_proba(x)[:, 1]
    assert np.mean((p > 0.5) == y) > 0.85
    low, high = model.predict_interval(x)
    assert np.all(low <= p + 1e-12) and np.all(p <= high + 1e-12)
    again = LogisticModel.from_json(json.loads(json.dumps(model.model_.to_json())))
    assert np.array_equal(again.proba(x), model.predict_proba(x)[:, 1])
    assert np.array_equal(again.predict_interval(x)[0], low) and np.array_equal(again.predict_interval(x)[1], high)


def test_classifier_interval_widens_for_group_shift():
    """Groups whose base rates differ by more than sampling noise: the bootstrap interval alone holds
    few held-out groups' observed rates; widened by the groups' conformal shift it holds most."""
    rng = np.random.default_rng(2)
    rates = [0.95, 0.9, 0.85, 0.6, 0.92, 0.88, 0.75, 0.97]
    groups = np.repeat([f"g{i}" for i in range(len(rates))], 40)
    x = rng.normal(size=(len(groups), 2))
    y = (rng.random(len(groups)) < np.repeat(rates, 40)).astype(int)
    plain = FidelityClassifier(n_bootstrap=20).fit(x, y)
    grouped = FidelityClassifier(n_bootstrap=20).fit(x, y, groups=list(groups))
    assert grouped.shift_ > 2 * plain.shift_  # random folds see sampling noise only
    held_in, held_in_bootstrap = 0, 0
    for g in sorted(set(groups)):
        held = groups == g
        model = FidelityClassifier(n_bootstrap=20).fit(x[~held], y[~held], groups=list(groups[~held]))
        rate = y[held].mean()
        low, high = model.predict_interval(x[held])
        held_in += low.mean() <= rate <= high.mean()
        low, high = replace(model.model_, shift=0.0).predict_interval(x[held])
        held_in_bootstrap += low.mean() <= rate <= high.mean()
    assert held_in >= 6 and held_in_bootstrap <= 3, (held_in, held_in_bootstrap)


def test_estimator_file_is_json_and_rejects_other_files(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"schema": "planner.stats/1"}))
    with pytest.raises(SpecError, match="not a fidelity estimator"):
        FidelityEstimator.load(path)
    with pytest.raises(SpecError, match="calibrate fit"):
        FidelityEstimator.load(tmp_path / "missing.json")


# ---- labels ---------------------------------------------------------------------------------------

def test_labels():
    from planner.fidelity.labels import curve_agreement, curve_deviation, fault_reproduced, margin_ratio, spearman

    assert margin_ratio("fp16-overflow", 18.0, 19.0) == 1.0  # knobs in log2 units stand as they are
    assert math.isclose(margin_ratio("entropy-collapse", -2.0, -3.0), math.log2(10))  # log10 knobs convert
    rng = np.random.default_rng(0)
    keys = ("grad_norm", "entropy", "kl_ref", "reward_mean", "load_cv_max")
    run = [{k: float(v) for k, v in zip(keys, rng.uniform(0.1, 1, 5))} for _ in range(12)]
    replica = [{k: v + rng.normal(scale=0.05) for k, v in r.items()} for r in run]
    far = [{k: v + rng.normal(scale=0.5) for k, v in r.items()} for r in run]
    assert curve_deviation(run, run, run) == 0.0 and curve_agreement(run, run, replica) == 0.0
    assert curve_agreement(far, run, replica) > 3 * curve_agreement(replica, run, replica)  # further from it than its noise
    flat = [{"grad_norm": 1.0} for _ in range(6)]
    assert math.isnan(spearman(flat, flat))  # a constant curve ranks nothing
    ties = [{"grad_norm": v} for v in (1, 1, 2, 2, 3, 3)]
    assert math.isclose(spearman(ties, [{"grad_norm": v} for v in (1, 2, 3, 4, 5, 6)]), 0.9562, abs_tol=1e-4)  # ranks 1.5,1.5,3.5,3.5,5.5,5.5 vs 1..6
    assert fault_reproduced(True, True) == 1.0 and fault_reproduced(False, True) == 0.0
    assert math.isnan(fault_reproduced(True, False))  # the original did not fault: no question to answer


def test_pair_row_labels_and_censoring():
    from planner.fidelity.dataset import pair_row

    def margin(values, censored=(False, False)):
        return {"margin": {"values": values, "mean": float(np.mean(values)), "spread": float(np.std(values, ddof=1)), "censored": list(censored)}}

    row = pair_row("fp16-overflow", "static", margin([19.0, 19.5]), margin([18.0, 18.5]), knob_offset=0.25)
    assert row["margin_ratio"] == 1.0 and row["censored"] == 0 and row["fault_reproduced"] == 1.0
    assert math.isclose(row["margin_noise"], np.std([19.0, 19.5], ddof=1))
    later = pair_row("fp16-overflow", "static", margin([19.0, 19.5]), margin([20.0, 20.5]), knob_offset=0.25)
    assert later["fault_reproduced"] == 0.0  # the proxy needs a larger scale than the original's + offset
    censored = pair_row("fp16-overflow", "static", margin([40.0, 40.0], (True, True)), margin([20.0, 20.5]), knob_offset=0.25)
    assert censored["censored"] == 1 and math.isnan(censored["fault_reproduced"])
    assert math.isnan(pair_row("fp16-overflow", "static", {"margin": None}, margin([1.0, 2.0]), knob_offset=0.25)["margin_ratio"])


def test_grouped_cv_never_fits_on_the_held_out_group():
    from planner.fidelity.validate import cross_validate

    rng = np.random.default_rng(0)
    rows = []
    for g, (family, recipe) in enumerate([("a", "fp16-overflow"), ("a", "entropy-collapse"), ("b", "fp16-overflow"), ("b", "entropy-collapse")]):
        for i in range(20):
            row = {f: float(rng.normal()) for f in FULL_FEATURES}
            row.update(family=family, recipe=recipe, model=f"m{i}", experts=8 + 4 * (i % 3), censored=0)
            # one group's labels follow a feature no other group shares: only a leak could learn it
            row["margin_ratio"] = abs(row["dispersion_mean"]) * 5 if g == 3 else 0.1 * abs(row["kept_fraction"])
            row["curve_agreement"] = float("nan")
            row["fault_reproduced"] = float(i % 2)
            rows.append(row)
    report = cross_validate(rows)["labels"]["margin_ratio"]["full"]
    held_out = FidelityRegressor().fit(np.array([[r["dispersion_mean"]] for r in rows[:60]]), [r["margin_ratio"] for r in rows[:60]])
    assert report["n"] == 80
    assert report["mae"] > 0.5  # the last group cannot be predicted from the others
    assert held_out.coef_[0] == pytest.approx(0.0, abs=0.05)


# ---- the grid on Optuna storage -------------------------------------------------------------------

def _trials(storage: str, grid, phase: str):
    """Every trial of the phase's studies (one per recipe)."""
    import optuna

    from planner.fidelity.grid import _storage, study_name

    out = []
    for recipe in grid.recipes:
        try:
            out += optuna.load_study(study_name=study_name(grid, recipe, phase), storage=_storage(storage)).get_trials(deepcopy=False)
        except KeyError:  # not made yet
            pass
    return out


def _units(grid, work, phase):
    from planner.fidelity.grid import _units as units_of

    records = json.loads((work / "models.json").read_text())
    return [u for recipe in grid.recipes for u in units_of(grid, records, recipe, phase)]


def _completed_once(trials, units):
    done = [t.params["unit"] for t in trials if t.state.name == "COMPLETE"]
    assert sorted(done) == sorted(units), "every grid point completes exactly once"
    assert all("result" in t.user_attrs for t in trials if t.state.name == "COMPLETE")


@pytest.fixture(scope="module")
def mini_grid(tmp_path_factory):
    from planner.fidelity.grid import Grid, prepare

    grid = Grid(families=("qwen3_moe",), recipes=("fp16-overflow", "rollout-mismatch"), experts=(16,), methods=("agglomerative",),
                random_draws=1, margin_seeds=(0,), iters_static=3, calib_tokens=256, dense_steps=10, moe_steps=10)  # fmt: skip
    root = tmp_path_factory.mktemp("grid")
    path = root / "grid.yaml"
    path.write_text(grid.to_yaml())
    records = prepare(grid, root / "work")
    assert len(records) == 3  # the original and two proxies
    return grid, path, root / "work"


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
    rows = export(storage, grid, work)
    assert len(rows) == 4 and all(math.isfinite(r["margin_ratio"]) for r in rows)
    assert all(r["frequency_dropped_mean"] > 0 for r in rows)  # the plan statistics became features
    before = len(_trials(storage, grid, "proxies"))
    run_workers(storage, grid, str(path), work, "proxies", workers=2)  # all done: nothing is run again
    assert len(_trials(storage, grid, "proxies")) == before


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


def test_the_cli_offers_every_recipe_of_the_table():
    """cli_rl keeps its own tuple of recipe names (importing the table would slow every CLI start)."""
    from planner.cli_rl import RECIPE_NAMES
    from planner.fidelity.labels import LOG10_KNOBS
    from planner.rl.recipes import RECIPES

    assert RECIPE_NAMES == tuple(RECIPES) and LOG10_KNOBS <= set(RECIPES)
