"""Trainer releases: the passes a job asks for against what the named release can do, and each
trainer's own default for the old log-prob pass (facts from the trainers' code at their tags,
planner/trainer_versions.py)."""

from __future__ import annotations

import pytest

from planner.errors import SpecError
from planner.specs import Job
from planner.trainer_versions import release


@pytest.mark.parametrize(
    "trainer, version, old_skip, ref_skip, offload",
    [
        ("verl", "0.2", False, True, False),
        ("verl", "0.6.0", False, True, False),  # 0.6.0's on-policy shortcut changes the loss, not the pass
        ("verl", "0.6.1", True, True, False),  # bypass_mode
        ("verl", "v0.9.1", True, True, False),
        ("nemo-rl", "0.4.0", False, False, True),  # optimizer to host and back around the log-prob pass
        ("nemo-rl", "0.5.0", False, False, False),
        ("nemo-rl", "0.6.0", False, True, False),  # skip_reference_policy_logprobs_calculation
        ("nemo-rl", "0.7.0", True, True, False),  # force_on_policy_ratio skips the pass
        ("mindspeed-rl", "1.0", False, True, False),
        ("mindspeed-rl", "2.1.0", True, True, False),
    ],
)
def test_release_facts(trainer, version, old_skip, ref_skip, offload):
    r = release(trainer, version)
    assert (r.old_logprob_skip is not None, r.reference_skip is not None, r.logprob_optimizer_offload) == (old_skip, ref_skip, offload)


def test_a_job_cannot_skip_what_its_release_always_runs():
    with pytest.raises(SpecError, match=r"verl 0\.6\.0 always runs the old log-prob pass \(bypass_mode came in verl 0\.6\.1\)"):
        Job.from_dict({"trainer": "verl", "trainer_version": "0.6.0", "skip_old_logprob": True})
    with pytest.raises(SpecError, match=r"nemo-rl 0\.6\.0 always runs the old log-prob pass"):
        Job.from_dict({"trainer": "nemo-rl", "trainer_version": "0.6.0", "skip_old_logprob": True})
    with pytest.raises(SpecError, match=r"nemo-rl 0\.5\.0 always computes the reference log-probs"):
        Job.from_dict({"trainer": "nemo-rl", "trainer_version": "0.5.0", "reference_model": False, "skip_old_logprob": False})
    assert Job.from_dict({"trainer": "verl", "trainer_version": "0.6.1", "skip_old_logprob": True}).skip_old_logprob
    assert not Job.from_dict({"trainer": "nemo-rl", "trainer_version": "0.6.0", "reference_model": False}).reference_model


def test_each_trainers_default_for_the_old_logprob_pass():
    """Without skip_old_logprob in the job, the named trainer's default: verl and NeMo RL run the pass;
    MindSpeed-RL 2.0 and later skips it by itself when the step is one optimizer step."""
    assert Job().skip_old_logprob  # no trainer named: the on-policy shortcut, as before
    assert not Job.from_dict({"trainer": "verl"}).skip_old_logprob
    assert not Job.from_dict({"trainer": "nemo-rl", "trainer_version": "0.7.0"}).skip_old_logprob
    assert Job.from_dict({"trainer": "mindspeed-rl"}).skip_old_logprob
    assert not Job.from_dict({"trainer": "mindspeed-rl", "mini_batches": 2}).skip_old_logprob
    assert not Job.from_dict({"trainer": "mindspeed-rl", "trainer_version": "1.0"}).skip_old_logprob


@pytest.mark.parametrize(
    "data, message",
    [
        ({"trainer_version": "0.6.1"}, "trainer_version 0.6.1 needs trainer"),
        ({"trainer": "openrlhf"}, "trainer: 'openrlhf' is not one of verl, nemo-rl, mindspeed-rl"),
        ({"trainer": "verl", "trainer_version": "latest"}, "trainer_version 'latest': expected a release number"),
    ],
)
def test_bad_trainer_fields_name_the_problem(data, message):
    with pytest.raises(SpecError, match=message):
        Job.from_dict(data)


