"""Trainer configs out and in: a plan's proxy run as verl, MindSpeed-RL or NeMo RL config, and a
trainer's config as planner's job file.

Each trainer is a table of (dotted key, how to read it from the plan's deployment, how to read the
job back). verl gets Hydra overrides for its Megatron trainer (ppo_megatron_trainer), checked
against the config the verl package ships; MindSpeed-RL gets YAML checked against its config
classes' attributes, NeMo RL YAML checked against the keys of its published GRPO configs
(trainer_keys.yaml names the sources). `job_from` reads the same keys
back, so export and import round-trip.

Routing replay (`--routing-replay`): the trainer records the proxy run's own routes and replays
them within that run (verl R3: the rollout's routes replayed in training; NeMo RL's router_replay the
same), so the proxy's expert ids are the ones recorded and nothing needs remapping. Routes recorded
on the original are not used by either trainer; the proxy's expert_map.json (original id -> proxy
id per MoE layer) is what a tool that replays the original's routes on the proxy would rewrite them
through, and planner has no such tool.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from planner.errors import PlannerError, SpecError

__all__ = ["TRAINERS", "VERL_VERSIONS", "export_plan", "job_from", "flatten", "published_keys", "verl_version", "verl_defaults"]

TRAINERS = ("verl", "mindspeed-rl", "nemo-rl")
_RECOMPUTE = {"none": None, "selective": "selective", "moe": "selective", "full": "full"}
# Megatron-Core recompute_modules of the selective modes, as the memory model counts them
# (planner.cost.activations): verl's own default, core_attn, would leave the SwiGLU outputs saved
_MODULES = {"selective": ["moe_act", "layernorm"], "moe": ["moe", "layernorm"]}
_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class Deployment:
    """What a plan's deployment says, in the terms every trainer needs."""

    job: Any  # planner.specs.Job
    train: Any  # TrainLayout
    rollout: Any  # RolloutLayout
    cards: int
    per_node: int
    model_path: str
    name: str  # the model's name (MindSpeed-RL's model key)
    device_family: str = "nvidia"  # ascend | nvidia (the accelerator profile's family)
    experts: int = 0  # the proxy's routed experts per MoE layer
    model_type: str | None = None  # the original's transformers model_type, where its config is at hand
    layers: int = 0  # decoder layers

    @property
    def nodes(self) -> int:
        return math.ceil(self.cards / self.per_node)

    @property
    def gpus_per_node(self) -> int:
        return min(self.cards, self.per_node)


def _deployment(plan, model_path: str) -> Deployment:
    from planner.catalog import load_accelerator, load_model_config
    from planner.specs import Job, RolloutLayout, TrainLayout

    d = plan.deployment
    if not d or not d.get("train_layout") or not d.get("job"):
        raise SpecError("the plan has no deployment (layouts, job, device count): export a plan written by `planner suggest -o`")
    accel = load_accelerator(str(d.get("hardware", "ascend-910b2")))
    try:
        config = load_model_config(str(plan.model))[1]
    except PlannerError:  # a plan of a model whose config is not here: the exports that need it say so
        config = {}
    text = config.get("text_config", config)
    job = Job.from_dict(d["job"], "plan deployment.job")
    _check_deployment(plan, d, job)
    return Deployment(job=job, train=TrainLayout.from_dict(d["train_layout"]),
                      rollout=RolloutLayout.from_dict(d["rollout_layout"]), cards=int(d["num_cards"]), per_node=accel.devices_per_node,
                      model_path=model_path, name=_MINDSPEED_MODELS.get(str(plan.model), Path(str(plan.model)).name.replace("-", "_").replace(".", "_")),
                      device_family=accel.family, experts=int(plan.experts), model_type=text.get("model_type"),
                      layers=int(text.get("num_hidden_layers", 0)))  # fmt: skip


def _check_deployment(plan, d: Mapping[str, Any], job) -> None:
    """The plan's pruning rules and its deployment's device count and layouts, checked against the
    model before a config that could not launch is written (a plan edited by hand, or of another
    model). A model whose config is not here goes unchecked: the exports that need it say so."""
    from planner.catalog import load_model
    from planner.cost.layouts import rollout_layout_problems, train_layout_problems
    from planner.plan import deployment_cards
    from planner.specs import RolloutLayout, TrainLayout

    cards = deployment_cards(d)
    if not job.colocated and job.rollout_devices is not None and not 0 < job.rollout_devices < cards:
        raise SpecError(f"the plan's rollout pool of {job.rollout_devices} devices leaves none of its {cards} to train on")
    try:
        arch = load_model(str(plan.model))
    except PlannerError:  # a checkpoint on another machine: `planner build` and preflight check the plan against it
        return
    plan.check(arch, sorted(plan.layers) if plan.mtp == "prune" else None)  # pruned MTP layers: kept sets the trunk lacks
    proxy = arch.with_experts(plan.experts)
    pool = None if job.colocated else job.rollout_devices  # separate pools: the rest train
    train, rollout = (cards - pool, pool) if pool else (cards, cards)
    problems = train_layout_problems(proxy, train, TrainLayout.from_dict(d["train_layout"]))
    if d.get("rollout_layout"):
        problems += rollout_layout_problems(proxy, rollout, RolloutLayout.from_dict(d["rollout_layout"]))
    if problems:
        where = f"{train} training and {rollout} rollout devices" if pool else f"{cards} devices"
        raise SpecError(f"the plan's layouts cannot run K={plan.experts} of {plan.model} on {where}: " + "; ".join(problems))


def _mini_batch(j) -> int:
    if j.prompts_per_step % j.mini_batches:
        raise SpecError(f"prompts_per_step {j.prompts_per_step} is not a multiple of mini_batches {j.mini_batches}: trainers count mini-batches in prompts")
    return j.prompts_per_step // j.mini_batches


def _dynamic_sampling(j) -> bool:
    """DAPO's dynamic sampling: groups whose samples all score alike are dropped and more prompts are
    generated until the step's batch is full."""
    return j.algorithm == "dapo" or j.rollout_oversampling > 1


def _generated_prompts(j) -> int:
    """Prompts generated per round under dynamic sampling: the step's prompts times the job's
    oversampling, the way the trainers size it (verl's data.gen_batch_size, NeMo RL's batch_multiplier,
    MindSpeed-RL's global batch over filter_groups_train_batch_size); reading it back gives the
    oversampling as generated over kept prompts."""
    return math.ceil(j.prompts_per_step * j.rollout_oversampling)


def _first_last(t) -> tuple[int, int] | None:
    """(first, last) stage layer counts of an uneven pipeline, as Megatron sets it
    (num_layers_in_{first,last}_pipeline_stage; the stages between share the rest evenly)."""
    layers = t.pipeline_layers
    if not layers:
        return None
    if len(set(layers[1:-1])) > 1:
        raise SpecError(f"train_layout.pipeline_layers {list(layers)}: Megatron sets only the first and the last stage's layers "
                        "(num_layers_in_first/last_pipeline_stage); the stages between must hold as many layers each")  # fmt: skip
    return layers[0], layers[-1]


def _stage_layers(first: Any, last: Any, pp: int, model_path: Any, notes: list[str]) -> tuple[int, ...] | None:
    """A job's pipeline_layers from Megatron's num_layers_in_{first,last}_pipeline_stage and the
    model's layer count (its config.json at the path the config names), or None with a note."""
    if first is None and last is None:
        return None
    from planner.catalog import load_model_config

    try:
        config = load_model_config(str(model_path))[1]
        total = int(config.get("text_config", config)["num_hidden_layers"])
    except (PlannerError, KeyError, TypeError, ValueError):
        notes.append(f"num_layers_in_first/last_pipeline_stage {first}/{last}: the model's layer count is not readable at {model_path}, "
                     "so the job's train_layout.pipeline_layers is left out (set it: layers per stage)")  # fmt: skip
        return None
    ends = [x for x in (first, last) if x is not None]
    middle = pp - len(ends)
    rest = total - sum(ends)
    if middle < 0 or rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
        raise SpecError(f"num_layers_in_first/last_pipeline_stage {first}/{last} with {total} layers over {pp} stages: the stages between "
                        "cannot share the rest evenly")  # fmt: skip
    each = rest // middle if middle else 0
    return tuple(([first] if first is not None else []) + [each] * middle + ([last] if last is not None else []))


# ---- the tables: key -> value from a Deployment ------------------------------------------------------

