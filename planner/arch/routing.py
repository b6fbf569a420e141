"""The routing shape of an MoE model: every fact of its router that pruning touches.

A proxy keeps K of E routed experts and slices the router's rows. What that does to routing depends
on how the router turns logits into gates: the scoring function and whether it is applied before
or after top-k, renormalisation of the top-k gates, grouped routing (groups and groups kept), the
correction bias that steers selection, the router's own bias, shared experts and their gate (a
share of every token's output pruning never touches), dense decoder layers, and the routed scaling
factor. Two models whose shapes are equal prune alike, whatever their width, depth and vocabulary:
a calibration family is one shape (planner.families names it, planner.rl.models makes its small models), and the fidelity
estimator's gate asks whether a target's shape was calibrated.

`mechanism` is the shape without E and top_k: models that route alike but differ in their expert
counts share it, so E can be a measured covariate within one mechanism.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from planner.arch.model import Architecture

__all__ = ["RoutingShape", "routing_shape", "load_cv"]

_SCORING = {
    "softmax": "softmax over all experts, then top-k",
    "softmax_topk": "top-k on logits, then softmax over the k",
    "sigmoid": "sigmoid per expert, then top-k",
    "sigmoid_topk": "top-k on logits, then sigmoid of the k",
    "sparsemixer": "sparsemixer top-2",
}


@dataclass(frozen=True, kw_only=True)
class RoutingShape:
    experts: int  # E, routed experts per MoE layer (of the original)
    top_k: int
    scoring: str  # softmax | softmax_topk | sigmoid | sigmoid_topk | sparsemixer (planner.arch.families; an always
    # renormalised softmax, Mixtral's, is softmax with renormalised set: the two route alike)
    renormalised: bool  # the top-k gates are divided by their sum (always for softmax_renorm and softmax_topk)
    groups: int  # n_group (1: not grouped)
    groups_kept: int  # topk_group
    correction_bias: bool  # e_score_correction_bias steers selection (deepseek_v3, glm4_moe)
    router_bias: bool  # the router's linear layer has a bias (gpt_oss)
    shared_experts: bool
    shared_gate: bool  # a sigmoid gate on the shared expert (qwen2_moe)
    dense_layers: bool  # some decoder layers have a dense MLP instead of experts
    scaling: float  # routed_scaling_factor

    @property
    def sigmoid(self) -> bool:
        return self.scoring in ("sigmoid", "sigmoid_topk")

    @property
    def scored_after_top_k(self) -> bool:
        return self.scoring in ("softmax_topk", "sigmoid_topk")

    @property
    def mechanism(self) -> "RoutingShape":
        """The shape with E and top_k blanked: what routes alike at any expert count."""
        return replace(self, experts=0, top_k=0)

    def key(self) -> str:
        """A stable name of the shape, e.g. `softmax/top8of128/renorm`; the same string for equal shapes."""
        parts = [self.scoring, f"top{self.top_k}of{self.experts}" if self.experts else "topk"]
        parts.append("renorm" if self.renormalised else "raw")
        if self.groups > 1:
            parts.append(f"groups{self.groups}keep{self.groups_kept}")
        for flag, name in ((self.correction_bias, "corrbias"), (self.router_bias, "routerbias"), (self.shared_experts, "shared"),
                           (self.shared_gate, "sharedgate"), (self.dense_layers, "dense")):  # fmt: skip
            if flag:
                parts.append(name)
        if self.scaling != 1.0:
            parts.append(f"x{self.scaling:g}")
        return "/".join(parts)

    def describe(self) -> str:
        """The shape in words, for tables and status lines."""
        text = [_SCORING.get(self.scoring, self.scoring)]
        if self.experts:
            text[0] = f"top-{self.top_k} of {self.experts}, " + text[0]
        text.append("renormalised" if self.renormalised else "not renormalised")
        if self.groups > 1:
            text.append(f"{self.groups} groups, top-{self.groups_kept} kept")
        if self.correction_bias:
            text.append("correction bias")
        if self.router_bias:
            text.append("router bias")
        if self.shared_experts:
            text.append("shared expert" + (" with a sigmoid gate" if self.shared_gate else ""))
        if self.dense_layers:
            text.append("dense layers")
        if self.scaling != 1.0:
            text.append(f"scaled x{self.scaling:g}")
        return ", ".join(text)

    def differences(self, other: "RoutingShape") -> list[str]:
        """The fields in which two shapes differ, as `name a != b`."""
        return [f"{f.name} {getattr(self, f.name)} != {getattr(other, f.name)}" for f in fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "RoutingShape":
        return cls(**{f.name: data[f.name] for f in fields(cls)})


def routing_shape(arch: Architecture) -> RoutingShape:
    """The routing shape of the original model `arch` describes (a pruned architecture gives its
    original's E)."""
    moe = arch.moe
    always = moe.scoring in ("softmax_renorm", "softmax_topk")
    return RoutingShape(
        experts=arch.original_num_experts,
        top_k=moe.top_k,
        scoring="softmax" if moe.scoring == "softmax_renorm" else moe.scoring,
        renormalised=bool(always or moe.norm_topk_prob),
        groups=moe.n_group,
        groups_kept=moe.topk_group if moe.grouped else 1,
        correction_bias=moe.correction_bias != "none",
        router_bias=moe.router_bias,
        shared_experts=moe.shared_intermediate > 0,
        shared_gate=moe.shared_gate,
        dense_layers=arch.num_dense_layers > 0,
        scaling=float(moe.routed_scaling_factor),
    )


def load_cv(counts) -> float:
    """The coefficient of variation of tokens per expert: the standard deviation of the counts over
    their mean, over the experts of one layer as a whole population (ddof 0: the layer's experts are
    all the experts, not a sample of them); 0 where no token was routed. The one definition that
    `planner stats` (load CV after pruning) and the RL harness (load_cv_max) share. Takes a numpy
    array or a torch tensor of counts."""
    import numpy as np

    c = np.asarray(counts.detach().cpu() if hasattr(counts, "detach") else counts, dtype=np.float64)
    mean = c.mean()
    return float(c.std(ddof=0) / mean) if mean > 0 else 0.0
