"""What a trainer's release changes in the terms the cost model has: which log-prob passes run, what
moves over the host link around them, and how the trained weights reach the rollout engine. Pure
data and one function; a job names `trainer` and `trainer_version`, `Job` checks its passes against
the release here and takes its weight-sync path from it unless the job sets weight_sync.

Only facts read from the trainers' own code at their release tags are kept (no efficiency knob per
version: no published run pins one):

verl (volcengine/verl, later verl-project/verl)
  0.1          the old log-probs are recomputed inside generate_sequences (no phase of its own;
               the same forward pass over the batch)
  0.2 - 0.6.0  a separate old_log_prob pass, always (ray_trainer.py: `compute_log_prob`, commit
               e974fb19, PR #129); 0.6.0's on-policy shortcut in the FSDP actor
               (`old_log_prob = log_prob.detach()`) changes the loss, not the pass (issue #3996)
  0.6.1 -      skipped with algorithm.rollout_correction.bypass_mode: true (PR #3984, renamed in
               #4070; default false in every release), which takes the rollout's log-probs and needs
               actor_rollout_ref.rollout.calculate_log_probs: true (the default from 0.9.0, PR #6616)
NeMo RL (NVIDIA-NeMo/RL)
  - 0.6        prev_logprobs from a separate forward pass in every step (grpo.py
               `policy.get_logprobs`); force_on_policy_ratio (0.5) changes the loss only
  0.7 -        loss_fn.force_on_policy_ratio: true skips it (PR #2443), unless
               seq_logprob_error_threshold is set
  reference    always computed before 0.6; grpo.skip_reference_policy_logprobs_calculation from 0.6
  - 0.4        prepare_for_lp_inference moves the optimizer state to the host and
               prepare_for_training brings it back, every step (megatron_policy_worker.py at v0.4.0);
               from 0.5 only with policy.offload_optimizer_for_logprob: true (PR #1404: "3 ~ 15s per
               step")
MindSpeed-RL (Ascend/MindSpeed-RL)
  2.0 -        the actor's log-prob pass is skipped by itself when the step is one optimizer step
               (global batch x samples == mini-batch, one epoch; PPO also without a KL reward term:
               grpo_trainer_hybrid.py set_actor_log_prob_skip_flag)
weight sync (the refit: trained weights handed to the rollout engine each step)
  verl         - 0.7.0: per tensor: vLLM runs inside the trainer's process and loads a generator that
               gathers each tensor over the pipeline and TP/EP groups (per_tensor_generator,
               verl/utils/megatron_utils.py); its one-step-off and fully-async recipes broadcast
               tensor by tensor between pools (the fully-async checkpoint engine of 0.7.0 packs, as an
               option). 0.7.1 -: packed: vLLM in a process of its own, weights sent through one
               shared buffer of update_weights_bucket_megabytes (PR #4280; BucketedWeightSender)
  NeMo RL      - 0.3: one IPC handle or broadcast per tensor (DTensor; Megatron's colocated path
               packs by dtype from 0.3, PR #589). 0.4 -: packed on every path: colocated through two
               alternating buffers over ZMQ (PR #1267, in r0.4.0 as #1409), between pools a packed
               broadcast (PR #1313, as #1346) overlapped with the parameter gather (PR #1379, as #1418)
  MindSpeed-RL per tensor: each tensor resharded (TP all-gather, expert P2P) and loaded into the
               in-process vLLM (vllm_weight_container.py); only the cross-stage step moves whole buffers
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from planner.errors import SpecError

__all__ = ["TRAINERS", "Release", "release"]

TRAINERS = ("verl", "nemo-rl", "mindspeed-rl")


@dataclass(frozen=True)
class Release:
    trainer: str
    version: tuple[int, ...]
    old_logprob_skip: str | None  # how this release skips the old log-prob pass, or None: it cannot
    old_logprob_skip_default: str  # never | on-policy: whether it skips without being asked
    reference_skip: str | None  # how it skips the reference pass, or None: it always runs it
    logprob_optimizer_offload: bool  # the optimizer state goes to the host and back around the log-prob pass
    weight_sync: str = "gather"  # gather: the refit hands the engine one tensor at a time; packed: large buffers

    @property
    def label(self) -> str:
        return f"{self.trainer} {'.'.join(map(str, self.version))}"


def _parse(version: str) -> tuple[int, ...]:
    m = re.match(r"^v?(\d+(?:\.\d+){0,2})", str(version).strip())
    if not m:
        raise SpecError(f"trainer_version {version!r}: expected a release number such as 0.6.1")
    return tuple(int(p) for p in m.group(1).split("."))


def release(trainer: str, version: str) -> Release:
    """The facts of `trainer` at `version` (major.minor[.patch])."""
    if trainer not in TRAINERS:
        raise SpecError(f"trainer {trainer!r}: one of {', '.join(TRAINERS)}")
    v = _parse(version)
    if trainer == "verl":
        skip = "algorithm.rollout_correction.bypass_mode: true" if v >= (0, 6, 1) else None
        return Release(trainer, v, skip, "never", "no KL term (use_kl_loss: false, no KL in the reward)", False,
                       "packed" if v >= (0, 7, 1) else "gather")
    if trainer == "nemo-rl":
        skip = "loss_fn.force_on_policy_ratio: true" if v >= (0, 7) else None
        ref = "grpo.skip_reference_policy_logprobs_calculation: true" if v >= (0, 6) else None
        return Release(trainer, v, skip, "never", ref, v < (0, 5), "packed" if v >= (0, 4) else "gather")
    on_policy = v >= (2, 0)
    return Release(trainer, v, "automatic when on-policy" if on_policy else None, "on-policy" if on_policy else "never",
                   "no KL term", False)  # fmt: skip