VERL_VERSIONS = ("0.6", "0.7", "0.8", "0.9")  # the verl releases whose Megatron trainer config the export writes


def verl_version(asked: str | None = None) -> str:
    """The verl release (major.minor) an export is written for: the one asked, else the installed
    verl's, else the newest supported."""
    if asked is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            asked = version("verl")
        except PackageNotFoundError:
            asked = VERL_VERSIONS[-1]
    release = ".".join(str(asked).split(".")[:2])
    if release not in VERL_VERSIONS:
        raise SpecError(f"verl {asked}: the export writes the config of verl {', '.join(VERL_VERSIONS)}")
    return release


def _verl(d: Deployment, replay: bool, version: str | None = None) -> dict[str, Any]:
    version = verl_version(version)
    j, t, r = d.job, d.train, d.rollout
    if j.trainer_backend != "megatron":
        raise SpecError("verl export covers its Megatron trainer (ppo_megatron_trainer); this plan's job trains with the transformers backend")
    actor, mega = "actor_rollout_ref.actor", "actor_rollout_ref.actor.megatron"
    recompute = _RECOMPUTE[j.recompute]
    out = {
        "algorithm.adv_estimator": "gae" if j.algorithm == "ppo" else "grpo",
        "data.train_batch_size": j.prompts_per_step,
        "data.max_prompt_length": j.prompt_tokens.max,
        "data.max_response_length": j.response_tokens.max,
        "actor_rollout_ref.model.path": d.model_path,
        f"{mega}.tensor_model_parallel_size": t.tp,
        f"{mega}.pipeline_model_parallel_size": t.pp,
        f"{mega}.expert_model_parallel_size": t.ep,
        f"{mega}.expert_tensor_parallel_size": t.etp if t.etp is not None else t.tp,
        f"{mega}.context_parallel_size": t.cp,
        f"{mega}.use_distributed_optimizer": j.distributed_optimizer,
        f"{mega}.param_offload": j.offload.params,  # verl releases the gradient buffers with the parameters
        f"{mega}.optimizer_offload": j.offload.optimizer,
        f"{mega}.dtype": _DTYPE[j.precision],
        f"{mega}.override_transformer_config.recompute_granularity": recompute,
        f"{mega}.override_transformer_config.recompute_method": "uniform" if recompute == "full" else None,
        f"{mega}.override_transformer_config.recompute_num_layers": 1 if recompute == "full" else None,
        f"{mega}.override_transformer_config.recompute_modules": _MODULES.get(j.recompute),
        f"{actor}.ppo_mini_batch_size": _mini_batch(j),
        f"{actor}.ppo_epochs": j.ppo_epochs,
        f"{actor}.use_dynamic_bsz": True,
        f"{actor}.ppo_max_token_len_per_gpu": j.micro_tokens,
        f"{actor}.use_kl_loss": j.reference_model,
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.n": j.samples_per_prompt,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": r.tp,
        "actor_rollout_ref.rollout.data_parallel_size": r.dp,
        "actor_rollout_ref.rollout.expert_parallel_size": r.ep,
        "actor_rollout_ref.rollout.gpu_memory_utilization": j.rollout_memory_utilization,
        "actor_rollout_ref.rollout.enforce_eager": not j.rollout_graphs,
        "trainer.n_gpus_per_node": d.gpus_per_node,
        "trainer.nnodes": d.nodes,
    }
    # the reference model in the actor's layout: verl 0.7 and later inherit it, 0.6 defaults its own to 1
    for key in ("tensor_model", "pipeline_model", "expert_model", "expert_tensor", "context"):
        out[f"actor_rollout_ref.ref.megatron.{key}_parallel_size"] = out[f"{mega}.{key}_parallel_size"]
    if (stages := _first_last(t)) is not None:  # Megatron's TransformerConfig fields, new to verl's mapping (written with +)
        for stage, count in zip(("first", "last"), stages):
            out[f"{mega}.override_transformer_config.num_layers_in_{stage}_pipeline_stage"] = count
    # the reference and the rollout in the actor's precision (each has its own key, bf16 by default)
    out["actor_rollout_ref.ref.megatron.dtype"] = out["actor_rollout_ref.rollout.dtype"] = _DTYPE[j.precision]
    if _dynamic_sampling(j):
        if version != "0.9":
            raise SpecError(f"DAPO's dynamic sampling: verl {version} runs it through recipe/dapo's own trainer, whose config this export "
                            "does not write; its filter_groups came into the main trainer in 0.9 (--verl-version 0.9)")  # fmt: skip
        out["algorithm.filter_groups.enable"] = True
        out["data.gen_batch_size"] = _generated_prompts(j)
    if d.device_family == "ascend":
        out["trainer.device"] = "npu"
    # vLLM's cap on the sequences a rank decodes at once (verl's default: 256); a job without a cap gets
    # one that cannot bind, the step's every sequence
    out["actor_rollout_ref.rollout.max_num_seqs"] = j.rollout_max_seqs or j.prompts_per_step * j.samples_per_prompt
    if j.optimizer_offload_fraction > 0:  # Megatron's hybrid CPU optimizer, passed through verl's open override mapping
        out[f"{_VERL_OPTIM}.optimizer_cpu_offload"] = True
        out[f"{_VERL_OPTIM}.optimizer_offload_fraction"] = j.optimizer_offload_fraction
    if replay:
        if version == "0.6":
            raise SpecError("routing replay: verl 0.6 has no router replay (it came in 0.7); export for --verl-version 0.7 or later")
        # 0.7's default (legacy) Megatron worker reads actor.router_replay, its engine worker and 0.8+ actor.megatron.router_replay
        out[f"{mega}.router_replay.mode"] = "R3"
        if version == "0.7":
            out[f"{actor}.router_replay.mode"] = "R3"
        out["actor_rollout_ref.rollout.enable_rollout_routing_replay"] = True
    return out


# MindSpeed-RL's model entries (configs/model/<name>.yaml) of catalog models, and the --model-type-hf of
# MindSpeed-LLM's HF-to-Megatron converter (convert_ckpt_v2.py) per transformers model_type
_MINDSPEED_MODELS = {"qwen3-30b-a3b": "qwen3_30b_a3b", "qwen3-235b-a22b": "qwen3_235b_a22b", "deepseek-v3": "deepseekv3_671b"}
_MINDSPEED_HF_TYPES = {"qwen3_moe": "qwen3-moe", "deepseek_v2": "deepseek2-lite"}


def _mindspeed_experts(t) -> tuple[int, bool]:
    """(expert_model_parallel_size, moe_tp_extend_ep) of a training layout: MindSpeed-RL keeps the
    experts tensor-split like the attention (expert TP = TP), or whole over TP x EP ranks."""
    etp = t.etp if t.etp is not None else t.tp
    if etp == t.tp:
        return t.ep, False
    if etp == 1 and t.ep % t.tp == 0:
        return t.ep // t.tp, True
    raise SpecError(f"MindSpeed-RL splits experts like the attention (expert TP = TP) or keeps them whole over TP x EP ranks "
                    f"(moe_tp_extend_ep, EP a multiple of TP); this plan trains with {t.describe()}")  # fmt: skip