def test_verls_bypass_mode_skips_the_pass_for_any_number_of_optimizer_steps():
    """verl's bypass mode takes the rollout's log-probs as the old policy's in every optimizer step
    (ray_trainer: old_log_probs = rollout_log_probs, no recompute), so a verl job may skip the pass
    with several mini-batches; a job that names no trainer (or another) may not: its skip is the
    on-policy one, where the old log-probs equal the detached current."""
    job = Job.from_dict({"trainer": "verl", "mini_batches": 4, "skip_old_logprob": True})
    assert job.skip_old_logprob and job.mini_batches == 4
    for data in ({"mini_batches": 4}, {"trainer": "nemo-rl", "trainer_version": "0.7", "mini_batches": 4}):
        with pytest.raises(SpecError, match="needs one optimizer step per RL step"):
            Job.from_dict({**data, "skip_old_logprob": True})


def test_the_step_follows_the_release(tmp_path):
    """The same job on verl 0.6.0 and 0.6.1 with bypass mode: the old log-prob pass is timed on the
    first and gone on the second; the output says which and why."""
    import json

    from click.testing import CliRunner

    from planner.cli import main

    def step(job: str):
        path = tmp_path / "job.yaml"
        path.write_text(job)
        out = CliRunner().invoke(main, ["cost", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--cards", "16", "--job", str(path), "--json"])
        assert out.exit_code == 0, out.output
        return json.loads(out.stdout)

    old = step("trainer: verl\ntrainer_version: 0.6.0\n")
    new = step("trainer: verl\ntrainer_version: 0.6.1\nskip_old_logprob: true\n")
    assert old["phase_times_s"]["old_logprob"] > 0 and new["phase_times_s"]["old_logprob"] == 0
    assert "verl 0.6.0 runs the old log-prob pass; this release cannot skip it" in old["notes"]


@pytest.mark.parametrize(
    "trainer, version, path",
    [
        ("verl", "0.7.0", "gather"),  # vLLM in the trainer's process, loaded tensor by tensor
        ("verl", "0.7.1", "packed"),  # vLLM in its own process, one shared bucket (PR #4280)
        ("nemo-rl", "0.3.1", "gather"),
        ("nemo-rl", "0.4.0", "packed"),  # ZMQ buffers colocated, packed broadcast between pools
        ("mindspeed-rl", "2.3.0", "gather"),
    ],
)
def test_the_weight_sync_path_follows_the_release_unless_the_job_sets_it(trainer, version, path):
    assert release(trainer, version).weight_sync == path
    job = {"trainer": trainer, "trainer_version": version, "skip_old_logprob": False}
    assert Job.from_dict(job).weight_sync == path
    assert Job(**{**job, "skip_old_logprob": False}).weight_sync == path  # built directly, the same resolution
    assert Job.from_dict({**job, "weight_sync": "shard"}).weight_sync == "shard"
    assert Job.from_dict({"trainer": trainer}).weight_sync == "gather"  # no release named: the per-tensor path


def test_packed_sync_is_the_same_bytes_without_the_cost_per_tensor():
    """DeepSeek-V3 on 512 H100: the packed refit prices the gather's bytes as the per-tensor one
    does and drops exactly weight tensors x switch_tensor_s, colocated and between pools alike."""
    from planner.catalog import load_accelerator, load_model
    from planner.cost.evaluate import evaluate
    from planner.cost.model import CostModel

    arch, accel = load_model("deepseek-v3"), load_accelerator("h100-sxm")
    base = {"train_layout": {"tp": 1, "pp": 16, "ep": 16}, "rollout_layout": {"tp": 32, "dp": 1}, "recompute": "full"}
    for extra in ({}, {"colocated": False, "rollout_devices": 256, "max_staleness": 1}):
        gather, packed = (evaluate(arch, accel, Job.from_dict({**base, **extra, "weight_sync": w}), 512, memory_margin=0.0) for w in ("gather", "packed"))
        per_tensor = CostModel(arch, accel, gather.job)
        saved = per_tensor.weight_tensors * per_tensor.knobs.switch_tensor_s
        phase = "switch" if not extra else "weight_sync"
        assert gather.phase_times_s[phase] - packed.phase_times_s[phase] == pytest.approx(saved, rel=1e-9), extra
        assert saved > 10  # 30k tensors: the term is worth modelling
