"""The pruning plan: which original experts each MoE layer keeps. Frozen, validated, YAML in/out.

A plan with ids is built exactly as written. Kept ids are renumbered 0..K-1 in ascending original
order, which keeps every routing group's experts together. The rules (docs/proxy-rules.md section
"Pruning rules") are checked against the model before anything is written; a violation names the
rule and the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from planner.arch import Architecture
from planner.errors import PlanError, SpecError
from planner.files import read_yaml

__all__ = ["Plan", "PLAN_SCHEMA", "load_plan", "deployment_cards", "METHODS", "SELECTION_METHODS", "BAD_METHODS", "CONTROL_METHODS", "PROXY_BUILDS"]

PLAN_SCHEMA = "planner.plan/1"
# the last two are deliberately bad plans, for calibration: the estimator has to learn what an
# unfaithful proxy looks like (docs/fidelity-labels.md section "Why the grid holds bad plans");
# `suggest` never proposes them
SELECTION_METHODS = ("agglomerative", "kmeans", "router", "saliency", "frequency", "random", "least-used", "one-cluster")
BAD_METHODS = ("least-used", "one-cluster")
# negative controls of the calibration grid: proxies built wrongly on purpose (mis-sliced: the kept
# experts of a clustered plan with their router rows rotated by one, so every token is routed to
# another expert than the router meant). They show that a label can say "not reproduced"; no
# estimator is fitted on them and no search proposes them
CONTROL_METHODS = ("mis-sliced",)
# how a proxy's kept experts are written: "sliced" (every tensor as the original has it) or
# "settled" (the correction bias settled again after pruning: `planner build --settle-bias`)
PROXY_BUILDS = ("sliced", "settled")
METHODS = (*SELECTION_METHODS, "manual")
_KEYS = ("schema", "model", "experts", "original_experts", "method", "mtp", "checkpoint_fingerprint",
         "target_ep", "seed", "feature_spec", "statistics", "deployment", "layers", "labels", "correction_bias")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: str
    experts: int  # K, the same in every MoE layer
    original_experts: int
    layers: Mapping[int, tuple[int, ...]]  # MoE layer index -> kept original expert ids, ascending
    method: str = "manual"
    mtp: str = "drop"  # drop the MTP layers, or prune them with their own kept ids
    checkpoint_fingerprint: str | None = None
    target_ep: tuple[int, ...] = ()  # EP sizes the proxy must run with
    seed: int | None = None
    feature_spec: str | None = None
    labels: Mapping[int, tuple[int, ...]] | None = None  # cluster of every original expert, per layer
    statistics: Mapping[str, Any] | None = None  # the plan's statistics summary (planner stats), fidelity features
    # where and how the proxy is meant to run, and what planner predicted for it (planner suggest):
    # hardware, num_cards, layouts, recompute, offload, job, fault, predicted memory/time/fidelity
    deployment: Mapping[str, Any] | None = None
    # the kept experts' correction bias per MoE layer, settled again after pruning (planner stats
    # --settle-bias); None: sliced from the original's like every other expert-indexed tensor
    correction_bias: Mapping[int, tuple[float, ...]] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpecError(f"plan: method {self.method!r} is not one of {', '.join(METHODS)}")
        if self.mtp not in ("drop", "prune"):
            raise SpecError(f"plan: mtp must be drop or prune, got {self.mtp!r}")
        object.__setattr__(self, "layers", {int(k): tuple(sorted(int(i) for i in v)) for k, v in self.layers.items()})
        if self.labels is not None:
            object.__setattr__(self, "labels", {int(k): tuple(int(i) for i in v) for k, v in self.labels.items()})
        if self.correction_bias is not None:
            object.__setattr__(self, "correction_bias", {int(k): tuple(float(b) for b in v) for k, v in self.correction_bias.items()})

    @property
    def build(self) -> str:
        """How the proxy is written (PROXY_BUILDS): "settled" where it carries a settled correction bias,
        or is deferred with its deployment's `settle_bias` (planner suggest --settle-bias)."""
        deferred_settle = not self.layers and bool((self.deployment or {}).get("settle_bias"))
        return "settled" if self.correction_bias is not None or deferred_settle else "sliced"

    @property
    def deferred(self) -> bool:
        """No kept sets yet: `method` chooses them from the checkpoint at build time."""
        return not self.layers

    # ---- rules --------------------------------------------------------------------------------
    def check(self, arch: Architecture, moe_layers: list[int] | None = None) -> list[str]:
        """Raise PlanError on the first broken rule; return warnings (which do not block a build).

        `moe_layers` lists the MoE layers the checkpoint holds (MTP layers included when present);
        default: the architecture's trunk MoE layers."""
        moe = arch.moe
        e, k = arch.original_num_experts, self.experts
        if self.original_experts != e:
            raise PlanError(f"plan is for {self.original_experts} experts per layer; the model has {e}")
        if k > e or k < 1:
            raise PlanError(f"rule 1 <= K <= E: K={k}, E={e}")
        if moe.top_k > k:
            raise PlanError(f"rule top_k <= K: top_k={moe.top_k} > K={k}")
        if moe.grouped:
            g = moe.n_group
            if k % g:
                raise PlanError(f"rule K % n_group == 0: K={k}, n_group={g}")
            if k // g < 2:
                raise PlanError(f"rule K/n_group >= 2 (group scores sum each group's top-2): K/n_group={k // g}")
            if moe.topk_group * (k // g) < moe.top_k:
                raise PlanError(
                    f"rule topk_group*K/n_group >= top_k: {moe.topk_group}*{k // g}={moe.topk_group * (k // g)} < top_k={moe.top_k}"
                )
        for ep in self.target_ep:
            if ep < 1:
                raise PlanError(f"target_ep entries must be >= 1, got {ep}")
            if k % ep:
                raise PlanError(f"rule K % EP == 0 for the declared layout: K={k}, EP={ep}")
        if not self.deferred:  # kept sets are chosen at build time otherwise
            expected = sorted(moe_layers if moe_layers is not None else arch.moe_layers)
            trunk_only = [i for i in expected if i < arch.num_layers]
            want = expected if self.mtp == "prune" else trunk_only
            have = sorted(self.layers)
            if have != want:
                missing = sorted(set(want) - set(have))
                extra = sorted(set(have) - set(want))
                raise PlanError(
                    f"rule one kept set per MoE layer: the plan lists layers {_span(have)}, the model's MoE layers are "
                    f"{_span(want)} (missing {missing[:6]}, extra {extra[:6]})"
                )
            for layer, ids in self.layers.items():
                if len(ids) != k or len(set(ids)) != k:
                    raise PlanError(
                        f"rule one K for every MoE layer: layer {layer} keeps {len(set(ids))} distinct experts, K={k}"
                    )
                bad = [i for i in ids if not 0 <= i < e]
                if bad:
                    raise PlanError(f"rule expert ids in 0..E-1: layer {layer} keeps {bad[:5]}, E={e}")
                if moe.grouped:
                    per = e // moe.n_group
                    counts = [sum(1 for i in ids if i // per == grp) for grp in range(moe.n_group)]
                    if any(c != k // moe.n_group for c in counts):
                        raise PlanError(
                            f"rule equal experts per routing group: layer {layer} keeps {counts} per group, "
                            f"each group must keep K/n_group={k // moe.n_group}"
                        )
        if self.labels is not None and not self.deferred:
            self._check_labels(e)
        if self.correction_bias is not None:
            self._check_correction_bias(moe)
        warnings = []
        if k & (k - 1):
            warnings.append(f"K={k} is not a power of two: fused grouped-gate kernels (sglang, vLLM) want one")
        if k < 4 * moe.top_k:
            warnings.append(
                f"K/top_k = {k}/{moe.top_k} < 4: routing is nearly dense and loses the fragility behind mismatch faults"
            )
        return warnings

    def _check_labels(self, e: int) -> None:
        """Cluster labels (used to remap routing-replay masks) must describe the kept sets: every
        expert labelled 0..K-1, one kept expert per label."""
        if sorted(self.labels) != sorted(self.layers):
            raise PlanError(f"labels cover layers {sorted(self.labels)[:8]}, the plan's kept sets cover {sorted(self.layers)[:8]}")
        for layer, lab in self.labels.items():
            if len(lab) != e or any(not 0 <= x < self.experts for x in lab):
                raise PlanError(f"labels of layer {layer} must give each of the {e} experts a cluster in 0..{self.experts - 1}")
            kept_labels = sorted(lab[i] for i in self.layers[layer])
            if kept_labels != list(range(self.experts)):
                raise PlanError(f"layer {layer}: the kept experts {list(self.layers[layer])} must carry one label each of 0..{self.experts - 1}")

    def _check_correction_bias(self, moe) -> None:
        """A settled correction bias needs a router that has one, a layer the plan keeps, and one
        finite value per kept expert."""
        if moe.correction_bias == "none":
            raise PlanError("the plan sets correction biases, but the model's router has no correction bias")
        extra = sorted(set(self.correction_bias) - set(self.layers))
        if extra:
            raise PlanError(f"correction_bias names layers {extra[:6]} that the plan keeps no experts for")
        for layer, bias in self.correction_bias.items():
            if len(bias) != self.experts or not all(math.isfinite(b) for b in bias):
                raise PlanError(f"correction_bias of layer {layer} must hold {self.experts} finite values (one per kept expert), "
                                f"got {len(bias)}")  # fmt: skip

    # ---- YAML ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": PLAN_SCHEMA,
            "model": self.model,
            "experts": self.experts,
            "original_experts": self.original_experts,
            "method": self.method,
            "mtp": self.mtp,
        }
        for key in ("checkpoint_fingerprint", "seed", "feature_spec"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.target_ep:
            out["target_ep"] = list(self.target_ep)
        if self.statistics:
            out["statistics"] = dict(self.statistics)
        if self.deployment:
            out["deployment"] = dict(self.deployment)
        if self.layers:
            out["layers"] = {int(i): list(ids) for i, ids in sorted(self.layers.items())}
        if self.labels is not None:
            out["labels"] = {int(i): list(lab) for i, lab in sorted(self.labels.items())}
        if self.correction_bias is not None:
            out["correction_bias"] = {int(i): list(b) for i, b in sorted(self.correction_bias.items())}
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=120)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "plan") -> "Plan":
        if not isinstance(data, Mapping):
            raise SpecError(f"{where}: expected a mapping")
        unknown = [k for k in data if k not in _KEYS]
        if unknown:
            raise SpecError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(_KEYS)}")
        if data.get("schema", PLAN_SCHEMA) != PLAN_SCHEMA:
            raise SpecError(f"{where}: schema {data.get('schema')!r} is not {PLAN_SCHEMA}")
        missing = [k for k in ("model", "experts", "original_experts") if k not in data]
        if "layers" not in data and data.get("method", "manual") not in SELECTION_METHODS:
            missing.append("layers")  # only a selection method can choose them later
        if missing:
            raise SpecError(f"{where}: missing required key(s) {', '.join(missing)}")
        layers = data.get("layers", {})
        if not isinstance(layers, Mapping) or not all(isinstance(v, (list, tuple)) for v in layers.values()):
            raise SpecError(f"{where}: layers must map each MoE layer index to a list of kept expert ids")
        for key in ("experts", "original_experts"):
            if isinstance(data[key], bool) or not isinstance(data[key], int):
                raise SpecError(f"{where}: {key} must be an integer, got {data[key]!r}")
        ids = [i for v in layers.values() for i in v]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise SpecError(f"{where}: expert ids must be integers")
        try:
            return cls(
                model=str(data["model"]),
                experts=data["experts"],
                original_experts=data["original_experts"],
                layers={int(k): tuple(int(i) for i in v) for k, v in layers.items()},
                method=str(data.get("method", "manual")),
                mtp=str(data.get("mtp", "drop")),
                checkpoint_fingerprint=data.get("checkpoint_fingerprint"),
                target_ep=tuple(int(x) for x in data.get("target_ep", ()) or ()),
                seed=data.get("seed"),
                feature_spec=data.get("feature_spec"),
                statistics=_mapping(data.get("statistics"), "statistics", where),
                deployment=_mapping(data.get("deployment"), "deployment", where),
                labels={int(k): tuple(int(i) for i in v) for k, v in data["labels"].items()} if data.get("labels") else None,
                correction_bias=_float_rows(data.get("correction_bias"), "correction_bias", where),
            )
        except (TypeError, ValueError) as exc:
            raise SpecError(f"{where}: {exc}") from None


def _mapping(value: Any, key: str, where: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}: {key} must be a mapping")
    return dict(value)


def _float_rows(value: Any, key: str, where: str) -> dict[int, tuple[float, ...]] | None:
    """A mapping of layer index to a list of numbers (None stays None)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(v, (list, tuple)) for v in value.values()):
        raise SpecError(f"{where}: {key} must map each MoE layer index to a list of numbers")
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) for v in value.values() for b in v):
        raise SpecError(f"{where}: {key} values must be numbers")
    return {int(k): tuple(float(b) for b in v) for k, v in value.items()}


def _span(ids: list[int]) -> str:
    if not ids:
        return "[]"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]}"
    return str(ids[:8]) + ("..." if len(ids) > 8 else "")


def deployment_cards(deployment: Mapping[str, Any]) -> int:
    """A plan deployment's device count (num_cards), checked: a whole number, at least 1."""
    cards = deployment.get("num_cards")
    if isinstance(cards, bool) or not isinstance(cards, int) or cards < 1:
        raise SpecError(f"the plan's deployment.num_cards is {cards!r}: a whole number of devices, at least 1")
    return cards


def load_plan(path: str | Path) -> Plan:
    return Plan.from_dict(read_yaml(path, "plan"), where=str(path))