def _mindspeed(d: Deployment, replay: bool) -> dict[str, Any]:
    j, t, r = d.job, d.train, d.rollout
    if replay:
        raise SpecError("routing replay: MindSpeed-RL's config classes have no router replay key")
    if j.recompute == "moe":
        raise SpecError("MindSpeed-RL's config classes have no key for recomputing the MoE layers; use recompute full or selective")
    if j.precision == "fp16":
        raise SpecError("MindSpeed-RL trains in bf16 or fp32: its MegatronConfig has no fp16 key")
    if t.cp != 1:
        raise SpecError(f"context parallelism: planner's cost model counts Megatron's ring attention, and MindSpeed-RL's default "
                        f"algorithm is Ulysses; export a plan without CP (this one trains with {t.describe()})")  # fmt: skip
    ep, extend = _mindspeed_experts(t)
    if r.ep == 1 and r.dp != 1:
        raise SpecError(f"MindSpeed-RL's vLLM runs data-parallel ranks only with expert parallelism (VLLM_DP_SIZE = "
                        f"infer_expert_parallel_size); this plan's rollout is {r.describe()}")  # fmt: skip
    recompute = _RECOMPUTE[j.recompute]
    out = {
        f"model.{d.name}.num_experts": d.experts,  # the proxy's expert count over the model entry's
        "megatron_training.model": d.name,
        "megatron_training.tokenizer_name_or_path": d.model_path,
        "megatron_training.global_batch_size": _generated_prompts(j) if _dynamic_sampling(j) else j.prompts_per_step,
        "megatron_training.seq_length": j.max_sequence_tokens,
        "megatron_training.stage": "ray_dapo" if _dynamic_sampling(j) else {"grpo": "ray_grpo", "ppo": "ray_ppo"}[j.algorithm],
        "megatron_training.bf16": j.precision == "bf16",
        "megatron_training.use_distributed_optimizer": j.distributed_optimizer,
        "megatron_training.swap_optimizer": j.optimizer_swap,
        "actor_config.model": d.name,
        "actor_config.load": _mindspeed_weights(d, ep),
        "actor_config.micro_batch_size": 1,
        "actor_config.tensor_model_parallel_size": t.tp,
        "actor_config.pipeline_model_parallel_size": t.pp,
        "actor_config.expert_model_parallel_size": ep,
        "actor_config.moe_tp_extend_ep": extend or None,
        "actor_config.num_layer_list": ",".join(map(str, t.pipeline_layers)) if t.pipeline_layers else None,
        "rl_config.use_integrated_worker": j.colocated,
        "rl_config.mini_batch_size": _mini_batch(j),
        "rl_config.n_samples_per_prompt": j.samples_per_prompt,
        "rl_config.max_prompt_length": j.prompt_tokens.max,
        "rl_config.epochs": j.ppo_epochs,
        "rl_config.actor_resource.num_npus": d.cards,
        "generate_config.infer_tensor_parallel_size": r.tp,
        "generate_config.infer_pipeline_parallel_size": 1,
        "generate_config.infer_expert_parallel_size": r.dp if r.ep > 1 else 1,  # vLLM's DP; its EP is that x TP
        "generate_config.enable_expert_parallel": r.ep > 1,
        "generate_config.gpu_memory_utilization": j.rollout_memory_utilization,
        "generate_config.max_model_len": j.max_sequence_tokens,
        "generate_config.max_num_seqs": j.rollout_max_seqs or j.num_sequences,
        "generate_config.enforce_eager": not j.rollout_graphs,
        "generate_config.offload_train_optimizer": j.offload.optimizer,
        "generate_config.offload_train_grad": j.offload.grads,
        "generate_config.offload_train_param": j.offload.params,
        "generate_config.sampling_config.max_tokens": j.response_tokens.max,
    }
    if recompute is not None:
        out.update({"actor_config.recompute_granularity": recompute, "actor_config.recompute_method": "uniform" if recompute == "full" else None,
                    "actor_config.recompute_num_layers": 1 if recompute == "full" else None})  # fmt: skip
    if _dynamic_sampling(j):  # DAPO: generate the global batch per round until the step's prompts are filled
        out.update({"rl_config.filter_groups_enable": True, "rl_config.filter_groups_train_batch_size": j.prompts_per_step})
    return {k: v for k, v in out.items() if v is not None}


def _mindspeed_weights(d: Deployment, ep: int) -> str:
    """Where the proxy's Megatron-format weights go (MindSpeed-RL's actor loads those, not the HF folder)."""
    return f"{d.model_path.rstrip('/')}-mcore-tp{d.train.tp}-pp{d.train.pp}-ep{ep}"


def _mindspeed_head(d: Deployment, flat: dict[str, Any]) -> list[str]:
    """The header of a MindSpeed-RL export: the model entry it overrides and MindSpeed-LLM's weight conversion."""
    t, ep = d.train, flat["actor_config.expert_model_parallel_size"]
    target = (f"--target-tensor-parallel-size {t.tp} --target-pipeline-parallel-size {t.pp} --target-expert-parallel-size {ep}"
              + (" --moe-tp-extend-ep" if flat.get("actor_config.moe_tp_extend_ep") else "")
              + (f" --num-layer-list {flat['actor_config.num_layer_list']}" if "actor_config.num_layer_list" in flat else ""))  # fmt: skip
    dirs = f"--load-dir {d.model_path} --save-dir {flat['actor_config.load']}"
    if d.model_type == "deepseek_v3":  # MindSpeed-LLM converts DeepSeek-V3 with a script of its own
        convert = (f"python examples/mcore/deepseek3/convert_ckpt_deepseek3.py --moe-grouped-gemm {target} {dirs} --num-layers {d.layers} "
                   "--num-nextn-predict-layers 0")  # fmt: skip
    else:
        hf = _MINDSPEED_HF_TYPES.get(d.model_type or "", f"<MODEL: the --model-type-hf of MindSpeed-LLM's examples/mcore/*/ckpt_convert_*_hf2mcore.sh for {d.model_type}>")
        convert = f"python convert_ckpt_v2.py --load-model-type hf --save-model-type mg --model-type-hf {hf} --moe-grouped-gemm {target} {dirs}"
    entry = (f"the model entry {d.name} (configs/model/{d.name}.yaml, which MindSpeed-RL ships)" if d.name in _MINDSPEED_MODELS.values()
             else f"a model entry {d.name}: write configs/model/{d.name}.yaml from the original's (MindSpeed-RL ships none for this model)")
    return [f"defaults: - model: [{d.name}] loads {entry}; model.{d.name}.num_experts sets the proxy's {d.experts} experts over it",
            "weights: MindSpeed-RL's actor loads Megatron-format weights (actor_config.load); convert the proxy once with MindSpeed-LLM:",
            f"  {convert}",
            "the rollout's vLLM data-parallel size is set from infer_expert_parallel_size (VLLM_DP_SIZE) by MindSpeed-RL's launcher"]


def _nemo(d: Deployment, replay: bool) -> dict[str, Any]:
    j, t, r = d.job, d.train, d.rollout
    out = {
        "defaults": "grpo_math_1B_megatron.yaml",
        "grpo.num_prompts_per_step": j.prompts_per_step,
        "grpo.num_generations_per_prompt": j.samples_per_prompt,
        "policy.model_name": d.model_path,
        "policy.train_global_batch_size": j.num_sequences // j.mini_batches,
        "policy.train_micro_batch_size": 1,
        "policy.max_total_sequence_length": j.max_sequence_tokens,
        "policy.precision": _DTYPE[j.precision],
        # NeMo RL's own dtype check (_validate_dtype_config) wants the precision-aware optimizer in the same precision
        "policy.megatron_cfg.optimizer.bf16": j.precision == "bf16",
        "policy.megatron_cfg.optimizer.fp16": j.precision == "fp16",
        "policy.router_replay.enabled": replay,
        "policy.megatron_cfg.enabled": True,
        "policy.megatron_cfg.tensor_model_parallel_size": t.tp,
        "policy.megatron_cfg.pipeline_model_parallel_size": t.pp,
        "policy.megatron_cfg.context_parallel_size": t.cp,
        "policy.megatron_cfg.expert_tensor_parallel_size": t.etp if t.etp is not None else t.tp,
        "policy.megatron_cfg.expert_model_parallel_size": t.ep,
        "policy.megatron_cfg.sequence_parallel": t.tp > 1,
        "policy.megatron_cfg.activation_checkpointing": j.recompute != "none",
        "policy.megatron_cfg.recompute_granularity": _RECOMPUTE[j.recompute] or "full",
        "policy.megatron_cfg.recompute_modules": _MODULES.get(j.recompute),
        **({f"policy.megatron_cfg.num_layers_in_{stage}_pipeline_stage": count for stage, count in zip(("first", "last"), _first_last(t))}
           if t.pipeline_layers else {}),
        "policy.megatron_cfg.optimizer.optimizer_cpu_offload": j.optimizer_offload_fraction > 0,
        "policy.megatron_cfg.optimizer.optimizer_offload_fraction": j.optimizer_offload_fraction,
        "policy.generation.vllm_cfg.tensor_parallel_size": r.tp,
        "policy.generation.vllm_cfg.expert_parallel_size": r.ep,  # vLLM's EP = DP x TP: NeMo RL's DP follows from it
        "policy.generation.vllm_cfg.gpu_memory_utilization": j.rollout_memory_utilization,
        "policy.generation.vllm_cfg.enforce_eager": not j.rollout_graphs,
        "cluster.gpus_per_node": d.gpus_per_node,
        "cluster.num_nodes": d.nodes,
    }
    if r.ep == 1 and r.dp != 1:
        raise SpecError(f"NeMo RL's vLLM runs data-parallel ranks only with expert parallelism (its EP = DP x TP); this plan's rollout is "
                        f"{r.describe()}")  # fmt: skip
    if j.rollout_max_seqs:  # passed to vLLM's engine arguments as they are
        out["policy.generation.vllm_kwargs.max_num_seqs"] = j.rollout_max_seqs
    if _dynamic_sampling(j):  # DAPO: batch_multiplier x the step's prompts generated per round
        out.update({"grpo.use_dynamic_sampling": True, "grpo.batch_multiplier": math.ceil(j.rollout_oversampling)})
    return out


