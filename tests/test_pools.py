"""Separate rollout and training pools (colocated: false): the split, the weight sync between the
pools, and the step as the pipeline it is, cross-checked against a small event simulation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.arch import Architecture
from planner.catalog import load_accelerator, load_model_config
from planner.cost.evaluate import evaluate
from planner.errors import SpecError
from planner.specs import Job, Lengths

JOB = Job(prompts_per_step=64, samples_per_prompt=16)


@pytest.fixture(scope="module")
def setup():
    name, config = load_model_config("qwen3-30b-a3b")
    return Architecture.from_config(config, name=name), load_accelerator("h20")


def simulate(generate: float, train: float, sync: float, staleness: int, steps: int = 400, partial: bool = False) -> tuple[float, float, float]:
    """Event times of the pipeline, step by step: batch i is generated with the weights of step
    i - staleness (so it waits for that sync), training step i waits for its batch and the previous
    sync, and a sync waits for the training step and for the rollout to finish the last batch it
    may generate before new weights (i + staleness). With partial rollout the engine never waits for
    weights (they arrive in flight) and a sync waits for training alone; generation of batch i may
    start once training has taken batch i - staleness - 1 off the queue. Returns the steady-state
    step and each pool's busy share over the last half."""
    gen_done, train_done, sync_done = {}, {}, {}

    def weights_ready(i: int) -> float:  # the sync that delivers the weights batch i is generated with
        j = i - staleness - 1
        return sync_done[j] if j >= 0 else 0.0

    for i in range(staleness + 1):
        gen_done[i] = (gen_done.get(i - 1, 0.0) if i else 0.0) + generate
    for i in range(steps):
        train_done[i] = max(sync_done.get(i - 1, 0.0), gen_done[i]) + train
        nxt = i + staleness + 1
        if partial:
            sync_done[i] = train_done[i] + sync
            gen_done[nxt] = max(gen_done[nxt - 1], train_done[i] - train) + generate
            continue
        sync_done[i] = max(train_done[i], gen_done[i + staleness]) + sync
        gen_done[nxt] = max(gen_done[nxt - 1], weights_ready(nxt)) + generate
    half = steps // 2
    period = (sync_done[steps - 1] - sync_done[half - 1]) / (steps - half)
    return period, generate / period, train / period


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_the_step_is_the_pipelines_and_the_simulation_agrees(setup, staleness):
    """On-policy the pools take turns (every phase adds up); with staleness k >= 1 generation of
    step t + k overlaps training of step t and the step is the slower pool's work plus the sync;
    the event simulation of the same phases gives the same steady-state step and busy shares."""
    arch, accel = setup
    r = evaluate(arch, accel, replace(JOB, colocated=False, max_staleness=staleness), 32)
    assert r.feasible and r.pools["rollout_devices"] + r.pools["train_devices"] == 32
    p = r.phase_times_s
    generate, train = p["rollout"] + p["reward"], p["reference"] + p["old_logprob"] + p["update"]
    want = generate + train + p["weight_sync"] if staleness == 0 else max(generate, train) + p["weight_sync"]
    assert r.step_time_s == pytest.approx(want, rel=1e-12) and "switch" not in p
    period, gen_busy, train_busy = simulate(generate, train, p["weight_sync"], staleness)
    assert period == pytest.approx(r.step_time_s, rel=1e-9)
    assert (gen_busy, train_busy) == pytest.approx((r.pools["rollout_busy"], r.pools["train_busy"]), rel=1e-9)
    assert r.pools["policy_lag_steps"] == staleness and "training_states_kept" not in r.memory_per_device_bytes["rollout"]
    assert r.device_hours_per_step == pytest.approx(32 * r.step_time_s / 3600)


def test_the_search_takes_the_split_with_the_shortest_step(setup):
    """Unset rollout_devices: every split in whole cards within one node of 8 is costed and the
    shortest step is taken (checked against each split given explicitly); the split given is kept."""
    arch, accel = setup
    job = replace(JOB, colocated=False, max_staleness=1)
    best = evaluate(arch, accel, job, 16)
    steps = {}
    for n in range(8, 16, 8):  # 16 devices are two nodes of 8: splits in whole nodes
        r = evaluate(arch, accel, replace(job, rollout_devices=n), 16)
        if r.feasible:
            steps[n] = r.step_time_s
    assert steps and best.step_time_s == pytest.approx(min(steps.values())) and best.pools["rollout_devices"] == min(steps, key=steps.get)
    fixed = evaluate(arch, accel, replace(job, rollout_devices=8), 16)
    assert fixed.pools["rollout_devices"] == 8 and "separate pools: 8 rollout + 8 training gpus" in fixed.notes[0]
    compute = next(t for t in fixed.terms if t["term"] == "compute")  # the update runs on the training pool
    assert " / (8 x " in compute["inputs"]


