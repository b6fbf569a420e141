"""What a trainer's release changes in the terms the cost model has: which log-prob passes run, and
what moves over the host link around them. Pure data and one function; a job names `trainer` and
`trainer_version`, and `Job` checks its passes against the release here.

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
        return Release(trainer, v, skip, "never", "no KL term (use_kl_loss: false, no KL in the reward)", False)
    if trainer == "nemo-rl":
        skip = "loss_fn.force_on_policy_ratio: true" if v >= (0, 7) else None
        ref = "grpo.skip_reference_policy_logprobs_calculation: true" if v >= (0, 6) else None
        return Release(trainer, v, skip, "never", ref, v < (0, 5))
    on_policy = v >= (2, 0)
    return Release(trainer, v, "automatic when on-policy" if on_policy else None, "on-policy" if on_policy else "never",
                   "no KL term", False)  # fmt: skip