_TABLES: dict[str, Callable[[Deployment, bool], dict[str, Any]]] = {"verl": _verl, "mindspeed-rl": _mindspeed, "nemo-rl": _nemo}


# ---- out ---------------------------------------------------------------------------------------------

def _hydra(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):  # Hydra's list syntax: no spaces, bare strings
        return "[" + ",".join(_hydra(v) for v in value) + "]"
    return str(value)


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def export_plan(plan, trainer: str, model_path: str, *, routing_replay: bool = False, version: str | None = None) -> tuple[str, dict[str, Any]]:
    """(file text, dotted keys) that launch the plan's proxy run in `trainer` (verl: for `version`,
    by default the installed verl's)."""
    if trainer not in _TABLES:
        raise SpecError(f"unknown trainer {trainer!r}; one of {', '.join(TRAINERS)}")
    if version is not None and trainer != "verl":
        raise SpecError(f"--verl-version is for --to verl, not {trainer}")
    if not model_path.strip():
        raise SpecError("--model-path is empty: give where the built proxy checkpoint lies on the training cluster")
    if trainer != "nemo-rl" and re.search(r"[\s'\"$`\\]", model_path):  # NeMo RL's is a quoted YAML value
        raise SpecError(f"--model-path {model_path!r}: give the checkpoint's path without spaces, quotes, $, ` or backslashes (the "
                        f"{trainer} export's values are read back word by word, e.g. by $(grep -v '^#' FILE) for verl)")  # fmt: skip
    d = _deployment(plan, model_path)
    if "fp8" in (d.job.precision, d.job.rollout_precision):
        raise SpecError(f"this plan runs FP8 (training {d.job.precision}, rollout {d.job.rollout_precision}); each trainer sets FP8 with "
                        "keys of its own (recipes, scaling, the engine's quantization) that the export does not write yet")  # fmt: skip
    if not d.job.colocated:
        raise SpecError(f"this plan puts the rollout on a pool of its own ({d.job.rollout_devices} of {d.cards} devices, max_staleness "
                        f"{d.job.max_staleness}); the export writes colocated configs only (verl's fully-async recipe, NeMo RL's "
                        "non-colocated generation and MindSpeed-RL's separate resources are not written yet): set the pool sizes "
                        "in the trainer by hand, or suggest with a colocated job")  # fmt: skip
    flat = _verl(d, routing_replay, version) if trainer == "verl" else _TABLES[trainer](d, routing_replay)
    pred = (plan.deployment or {}).get("predicted", {})
    head = [f"planner export --to {trainer}: the proxy of {plan.model} keeping {plan.experts} of {plan.original_experts} experts "
            f"({plan.method}) on {d.cards} {plan.deployment.get('device_unit', 'device')}s of {plan.deployment.get('hardware')}",
            f"predicted: {pred.get('memory_per_card_bytes', float('nan')) / 2**30:.1f} GiB per device, "
            f"{pred.get('step_time_s', float('nan')):.0f} s per step; fault {plan.deployment.get('fault')}",
            "prompt and response lengths are the maxima; the job's mean lengths are planner's cost-model inputs only"]
    if routing_replay:
        head.append("routing replay: the trainer records this proxy run's own routes in the rollout and replays them in training; routes "
                    f"recorded on the original are not used (its expert ids map to the proxy's through {model_path}/expert_map.json)")  # fmt: skip
    if trainer == "verl":
        lines = [f"# {h}" for h in head] + [f"# written for verl {verl_version(version)}.x's ppo_megatron_trainer (--verl-version)"]
        if plan_job_skips_old_logprob(plan):
            lines.append("# old log-probs: verl recomputes them (algorithm.rollout_correction.bypass_mode=false, its default) where the plan's "
                         "job skips that pass; planner job --from reads this file back with the pass (bypass_mode=true would use the "
                         "rollout's log-probs as the old policy instead, which changes the ratio a rollout mismatch acts on)")  # fmt: skip
        lines.append("# launch: python -m verl.trainer.main_ppo --config-name ppo_megatron_trainer $(grep -v '^#' THIS_FILE)")
        # keys inside a mapping verl's config leaves open are new to Hydra: `+key=value`
        lines += [f"{'+' if k.startswith(VERL_APPENDED) else ''}{k}={_hydra(v)}" for k, v in flat.items()]
        return "\n".join(lines) + "\n", flat
    if trainer == "mindspeed-rl":
        head += ["merge into a MindSpeed-RL config of the same stage (configs/grpo_*.yaml, dapo_*.yaml): MindSpeed-RL refuses keys it "
                 "does not know, and these are all its own", *_mindspeed_head(d, flat)]  # fmt: skip
        if d.job.optimizer_offload_fraction > 0:
            head.append(f"optimizer_offload_fraction {d.job.optimizer_offload_fraction:g} is not written: MindSpeed-RL has no hybrid CPU "
                        "optimizer; swap_optimizer (the whole state in host memory, stepped on the device) is its nearest")  # fmt: skip
        flat = {"defaults": [{"model": [d.name]}], **flat}
    else:
        head.append("a NeMo RL config that inherits grpo_math_1B_megatron.yaml: run with examples/run_grpo_math.py --config THIS_FILE")
    text = "".join(f"# {h}\n" for h in head) + yaml.safe_dump(unflatten(flat), sort_keys=False)
    return text, flat


def plan_job_skips_old_logprob(plan) -> bool:
    from planner.specs import Job

    job = (plan.deployment or {}).get("job")
    return bool(job.get("skip_old_logprob", Job().skip_old_logprob)) if isinstance(job, dict) else Job().skip_old_logprob


# ---- in ---------------------------------------------------------------------------------------------

def _read_flat(path: Path, notes: list[str] | None = None) -> dict[str, Any]:
    """A trainer config as dotted keys: a YAML mapping (a saved `.hydra/config.yaml` too), a file of
    Hydra overrides (`key=value`), or a launch script whose trainer command holds them (variables
    expanded, planner.runs.shell; what it cannot resolve is named in `notes`)."""
    from planner.files import read_text
    from planner.runs.shell import looks_like_script, script_overrides

    text = read_text(path, "trainer config")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if isinstance(data, dict) and not any("=" in str(k) for k in data):
        if "defaults" in data and isinstance(data["defaults"], (str, list)):
            data = _inherited(path, notes, text=text)
        else:
            _note_duplicates(path, text, notes)
        return flatten(data)
    if looks_like_script(text):
        raw, unresolved = script_overrides(text)
        if notes is not None:
            notes.extend(f"{path.name}: {n}" for n in unresolved)
    else:
        raw = {}
        for token in text.replace("\\\n", " ").split():
            if token.startswith("#"):
                continue
            key, sep, value = token.partition("=")
            if sep and "." in key.lstrip("+~"):
                raw[key.lstrip("+~")] = value
    flat = {k: (_yaml_value(v) if v != "" else None) for k, v in raw.items()}
    if not flat:
        raise SpecError(f"{path}: neither a YAML config, nor Hydra overrides (key=value), nor a launch script holding them")
    return flat


def _note_duplicates(path: Path, text: str, notes: list[str] | None) -> None:
    """A trainer config that gives a key twice is read with the last value, as PyYAML does, and
    named: the trainers' own loader (OmegaConf) refuses such a file."""
    from planner.files import duplicate_key

    where = duplicate_key(text)
    if where and notes is not None:
        notes.append(f"{path.name}: {where}: read with the last value here, but the trainers' loader (OmegaConf) refuses such a "
                     "file: keep one")  # fmt: skip