def test_off_policy_pools_beat_on_policy_pools_and_nothing_is_offloaded(setup):
    """Overlapping the pools can only shorten the step; separate pools keep their states on the
    device (no host moves, no switch), and the weight sync is the gather plus the bf16 model over
    the network between them."""
    arch, accel = setup
    on = evaluate(arch, accel, replace(JOB, colocated=False), 32)
    off = evaluate(arch, accel, replace(JOB, colocated=False, max_staleness=1), 32)
    assert off.step_time_s <= on.step_time_s
    sync = {t["term"]: t["seconds"] for t in off.terms if t["phase"] == "weight_sync"}
    assert sum(sync.values()) == pytest.approx(off.phase_times_s["weight_sync"])
    from planner.arch.params import count_parameters

    assert sync["sent across the pools"] == pytest.approx(count_parameters(arch).total * 2 / accel.inter_node_bytes_per_s, rel=1e-9)


@pytest.mark.parametrize("staleness", [1, 4])
def test_partial_rollout_hides_the_sync_behind_generation_and_pays_the_tail_once_for_the_queue(setup, staleness):
    """With partial rollout (NeMo RL's in-flight weight updates, verl's fully-async) the step is the
    slower of generation and training + sync, as the event simulation gives; one step's rollout is
    the rollout of staleness + 1 steps' sequences over staleness + 1, never longer than a batch's own."""
    arch, accel = setup
    base = replace(JOB, colocated=False, max_staleness=staleness, rollout_devices=16)
    whole, partial = evaluate(arch, accel, base, 32), evaluate(arch, accel, replace(base, partial_rollout=True), 32)
    assert whole.feasible and partial.feasible
    p = partial.phase_times_s
    generate, train = p["rollout"] + p["reward"], p["reference"] + p["old_logprob"] + p["update"]
    assert partial.step_time_s == pytest.approx(max(generate, train + p["weight_sync"]), rel=1e-12)
    period, gen_busy, _ = simulate(generate, train, p["weight_sync"], staleness, partial=True)
    assert period == pytest.approx(partial.step_time_s, rel=1e-9) and gen_busy == pytest.approx(partial.pools["rollout_busy"], rel=1e-9)
    assert p["rollout"] <= whole.phase_times_s["rollout"] and partial.step_time_s <= whole.step_time_s
    with pytest.raises(SpecError, match="partial_rollout generates ahead of training"):
        replace(JOB, colocated=False, partial_rollout=True)


def test_pool_settings_are_checked(setup):
    arch, accel = setup
    with pytest.raises(SpecError, match="set colocated: false with them"):
        replace(JOB, rollout_devices=8)
    with pytest.raises(SpecError, match="max_staleness: must be >= 0"):
        Job.from_dict({"colocated": False, "max_staleness": -1})
    with pytest.raises(SpecError, match="rollout_devices 32 leaves no training pool on 32 gpus"):
        evaluate(arch, accel, replace(JOB, colocated=False, rollout_devices=32), 32)
    assert not evaluate(arch, accel, replace(JOB, colocated=False), 1).feasible  # one device cannot be split


def test_suggest_keeps_a_separate_pool_job_on_pools_and_searches_pools_for_a_colocated_one(tmp_path):
    """A production run on separate pools one step off-policy (verl's fully-async style): every plan
    keeps separate pools at its staleness and says so, the split is recorded in the plan's job, and
    the export refuses to write it as a colocated config. A colocated job's search space holds the
    on-policy pool placement next to the offload settings."""
    import json

    import yaml
    from click.testing import CliRunner

    from planner.cli import main
    from planner.search.suggest import POOLS, Request, Suggester

    job = tmp_path / "job.yaml"
    job.write_text("prompts_per_step: 64\nsamples_per_prompt: 16\ncolocated: false\nmax_staleness: 1\n")
    out = tmp_path / "plan.yaml"
    result = CliRunner().invoke(main, ["suggest", "--hardware", "h20", "--budget", "32gpu", "--job", str(job), "--json", "-o", str(out)],
                                catch_exceptions=False)  # fmt: skip
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout)["plans"]
    assert plans and all(p["offload"] == POOLS for p in plans)
    assert any("separate pools:" in n and "trained 1 step(s) after" in n for n in plans[0]["notes"])
    deployment = yaml.safe_load(out.read_text())["deployment"]
    assert deployment["job"]["colocated"] is False and deployment["job"]["max_staleness"] == 1
    assert 0 < deployment["job"]["rollout_devices"] < deployment["num_cards"]
    refused = CliRunner().invoke(main, ["export", str(out), "--to", "verl", "--model-path", "/p"])
    assert refused.exit_code == 2 and "the export writes colocated configs only" in refused.output
    space = Suggester(Request(model="qwen3-30b-a3b", hardware="h20", budget="32gpu")).space()
    assert POOLS in space["offload"] and "all" in space["offload"]


