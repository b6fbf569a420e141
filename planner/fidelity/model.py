"""The shift model's design: the features a plan is described by, the signs the mechanism fixes, which
rows train it, and the fitted model itself (ShiftModel: numpy only, JSON, never pickle).

planner.fidelity.learners fits ShiftModels, planner.fidelity.validate scores them on held-out
originals, planner.fidelity.estimator gates and applies them; all three import this module, and it
imports none of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

import numpy as np

from planner.stats.store import STATISTICS_VERSION

__all__ = ["ARCH_FEATURES", "STAT_FEATURES", "FULL_FEATURES", "PLAN_PASS_MEASURES", "SHIFT_FEATURES", "ROUTING_FEATURES", "RECIPE_FEATURES",
           "SIGNS", "MIN_ROWS", "LOCAL_ORIGINALS", "recipe_features", "baselines", "features_of", "ShiftModel", "training_rows",
           "design"]  # fmt: skip

ARCH_FEATURES = ("kept_fraction", "top_k_over_k", "experts_per_group", "log2_experts", "sigmoid_router", "grouped", "norm_topk")
STAT_FEATURES = (
    "frequency_dropped_mean", "frequency_dropped_max", "gate_mass_dropped_mean", "saliency_dropped_mean",
    "saliency_dropped_max", "dispersion_mean", "silhouette_mean", "reconstruction_error_mean",
    "reconstruction_error_max", "routing_agreement_mean", "routing_agreement_min", "entropy_after_mean",
    "load_cv_after_mean", "log_kl_original_proxy",
)  # fmt: skip
FULL_FEATURES = ARCH_FEATURES + STAT_FEATURES  # the dataset's feature columns
# measured by running the pruned plan (their definitions change with planner.stats.store.STATISTICS_VERSION)
PLAN_PASS_MEASURES = ("reconstruction_error", "routing_agreement", "entropy_after", "load_cv_after", "log_kl_original_proxy")
# the estimator's features: monotone in how much of the original the plan throws away
SHIFT_FEATURES = ("kept_fraction", "frequency_dropped_mean", "entropy_after_mean", "load_cv_after_mean", "log_kl_original_proxy",
                  "reconstruction_error_mean")  # fmt: skip
# the routing type (architecture, known without a checkpoint): where a recipe's shift has a level of its
# own per routing type, the model carries it. Router collapse: chosen before the third originals were
# measured (sigmoid grouped routers collapse about 2 log2 units earlier than softmax ones, and top_k/K
# sets how much of the kept pool every token already uses); the static recipes' shift has no such level.
ROUTING_FEATURES = ("sigmoid_router", "grouped", "top_k_over_k")
RECIPE_FEATURES = {"router-collapse": SHIFT_FEATURES + ROUTING_FEATURES}
# signs the mechanism fixes (+1: the shift grows with the feature, -1: it falls). Router collapse: a
# plan that drops routing mass (keeps dead experts) concentrates the anti-balance pressure on few
# live experts and collapses earlier. fp16 overflow: fewer experts carry more tokens each, their
# gradients grow and overflow at a smaller loss scale (the pilot: -0.7 bits at K=16, -1.1 at K=8 of 32).
SIGNS = {"router-collapse": {"frequency_dropped_mean": -1}, "fp16-overflow": {"kept_fraction": +1}}
MIN_ROWS = 20  # a recipe with fewer labelled rows (or fewer than 2 originals) is not fitted
LOCAL_ORIGINALS = 3  # a family with this many originals (and MIN_ROWS rows) gets models of its own, fitted on its rows alone


def recipe_features(recipe: str) -> tuple[str, ...]:
    """The full model's features for `recipe`."""
    return RECIPE_FEATURES.get(recipe, SHIFT_FEATURES)


def baselines(recipe: str) -> dict[str, tuple[str, ...]]:
    """The variants the full model is scored against: K/E alone, the recipe's mean shift, and where
    the full model knows the routing type, K/E with the routing type (the level of each routing type
    without any plan statistic: what the full model adds beyond it is plan-level)."""
    out = {"K/E only": ("kept_fraction",), "recipe mean": ()}
    routing = tuple(n for n in recipe_features(recipe) if n in ROUTING_FEATURES)
    if routing:
        out["K/E + routing"] = ("kept_fraction", *routing)
    return out


def features_of(statistics: Mapping[str, Any], architecture: Mapping[str, Any]) -> dict[str, float]:
    """The feature row of one plan: plan-statistics summary (planner.stats) + architecture (the
    recipe is a column of its own; each recipe has its own model). Measures of another statistics
    version than the estimator's are left out (the plan then counts as one without them)."""
    out = {name: float(architecture[name]) for name in ARCH_FEATURES if name in architecture}
    for key in ("kept_fraction", "top_k_over_k", "experts_per_group"):
        if key in statistics:
            out[key] = float(statistics[key])
    stale = statistics.get("statistics_version", 1) != STATISTICS_VERSION
    for name in STAT_FEATURES:
        if stale and name.startswith(PLAN_PASS_MEASURES):
            continue
        if name == "log_kl_original_proxy":
            if "kl_original_proxy" in statistics:
                out[name] = math.log10(max(float(statistics["kl_original_proxy"]), 1e-8))
            continue
        stat, _, agg = name.rpartition("_")
        value = statistics.get(stat)
        if isinstance(value, Mapping) and agg in value:
            out[name] = float(value[agg])
    return out



