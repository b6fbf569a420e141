"""Job validation and the response-length model."""

from __future__ import annotations

import numpy as np
import pytest

from planner.cost.lengths import LengthModel
from planner.errors import SpecError
from planner.specs import Job, Lengths


def test_default_job_round_trips_through_yaml_dict():
    job = Job()
    again = Job.from_dict(job.to_dict())
    assert again == job
    assert job.num_sequences == 8192 and job.max_sequence_tokens == 256 + 3072


@pytest.mark.parametrize(
    "data,message",
    [
        ({"algorithm": "sft"}, "'sft' is not one of grpo, ppo, dapo"),
        ({"precision": "int8"}, "precision"),
        ({"response_tokens": {"mean": 5000, "max": 3072}}, "need 0 < mean <= max"),
        ({"response_tokens": {"mean": 100}}, "missing required key(s) 'max'"),
        ({"train_layout": {"tp": 2, "dp": 4}}, "unknown key(s) 'dp'"),
        ({"offload": {"params": "yes"}}, "expected true or false"),
        ({"prompts_per_step": 0}, "must be >= 1"),
        ({"rollout_memory_utilization": 1.5}, "must lie in"),
        ({"mini_batches": 4}, "skip_old_logprob: true needs one optimizer step per RL step"),
        ({"response_tokens": {"mean": 3000, "max": 2000}}, "job.response_tokens: need 0 < mean <= max"),
    ],
)
def test_bad_jobs_are_rejected_with_the_reason(data, message):
    with pytest.raises(SpecError) as err:
        Job.from_dict(data)
    assert message in str(err.value)


@pytest.mark.parametrize("mean,cap", [(1576.6, 3072), (300, 8192), (7344.973, 32768)])
def test_truncated_gamma_matches_the_stated_mean(mean, cap):
    model = LengthModel.from_spec(Lengths(mean=mean, max=cap))
    assert model.mean == pytest.approx(mean, rel=0.01)
    assert np.all(np.diff(model.survival) <= 1e-12)  # the live batch only shrinks
    assert 0 <= model.p_at_max < 1


def test_mean_at_the_cap_means_every_response_runs_to_it():
    model = LengthModel.from_spec(Lengths(mean=3072, max=3072))
    assert model.mean == 3072 and np.all(model.survival == 1.0)
    near = LengthModel.from_spec(Lengths(mean=3039.8, max=3072))  # the random-weight DeepSeek run
    assert near.mean == pytest.approx(3039.8, rel=1e-3) and near.p_at_max > 0.8


@pytest.mark.parametrize("mean,cap", [(1576.6, 3072), (7344.973, 32768), (3072, 3072)])
def test_expected_longest_of_a_micro_batch(mean, cap):
    """E[max of n lengths] against sampling the same distribution: n = 1 is the mean, it grows with n
    and never passes the cap."""
    model = LengthModel.from_spec(Lengths(mean=mean, max=cap))
    assert model.expected_max(1) == pytest.approx(model.mean, rel=1e-9)
    draws = np.random.default_rng(0).choice(model.pmf_lengths, p=model.pmf, size=(20000, 8)).max(axis=1)
    assert model.expected_max(8) == pytest.approx(draws.mean(), rel=0.01)
    values = [model.expected_max(n) for n in (1, 2, 8, 64)]
    assert values == sorted(values) and values[-1] <= cap


def test_dispatch_delays_name_their_passes():
    job = Job.from_dict({"dispatch_s": {"reference": 57, "update": 73}})
    assert dict(job.dispatch_s) == {"reference": 57.0, "update": 73.0}
    assert Job.from_dict(job.to_dict()) == job
    with pytest.raises(SpecError, match=r"unknown key\(s\) 'rollout'"):
        Job.from_dict({"dispatch_s": {"rollout": 5}})
    with pytest.raises(SpecError, match="expected a mapping"):
        Job.from_dict({"dispatch_s": 5})
    with pytest.raises(SpecError, match="dispatch_s.update"):
        Job.from_dict({"dispatch_s": {"update": -1}})
    assert Job.from_dict({"dispatch_s": None}).dispatch == {}
    assert Job.from_dict({"dispatch_s": {"update": 73, "reference": 57}}) == job  # order does not matter
    with pytest.raises(SpecError, match="names a pass twice"):
        Job(dispatch_s=(("update", 1.0), ("update", 2.0)))