def test_suggest_proposes_separate_pools_where_they_beat_every_colocated_setting_and_says_so(tmp_path):
    """Short responses on H100 (the rollout a small share of the step, the colocated switch a large
    one): the cheapest proxy runs on separate on-policy pools, and the plan says by how much they beat
    the best colocated setting of the same proxy on the same devices, checked here against the cost
    model's own colocated points."""
    import json

    from click.testing import CliRunner

    from planner.cli import main
    from planner.search.suggest import OFFLOADS, POOLS

    job = tmp_path / "job.yaml"
    job.write_text("prompts_per_step: 128\nsamples_per_prompt: 16\nresponse_tokens: {mean: 300, max: 480}\n")
    result = CliRunner().invoke(main, ["suggest", "--hardware", "h100-sxm", "--budget", "16gpu", "--job", str(job), "--job-bounds", "batch=1,length=1",
                                       "--json"], catch_exceptions=False)  # fmt: skip
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout)["plans"]
    best = plans[0]
    assert best["offload"] == POOLS and best["layout"]["rollout"] is not None
    name, config = load_model_config("qwen3-30b-a3b")
    arch = Architecture.from_config(config, name=name).with_experts(best["experts"])
    base = replace(Job(prompts_per_step=128, samples_per_prompt=16), response_tokens=Lengths(mean=300, max=480), recompute=best["recompute"])
    colocated = [c.step_time_s for o in OFFLOADS.values() if (c := evaluate(arch, load_accelerator("h100-sxm"), replace(base, offload=o),
                                                                            best["num_cards"])).feasible]  # fmt: skip
    assert colocated and best["step_time_s"] < min(colocated)
    assert f"{best['step_time_s']:,.0f} s a step against {min(colocated):,.0f} s colocated" in best["placement"]
    assert "faster by" in best["placement"]
    assert all((p["placement"] is not None) == (p["offload"] == POOLS) for p in plans)
    backing = json.loads(result.stdout)["feature_validation"]
    assert [v["feature"] for v in backing] == ["separate pools"] and backing[0]["family"] == "nvidia" and backing[0]["runs"] > 0


def test_what_no_fitted_run_has_is_backed_by_the_validation_rows_that_have_it(tmp_path):
    """A job with separate pools, speculative decoding or an FP8 rollout rests on the published
    validation rows with the same feature (no fitted run has one: checked here), each predicted with
    the stored knobs; the counts and the rows outside 25% follow from those predictions, a family
    without such a row says so, and `planner cost` prints it all."""
    import json

    from click.testing import CliRunner

    from planner.cli import main
    from planner.cost.fit import JOB_FEATURES, feature_validation, load_runs, predict
    from planner.cost.knobs import load_knobs
    from planner.specs import Speculative

    assert not [(r.id, name) for r in load_runs() for name, has in JOB_FEATURES.items() if has(r.job)]
    assert feature_validation(Job(), "nvidia") == []
    pools = replace(Job(), colocated=False, max_staleness=1)
    [v] = feature_validation(pools, "nvidia")
    rows = [r for r in load_runs(section="validation") if r.family == "nvidia" and not r.job.colocated]
    ratios = {r.id: predict(r, load_knobs("nvidia")).step_time_s / r.published["step"] for r in rows}
    assert v["feature"] == "separate pools" and v["runs"] == len(rows) >= 5
    assert v["runs_within_25"] == sum(abs(x - 1) <= 0.25 for x in ratios.values())
    assert v["outside"] == {k: round(x, 3) for k, x in ratios.items() if abs(x - 1) > 0.25}
    assert v["worst_step"] == pytest.approx(max(abs(x - 1) for x in ratios.values()))
    spec = replace(Job(), speculative=Speculative(method="sam", draft_tokens=3, accept_length=2.0))
    [ascend] = feature_validation(spec, "ascend")
    assert ascend["runs"] == 1 and ascend["feature"] == "speculative decoding"
    [nvidia] = feature_validation(spec, "nvidia")
    assert nvidia["runs"] == 0 and nvidia["worst_step"] is None and nvidia["outside"] == {}
    from planner.summary import feature_validation_lines
    assert "not validated on nvidia" in feature_validation_lines([nvidia])[0]
    job = tmp_path / "job.yaml"
    job.write_text("prompts_per_step: 64\nsamples_per_prompt: 16\ncolocated: false\nmax_staleness: 1\n")
    args = ["cost", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--cards", "32", "--job", str(job), "--memory-margin", "0"]
    text = CliRunner().invoke(main, args, catch_exceptions=False)
    assert text.exit_code == 0, text.output
    assert f"separate pools: {v['runs_within_25']} of {v['runs']} published nvidia runs with it within 25%" in text.output
    assert all(rid in text.output for rid in v["outside"])
    out = CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False)
    assert json.loads(out.stdout)["feature_validation"] == json.loads(json.dumps([v]))


def test_an_evaluator_kept_across_device_counts_gives_what_evaluate_gives(setup):
    """`evaluator` keeps the layouts and each pool size's estimate between device counts (a search
    over counts meets the same pool sizes again): every count, asked again and in another order,
    gives the result a fresh `evaluate` gives."""
    from planner.cost.evaluate import evaluator

    arch, accel = setup
    for job in (replace(JOB, colocated=False, max_staleness=1), JOB):
        run = evaluator(arch, accel, job)
        for devices in (16, 32, 24, 16, 32):
            kept, fresh = run(devices), evaluate(arch, accel, job, devices)
            assert kept.to_json() == fresh.to_json(), (job.colocated, devices)
    with pytest.raises(SpecError, match="--cards must be >= 1"):
        evaluator(arch, accel, JOB)(0)
