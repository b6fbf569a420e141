"""Step time against the published RL runs: fitted to all of them, and with each left out.

The knobs stored in calibration/knobs.json are fitted to every run (fewer free parameters than runs
of each family); the file also stores, per run, the prediction of knobs refitted without that run.
Pinned here: those out-of-sample figures as measured (13 of 16 runs within 25% on the step; the
three outside are named in calibration/published_runs.md and calibration/README.md), and refitting
reproduces the file.
"""

from __future__ import annotations

import json

import pytest

from planner.cost.fit import FAMILY_KNOBS, PHASES, SHARED_KNOBS, fit_all, load_runs, loo_summary, residual_table, update_mfu_checks
from planner.cost.knobs import knobs_path, load_knobs

RUNS = load_runs()
STORED = json.loads(knobs_path().read_text())


def stored_knobs():
    return {family: load_knobs(family) for family in {r.family for r in RUNS}}


def test_published_runs_cover_sizes_families_and_the_unseen_runs():
    """At least 10 runs over 3 model sizes and both families, among them the three runs the cost
    model once missed by up to 2x (verl DeepSeek-V3 on 96 H20; NeMo RL DeepSeek-V3 on 256 H100 and
    Qwen3-235B on 128 H100), and fewer free parameters than runs in each family."""
    ids = {r.id for r in RUNS}
    assert {"ds-r1-a3-real", "ds-r1-a3-random", "qwen3-30b-h20-128", "qwen3-30b-h100-32"} <= ids
    assert {"dsv3-h20-96", "dsv3-h100-256", "qwen3-235b-h100-128"} <= ids
    assert len(RUNS) >= 10 and {r.model for r in RUNS} >= {"qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"}
    for family in ("ascend", "nvidia"):
        assert len(FAMILY_KNOBS) < sum(r.family == family for r in RUNS), family
    assert STORED["free_parameters"] == 2 * len(FAMILY_KNOBS) + len(SHARED_KNOBS) < len(RUNS)


def test_residuals_and_leave_one_out_stored_with_the_knobs():
    expected = {(r.id, p) for r in RUNS for p in PHASES if p in r.published}
    assert {(r["run"], r["phase"]) for r in STORED["residuals"]} == expected
    assert {(r["run"], r["phase"]) for r in STORED["leave_one_out"]} == expected
    stored = {(r["run"], r["phase"]): r["ratio"] for r in STORED["residuals"]}
    for row in residual_table(RUNS, stored_knobs()):  # the stored residuals are the stored knobs'
        assert row["ratio"] == pytest.approx(stored[(row["run"], row["phase"])], abs=2e-3), row


def test_out_of_sample_error_as_measured():
    summary = loo_summary(STORED["leave_one_out"])
    assert summary["runs"] == len(RUNS)
    assert summary["runs_within_25"] >= 13, summary
    # in sample every step total is within 45% (the worst: dsv3-h20-96, 44%, whose ~400 s outside the
    # rollout and the actor update the model does not find)
    for row in STORED["residuals"]:
        if row["phase"] == "step":
            assert abs(row["ratio"] - 1) <= 0.45, row


@pytest.mark.slow
def test_refit_reproduces_stored_knobs_and_out_of_sample_figures():
    refit = fit_all(RUNS)
    for family, knobs in STORED["knobs"].items():
        for name, value in knobs.items():
            assert refit["knobs"][family][name] == pytest.approx(value, rel=1e-4), (family, name)
    stored = {(r["run"], r["phase"]): r["predicted_s"] for r in STORED["leave_one_out"]}
    for row in refit["leave_one_out"]:
        assert row["predicted_s"] == pytest.approx(stored[(row["run"], row["phase"])], rel=1e-3), row


@pytest.mark.parametrize("row", update_mfu_checks(), ids=lambda r: f"{r['check']}:{r['devices']}")
def test_update_mfu_check_within_30_percent(row):
    """Not fitted: the update model's implied MFU against verl's reported actor MFU."""
    assert abs(row["ratio"] - 1) <= 0.30, row