def _inherited(path: Path, notes: list[str] | None, depth: int = 0, text: str | None = None) -> dict[str, Any]:
    """A YAML config with its `defaults:` parents merged under it, the way NeMo RL loads its configs
    (nemo_rl/utils/config.py): parents are paths relative to the file (a list merges in order), the
    child's keys win and merge into the parents' mappings, a mapping marked `_override_: true`
    replaces the parents' instead, and a mandatory value (`???`) leaves the parent's."""
    from planner.files import parse_yaml, read_text

    if depth > 20:
        raise SpecError(f"{path}: more than 20 levels of defaults: inheritance (a cycle?)")
    text = read_text(path, "trainer config") if text is None else text
    data = parse_yaml(text, path, unique=False)
    _note_duplicates(path, text, notes)
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a config file is a mapping, got {type(data).__name__}")
    parents = data.pop("defaults", None)
    parents = [parents] if isinstance(parents, str) else list(parents or [])
    base: dict[str, Any] = {}
    for parent in parents:
        for group, name in _defaults_entry(parent):
            if name == "_self_":
                continue
            where = f"{group}/{name}.yaml" if group else str(name)
            parent_path = Path(where) if where.startswith("/") else path.parent / where
            if not parent_path.is_file():  # what the file sets itself still reads; a key only the parent has is missing
                if notes is not None:
                    notes.append(f"{path.name}: defaults: {where} not found at {parent_path}: the keys it would give are missing (keep "
                                 "the config beside the files it inherits from)")  # fmt: skip
                continue
            loaded = _inherited(parent_path, notes, depth + 1)
            base = _merge(base, {group: loaded} if group else loaded)
            if notes is not None and depth == 0:
                notes.append(f"{path.name} inherits from {where}: its keys that the file does not set come from there")
    return _merge(base, data)


