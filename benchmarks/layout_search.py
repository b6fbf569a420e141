"""How fast the cost model evaluates layouts and finds minimum device counts.

Measures, in one run:
  1. vectorised evaluation of every valid layout of DeepSeek-V3 on up to 1024 Atlas A3 dies for every
     legal K, in layout evaluations per second;
  2. the same formulas called one layout at a time (a Python loop over arrays of length one) on a
     sample, as the baseline; the ratio is the speed-up of vectorising;
  3. the time `--min-cards` takes for DeepSeek-V3 on atlas-a3, and for Qwen3-30B-A3B on 910B2.

    python benchmarks/layout_search.py
"""

from __future__ import annotations

import time

from planner.catalog import load_accelerator, load_model
from planner.cost.evaluate import candidate_device_counts, min_devices
from planner.cost.layouts import RolloutCandidates, TrainCandidates, enumerate_rollout, enumerate_train
from planner.cost.model import CostModel
from planner.specs import Job


def main() -> None:
    accel = load_accelerator("atlas-a3")
    job = Job()
    base = load_model("deepseek-v3")
    ks = base.legal_expert_counts()
    counts = candidate_device_counts(accel, 1024)

    start = time.perf_counter()
    evaluated = 0
    sample_t, sample_r = None, None
    for k in ks:
        arch = base.with_experts(k)
        model = CostModel(arch, accel, job)
        train = TrainCandidates.concat([enumerate_train(arch, n, max_tp=16) for n in counts])
        rollout = RolloutCandidates.concat([enumerate_rollout(arch, n, max_tp=16) for n in counts])
        model.train(train)
        model.rollout(rollout)
        evaluated += len(train) + len(rollout)
        if k == base.original_num_experts:
            sample_t, sample_r, sample_model = train, rollout, model
    vector_s = time.perf_counter() - start
    print(f"DeepSeek-V3 on atlas-a3, {len(ks)} legal K x {len(counts)} device counts (2..1024 dies):")
    print(f"  {evaluated:,} layouts (train + rollout, enumeration included) in {vector_s:.2f} s = {evaluated / vector_s:,.0f} per s")

    n = 300
    start = time.perf_counter()
    for i in range(n):
        sample_model.train(TrainCandidates.single(int(sample_t.devices[i]), sample_t.layout(i)))
        sample_model.rollout(RolloutCandidates.single(int(sample_r.devices[i % len(sample_r)]), sample_r.layout(i % len(sample_r))))
    loop_s = (time.perf_counter() - start) / (2 * n)
    print(f"  one layout at a time: {1 / loop_s:,.0f} per s; vectorised is {loop_s * evaluated / vector_s:,.0f}x faster")

    for model_id, accel_id in (("deepseek-v3", "atlas-a3"), ("qwen3-30b-a3b", "ascend-910b2")):
        start = time.perf_counter()
        result = min_devices(load_model(model_id), load_accelerator(accel_id), job)
        took = time.perf_counter() - start
        print(
            f"min cards {model_id} on {accel_id}: {result.num_devices} {result.device_unit}s "
            f"({result.train_layout.describe()}; rollout {result.rollout_layout.describe()}) in {took:.3f} s"
        )


if __name__ == "__main__":
    main()
