"""Precursors (planner.runs.precursors): signals before a collapse, read from runs that verl's own
logger code wrote, each found at the step it was planted, naming the trainer key and the threshold;
none on a healthy run."""

from __future__ import annotations

import numpy as np
import pytest
from test_runs import planted_rows, verl_loggers

from planner.runs.precursors import PRECURSORS, precursors

# verl 0.9's rollout-correction metrics (verl/trainer/ppo/rollout_corr_helper.py; docs/algo/rollout_corr.md)
VERL_KEYS = {"grad_norm": "actor/grad_norm", "entropy": "actor/entropy", "loss": "actor/pg_loss", "clip_frac": "actor/pg_clipfrac",
             "reward_mean": "critic/score/mean", "mismatch_k3": "rollout_corr/k3_kl", "is_weight_mean": "rollout_corr/rollout_is_mean",
             "is_weight_std": "rollout_corr/rollout_is_std", "is_ess": "rollout_corr/rollout_is_eff_sample_size",
             "chi2_token": "rollout_corr/chi2_token"}  # fmt: skip


def healthy(steps: int = 40) -> list[dict]:
    rows = planted_rows(steps)
    for r in rows:
        r.update(is_weight_mean=1.0, is_weight_std=0.2, is_ess=0.9, chi2_token=0.05)
    return rows


def verl_jsonl(rows, tmp_path, monkeypatch, name):
    """The rows as verl's FileLogger writes them (steps from 1, after the step-0 validation record)."""
    _, file_logger = verl_loggers()
    path = tmp_path / f"{name}.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    log = file_logger(project_name="p", experiment_name=name)
    log.log(data={"val-core/openai/gsm8k/reward/mean@1": 0.4}, step=0)
    for r in rows:
        log.log(data={VERL_KEYS[k]: r[k] for k in VERL_KEYS if k in r}, step=int(r["step"]) + 1)
    log.finish()
    return path


CASES = [  # precursor, the series planted from row 25 on, the key it must name
    ("is-weight-spread", {"is_weight_std": [0.2] * 25 + [1.6] * 15}, "rollout_corr/rollout_is_std"),
    ("is-weight-spread", {"is_ess": [0.9] * 25 + [0.2] * 15}, "rollout_corr/rollout_is_eff_sample_size"),
    ("is-weight-mean", {"is_weight_mean": [1.0] * 25 + [2.5] * 15}, "rollout_corr/rollout_is_mean"),
    ("chi2-divergence", {"chi2_token": [0.05] * 25 + [1.5] * 15}, "rollout_corr/chi2_token"),
    ("clip-burst", {"clip_frac": [0.05] * 25 + [0.3] * 15}, "actor/pg_clipfrac"),
    ("entropy-slope", {"entropy": [2.0] * 25 + [2.0 * 0.9**k for k in range(1, 16)]}, "actor/entropy"),
    ("mismatch-growth", {"mismatch_k3": [1e-4] * 25 + [1e-3 * 1.5**k for k in range(15)]}, "rollout_corr/k3_kl"),
]


@pytest.mark.parametrize("name, series, key", CASES, ids=[c[0] + "-" + next(iter(c[1])) for c in CASES])
def test_each_precursor_is_found_where_planted_in_a_verl_log(name, series, key, tmp_path, monkeypatch):
    from planner.runs.signature import signature

    rows = healthy()
    for metric, values in series.items():
        for r, v in zip(rows, values):
            r[metric] = v
    sig = signature(verl_jsonl(rows, tmp_path, monkeypatch, name))
    found = {p["fault"]: p for p in sig["precursors"]}[name]
    expected = {"entropy-slope": 25 + 3, "mismatch-growth": 25 + 2}.get(name, 25)  # row of the first firing: 2 x 0.9^4 <= 0.7 x 2; a third rise
    assert found["onset_step"] == expected + 1 and found["source_key"] == key, found  # verl's steps start at 1
    others = [p for p in sig["precursors"] if p["onset_step"] is not None and p["fault"] != name]
    assert others == [], others


def test_a_healthy_run_shows_no_precursor_and_a_missing_metric_says_not_logged(tmp_path, monkeypatch):
    from planner.runs.signature import render_signature, signature

    sig = signature(verl_jsonl(healthy(), tmp_path, monkeypatch, "healthy"))
    assert sig["fault"] is None
    assert [p["fault"] for p in sig["precursors"] if p["onset_step"] is not None] == []
    assert all(p["logged"] for p in sig["precursors"])  # every metric of every precursor is in the log
    text = render_signature(sig)
    assert "precursors (signals reported before a collapse; not faults)" in text and "rollout_corr/rollout_is_std" in text
    bare = precursors(np.arange(10), {"grad_norm": np.ones(10)})
    assert [p.logged for p in bare] == [False] * len(PRECURSORS)


def test_thresholds_are_the_documented_ones():
    """verl's rollout-correction guide: IS-weight SD above 1.0 or ESS below 0.3 is high spread, a mean
    weight outside [0.5, 2.0] is far from 1, a token chi-squared above 1.0 a severe shift."""
    steps = np.arange(8)
    at = lambda name, **m: {p.fault: p for p in precursors(steps, {k: np.asarray(v, float) for k, v in m.items()})}[name].onset  # noqa: E731
    assert at("is-weight-spread", is_weight_std=[1.0] * 4 + [1.01] * 4) == 4
    assert at("is-weight-spread", is_ess=[0.3] * 5 + [0.29] * 3) == 5
    assert at("is-weight-mean", is_weight_mean=[0.5, 2.0, 1.0, 0.49, 1, 1, 1, 1]) == 3
    assert at("chi2-divergence", chi2_token=[1.0] * 6 + [1.01] * 2) == 6