def _defaults_entry(entry: Any) -> list[tuple[str | None, str]]:
    """(config group, name) pairs of one `defaults:` entry: a path (NeMo RL: `../grpo_math_1B.yaml`)
    or a Hydra config-group choice (MindSpeed-RL: `model: [qwen3_30b_a3b]`, loaded from
    `model/qwen3_30b_a3b.yaml` and placed under the group's key)."""
    if isinstance(entry, dict):
        return [(str(g), str(n)) for g, names in entry.items() for n in (names if isinstance(names, list) else [names]) if n is not None]
    return [(None, str(entry))]


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        if value == "???":
            continue
        if isinstance(value, dict):
            value = dict(value)
            if value.pop("_override_", False) or not isinstance(out.get(key), dict):
                out[key] = value
            else:
                out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _yaml_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def verl_defaults(fully_async: bool = False) -> tuple[dict[str, Any], str] | None:
    """(every key of verl's Megatron trainer config with its shipped default, verl's version) from the
    installed verl package (its composed `_generated_ppo_megatron_trainer.yaml`; `fully_async`: with
    the fully-async trainer's own config over it, as its Hydra defaults list puts it), or None."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "trainer" / "config" / "_generated_ppo_megatron_trainer.yaml"
    if not path.is_file():
        return None
    try:
        v = version("verl")
    except PackageNotFoundError:
        v = "?"
    flat = flatten(yaml.safe_load(path.read_text()))
    if fully_async:
        extra = path.parents[2] / "experimental" / "fully_async_policy" / "config" / "fully_async_ppo_megatron_trainer.yaml"
        if not extra.is_file():
            raise SpecError(f"the script runs verl's fully-async trainer, which verl {v} does not ship ({extra} is missing)")
        own = yaml.safe_load(extra.read_text())
        own.pop("hydra", None), own.pop("defaults", None)
        flat.update(flatten(own))
    return flat, v


_SELECT = re.compile(r"^\$\{oc\.select:([\w.]+)(?:,(.*))?\}$")
_REF = re.compile(r"^\$\{([A-Za-z_][\w.]*)\}$")


def _resolve(flat: dict[str, Any]) -> dict[str, Any]:
    """Hydra interpolations of the values (`${a.b}`, `${oc.select:a.b,default}`) resolved against
    the same keys; relative or other resolvers are left as they are."""
    out = dict(flat)
    for _ in range(5):
        changed = False
        for key, value in out.items():
            if not isinstance(value, str) or "${" not in value:
                continue
            if (m := _SELECT.match(value)) is not None:
                target, default = m.group(1), m.group(2)
                new = out.get(target, _yaml_value(default) if default is not None else None)
            elif (m := _REF.match(value)) is not None and m.group(1) in out:
                new = out[m.group(1)]
            else:
                continue
            if new != value:
                out[key], changed = new, True
        if not changed:
            break
    return out


def _number(flat: dict, key: str, path: Path, kind=int):
    value = flat.get(key)
    if isinstance(value, str):  # YAML 1.1 reads 1e-6 as text; trainers' configs are full of them
        try:
            value = float(value)
        except ValueError:
            raise SpecError(f"{path}: {key}: {value!r} is not a number") from None
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{path}: {key} is missing or not a number (got {value!r})")
    return kind(value)


def job_from(trainer: str, path: str | Path) -> tuple[Any, int, list[str]]:
    """(Job with its layouts, device count, notes) from a trainer's config."""
    from planner.specs import Job, Lengths, Offload, RolloutLayout, TrainLayout

    if trainer not in _TABLES:
        raise SpecError(f"unknown trainer {trainer!r}; one of {', '.join(TRAINERS)}")
    path = Path(path)
    notes = ["mean prompt and response lengths are not in a trainer config: the default job's ratios of mean to maximum are used; "
             "set them from your data"]  # fmt: skip
    f = _read_flat(path, notes)
    raw_keys = set(f)
    if trainer == "verl" and not raw_keys & set(_REQUIRED[trainer]):  # else verl's shipped defaults would stand in for every key
        others = [t for t in _REQUIRED if t != trainer and raw_keys & set(_REQUIRED[t])]
        raise SpecError(f"{path}: not a verl config: it sets none of the keys a verl job is read from ({', '.join(_REQUIRED[trainer][:4])}, ...)"
                        + (f"; it reads as a {others[0]} config (--from {others[0]})" if others else ""))  # fmt: skip
    fully_async = trainer == "verl" and any(k.startswith("async_training.") or k.startswith("rollout.nnodes") for k in raw_keys)
    shipped = None
    if trainer == "verl":  # what the script leaves out is verl's own default, from the config verl ships
        shipped = verl_defaults(fully_async=fully_async)
        if shipped is not None:
            defaults, verl_version = shipped
            taken = [k for k in _REQUIRED["verl"] + _VERL_DEFAULTED if k not in f and defaults.get(k) is not None]
            f = _resolve({**defaults, **f})  # the script's keys win, an explicit null too
            if taken:
                notes.append(f"from verl {verl_version}'s shipped defaults: " + ", ".join(f"{k.split('.', 1)[-1] if k.startswith('actor_rollout_ref.') else k}="
                                                                                       f"{f.get(k)}" for k in taken))  # fmt: skip
        else:
            notes.append("verl is not installed, so its defaults are not known: every key the config leaves out must be set")
    if trainer == "mindspeed-rl":  # MindSpeed-RL merges the actor over the shared Megatron block; the rest is its classes' defaults
        f = {**{f"actor_config.{k.split('.', 1)[1]}": v for k, v in f.items() if k.startswith("megatron_training.")}, **f}
        taken = {k: v for k, v in _MINDSPEED_DEFAULTS.items() if k not in f}
        f = {**_MINDSPEED_DEFAULTS, **f}
        if taken:
            notes.append("from MindSpeed-RL's config classes' defaults: " + ", ".join(f"{k}={v}" for k, v in taken.items()))
    missing = [k for k in _REQUIRED[trainer] if f.get(k) is None]
    if missing:
        raise SpecError(f"{path}: not a complete {trainer} config: missing {', '.join(missing)}")
    n = lambda key, kind=int: _number(f, key, path, kind)  # noqa: E731
    default = Job()

    def lengths(prompt_max: int, response_max: int) -> dict:
        scale = lambda d, m: Lengths(mean=round(d.mean / d.max * m, 1), max=m)  # noqa: E731
        return {"prompt_tokens": scale(default.prompt_tokens, prompt_max), "response_tokens": scale(default.response_tokens, response_max)}

    precision = {v: k for k, v in _DTYPE.items()}
    if trainer == "verl":
        mega, actor = "actor_rollout_ref.actor.megatron", "actor_rollout_ref.actor"
        prompts = n("data.train_batch_size")
        if fully_async:  # its step is one parameter sync: trigger_parameter_sync_step x require_batches mini-batches
            syncs = n("async_training.trigger_parameter_sync_step") * n("async_training.require_batches")
            prompts = syncs * n(f"{actor}.ppo_mini_batch_size")
            notes.append(f"verl's fully-async trainer: a step is one parameter sync, {syncs} mini-batches of "
                         f"{n(f'{actor}.ppo_mini_batch_size')} prompts (async_training.trigger_parameter_sync_step x require_batches)")
        if prompts < n(f"{actor}.ppo_mini_batch_size"):
            raise SpecError(f"{path}: data.train_batch_size {prompts} is smaller than actor.ppo_mini_batch_size {n(f'{actor}.ppo_mini_batch_size')}"
                            f"{' (verl' + chr(39) + 's default)' if f'{actor}.ppo_mini_batch_size' not in raw_keys else ''}: verl needs at "
                            "least one mini-batch per step")  # fmt: skip
        recompute = f.get(f"{mega}.override_transformer_config.recompute_granularity")
        modules = f.get(f"{mega}.override_transformer_config.recompute_modules")
        if recompute == "selective" and isinstance(modules, list) and "moe" in modules:
            recompute = "moe"
        kw = dict(algorithm="ppo" if f.get("algorithm.adv_estimator") == "gae" else "grpo", prompts_per_step=prompts,
                  samples_per_prompt=n("actor_rollout_ref.rollout.n"), **lengths(n("data.max_prompt_length"), n("data.max_response_length")),
                  precision=precision.get(f.get(f"{mega}.dtype", "bfloat16"), "bf16"), recompute=recompute or "none",
                  offload=Offload(params=bool(f.get(f"{mega}.param_offload", False)), grads=bool(f.get(f"{mega}.param_offload", False)),
                                  optimizer=bool(f.get(f"{mega}.optimizer_offload", False))),
                  reference_model=bool(f.get(f"{actor}.use_kl_loss", False)), ppo_epochs=n(f"{actor}.ppo_epochs"),
                  mini_batches=prompts // n(f"{actor}.ppo_mini_batch_size"), distributed_optimizer=bool(f.get(f"{mega}.use_distributed_optimizer", True)),
                  rollout_memory_utilization=n("actor_rollout_ref.rollout.gpu_memory_utilization", float),
                  train_layout=TrainLayout(tp=n(f"{mega}.tensor_model_parallel_size"), pp=n(f"{mega}.pipeline_model_parallel_size"),
                                           ep=n(f"{mega}.expert_model_parallel_size"), cp=n(f"{mega}.context_parallel_size"),
                                           etp=f.get(f"{mega}.expert_tensor_parallel_size")),
                  rollout_layout=RolloutLayout(tp=n("actor_rollout_ref.rollout.tensor_model_parallel_size"),
                                               dp=n("actor_rollout_ref.rollout.data_parallel_size"),
                                               ep=n("actor_rollout_ref.rollout.expert_parallel_size")))  # fmt: skip
        if f.get(f"{actor}.use_dynamic_bsz"):
            kw["micro_batch_tokens"] = n(f"{actor}.ppo_max_token_len_per_gpu")
        if f.get("actor_rollout_ref.rollout.enforce_eager") is not None:
            kw["rollout_graphs"] = not f["actor_rollout_ref.rollout.enforce_eager"]
        if f.get("actor_rollout_ref.rollout.max_num_seqs") is not None:  # a cap of the step's every sequence cannot bind
            seqs = n("actor_rollout_ref.rollout.max_num_seqs")
            kw["rollout_max_seqs"] = None if seqs >= prompts * kw["samples_per_prompt"] else seqs
        if f.get(f"{_VERL_OPTIM}.optimizer_cpu_offload"):
            kw["optimizer_offload_fraction"] = float(f.get(f"{_VERL_OPTIM}.optimizer_offload_fraction", 1.0))
        if f.get("algorithm.filter_groups.enable"):  # DAPO's dynamic sampling (verl 0.9's main trainer)
            kw.update(_oversampling(f.get("data.gen_batch_size"), prompts, "data.gen_batch_size", notes))
            kw["algorithm"] = "dapo" if kw["algorithm"] == "grpo" else kw["algorithm"]
        rollout_dtype = f.get("actor_rollout_ref.rollout.dtype")
        if rollout_dtype not in (None, f.get(f"{mega}.dtype", "bfloat16")):
            notes.append(f"the rollout runs in {rollout_dtype}, the actor in {f.get(f'{mega}.dtype', 'bfloat16')}: the job's precision is the "
                         "actor's, and the rollout's own precision is a rollout-mismatch knob, not a cost")  # fmt: skip
        cards = n("trainer.n_gpus_per_node") * n("trainer.nnodes")
        if fully_async:
            kw.update(_verl_async_pools(f, n, cards, notes))
            cards += kw["rollout_devices"]
        # verl recomputes the old log-probs unless bypass mode takes the rollout's (verl >= 0.6.1)
        kw["skip_old_logprob"] = bool(f.get("algorithm.rollout_correction.bypass_mode", False))
        stages = _stage_layers(*(f.get(f"{mega}.override_transformer_config.num_layers_in_{s}_pipeline_stage") for s in ("first", "last")),
                               kw["train_layout"].pp, f.get("actor_rollout_ref.model.path"), notes)  # fmt: skip
        if stages is not None:
            kw["train_layout"] = replace(kw["train_layout"], pipeline_layers=stages)
    elif trainer == "mindspeed-rl":
        kw, cards = _mindspeed_job(f, n, lengths, notes)
    else:
        prompts = n("grpo.num_prompts_per_step")
        samples = n("grpo.num_generations_per_prompt")
        total = n("policy.max_total_sequence_length")
        if isinstance(f.get("data.max_input_seq_length"), int) and 0 < f["data.max_input_seq_length"] < total:
            prompt_max = f["data.max_input_seq_length"]  # the prompt's cap; the rest of the sequence is response
        else:
            notes.append("NeMo RL gives one total sequence length here: the prompt maximum is taken from planner's default job, the rest is response")
            prompt_max = min(default.prompt_tokens.max, total // 2)
        mega = "policy.megatron_cfg"
        f = _resolve(f)
        kw = dict(prompts_per_step=prompts, samples_per_prompt=samples, **lengths(prompt_max, total - prompt_max),
                  recompute=_nemo_recompute(f, mega),
                  precision=precision.get(f.get("policy.precision", "bfloat16"), "bf16"),
                  optimizer_offload_fraction=float(f.get(f"{mega}.optimizer.optimizer_offload_fraction", 1.0))
                  if f.get(f"{mega}.optimizer.optimizer_cpu_offload") else 0.0,
                  mini_batches=max(1, prompts * samples // n("policy.train_global_batch_size")),
                  rollout_memory_utilization=n("policy.generation.vllm_cfg.gpu_memory_utilization", float),
                  train_layout=TrainLayout(tp=n(f"{mega}.tensor_model_parallel_size"), pp=n(f"{mega}.pipeline_model_parallel_size"),
                                           ep=n(f"{mega}.expert_model_parallel_size"), cp=int(f.get(f"{mega}.context_parallel_size", 1)),
                                           etp=f.get(f"{mega}.expert_tensor_parallel_size")),
                  rollout_layout=_nemo_rollout(n("policy.generation.vllm_cfg.tensor_parallel_size"),
                                               int(f.get("policy.generation.vllm_cfg.expert_parallel_size", 1))))  # fmt: skip
        # sequence packing (dynamic batching alike): each training micro-batch packs up to
        # max_total_sequence_length x train_micro_batch_size tokens (its train_mb_tokens)
        if f.get("policy.sequence_packing.enabled") or f.get("policy.dynamic_batching.enabled"):
            kw["micro_batch_tokens"] = total * n("policy.train_micro_batch_size")
        # NeMo RL's GRPO step computes the policy's log-probs before training, whatever the number of
        # updates (nemo_rl/algorithms/grpo.py: train_data["prev_logprobs"] = policy.get_logprobs(...))
        kw["skip_old_logprob"] = False
        # the refit: packed buffers on every path from NeMo RL 0.4 (trainer_versions.py); these config keys are 0.4's and later's
        kw["weight_sync"] = "packed"
        notes.append("weight_sync packed: NeMo RL hands the refit to vLLM in packed buffers from 0.4 (earlier releases tensor by "
                     "tensor: set weight_sync: gather)")
        # FP8: Megatron's fp8_cfg for training, vLLM's precision for generation
        if f.get(f"{mega}.fp8_cfg.enabled"):
            kw["precision"] = "fp8"
            notes.append(f"{mega}.fp8_cfg.enabled: training in FP8 ({f.get(f'{mega}.fp8_cfg.fp8_recipe', 'its recipe')} scaling)")
        if f.get("policy.generation.vllm_cfg.precision") == "fp8":
            kw["rollout_precision"] = "fp8"
        if f.get("policy.generation.vllm_cfg.enforce_eager") is not None:
            kw["rollout_graphs"] = not f["policy.generation.vllm_cfg.enforce_eager"]
        if f.get("policy.generation.vllm_kwargs.max_num_seqs") is not None:
            seqs = n("policy.generation.vllm_kwargs.max_num_seqs")
            kw["rollout_max_seqs"] = None if seqs >= prompts * samples else seqs
        if f.get("grpo.use_dynamic_sampling"):  # DAPO: batch_multiplier x the step's prompts per generation round
            multiplier = f.get("grpo.batch_multiplier", 1)
            kw.update(algorithm="dapo", **_oversampling(prompts * multiplier if isinstance(multiplier, (int, float)) else None, prompts,
                                                         "grpo.batch_multiplier", notes))  # fmt: skip
        stages = _stage_layers(f.get(f"{mega}.num_layers_in_first_pipeline_stage"), f.get(f"{mega}.num_layers_in_last_pipeline_stage"),
                               kw["train_layout"].pp, f.get("policy.model_name"), notes)  # fmt: skip
        if stages is not None:
            kw["train_layout"] = replace(kw["train_layout"], pipeline_layers=stages)
        cards = n("cluster.gpus_per_node") * n("cluster.num_nodes")
        if f.get("policy.generation.colocated.enabled") is False:
            kw.update(_nemo_pools(f, n, cards, notes))
    kw["trainer"] = trainer
    if trainer == "verl" and shipped is not None:  # the installed verl's release: its passes follow it
        kw["trainer_version"] = verl_version
    updates = kw.get("ppo_epochs", 1) * kw["mini_batches"]
    if "skip_old_logprob" not in kw:
        kw["skip_old_logprob"] = updates == 1
    elif kw["skip_old_logprob"] and updates > 1:
        notes.append(f"bypass mode with {updates} optimizer steps per RL step: the rollout's log-probs stand in for the old policy's "
                     "in every step, so no old log-prob pass runs")  # fmt: skip
    if cards < 1:
        raise SpecError(f"{path}: the config gives {cards} devices (its device and node counts multiplied); a job needs at least one")
    return Job(**kw), cards, notes


def _verl_async_pools(f: dict, n: Callable, train_devices: int, notes: list[str]) -> dict[str, Any]:
    """verl's fully-async trainer as separate pools: the rollouter on rollout.nnodes x
    rollout.n_gpus_per_node, the trainer on trainer.nnodes x n_gpus_per_node. Its staleness_threshold
    is a share of one sync's samples the rollouter may run ahead; planner counts whole steps, so any
    share above 0 is one step, more than 1 its ceiling (0: on-policy, the pools taking turns)."""
    rollout = n("rollout.nnodes") * n("rollout.n_gpus_per_node")
    threshold = n("async_training.staleness_threshold", float)
    staleness = max(1, math.ceil(threshold)) if threshold > 0 else 0
    partial = bool(f.get("async_training.partial_rollout")) and staleness > 0
    notes.append(f"separate pools: {rollout} rollout and {train_devices} training GPUs; staleness_threshold {threshold:g} read as "
                 f"{staleness} step(s) ahead" + ("; partial rollout (generation resumes across a sync)" if partial else ""))  # fmt: skip
    return {"colocated": False, "rollout_devices": rollout, "max_staleness": staleness, "partial_rollout": partial}


def _nemo_recompute(f: dict, mega: str) -> str:
    """NeMo RL's activation checkpointing as the job's recompute: its granularity (full by default),
    selective with Megatron's `moe` module as moe."""
    if not f.get(f"{mega}.activation_checkpointing"):
        return "none"
    granularity = f.get(f"{mega}.recompute_granularity") or "full"
    modules = f.get(f"{mega}.recompute_modules")
    return "moe" if granularity == "selective" and isinstance(modules, list) and "moe" in modules else granularity


def _nemo_pools(f: dict, n: Callable, cards: int, notes: list[str]) -> dict[str, Any]:
    """NeMo RL's non-colocated generation as separate pools, the way its setup splits the cluster
    (nemo_rl/algorithms/grpo.py): on one node the generation takes resources.gpus_per_node of it,
    on several it takes resources.num_nodes whole nodes; async GRPO runs max_trajectory_age_steps
    ahead."""
    key = "policy.generation.colocated.resources"
    rollout = n(f"{key}.gpus_per_node") if n("cluster.num_nodes") == 1 else n(f"{key}.num_nodes") * n("cluster.gpus_per_node")
    staleness = int(f.get("grpo.async_grpo.max_trajectory_age_steps") or 1) if f.get("grpo.async_grpo.enabled") else 0
    partial = bool(staleness and f.get("grpo.async_grpo.in_flight_weight_updates"))
    notes.append(f"separate pools: {rollout} generation and {cards - rollout} training GPUs"
                 + (f", async GRPO {staleness} step(s) ahead" if staleness else ", synchronous (on-policy)")
                 + ("; in-flight weight updates: generation keeps running through a sync (partial_rollout)" if partial else ""))  # fmt: skip
    return {"colocated": False, "rollout_devices": rollout, "max_staleness": staleness, "partial_rollout": partial}


def _nemo_rollout(tp: int, ep: int):
    """NeMo RL's vLLM layout: with expert parallelism its EP is DP x TP (EP a multiple of TP)."""
    from planner.specs import RolloutLayout

    if ep > 1 and ep % tp:
        raise SpecError(f"policy.generation.vllm_cfg.expert_parallel_size {ep} is not a multiple of tensor_parallel_size {tp} "
                        "(NeMo RL's vLLM EP = DP x TP)")  # fmt: skip
    return RolloutLayout(tp=tp, dp=ep // tp if ep > 1 else 1, ep=ep)


def _oversampling(generated: Any, prompts: int, key: str, notes: list[str]) -> dict[str, float]:
    """The job's rollout_oversampling under DAPO's dynamic sampling: prompts generated per round over
    prompts kept, at least 1 (more rounds, when a round keeps too few, depend on the data)."""
    ratio = generated / prompts if isinstance(generated, (int, float)) and not isinstance(generated, bool) and generated > 0 else 1.0
    ratio = max(1.0, float(ratio))
    notes.append(f"DAPO dynamic sampling: rollout_oversampling {ratio:g} from {key} (prompts generated per round over the step's "
                 f"{prompts}); a run whose rounds keep too few prompts generates more, so set it from your run's own ratio")  # fmt: skip
    return {"rollout_oversampling": ratio}


# MindSpeed-RL's defaults for the keys job_from reads (mindspeed_rl/config_cls/{megatron,rl,generate}_config.py,
# commit 05a90d77): a config that leaves a key out runs with these
_MINDSPEED_DEFAULTS = {
    "actor_config.tensor_model_parallel_size": 1, "actor_config.pipeline_model_parallel_size": 1, "actor_config.expert_model_parallel_size": 1,
    "actor_config.context_parallel_size": 1, "actor_config.moe_tp_extend_ep": False, "actor_config.bf16": True,
    "actor_config.use_distributed_optimizer": False, "actor_config.swap_optimizer": False, "actor_config.recompute_granularity": None,
    "actor_config.stage": None, "rl_config.n_samples_per_prompt": 1, "rl_config.mini_batch_size": 1, "rl_config.max_prompt_length": 512,
    "rl_config.epochs": 1, "rl_config.use_integrated_worker": True, "rl_config.filter_groups_enable": False,
    "rl_config.filter_groups_train_batch_size": 1,
    "generate_config.infer_tensor_parallel_size": 8, "generate_config.infer_pipeline_parallel_size": 1,
    "generate_config.infer_expert_parallel_size": 1, "generate_config.enable_expert_parallel": False,
    "generate_config.gpu_memory_utilization": 0.5, "generate_config.max_num_seqs": 1, "generate_config.enforce_eager": True,
    "generate_config.offload_train_param": False, "generate_config.offload_train_grad": False, "generate_config.offload_train_optimizer": False,
    "generate_config.sampling_config.max_tokens": 128,
}  # fmt: skip
_MINDSPEED_STAGES = {"ray_grpo": "grpo", "ray_dapo": "dapo", "ray_ppo": "ppo"}


def _mindspeed_job(f: dict, n: Callable, lengths: Callable, notes: list[str]) -> tuple[dict[str, Any], int]:
    """Job fields and device count from a MindSpeed-RL config (the actor merged over megatron_training,
    defaults filled). Its layouts as MindSpeed-RL computes them: with moe_tp_extend_ep the experts are
    split over TP x EP ranks and kept whole (expert TP 1); the rollout's vLLM runs VLLM_DP_SIZE =
    infer_expert_parallel_size data-parallel ranks of infer_tensor_parallel_size each, its experts
    split over all of them (the weight loader's EP is infer_expert_parallel_size x TP), or, without
    expert parallelism, tensor-parallel instances of TP ranks."""
    from planner.specs import Offload, RolloutLayout, TrainLayout

    a, g = "actor_config", "generate_config"
    prompts, samples = n(f"{a}.global_batch_size"), n("rl_config.n_samples_per_prompt")
    sampling = {}
    if f.get("rl_config.filter_groups_enable"):  # DAPO: the global batch is generated per round until this many prompts are kept
        generated, prompts = prompts, n("rl_config.filter_groups_train_batch_size")
        sampling = _oversampling(generated, prompts, "megatron_training.global_batch_size", notes)
    tp, ep = n(f"{a}.tensor_model_parallel_size"), n(f"{a}.expert_model_parallel_size")
    extend = bool(f.get(f"{a}.moe_tp_extend_ep"))
    stages = f.get(f"{a}.num_layer_list")  # uneven pipeline stages, "a,b,c" (MindSpeed-LLM's --num-layer-list)
    try:
        stages = tuple(int(x) for x in str(stages).split(",")) if stages not in (None, "") else None
    except ValueError:
        raise SpecError(f"actor_config.num_layer_list {stages!r}: layer counts per stage, comma-separated") from None
    train = TrainLayout(tp=tp, pp=n(f"{a}.pipeline_model_parallel_size"), ep=ep * tp if extend else ep, cp=n(f"{a}.context_parallel_size"),
                        etp=1 if extend else None, pipeline_layers=stages)  # fmt: skip
    if extend and tp > 1:
        notes.append(f"moe_tp_extend_ep: expert parallelism is TP x EP = {tp} x {ep} = {train.ep}, each expert whole on its rank")
    infer_tp, infer_ep = n(f"{g}.infer_tensor_parallel_size"), n(f"{g}.infer_expert_parallel_size")
    if n(f"{g}.infer_pipeline_parallel_size") != 1:
        raise SpecError("generate_config.infer_pipeline_parallel_size > 1: MindSpeed-RL's vLLM rollout has no pipeline parallelism")
    if f.get(f"{g}.enable_expert_parallel"):
        rollout = RolloutLayout(tp=infer_tp, dp=infer_ep, ep=infer_tp * infer_ep)
        notes.append(f"rollout: vLLM data parallel {infer_ep} (VLLM_DP_SIZE = infer_expert_parallel_size) x TP {infer_tp}, experts over all "
                     f"{rollout.ep} ranks of an instance")  # fmt: skip
    else:
        rollout = RolloutLayout(tp=infer_tp, dp=1, ep=1)
    stage = f.get(f"{a}.stage")
    kw = dict(algorithm=_MINDSPEED_STAGES.get(stage, "grpo"), prompts_per_step=prompts, samples_per_prompt=samples,
              **lengths(n("rl_config.max_prompt_length"), n(f"{g}.sampling_config.max_tokens")),
              precision="bf16" if f.get(f"{a}.bf16") else "fp32", recompute=f.get(f"{a}.recompute_granularity") or "none",
              colocated=bool(f.get("rl_config.use_integrated_worker")),
              offload=Offload(params=bool(f.get(f"{g}.offload_train_param")), grads=bool(f.get(f"{g}.offload_train_grad")),
                              optimizer=bool(f.get(f"{g}.offload_train_optimizer"))),
              ppo_epochs=n("rl_config.epochs"), mini_batches=max(1, prompts // n("rl_config.mini_batch_size")),
              distributed_optimizer=bool(f.get(f"{a}.use_distributed_optimizer")), optimizer_swap=bool(f.get(f"{a}.swap_optimizer")),
              rollout_memory_utilization=n(f"{g}.gpu_memory_utilization", float), rollout_graphs=not f.get(f"{g}.enforce_eager"),
              train_layout=train, rollout_layout=rollout, **sampling)  # fmt: skip
    if sampling:
        kw["algorithm"] = "dapo"
    if stage is not None and stage not in _MINDSPEED_STAGES:
        notes.append(f"megatron_training.stage {stage}: not a stage planner knows ({', '.join(_MINDSPEED_STAGES)}); read as GRPO")
    seqs = n(f"{g}.max_num_seqs")
    kw["rollout_max_seqs"] = None if seqs >= prompts * samples else seqs  # a cap of the step's every sequence cannot bind
    if kw["recompute"] == "full" and f.get(f"{a}.recompute_num_layers") is not None:
        notes.append(f"recompute_granularity full with recompute_method {f.get(f'{a}.recompute_method')} and recompute_num_layers "
                     f"{f.get(f'{a}.recompute_num_layers')}: planner counts every layer as recomputed")  # fmt: skip
    if stage == "ray_dapo" and (f.get("rl_config.clip_higher_enable") or f.get("rl_config.overlong_buffer_enable")):
        notes.append("DAPO's clip-higher and overlong buffer change the loss, not the cost: the job does not carry them")
    return kw, n("rl_config.actor_resource.num_npus")


_VERL_MEGA = "actor_rollout_ref.actor.megatron"
# read with a default of verl's when the script leaves them out (named in the notes)
_VERL_DEFAULTED = ["algorithm.adv_estimator", f"{_VERL_MEGA}.param_offload", f"{_VERL_MEGA}.optimizer_offload", f"{_VERL_MEGA}.dtype",
                   f"{_VERL_MEGA}.use_distributed_optimizer", f"{_VERL_MEGA}.expert_tensor_parallel_size",
                   f"{_VERL_MEGA}.override_transformer_config.recompute_granularity", "actor_rollout_ref.actor.use_kl_loss",
                   "actor_rollout_ref.actor.use_dynamic_bsz", "algorithm.rollout_correction.bypass_mode", "actor_rollout_ref.rollout.enforce_eager",
                   "actor_rollout_ref.rollout.max_num_seqs"]  # fmt: skip
_VERL_OPTIM = "actor_rollout_ref.actor.optim.override_optimizer_config"  # verl passes it to Megatron's OptimizerConfig
# keys new to verl's config, passed through its override mappings to Megatron's configs: Hydra wants `+key=value`
VERL_APPENDED = (f"{_VERL_OPTIM}.", f"{_VERL_MEGA}.override_transformer_config.num_layers_in_")
_REQUIRED = {  # what job_from reads without a default
    "verl": ["data.train_batch_size", "data.max_prompt_length", "data.max_response_length", "actor_rollout_ref.rollout.n",
             "actor_rollout_ref.actor.ppo_epochs", "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.rollout.gpu_memory_utilization",
             *(f"{_VERL_MEGA}.{k}_parallel_size" for k in ("tensor_model", "pipeline_model", "expert_model", "context")),
             *(f"actor_rollout_ref.rollout.{k}_parallel_size" for k in ("tensor_model", "data", "expert")), "trainer.n_gpus_per_node", "trainer.nnodes"],
    "mindspeed-rl": ["actor_config.global_batch_size", "rl_config.actor_resource.num_npus"],  # no default in MindSpeed-RL either
    "nemo-rl": ["grpo.num_prompts_per_step", "grpo.num_generations_per_prompt", "policy.max_total_sequence_length", "policy.train_global_batch_size",
                "policy.generation.vllm_cfg.gpu_memory_utilization", "policy.generation.vllm_cfg.tensor_parallel_size",
                *(f"policy.megatron_cfg.{k}_parallel_size" for k in ("tensor_model", "pipeline_model", "expert_model")),
                "cluster.gpus_per_node", "cluster.num_nodes"],
}  # fmt: skip


@lru_cache(maxsize=1)
def published_keys() -> dict[str, dict]:
    return yaml.safe_load(Path(__file__).with_name("trainer_keys.yaml").read_text())
