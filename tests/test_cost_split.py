"""`CostModel.train` and `.rollout` assemble their records from one method per term: the records'
totals are exactly the sums of the terms they report, and each term method gives what the record
holds."""

from __future__ import annotations

import numpy as np
import pytest

from planner.catalog import load_accelerator, load_model
from planner.cost.layouts import enumerate_rollout, enumerate_train
from planner.cost.model import CostModel
from planner.specs import Job

JOBS = {
    "grpo": Job(),
    "ppo": Job(algorithm="ppo", skip_old_logprob=False, ppo_epochs=2, mini_batches=2, recompute="moe",
               dispatch_s=(("update", 1.5), ("reference", 0.5), ("old_logprob", 0.25))),
    "swap": Job(optimizer_swap=True, recompute="selective"),
    "host_adam": Job(optimizer_offload_fraction=0.5, weight_sync="shard"),
}  # fmt: skip


@pytest.fixture(scope="module")
def arch():
    return load_model("qwen3-30b-a3b")


@pytest.mark.parametrize("name", sorted(JOBS))
def test_update_time_is_the_sum_of_its_terms(arch, name):
    job = JOBS[name]
    model = CostModel(arch, load_accelerator("ascend-910b2"), job)
    cand = enumerate_train(arch, 32, max_tp=8)
    te = model.train(cand)
    terms = (te.update_compute_s + te.update_bubble_s + te.update_a2a_s + te.update_etp_s + te.update_tp_s
             + te.update_sync_s + te.update_swap_s + te.update_host_adam_s)  # fmt: skip
    assert np.array_equal(te.update_s, terms * float(job.trained_models) + job.dispatch.get("update", 0.0))
    assert np.array_equal(te.switch_train_s, te.switch_host_s + te.switch_gather_s)
    assert (te.update_swap_s > 0).all() == job.optimizer_swap
    assert (te.update_host_adam_s > 0).all() == (job.optimizer_offload_fraction > 0)
    assert (te.switch_gather_s > 0).all() == (job.weight_sync != "shard")


def test_term_methods_give_the_record(arch):
    job = JOBS["ppo"]
    model = CostModel(arch, load_accelerator("h100-sxm"), job)
    cand = enumerate_train(arch, 16, max_tp=8)
    te = model.train(cand)
    g = model._grid(cand)
    mb = model._micro_batches(g)
    rc = model._recompute()
    slow = model._compute_slowdown(g, mb)
    comp = model._compute_times(g, slow.slow, rc)
    assert np.array_equal(te.compute_slowdown, slow.slow)
    assert np.array_equal(te.update_compute_s, comp.update)
    assert np.array_equal(te.update_bubble_s, comp.update * (g.pp - 1) / mb.m)
    assert np.array_equal(te.update_a2a_s, model._ep_all_to_all(g, mb, rc).update)
    assert np.array_equal(te.update_tp_s, model._tp_comm(g, mb, rc).update)
    assert np.array_equal(te.update_etp_s, model._expert_tp_comm(g, mb, rc).update)
    assert np.array_equal(te.micro_batches, mb.m)
    assert te.update_flops == comp.flops == pytest.approx(3.0 * job.ppo_epochs * model.forward_flops_per_step() * (1 + rc.fwd / 3))
    # forward-only passes: one forward of compute, its bubble and one pass of each collective
    fwd = (comp.forward + comp.forward * (g.pp - 1) / mb.m + model._ep_all_to_all(g, mb, rc).per_pass
           + model._expert_tp_comm(g, mb, rc).per_pass + model._tp_comm(g, mb, rc).per_pass)  # fmt: skip
    assert np.array_equal(te.values_s, fwd)
    assert np.array_equal(te.old_logprob_s, fwd + job.dispatch["old_logprob"])


def test_rollout_time_is_prefill_plus_decode(arch):
    job = Job(algorithm="dapo", rollout_oversampling=2.0)
    model = CostModel(arch, load_accelerator("h100-sxm"), job)
    cand = enumerate_rollout(arch, 16, max_tp=8)
    ro = model.rollout(cand)
    assert np.array_equal(ro.rollout_s, ro.prefill_s + ro.decode_s)
    r = model._rollout_grid(cand)
    kv = model._kv_concurrency(cand, r, model._rollout_workspace(r), 0.0)
    step_fixed = model._decode_step_fixed(r)
    decode, extra = model._decode(r, kv, step_fixed)
    assert np.array_equal(ro.prefill_s, model._prefill(r, kv) * 2.0)
    assert np.array_equal(ro.decode_s, decode * 2.0)
    assert np.array_equal(ro.decode_steps, (float(sum(model.lengths.bin_steps)) + extra) * 2.0)
    assert np.array_equal(ro.decode_overhead_s, ro.decode_steps * step_fixed)
    assert np.array_equal(ro.concurrency, kv.conc)
