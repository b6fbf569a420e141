"""Trainer configs out and in: every key planner exports exists in the trainer's own config (verl:
the YAML the verl package ships; MindSpeed-RL and NeMo RL: their published GRPO configs), and
`job --from` reads an export back to the plan's job and layouts."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from planner.cli import main
from planner.runs.trainers import VERL_APPENDED

TRAINERS = ("verl", "mindspeed-rl", "nemo-rl")


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """A plan from `planner suggest -o` (4 devices on one node) and the same on 16 devices (two nodes),
    at the production job (512 prompts x 16; the exports' batch figures below are its)."""
    root = tmp_path_factory.mktemp("export")
    assert run_cli("suggest", "--budget", "8npu", "--job-bounds", "batch=1,length=1", "-o", root / "plan.yaml").exit_code == 0
    data = yaml.safe_load((root / "plan.yaml").read_text())
    # pinned to one node of 4, whatever layout the cost model prefers today: experts whole over the TP
    # ranks (MindSpeed-RL's moe_tp_extend_ep) and a rollout without DP (NeMo RL's vLLM config has none)
    data["deployment"].update(num_cards=4, train_layout={"tp": 2, "pp": 2, "ep": 2, "cp": 1, "etp": 1},
                              rollout_layout={"tp": 4, "dp": 1, "ep": 4})  # fmt: skip
    (root / "plan.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    data["deployment"].update(num_cards=16, train_layout={"tp": 4, "pp": 2, "ep": 4, "cp": 1, "etp": 1}, recompute="full")
    data["deployment"]["job"].update(recompute="full", mini_batches=2, ppo_epochs=1, skip_old_logprob=False,
                                     optimizer_offload_fraction=0.5, rollout_graphs=False, rollout_max_seqs=64)
    (root / "wide.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return root / "plan.yaml", root / "wide.yaml"


def verl_config() -> dict:
    """The flattened Megatron trainer config shipped inside the verl package (read, never imported),
    with the mappings it leaves open (`{}`, e.g. override_optimizer_config) as keys ending in '.'."""

    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip("the verl package is not installed (make venv installs it without its dependencies)")
    path = Path(spec.origin).parent / "trainer" / "config" / "_generated_ppo_megatron_trainer.yaml"
    return config_keys(yaml.safe_load(path.read_text()))


def config_keys(tree: dict) -> dict:
    """A config tree's dotted keys, the mappings it leaves open as keys ending in '.'."""
    from planner.runs.trainers import flatten

    def open_mappings(node, prefix=""):
        for k, v in node.items() if isinstance(node, dict) else ():
            if v == {}:
                yield f"{prefix}{k}."
            yield from open_mappings(v, f"{prefix}{k}.")

    return {**flatten(tree), **{k: {} for k in open_mappings(tree)}}


def mindspeed_knows(key: str) -> bool:
    """A dotted key MindSpeed-RL's config classes accept (BaseConfig.update refuses any other): an
    attribute of MegatronConfig (megatron_training, actor_config, a model entry), RLConfig or
    GenerateConfig, as their source at the commit trainer_keys.yaml names defines them."""
    from planner.runs.trainers import published_keys

    known = published_keys()["mindspeed-rl"]["sections"]
    head, _, rest = key.partition(".")
    if head in ("megatron_training", "actor_config"):
        return rest == "model" or rest in known["megatron"]
    if head == "model":  # model.<entry>.<attribute>
        return rest.partition(".")[2] in known["megatron"]
    if head == "rl_config":
        return rest == "actor_resource.num_npus" or rest in known["rl"]
    if head == "generate_config":
        return rest in known["generate"] or (rest.startswith("sampling_config.") and rest.partition(".")[2] in known["sampling"])
    return key == "defaults"


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_exported_key_exists_in_the_trainers_config(plans, trainer):
    from planner.plan import load_plan
    from planner.runs.trainers import export_plan, published_keys

    known = set(verl_config()) if trainer == "verl" else set(published_keys()[trainer].get("keys", ()))
    for path in plans:
        replay = trainer != "mindspeed-rl"
        _, flat = export_plan(load_plan(path), trainer, "/ckpt/proxy", routing_replay=replay)
        if trainer == "mindspeed-rl":
            unknown = sorted(k for k in flat if not mindspeed_knows(k))
        elif trainer == "verl":  # keys verl passes on to Megatron's configs are new to its own (written +key=value)
            unknown = sorted(k for k in set(flat) - known if not k.startswith(VERL_APPENDED) and not any(k.startswith(o) for o in known if o.endswith(".")))
        else:
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
        same += ["recompute"]
        if trainer != "nemo-rl":  # NeMo RL keeps one total length and only the optimizer offload
            same += ["offload", "micro_tokens"]
        if trainer != "mindspeed-rl":  # Megatron's hybrid CPU optimizer (MindSpeed-RL swaps the optimizer instead)
            same += ["optimizer_offload_fraction"]
        same += ["rollout_graphs", "rollout_max_seqs", "algorithm"]  # vLLM's enforce_eager and max_num_seqs, in each trainer's words
        if trainer == "verl":
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
    assert "records this proxy run's own routes" in text
    plain, flat = export_plan(load_plan(plans[0]), "verl", "/ckpt/proxy")
    assert (flat["trainer.n_gpus_per_node"], flat["trainer.nnodes"]) == (4, 1)
    assert "routing replay" not in plain and "router_replay" not in "".join(flat)  # no replay asked: no word of it


def data_of(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_export_and_job_refuse_what_they_cannot_write(plans, tmp_path):
    plain = tmp_path / "plain.yaml"
    data = yaml.safe_load(plans[0].read_text())
    data.pop("deployment")
    plain.write_text(yaml.safe_dump(data))
    result = run_cli("export", plain, "--to", "verl", "--model-path", "/p")
    assert result.exit_code == 2 and "no deployment" in result.output
    result = run_cli("export", plans[0], "--to", "mindspeed-rl", "--model-path", "/p", "--routing-replay")
    assert result.exit_code == 2 and "no router replay key" in result.output
    for path in ("/my models/q", "", "/p/$HOME"):
        result = run_cli("export", plans[0], "--to", "verl", "--model-path", path)
        assert result.exit_code == 2 and "--model-path" in result.output, result.output
    # a plan edited by hand is checked against the model before a config that cannot launch is written
    for edit, said in (({"experts": 1000}, "rule 1 <= K <= E: K=1000"), ({"experts": 4}, "rule top_k <= K"),
                       ({"deployment": {**data_of(plans[0])["deployment"], "num_cards": 0}}, "num_cards is 0"),
                       ({"deployment": {**data_of(plans[0])["deployment"], "job": {**data_of(plans[0])["deployment"]["job"], "colocated": False,
                                                                                  "rollout_devices": 4}}}, "leaves none of its 4 to train on"),
                       ({"deployment": {**data_of(plans[0])["deployment"], "train_layout": {"tp": 3, "pp": 1, "ep": 1, "cp": 1, "etp": 1}}},
                        "tp=3 does not divide the 32 attention heads")):  # fmt: skip
        edited = tmp_path / "edited.yaml"
        edited.write_text(yaml.safe_dump({**data_of(plans[0]), **edit}, sort_keys=False))
        result = run_cli("export", edited, "--to", "verl", "--model-path", "/p")
        assert result.exit_code == 2 and said in result.output, result.output
    out = tmp_path / "v.txt"
    assert run_cli("export", plans[0], "--to", "verl", "--model-path", "/p", "-o", out).exit_code == 0
    again = run_cli("export", plans[0], "--to", "verl", "--model-path", "/p", "-o", out)
    assert again.exit_code == 2 and "--force" in again.output
    (tmp_path / "junk.txt").write_text("just words here\n")
    result = run_cli("job", "--from", "verl", tmp_path / "junk.txt")
    assert result.exit_code == 2 and "neither a YAML config, nor Hydra overrides" in result.output
    (tmp_path / "part.yaml").write_text("data:\n  train_batch_size: 64\n")
    result = run_cli("job", "--from", "verl", tmp_path / "part.yaml")
    assert result.exit_code == 2 and "data.train_batch_size 64 is smaller than actor.ppo_mini_batch_size 256 (verl's default)" in result.output


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


# ---- verl's own launch scripts in (tests/data/verl, unchanged from verl's repository) ---------------

VERL_SCRIPTS = Path(__file__).parent / "data" / "verl"


@pytest.mark.parametrize("script, expect, model, hardware", [
    ("run_qwen3moe-30b_megatron.sh", dict(prompts=64, samples=5, tp=4, pp=2, ep=4, cards=32, rollout_tp=4, recompute="none"), "qwen3-30b-a3b", "h100-sxm"),
    ("run_qwen3-235b_megatron_96gb.sh", dict(prompts=32, samples=8, tp=4, pp=8, ep=4, cards=32, rollout_tp=8, recompute="none"), None, None),
    ("run_deepseek671b_math_megatron_80gb.sh", dict(prompts=512, samples=4, tp=1, pp=16, ep=16, cards=256, rollout_tp=32, recompute="full"),
     "deepseek-v3", "h100-sxm"),
    ("run_qwen30_a3b_megatron_vllm.sh", dict(prompts=8, samples=8, tp=2, pp=1, ep=8, cards=8, rollout_tp=2, recompute="full"), "qwen3-30b-a3b",
     "h100-sxm"),
])  # fmt: skip
def test_job_from_reads_verls_own_launch_scripts(script, expect, model, hardware, tmp_path):
    """Shell variables, defaults (${X:-y}), arithmetic and the keys a script leaves to verl's shipped
    defaults (ppo_epochs, context parallel, the rollout's DP and EP, max_num_seqs, bypass mode)."""
    from planner.runs.trainers import job_from, verl_defaults

    if verl_defaults() is None:
        pytest.skip("verl is not installed: the defaults come from the verl package's shipped config")

    job, cards, notes = job_from("verl", VERL_SCRIPTS / script)
    got = dict(prompts=job.prompts_per_step, samples=job.samples_per_prompt, tp=job.train_layout.tp, pp=job.train_layout.pp,
               ep=job.train_layout.ep, cards=cards, rollout_tp=job.rollout_layout.tp, recompute=job.recompute)  # fmt: skip
    assert got == expect
    assert job.train_layout.cp == 1 and job.rollout_layout.dp == 1 and job.ppo_epochs == 1  # verl's defaults, named in a note
    assert not job.skip_old_logprob  # verl recomputes the old log-probs unless bypass mode is on
    from importlib.metadata import version

    assert (job.trainer, job.trainer_version) == ("verl", version("verl"))  # the passes follow the installed release
    # verl's vLLM cap of 256 sequences a rank, where it can bind (a step of fewer sequences is not capped)
    assert job.rollout_max_seqs == (256 if expect["prompts"] * expect["samples"] > 256 else None) and any("shipped defaults" in n for n in notes)
    if model:  # the cost model takes the job at the script's own device count
        out = tmp_path / "job.yaml"
        assert run_cli("job", "--from", "verl", VERL_SCRIPTS / script, "-o", out).exit_code == 0
        result = run_cli("cost", model, "--hardware", hardware, "--cards", cards, "--job", out, "--json")
        assert result.exit_code == 0 and json.loads(result.stdout)["feasible"], result.output[-400:]


def test_the_235b_script_reads_its_arithmetic_and_defaults_and_names_what_it_cannot():
    from planner.runs.trainers import job_from, verl_defaults

    if verl_defaults() is None:
        pytest.skip("verl is not installed: the defaults come from the verl package's shipped config")

    job, cards, notes = job_from("verl", VERL_SCRIPTS / "run_qwen3-235b_megatron_96gb.sh")
    assert job.response_tokens.max == 1204 * 8 and job.prompt_tokens.max == 2048  # $((1204 * 8)), $((1024 * 2))
    assert job.micro_batch_tokens == (2048 + 9632) * 10 // 10 and job.optimizer_offload_fraction == 1.0  # ${OFFLOAD_FRACTION:-1.}
    assert not job.rollout_graphs  # enforce_eager=True
    assert any("SCRIPT_DIR" in n and "command substitution" in n for n in notes)


def test_the_235b_script_fits_its_32_h20_as_it_ran_and_the_current_one_is_named_short(tmp_path):
    """verl ran Qwen3-235B on 4 H20 nodes with the script of commit 65c59c7 (its pull request shows
    the run's curves): full recompute, one layer at a time. A later commit, described as a doc fix,
    dropped the recompute keys. With eight 11,680-token micro-batches in flight on the first stage
    and no recompute, the update needs more than an H20 has; the planner says so and names the
    activations, and the same job with verl's recompute fits."""
    from planner.runs.trainers import verl_defaults

    if verl_defaults() is None:
        pytest.skip("verl is not installed: the defaults come from the verl package's shipped config")

    ran, current = tmp_path / "ran.yaml", tmp_path / "current.yaml"
    assert run_cli("job", "--from", "verl", VERL_SCRIPTS / "run_qwen3-235b_megatron_96gb.65c59c7.sh", "-o", ran).exit_code == 0
    assert run_cli("job", "--from", "verl", VERL_SCRIPTS / "run_qwen3-235b_megatron_96gb.sh", "-o", current).exit_code == 0
    assert yaml.safe_load(ran.read_text())["recompute"] == "full"
    result = run_cli("cost", "qwen3-235b-a22b", "--hardware", "h20", "--cards", 32, "--job", ran, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["feasible"], result.output[-400:]

    result = run_cli("cost", "qwen3-235b-a22b", "--hardware", "h20", "--cards", 32, "--job", current, "--json")
    assert result.exit_code == 2
    reason = json.loads(result.stdout)["reasons"][0]
    activations = float(re.search(r"activations ([0-9.]+) GiB", reason).group(1))
    assert "update phase needs" in reason and "TP4 PP8 EP4" in reason and activations > 95.08 / 2  # most of an H20
    job = yaml.safe_load(current.read_text())
    job["recompute"] = "full"
    current.write_text(yaml.safe_dump(job))
    result = run_cli("cost", "qwen3-235b-a22b", "--hardware", "h20", "--cards", 32, "--job", current, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["feasible"]


def test_verls_fully_async_script_reads_as_separate_pools_with_partial_rollout(tmp_path):
    """verl's fully-async launch script (train_batch_size 0: the trainer's step is one parameter sync)
    with the fully-async trainer's own shipped defaults over the main trainer's: 12 rollout nodes and
    4 training nodes, staleness_threshold 0.5 read as one step ahead, partial rollout on."""
    from planner.runs.trainers import job_from, verl_defaults

    if verl_defaults() is None:
        pytest.skip("verl is not installed: the defaults come from the verl package's shipped config")

    script = VERL_SCRIPTS / "grpo_30b_a3b_base_math_megatron_96_32.sh"
    job, cards, notes = job_from("verl", script)
    lay = job.train_layout
    assert (job.prompts_per_step, job.samples_per_prompt, job.mini_batches, cards) == (4 * 128, 16, 4, 128)
    assert (job.colocated, job.rollout_devices, job.max_staleness, job.partial_rollout) == (False, 96, 1, True)
    assert (lay.tp, lay.cp, lay.ep, job.rollout_layout.tp) == (2, 2, 8, 4)
    assert any("one parameter sync" in n for n in notes) and any("staleness_threshold 0.5" in n for n in notes)
    # the fully-async trainer's shipped bypass mode: the rollout's log-probs, no old log-prob pass in any of the 4 steps
    assert job.skip_old_logprob and any("no old log-prob pass runs" in n for n in notes)
    out = tmp_path / "job.yaml"
    assert run_cli("job", "--from", "verl", script, "-o", out).exit_code == 0
    result = run_cli("cost", "qwen3-30b-a3b", "--hardware", "h20", "--cards", cards, "--job", out, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["pools"]["partial_rollout"], result.output[-400:]


def test_the_shell_reader_expands_what_a_shell_would_and_runs_nothing():
    from planner.runs.shell import script_overrides

    text = """
N=${N:-4}
export TP=2
L=$(( (N + 4) * 2 ))
ARGS=(
    a.b=$N    # a comment
    c.d="${TP}x"
)
WHO=$(whoami)
python3 -m verl.trainer.main_ppo x.y=$L "${ARGS[@]}" e.f=$UNSET g.h=$WHO i.j=${K:-7} $@
"""
    overrides, notes = script_overrides(text)
    assert overrides == {"x.y": "16", "a.b": "4", "c.d": "2x", "i.j": "7"}
    assert any(n.startswith("e.f: $UNSET: not set") for n in notes) and any("WHO" in n and "command substitution" in n for n in notes)
    assert any(n.startswith("g.h: $WHO") for n in notes)


# ---- NeMo RL's own configs in, with their defaults: inheritance (tests/data/nemo-rl) -----------------

NEMO_CONFIGS = Path(__file__).parent / "data" / "nemo-rl" / "examples" / "configs"


@pytest.mark.parametrize("config, expect", [
    ("grpo_math_qwen30ba3b_megatron.yaml", dict(prompts=64, samples=32, mini=4, tp=2, pp=1, ep=8, cp=1, cards=64, rollout=(4, 1), recompute="none")),
    ("recipes/llm/grpo-dapomath17k-dsv3-megatron.yaml", dict(prompts=32, samples=16, mini=1, tp=8, pp=8, ep=32, cp=4, cards=256, rollout=(32, 1),
                                                              recompute="full")),
    ("recipes/llm/grpo-math-qwen3-30ba3b-megatron-tp4-32k.yaml", dict(prompts=64, samples=16, mini=2, tp=4, pp=1, ep=8, cp=1, cards=32,
                                                                       rollout=(4, 1), recompute="full")),
    ("recipes/llm/grpo-qwen3-30ba3b-8n8g-megatron-cp2-r3.yaml", dict(prompts=16, samples=8, mini=1, tp=4, pp=2, ep=4, cp=2, cards=64,
                                                                      rollout=(4, 4), recompute="none")),
    # its async variant on 10 nodes: generation on 2 of them, one step ahead
    ("recipes/llm/grpo-qwen3-30ba3b-10n8g-megatron-cp2-r3-async.yaml", dict(prompts=16, samples=8, mini=1, tp=4, pp=2, ep=4, cp=2, cards=80,
                                                                            rollout=(4, 4), recompute="none", pools=(16, 1))),
])  # fmt: skip
def test_job_from_nemo_rl_follows_its_defaults_inheritance(config, expect, tmp_path):
    """Each config inherits most of its keys (cluster, parallel sizes, activation checkpointing) from the
    files its `defaults:` names, as NeMo RL's own loader merges them; the values expected here are read
    off the files by hand."""
    from planner.runs.trainers import job_from

    job, cards, notes = job_from("nemo-rl", NEMO_CONFIGS / config)
    got = dict(prompts=job.prompts_per_step, samples=job.samples_per_prompt, mini=job.mini_batches, tp=job.train_layout.tp,
               pp=job.train_layout.pp, ep=job.train_layout.ep, cp=job.train_layout.cp, cards=cards,
               rollout=(job.rollout_layout.tp, job.rollout_layout.ep), recompute=job.recompute)  # fmt: skip
    if not job.colocated:
        got["pools"] = (job.rollout_devices, job.max_staleness)
    assert got == expect
    assert any("inherits from" in n for n in notes)
    # planner cost takes the job at the config's own device count (NeMo RL's recipes run on H100s)
    out = tmp_path / "job.yaml"
    assert run_cli("job", "--from", "nemo-rl", NEMO_CONFIGS / config, "-o", out).exit_code == 0
    model = "deepseek-v3" if "dsv3" in config else "qwen3-30b-a3b"
    result = run_cli("cost", model, "--hardware", "h100-sxm", "--cards", cards, "--job", out, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["feasible"], result.output[-400:]


NEMO_V06 = Path(__file__).parent / "data" / "nemo-rl-r0.6.0" / "examples" / "configs" / "recipes" / "llm" / "performance"


@pytest.mark.parametrize("recipe, expect", [
    ("grpo-qwen3-30ba3b-4n8g-async-1off", dict(cards=32, pools=(16, 1), train=(1, 2, 8), rollout_tp=2, precision=("bf16", "bf16"), micro=4096)),
    ("grpo-qwen3-30ba3b-24n8g-async-8off", dict(cards=192, pools=(64, 8), train=(1, 1, 8), rollout_tp=2, precision=("bf16", "bf16"), micro=4096)),
    ("grpo-qwen3-235b-32n8g-async-1off", dict(cards=256, pools=(128, 1), train=(4, 8, 16), rollout_tp=8, precision=("bf16", "bf16"), micro=8192)),
    ("grpo-deepseek-v3-64n8g-fp8-async-1off", dict(cards=512, pools=(256, 1), train=(1, 16, 16), rollout_tp=16, precision=("fp8", "fp8"),
                                                   micro=1536)),
])  # fmt: skip
def test_nemo_rl_v06_off_policy_and_fp8_recipes_read_as_the_tables_ran_them(recipe, expect):
    """NeMo RL r0.6.0's own performance recipes: separate pools and the trajectory age (async GRPO),
    FP8 in training (fp8_cfg) and generation (vllm_cfg.precision), sequence packing's micro-batch
    (max_total_sequence_length x train_micro_batch_size), and the old log-prob pass NeMo RL's GRPO step
    always runs (prev_logprobs); values read off the files by hand."""
    from planner.runs.trainers import job_from

    job, cards, notes = job_from("nemo-rl", NEMO_V06 / f"{recipe}.yaml")
    lay = job.train_layout
    got = dict(cards=cards, pools=(job.rollout_devices, job.max_staleness), train=(lay.tp, lay.pp, lay.ep), rollout_tp=job.rollout_layout.tp,
               precision=(job.precision, job.rollout_precision), micro=job.micro_batch_tokens)  # fmt: skip
    assert got == expect and not job.colocated and not job.skip_old_logprob and job.partial_rollout  # in_flight_weight_updates: true


def test_nemo_rl_inheritance_override_marker_and_a_missing_parent(tmp_path):
    from planner.runs.trainers import _inherited

    (tmp_path / "base.yaml").write_text("policy: {a: 1, b: {c: 2, d: 3}}\ncluster: {num_nodes: 1}\n")
    (tmp_path / "mid.yaml").write_text("defaults: base.yaml\npolicy: {b: {c: 20}}\n")
    (tmp_path / "child.yaml").write_text("defaults: [mid.yaml]\npolicy:\n  b: {_override_: true, e: 5}\n  a: ???\ncluster: {num_nodes: 8}\n")
    assert _inherited(tmp_path / "child.yaml", None) == {"policy": {"a": 1, "b": {"e": 5}}, "cluster": {"num_nodes": 8}}
    assert _inherited(tmp_path / "mid.yaml", None) == {"policy": {"a": 1, "b": {"c": 20, "d": 3}}, "cluster": {"num_nodes": 1}}
    (tmp_path / "orphan.yaml").write_text("defaults: ../nowhere.yaml\ngrpo: {num_prompts_per_step: 8}\n")
    result = run_cli("job", "--from", "nemo-rl", tmp_path / "orphan.yaml")  # the parent's keys are missing, and said so
    assert result.exit_code == 2 and "not a complete nemo-rl config: missing grpo.num_generations_per_prompt" in result.output


def verl_release_configs() -> dict[str, set[str]]:
    """The flattened Megatron trainer config of every verl release at hand: the installed one and the
    older wheels make downloads (.venv/verl-wheels), read from the wheel's zip."""
    import zipfile

    from planner.runs.trainers import verl_defaults

    out = {}
    shipped = verl_defaults()
    if shipped:
        out[".".join(shipped[1].split(".")[:2])] = set(verl_config())
    wheels = Path(__file__).resolve().parents[1] / ".venv" / "verl-wheels"
    for wheel in sorted(wheels.glob("verl-*.whl")):
        release = ".".join(wheel.name.split("-")[1].split(".")[:2])
        with zipfile.ZipFile(wheel) as z:
            tree = yaml.safe_load(z.read("verl/trainer/config/_generated_ppo_megatron_trainer.yaml"))
        out[release] = set(config_keys(tree))
    return out


def test_the_verl_export_is_written_for_each_release(plans):
    """Every key the export writes for a verl release exists in that release's own shipped config;
    routing replay is refused for 0.6 (none there) and written twice for 0.7, whose default worker
    reads actor.router_replay while its engine worker reads actor.megatron.router_replay."""
    from planner.plan import load_plan
    from planner.runs.trainers import export_plan

    releases = verl_release_configs()
    if len(releases) < 3:
        pytest.skip(f"verl configs at hand: {sorted(releases)}; make downloads 0.6.1 and 0.7.1")
    plan = load_plan(plans[1])
    for release, known in releases.items():
        replay = release != "0.6"
        text, flat = export_plan(plan, "verl", "/ckpt/proxy", routing_replay=replay, version=release)
        unknown = sorted(k for k in flat if k not in known and not any(k.startswith(o) for o in known if o.endswith(".")))
        assert not unknown, (release, unknown)
        assert f"written for verl {release}.x" in text
        for key in ("tensor_model", "pipeline_model", "expert_model", "context"):  # the reference in the actor's layout, on any release
            assert flat[f"actor_rollout_ref.ref.megatron.{key}_parallel_size"] == flat[f"actor_rollout_ref.actor.megatron.{key}_parallel_size"]
        assert ("actor_rollout_ref.actor.router_replay.mode" in flat) == (release == "0.7")
    refused = run_cli("export", plans[1], "--to", "verl", "--model-path", "/p", "--verl-version", "0.6", "--routing-replay")
    assert refused.exit_code == 2 and "verl 0.6 has no router replay" in refused.output
    old = run_cli("export", plans[1], "--to", "verl", "--model-path", "/p", "--verl-version", "0.5.0")
    assert old.exit_code == 2 and "writes the config of verl 0.6, 0.7, 0.8, 0.9" in old.output


# ---- MindSpeed-RL's own configs in and out (tests/data/mindspeed-rl, unchanged from its repository) ---

MINDSPEED = Path(__file__).parent / "data" / "mindspeed-rl" / "configs"


@pytest.mark.parametrize("config, expect, model, hardware", [
    # DAPO: TP4 x EP2 with moe_tp_extend_ep is expert parallelism 8; vLLM DP 8 x TP 1 (EP 8), two instances on 16 dies
    ("dapo_qwen3_30b_a3b_A3.yaml", dict(algorithm="dapo", prompts=32, samples=8, train=(4, 1, 8, 1), rollout=(1, 8, 8), cards=16,
                                        recompute="none", swap=False, seqs=None), "qwen3-30b-a3b", "atlas-a3"),  # 512 >= its 256 sequences: no cap
    ("grpo_qwen3_235b_a22b_A2.yaml", dict(algorithm="grpo", prompts=256, samples=8, train=(2, 16, 8, 1), rollout=(4, 8, 32), cards=128,
                                          recompute="full", swap=True, seqs=64), "qwen3-235b-a22b", "ascend-910b2"),
    ("grpo_deepseek_r1_671b_A3.yaml", dict(algorithm="grpo", prompts=512, samples=16, train=(4, 8, 32, 1), rollout=(4, 64, 256), cards=256,
                                           recompute="full", swap=True, seqs=128), "deepseek-v3", "atlas-a3"),
])  # fmt: skip
def test_job_from_reads_mindspeed_rls_own_configs(config, expect, model, hardware, tmp_path):
    """The model entry through `defaults: - model: [...]`, the actor merged over megatron_training,
    expert parallelism as MindSpeed-RL computes it (TP x EP under moe_tp_extend_ep), the rollout's
    vLLM DP from infer_expert_parallel_size, swap_optimizer, enforce_eager and max_num_seqs; and
    planner cost takes the job at the config's own device count."""
    from planner.runs.trainers import job_from

    job, cards, notes = job_from("mindspeed-rl", MINDSPEED / config)
    t, r = job.train_layout, job.rollout_layout
    got = dict(algorithm=job.algorithm, prompts=job.prompts_per_step, samples=job.samples_per_prompt, train=(t.tp, t.pp, t.ep, t.etp),
               rollout=(r.tp, r.dp, r.ep), cards=cards, recompute=job.recompute, swap=job.optimizer_swap, seqs=job.rollout_max_seqs)  # fmt: skip
    assert got == expect
    assert not job.rollout_graphs and job.mini_batches == 1 and job.skip_old_logprob  # enforce_eager; one update a step: MindSpeed-RL skips the pass
    assert any("inherits from model/" in n for n in notes) and any("moe_tp_extend_ep" in n for n in notes)
    out = tmp_path / "job.yaml"
    assert run_cli("job", "--from", "mindspeed-rl", MINDSPEED / config, "-o", out).exit_code == 0
    result = run_cli("cost", model, "--hardware", hardware, "--cards", cards, "--job", out, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["feasible"], result.output[-400:]


def test_mindspeed_rl_defaults_fill_what_a_config_leaves_out(tmp_path):
    """A config with only the keys MindSpeed-RL has no default for: the rest is its config classes'
    defaults (rollout TP 8, 0.5 of the memory, one sequence at a time, eager), each named."""
    from planner.runs.trainers import job_from

    path = tmp_path / "minimal.yaml"
    path.write_text("megatron_training:\n  global_batch_size: 8\nrl_config:\n  actor_resource:\n    num_npus: 8\n")
    job, cards, notes = job_from("mindspeed-rl", path)
    assert (cards, job.samples_per_prompt, job.rollout_layout.tp, job.rollout_memory_utilization, job.rollout_max_seqs) == (8, 1, 8, 0.5, 1)
    assert job.response_tokens.max == 128 and job.prompt_tokens.max == 512 and not job.distributed_optimizer
    assert any("generate_config.infer_tensor_parallel_size=8" in n for n in notes)
    (tmp_path / "none.yaml").write_text("rl_config:\n  n_samples_per_prompt: 4\n")
    result = run_cli("job", "--from", "mindspeed-rl", tmp_path / "none.yaml")
    assert result.exit_code == 2 and "missing actor_config.global_batch_size, rl_config.actor_resource.num_npus" in result.output


def _merged_over(base: Path, export: dict) -> dict:
    """An export merged over one of MindSpeed-RL's shipped configs and its model entry, the way
    Hydra composes them (the config's own keys over its defaults)."""
    from planner.runs.trainers import _inherited, _merge, unflatten

    return _merge(_inherited(base, None), unflatten({k: v for k, v in export.items() if k != "defaults"}))


def test_the_mindspeed_rl_export_composes_with_its_shipped_config(plans, tmp_path):
    """A plan with a data-parallel rollout (vLLM DP 4 x TP 2, experts over 8 ranks) exports and reads
    back; merged over MindSpeed-RL's DAPO config every key is one its classes accept, its model entry
    gets the proxy's expert count, the actor loads converted Megatron weights named in the
    conversion command, and MindSpeed-RL's own divisibility checks (validate_config.py) hold."""
    from planner.plan import load_plan
    from planner.runs.trainers import export_plan, flatten, job_from

    data = yaml.safe_load(plans[1].read_text())
    data["deployment"]["rollout_layout"] = {"tp": 2, "dp": 4, "ep": 8}
    data["deployment"]["job"].update(algorithm="dapo", rollout_oversampling=1.5, optimizer_offload_fraction=0.0, optimizer_swap=True)
    path = tmp_path / "dp.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    plan = load_plan(path)
    text, flat = export_plan(plan, "mindspeed-rl", "/ckpt/proxy")
    assert (flat["generate_config.infer_tensor_parallel_size"], flat["generate_config.infer_expert_parallel_size"]) == (2, 4)
    assert flat["generate_config.enable_expert_parallel"] and flat["megatron_training.stage"] == "ray_dapo"
    assert flat["rl_config.filter_groups_enable"] and flat["megatron_training.swap_optimizer"]
    assert flat["actor_config.load"] == "/ckpt/proxy-mcore-tp4-pp2-ep1" and flat["actor_config.moe_tp_extend_ep"]  # EP 4 = TP 4 x 1
    assert "--model-type-hf qwen3-moe" in text and "--target-expert-parallel-size 1 --moe-tp-extend-ep" in text
    assert "--save-dir /ckpt/proxy-mcore-tp4-pp2-ep1" in text
    merged = _merged_over(MINDSPEED / "dapo_qwen3_30b_a3b_A3.yaml", flat)
    assert merged["model"]["qwen3_30b_a3b"]["num_experts"] == plan.experts and merged["model"]["qwen3_30b_a3b"]["moe_router_topk"] == 8
    assert not [k for k in flatten(merged) if not k.startswith("model.") and not mindspeed_knows(k)]
    actor = {**merged["megatron_training"], **merged["actor_config"]}
    npus = merged["rl_config"]["actor_resource"]["num_npus"]
    dp = npus // (actor["tensor_model_parallel_size"] * actor["pipeline_model_parallel_size"])
    gen_dp = npus // (merged["generate_config"]["infer_tensor_parallel_size"] * merged["generate_config"]["infer_pipeline_parallel_size"])
    assert npus % (actor["tensor_model_parallel_size"] * actor["pipeline_model_parallel_size"]) == 0
    assert actor["global_batch_size"] % dp == 0 and actor["global_batch_size"] % gen_dp == 0
    out = tmp_path / "ms.yaml"
    out.write_text(text)
    job, cards, _ = job_from("mindspeed-rl", out)
    assert (job.rollout_layout.tp, job.rollout_layout.dp, job.rollout_layout.ep) == (2, 4, 8) and cards == 16
    assert job.algorithm == "dapo" and job.optimizer_swap and job.train_layout.ep == 4 and job.train_layout.etp == 1


def test_the_mindspeed_rl_export_refuses_what_mindspeed_rl_cannot_run(plans, tmp_path):
    data = yaml.safe_load(plans[0].read_text())
    cases = [({"job": {"precision": "fp16"}}, "no fp16 key"),
             ({"train_layout": {"tp": 2, "pp": 2, "ep": 1, "cp": 1, "etp": 1}}, "moe_tp_extend_ep, EP a multiple of TP"),
             ({"rollout_layout": {"tp": 2, "dp": 2, "ep": 1}}, "data-parallel ranks only with expert parallelism")]  # fmt: skip
    for change, message in cases:
        case = yaml.safe_load(yaml.safe_dump(data))
        for key, value in change.items():
            case["deployment"][key] = {**case["deployment"][key], **value} if key == "job" else value
        path = tmp_path / "case.yaml"
        path.write_text(yaml.safe_dump(case, sort_keys=False))
        result = run_cli("export", path, "--to", "mindspeed-rl", "--model-path", "/p")
        assert result.exit_code == 2 and message in result.output, result.output


# ---- DAPO and precision, both ways ---------------------------------------------------------------------

def _variant(plans, tmp_path, name, **job) -> Path:
    data = yaml.safe_load(plans[0].read_text())
    data["deployment"]["job"].update(job)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("trainer", TRAINERS)
def test_dapo_and_its_oversampling_round_trip(plans, tmp_path, trainer):
    """DAPO's dynamic sampling as each trainer sizes it (verl 0.9's filter_groups and gen_batch_size,
    NeMo RL's use_dynamic_sampling and batch_multiplier, MindSpeed-RL's ray_dapo stage with its
    global batch generated per round): the job's algorithm and oversampling come back."""
    from planner.runs.trainers import job_from

    path = _variant(plans, tmp_path, "dapo", algorithm="dapo", rollout_oversampling=2.0)
    out = tmp_path / f"{trainer}.cfg"
    extra = ["--verl-version", "0.9"] if trainer == "verl" else []
    result = run_cli("export", path, "--to", trainer, "--model-path", "/ckpt/proxy", "-o", out, *extra)
    assert result.exit_code == 0, result.output
    job, _, notes = job_from(trainer, out)
    assert (job.algorithm, job.rollout_oversampling, job.prompts_per_step) == ("dapo", 2.0, 512)
    assert any("rollout_oversampling 2 from" in n for n in notes)
    if trainer == "verl":
        refused = run_cli("export", path, "--to", "verl", "--model-path", "/p", "--verl-version", "0.7")
        assert refused.exit_code == 2 and "recipe/dapo" in refused.output


def _nemo_rl_dtype_checks():
    """NeMo RL's own _apply_precision_config and _validate_dtype_config, read from its source with ast
    (the module's imports, Megatron Bridge among them, are not run) and run with torch."""
    import ast

    import torch

    source = (Path(__file__).parent / "data" / "nemo-rl" / "nemo_rl" / "models" / "megatron" / "setup.py").read_text()
    wanted = {"_apply_precision_config", "_validate_dtype_config"}
    body = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    namespace = {"torch": torch, "Any": object}
    exec(compile(ast.Module(body=body, type_ignores=[]), "nemo_rl/models/megatron/setup.py", "exec"), namespace)
    return namespace["_apply_precision_config"], namespace["_validate_dtype_config"]


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_nemo_rl_export_passes_nemo_rls_own_dtype_checks(plans, tmp_path, precision):
    """The export merged over the Megatron config it inherits (grpo_math_1B_megatron.yaml, whose
    optimizer is precision-aware and bf16) passes NeMo RL's dtype validation in every precision."""
    from types import SimpleNamespace

    import torch

    from planner.plan import load_plan
    from planner.runs.trainers import _inherited, _merge, export_plan, job_from, unflatten

    apply_precision, validate = _nemo_rl_dtype_checks()
    _, flat = export_plan(load_plan(_variant(plans, tmp_path, precision, precision=precision)), "nemo-rl", "/ckpt/proxy")
    base = _inherited(Path(__file__).parent / "data" / "nemo-rl" / "examples" / "configs" / "grpo_math_1B_megatron.yaml", None)
    policy = _merge(base, unflatten({k: v for k, v in flat.items() if k != "defaults"}))["policy"]
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[policy["precision"]]
    policy["megatron_cfg"]["pipeline_dtype"] = policy["precision"]  # ${policy.precision} in the file
    model = SimpleNamespace()
    apply_precision(model, policy, dtype)
    validate(dtype, model, SimpleNamespace(**policy["megatron_cfg"]["optimizer"]))  # raises AssertionError where NeMo RL would
    out = tmp_path / "nemo.yaml"
    out.write_text(yaml.safe_dump(unflatten(flat)))
    assert job_from("nemo-rl", out)[0].precision == precision


@pytest.mark.parametrize("trainer", TRAINERS)
def test_uneven_pipeline_stages_round_trip(plans, tmp_path, trainer):
    """48 layers over 4 stages as 11, 13, 13, 11: Megatron's num_layers_in_first/last_pipeline_stage
    (verl through +override_transformer_config, NeMo RL's megatron_cfg) or MindSpeed-RL's
    num_layer_list, read back with the model's layer count from its config.json."""
    from planner.catalog import load_model_config
    from planner.runs.trainers import job_from

    proxy = tmp_path / "proxy"
    proxy.mkdir()
    (proxy / "config.json").write_text(json.dumps(load_model_config("qwen3-30b-a3b")[1]))
    data = yaml.safe_load(plans[1].read_text())
    data["deployment"]["train_layout"] = {"tp": 4, "pp": 4, "ep": 4, "cp": 1, "etp": 1, "pipeline_layers": [11, 13, 13, 11]}
    path = tmp_path / "stages.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    out = tmp_path / "cfg"
    result = run_cli("export", path, "--to", trainer, "--model-path", proxy, "-o", out)
    assert result.exit_code == 0, result.output
    if trainer == "verl":
        assert "+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=11" in out.read_text()
    job, _, _ = job_from(trainer, out)
    assert job.train_layout.pipeline_layers == (11, 13, 13, 11)
    data["deployment"]["train_layout"]["pipeline_layers"] = [10, 13, 14, 11]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    if trainer != "mindspeed-rl":  # MindSpeed-LLM's num_layer_list takes any split; Megatron's first/last keys only an even middle
        result = run_cli("export", path, "--to", trainer, "--model-path", proxy)
        assert result.exit_code == 2 and "the stages between must hold as many layers each" in result.output


def _verl_config_dirs(tmp_path) -> dict[str, Path]:
    """The trainer config folder of every verl release at hand (the installed package's, and each
    older wheel's extracted from its zip), as verl's own Hydra entry point loads it."""
    import zipfile

    from planner.runs.trainers import verl_defaults

    out = {}
    shipped = verl_defaults()
    spec = importlib.util.find_spec("verl")
    if shipped and spec is not None:
        out[".".join(shipped[1].split(".")[:2])] = Path(spec.origin).parent / "trainer" / "config"
    for wheel in sorted((Path(__file__).resolve().parents[1] / ".venv" / "verl-wheels").glob("verl-*.whl")):
        release = ".".join(wheel.name.split("-")[1].split(".")[:2])
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith("verl/trainer/config/") and name.endswith(".yaml"):
                    z.extract(name, tmp_path / release)
        out[release] = tmp_path / release / "verl" / "trainer" / "config"
    return out


@pytest.mark.parametrize("variant", ["plan", "wide", "dapo-stages"])
def test_each_verl_export_composes_with_that_releases_hydra_config(plans, tmp_path, variant):
    """The export's override lines, as `main_ppo --config-name ppo_megatron_trainer` takes them,
    composed by Hydra itself over each release's shipped config folder (struct mode: a key the release
    does not have is refused unless written +key) and resolved; the composed values are the plan's."""
    pytest.importorskip("hydra", reason="hydra-core (the test extra) composes verl's configs")
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from planner.plan import load_plan
    from planner.runs.trainers import export_plan

    dirs = _verl_config_dirs(tmp_path)
    if len(dirs) < 3:
        pytest.skip(f"verl configs at hand: {sorted(dirs)}; make downloads 0.6.1 and 0.7.1")
    path = plans[0] if variant == "plan" else plans[1]
    if variant == "dapo-stages":
        data = yaml.safe_load(plans[1].read_text())
        data["deployment"]["train_layout"] = {"tp": 4, "pp": 4, "ep": 4, "cp": 1, "etp": 1, "pipeline_layers": [11, 13, 13, 11]}
        data["deployment"]["job"].update(algorithm="dapo", rollout_oversampling=2.0, precision="fp16")
        path = tmp_path / "dapo.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    plan = load_plan(path)
    for release, folder in dirs.items():
        if variant == "dapo-stages" and release != "0.9":
            continue  # DAPO is refused before 0.9 (tested above)
        text, flat = export_plan(plan, "verl", "/ckpt/proxy", routing_replay=release != "0.6", version=release)
        overrides = [line for line in text.splitlines() if line and not line.startswith("#")]
        with initialize_config_dir(config_dir=str(folder), version_base=None):
            cfg = compose(config_name="ppo_megatron_trainer", overrides=overrides)
        resolved = OmegaConf.to_container(cfg, resolve=True)
        actor = resolved["actor_rollout_ref"]["actor"]["megatron"]
        layout = plan.deployment["train_layout"]
        assert (actor["tensor_model_parallel_size"], actor["pipeline_model_parallel_size"], actor["expert_model_parallel_size"]) == (
            layout["tp"], layout["pp"], layout["ep"]), release
        assert resolved["actor_rollout_ref"]["ref"]["megatron"]["pipeline_model_parallel_size"] == layout["pp"]
        assert resolved["data"]["train_batch_size"] == plan.deployment["job"]["prompts_per_step"]
        if variant == "dapo-stages":
            assert resolved["algorithm"]["filter_groups"]["enable"] and resolved["data"]["gen_batch_size"] == 1024
            assert actor["override_transformer_config"]["num_layers_in_first_pipeline_stage"] == 11
            assert actor["dtype"] == resolved["actor_rollout_ref"]["rollout"]["dtype"] == "float16"
        with pytest.raises(Exception, match="bogus"), initialize_config_dir(config_dir=str(folder), version_base=None):
            compose(config_name="ppo_megatron_trainer", overrides=[*overrides, "actor_rollout_ref.actor.bogus=1"])


def test_a_config_of_another_trainer_or_of_no_devices_is_refused_and_job_writes_its_file_with_json(tmp_path):
    """verl's shipped defaults fill what a verl script leaves out, so a file that sets none of verl's
    job keys (another trainer's config) is refused and named as that trainer's, not read as verl's
    defaults; a config that multiplies to no devices is refused; `job -o F --json` writes F and
    prints the job, and `-o` into a missing folder fails before anything is read."""
    nemo = NEMO_CONFIGS / "grpo_math_qwen30ba3b_megatron.yaml"
    result = run_cli("job", "--from", "verl", nemo)
    assert result.exit_code == 2 and "not a verl config" in result.output and "--from nemo-rl" in result.output
    script = VERL_SCRIPTS / "run_qwen30_a3b_megatron_vllm.sh"
    zero = tmp_path / "zero.sh"
    zero.write_text(script.read_text().replace("trainer.nnodes=$NODES", "trainer.nnodes=0"))
    result = run_cli("job", "--from", "verl", zero)
    assert result.exit_code == 2 and "0 devices" in result.output, result.output
    out = tmp_path / "job.yaml"
    result = run_cli("job", "--from", "verl", script, "-o", out, "--json")
    assert result.exit_code == 0 and out.is_file()
    assert json.loads(result.stdout)["job"] == yaml.safe_load(out.read_text())
    missing = run_cli("job", "--from", "verl", script, "-o", tmp_path / "nowhere" / "job.yaml")
    assert missing.exit_code == 2 and "does not exist" in missing.output and ".part" not in missing.output
    # NeMo RL's super-v3 SWE recipe gives logger.wandb twice, which OmegaConf (NeMo RL's loader) refuses
    from omegaconf import OmegaConf

    from planner.runs.trainers import job_from

    swe = Path(__file__).parent / "data" / "nemo-rl-super-v3" / "examples/configs/recipes/llm/performance/grpo-nemotron-nano-16n8g-async-1off-swe.yaml"
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key"):
        OmegaConf.load(swe)
    _, _, notes = job_from("nemo-rl", swe)
    assert any("key 'wandb' is given twice at line 309" in n and "OmegaConf" in n for n in notes), notes