def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None  # JSON has no NaN


def _finite(value) -> bool:
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class ShiftModel:
    """A fitted shift model: the prediction, its conformal interval, and the held-out residuals
    (with the original each was held out from) that give the predictive distribution."""

    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: float
    halfwidth: float
    residuals: np.ndarray
    residual_groups: np.ndarray
    coverage: float = 0.8
    original_sd: float = float("nan")  # the residuals' SD between originals (a random intercept per original)
    within_sd: float = float("nan")  # and within one original

    def predict(self, x) -> np.ndarray:
        x = np.asarray(x, dtype=float).reshape(-1, len(self.coef))
        return ((x - self.mean) / self.scale) @ self.coef + self.intercept

    def predict_interval(self, x) -> tuple[np.ndarray, np.ndarray]:
        p = self.predict(x)
        return p - self.halfwidth, p + self.halfwidth

    def p_within(self, x, tolerance: float, offset: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """P(|shift| < tolerance) under the predictive distribution (prediction + held-out residuals),
        and an interval: the 10th and 90th percentiles of the same share computed with each held-out
        original's residuals alone (how much P depends on which original's errors one trusts).
        `offset` moves the prediction (a scale-transfer bound)."""
        return self._shares(self.predict(x) + offset, tolerance)

    def p_range(self, x, tolerance: float, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
        """The lowest and highest end of p_within's interval while the offset runs over [low, high]
        (a label that may move that far at the target's scale). Exact: the shares change only where
        a residual crosses the tolerance, so the range's ends and the midpoints between those
        crossings are every value they take. P peaks where the move cancels the predicted shift,
        which a coarse grid over a wide range steps over."""
        lows, highs = [], []
        for pred in self.predict(x):
            edges = np.concatenate([tolerance - pred - self.residuals, -tolerance - pred - self.residuals])
            edges = np.unique(np.concatenate([[low, high], edges[(edges > low) & (edges < high)]]))
            _, lo, hi = self._shares(pred + np.concatenate([edges, (edges[:-1] + edges[1:]) / 2]), tolerance)
            lows.append(lo.min())
            highs.append(hi.max())
        return np.array(lows), np.array(highs)

    @cached_property
    def _sorted_residuals(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """All residuals sorted, and each held-out original's."""
        return np.sort(self.residuals), [np.sort(self.residuals[self.residual_groups == g]) for g in np.unique(self.residual_groups)]

    def _shares(self, centre: np.ndarray, tolerance: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per predicted shift in `centre`: the share of residuals r with |centre + r| < tolerance, and
        the 10th and 90th percentiles of the same share among each held-out original's residuals."""

        def share(r: np.ndarray) -> np.ndarray:
            return (np.searchsorted(r, tolerance - centre, "left") - np.searchsorted(r, -tolerance - centre, "right")) / len(r)

        every, groups = self._sorted_residuals
        p = share(every)
        low, high = (np.quantile(np.column_stack([share(g) for g in groups] + [p]), q, axis=1) for q in (0.1, 0.9))
        return p, np.minimum(low, p), np.maximum(high, p)

    def to_json(self) -> dict:
        return {"mean": self.mean.tolist(), "scale": self.scale.tolist(), "coef": self.coef.tolist(), "intercept": self.intercept,
                "halfwidth": self.halfwidth, "residuals": self.residuals.tolist(), "residual_groups": self.residual_groups.tolist(),
                "coverage": self.coverage, "original_sd": _finite_or_none(self.original_sd), "within_sd": _finite_or_none(self.within_sd)}  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ShiftModel":
        return cls(np.array(d["mean"], dtype=float), np.array(d["scale"], dtype=float), np.array(d["coef"], dtype=float),
                   float(d["intercept"]), float(d["halfwidth"]), np.array(d["residuals"], dtype=float),
                   np.array(d["residual_groups"], dtype=str), float(d.get("coverage", 0.8)),
                   float("nan") if d.get("original_sd") is None else float(d["original_sd"]),
                   float("nan") if d.get("within_sd") is None else float(d["within_sd"]))  # fmt: skip



def training_rows(rows: list[dict], recipe: str, names: tuple[str, ...]) -> list[dict]:
    """A recipe's rows with a finite, uncensored shift and every feature finite, negative controls
    (planner.plan.CONTROL_METHODS: proxies built wrongly on purpose) left out."""
    from planner.plan import CONTROL_METHODS

    return [r for r in rows if r.get("recipe") == recipe and _finite(r.get("shift_log2")) and r.get("censored") != 1
            and r.get("method") not in CONTROL_METHODS and all(_finite(r.get(n)) for n in names)]  # fmt: skip


def design(rows: list[Mapping[str, Any]], names: tuple[str, ...]) -> np.ndarray:
    """The feature matrix of `rows`; with no features (the recipe-mean baseline) one constant
    column, which standardises to zero and leaves the intercept: the training mean."""
    if not names:
        return np.ones((len(rows), 1))
    return np.array([[float(r[n]) for n in names] for r in rows], dtype=float).reshape(len(rows), len(names))


