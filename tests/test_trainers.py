"""Trainer configs out and in: every key planner exports exists in the trainer's own config (verl:
the YAML the verl package ships; MindSpeed-RL and NeMo RL: their published GRPO configs), and
`job --from` reads an export back to the plan's job and layouts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from planner.cli import main

TRAINERS = ("verl", "mindspeed-rl", "nemo-rl")


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """A plan from `planner suggest -o` (4 devices on one node) and the same on 16 devices (two nodes)."""
    root = tmp_path_factory.mktemp("export")
    assert run_cli("suggest", "--budget", "8npu", "-o", root / "plan.yaml").exit_code == 0
    data = yaml.safe_load((root / "plan.yaml").read_text())
    # pinned to one node of 4, whatever layout the cost model prefers today: a rollout without DP
    # (MindSpeed-RL's generate_config has none) and no expert TP
    data["deployment"].update(num_cards=4, train_layout={"tp": 2, "pp": 2, "ep": 1, "cp": 1, "etp": 1},
                              rollout_layout={"tp": 4, "dp": 1, "ep": 4})  # fmt: skip
    (root / "plan.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    data["deployment"].update(num_cards=16, train_layout={"tp": 4, "pp": 2, "ep": 2, "cp": 1, "etp": 1}, recompute="full")
    data["deployment"]["job"].update(recompute="full", mini_batches=2, ppo_epochs=1, skip_old_logprob=False,
                                     optimizer_offload_fraction=0.5, rollout_graphs=False, rollout_max_seqs=64)
    (root / "wide.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return root / "plan.yaml", root / "wide.yaml"


def verl_config() -> dict:
    """The flattened Megatron trainer config shipped inside the verl package (read, never imported),
    with the mappings it leaves open (`{}`, e.g. override_optimizer_config) as keys ending in '.'."""
    from planner.runs.trainers import flatten

    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip("the verl package is not installed (make venv installs it without its dependencies)")
    path = Path(spec.origin).parent / "trainer" / "config" / "_generated_ppo_megatron_trainer.yaml"
    tree = yaml.safe_load(path.read_text())

    def open_mappings(node, prefix=""):
        for k, v in node.items() if isinstance(node, dict) else ():
            if v == {}:
                yield f"{prefix}{k}."
            yield from open_mappings(v, f"{prefix}{k}.")

    return {**flatten(tree), **{k: {} for k in open_mappings(tree)}}


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_exported_key_exists_in_the_trainers_config(plans, trainer):
    from planner.plan import load_plan
    from planner.runs.trainers import export_plan, published_keys

    known = set(verl_config()) if trainer == "verl" else set(published_keys()[trainer]["keys"])
    for path in plans:
        replay = trainer != "mindspeed-rl"
        _, flat = export_plan(load_plan(path), trainer, "/ckpt/proxy", routing_replay=replay)
        unknown = sorted(k for k in set(flat) - known if not any(k.startswith(o) for o in known if o.endswith(".")))
        assert not unknown, f"{trainer}: keys not in its config: {unknown}"


@pytest.mark.parametrize("trainer", TRAINERS)
def test_job_from_reads_the_export_back(plans, trainer, tmp_path):
    from planner.plan import load_plan
    from planner.specs import Job, RolloutLayout, TrainLayout

    for path in plans:
        plan = load_plan(path)
        out = tmp_path / f"{trainer}.cfg"
        assert run_cli("export", path, "--to", trainer, "--model-path", "/ckpt/proxy", "-o", out, "--force").exit_code == 0
        result = run_cli("job", "--from", trainer, out, "-o", tmp_path / "job.yaml", "--force")
        assert result.exit_code == 0, result.output
        got = Job.from_dict({k: v for k, v in yaml.safe_load((tmp_path / "job.yaml").read_text()).items()})
        want, d = Job.from_dict(plan.deployment["job"]), plan.deployment
        assert got.train_layout == TrainLayout.from_dict(d["train_layout"]) and got.rollout_layout == RolloutLayout.from_dict(d["rollout_layout"])
        same = ["prompts_per_step", "samples_per_prompt", "precision", "mini_batches", "ppo_epochs", "rollout_memory_utilization", "max_sequence_tokens"]
        if trainer != "nemo-rl":  # NeMo RL keeps one total length and only the optimizer offload
            same += ["offload", "recompute", "micro_tokens"]
        if trainer != "mindspeed-rl":  # Megatron's hybrid CPU optimizer (MindSpeed-RL swaps the optimizer instead)
            same += ["optimizer_offload_fraction"]
        if trainer == "verl":  # vLLM's enforce_eager and max_num_seqs, as verl's rollout config names them
            same += ["rollout_graphs", "rollout_max_seqs"]
            assert got.prompt_tokens.max == want.prompt_tokens.max and got.response_tokens.max == want.response_tokens.max
        assert {k: getattr(got, k) for k in same} == {k: getattr(want, k) for k in same}, trainer
        assert f"# from {trainer} config" in (tmp_path / "job.yaml").read_text() and f"{d['num_cards']} devices" in result.output


def test_export_names_the_cluster_shape_and_the_expert_map(plans, tmp_path):
    from planner.plan import load_plan
    from planner.runs.trainers import export_plan

    text, flat = export_plan(load_plan(plans[1]), "verl", "/ckpt/proxy", routing_replay=True)
    assert (flat["trainer.n_gpus_per_node"], flat["trainer.nnodes"]) == (8, 2)
    assert flat["actor_rollout_ref.actor.megatron.router_replay.mode"] == "R3" and "/ckpt/proxy/expert_map.json" in text
    assert flat["actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity"] == "full"
    assert flat["actor_rollout_ref.actor.ppo_mini_batch_size"] == 256  # 512 prompts in 2 mini-batches
    _, flat = export_plan(load_plan(plans[0]), "verl", "/ckpt/proxy")
    assert (flat["trainer.n_gpus_per_node"], flat["trainer.nnodes"]) == (4, 1)


def test_export_and_job_refuse_what_they_cannot_write(plans, tmp_path):
    plain = tmp_path / "plain.yaml"
    data = yaml.safe_load(plans[0].read_text())
    data.pop("deployment")
    plain.write_text(yaml.safe_dump(data))
    result = run_cli("export", plain, "--to", "verl", "--model-path", "/p")
    assert result.exit_code == 2 and "no deployment" in result.output
    result = run_cli("export", plans[0], "--to", "mindspeed-rl", "--model-path", "/p", "--routing-replay")
    assert result.exit_code == 2 and "no router replay key" in result.output
    out = tmp_path / "v.txt"
    assert run_cli("export", plans[0], "--to", "verl", "--model-path", "/p", "-o", out).exit_code == 0
    again = run_cli("export", plans[0], "--to", "verl", "--model-path", "/p", "-o", out)
    assert again.exit_code == 2 and "--force" in again.output
    (tmp_path / "junk.txt").write_text("just words here\n")
    result = run_cli("job", "--from", "verl", tmp_path / "junk.txt")
    assert result.exit_code == 2 and "neither a YAML config nor Hydra overrides" in result.output
    (tmp_path / "part.yaml").write_text("data:\n  train_batch_size: 64\n")
    result = run_cli("job", "--from", "verl", tmp_path / "part.yaml")
    assert result.exit_code == 2 and "not a complete verl config: missing data.max_prompt_length, data.max_response_length" in result.output


def test_moe_recompute_exports_as_megatron_recompute_modules(plans, tmp_path):
    """recompute moe is Megatron's selective recompute of the `moe` module (and the norms), selective
    that of moe_act and the norms: verl's override_transformer_config carries the modules and moe
    reads back; MindSpeed-RL's published configs cannot express moe."""
    from planner.plan import load_plan
    from planner.runs.trainers import export_plan

    data = yaml.safe_load(plans[0].read_text())
    data["deployment"]["job"]["recompute"] = "moe"
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    _, flat = export_plan(load_plan(path), "verl", "/ckpt/proxy")
    mega = "actor_rollout_ref.actor.megatron.override_transformer_config"
    assert flat[f"{mega}.recompute_granularity"] == "selective" and flat[f"{mega}.recompute_modules"] == ["moe", "layernorm"]
    assert f"{mega}.recompute_modules" in verl_config()
    data["deployment"]["job"]["recompute"] = "selective"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    _, flat = export_plan(load_plan(path), "verl", "/ckpt/proxy")
    assert flat[f"{mega}.recompute_modules"] == ["moe_act", "layernorm"]  # what the memory model's selective drops
    data["deployment"]["job"]["recompute"] = "moe"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    out = tmp_path / "verl.cfg"
    assert run_cli("export", path, "--to", "verl", "--model-path", "/p", "-o", out).exit_code == 0
    assert run_cli("job", "--from", "verl", out, "-o", tmp_path / "job.yaml").exit_code == 0
    assert yaml.safe_load((tmp_path / "job.yaml").read_text())["recompute"] == "moe"
    result = run_cli("export", path, "--to", "mindspeed-rl", "--model-path", "/p")
    assert result.exit_code == 2 and "no key for recomputing the MoE layers" in result.output
