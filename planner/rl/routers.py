"""Every MoE router of a transformers model, seen from outside, and the two ways models keep them balanced.

`Routers` hooks each router module (its name from planner.arch.families) and keeps, per forward
call, the module, its logits (with their graph) and the experts it chose. From them:

- `switch_loss`: the Switch-Transformer balance loss E * sum_e f_e P_e, with f_e the share of the
  routed slots that went to expert e and P_e its mean routing probability. It reads 1 when the load
  is even and E/k when every token goes to the same k experts: the convention of Megatron-Core's
  `moe_aux_loss_coeff`, MegaBlocks and the DeepSeek reports, whose published coefficients it takes
  as they are. (transformers' `load_balancing_loss_func` sums over the k slots and reads k at
  balance.) Computed over the whole batch, as a global-batch balance loss is, or per sequence and
  averaged (DeepSeek's sequence-wise loss). Sigmoid routers' probabilities are their scores
  normalised to sum to one, as DeepSeek-V3 defines it.
- `z_loss`: the router z-loss (ST-MoE), the mean squared log-sum-exp of the logits.
- `update_correction_bias`: auxiliary-loss-free balancing (Wang et al. 2024, DeepSeek-V3): after each
  optimizer step, every expert's correction bias (`e_score_correction_bias`, added to the scores
  for choosing experts only) moves by `rate` towards the mean load: up where the expert took fewer
  than the mean of the step's routed slots, down where it took more.
- `collapse_share`: the router-collapse detector's statistic for one layer, the top-k share of the
  routed slots normalised to 0 when balanced and 1 when collapsed.
"""

from __future__ import annotations

import math
import re

from planner.stats.settle import balance_bias

__all__ = ["Routers", "router_attr", "sigmoid_scored", "routing_probs", "switch_loss", "z_loss", "update_correction_bias",
           "expert_counts", "collapse_share"]  # fmt: skip


def router_attr(config) -> str:
    """The attribute name of a MoE block's router in this model type (planner.arch.families)."""
    from planner.checkpoint.reader import family_names

    return family_names(config.get_text_config().model_type)["memory"]["router"].split(".")[0]


def sigmoid_scored(config) -> bool:
    """Whether the model's routers score experts by a sigmoid (DeepSeek-V3, GLM-4.5, Nemotron-H, Llama-4)."""
    from planner.arch import Architecture

    return Architecture.from_config(config.get_text_config().to_dict()).moe.scoring in ("sigmoid", "sigmoid_topk")


class Routers:
    """Forward hooks on every router of `model`: per call (module, logits, chosen experts)."""

    def __init__(self, model, attr: str | None = None):
        attr = attr or router_attr(model.config)
        self.calls: list[tuple] = []
        self.handles = []
        for name, module in model.named_modules():
            if re.search(rf"\.layers\.\d+\.\w+\.{attr}$", name):
                self.handles.append(module.register_forward_hook(self._hook))

    def _hook(self, module, args, out):
        if len(out) == 3:
            logits, _, ids = out
        else:  # llama4 routers return (scores, logits)
            scores, logits = out
            ids = scores.topk(getattr(module, "top_k", 1), dim=-1).indices
        self.calls.append((module, logits, ids))

    def clear(self) -> None:
        self.calls = []

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.calls = [], []


def routing_probs(logits, sigmoid: bool):
    """Each token's routing probabilities over the experts (tokens x E), in fp32."""
    import torch

    if sigmoid:
        scores = torch.sigmoid(logits.float())
        return scores / scores.sum(-1, keepdim=True)
    return torch.softmax(logits.float(), -1)


def expert_counts(ids, experts: int):
    """Routed slots per expert (fp32) of a call's chosen experts."""
    import torch

    return torch.bincount(ids.reshape(-1), minlength=experts).float()


def switch_loss(probs, ids, sequences: int = 1):
    """E * sum_e f_e P_e over the tokens (1 balanced, E/k collapsed); with `sequences` > 1 the tokens
    are that many equal sequences in order, and the loss is each one's, averaged. Where E <= k every
    token uses every expert and the loss is a constant 1 (with the graph kept)."""
    import torch

    e, k = probs.shape[-1], ids.shape[-1]
    if e <= k:
        return probs.sum() * 0.0 + 1.0
    if sequences == 1:
        counts = expert_counts(ids, e)
        return e * (counts / counts.sum() * probs.mean(0)).sum()
    p = probs.reshape(sequences, -1, e)
    slots = torch.nn.functional.one_hot(ids.reshape(sequences, -1, k), e).float().sum(2)  # (sequences, tokens, E)
    f = slots.sum(1) / slots.sum((1, 2)).unsqueeze(-1)
    return (e * (f * p.mean(1)).sum(-1)).mean()


def z_loss(logits):
    """The router z-loss: the mean over tokens of log(sum_e exp(logit_e))^2."""
    import torch

    return torch.logsumexp(logits.float(), -1).square().mean()


def update_correction_bias(calls, rate: float) -> int:
    """Move every hooked router's correction bias by `rate` towards an even load, from the routed slots
    of its calls since the last clear; returns the number of routers updated (those without a bias
    are skipped)."""
    per_module: dict[int, tuple] = {}
    for module, _, ids in calls:
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is None:
            continue
        counts = expert_counts(ids.detach(), bias.numel())
        held = per_module.get(id(module))
        per_module[id(module)] = (bias, counts if held is None else held[1] + counts)
    for bias, counts in per_module.values():
        balance_bias(bias, counts, rate)
    return len(per_module)


def collapse_share(counts, k: int) -> tuple[float, float]:
    """(the top-k share of the routed slots, the same normalised to 0 balanced .. 1 collapsed; NaN
    where E <= k, where nothing can collapse)."""
    e = counts.numel()
    frac = counts / counts.sum()
    share = float(frac.sort(descending=True).values[:k].sum())
    return share, (share - k / e) / (1.0 - k / e) if e > k else math.nan
