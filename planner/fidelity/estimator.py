"""The fidelity estimator: from a plan's statistics, how faithful will the proxy be?

Three labels (planner.fidelity.labels): margin ratio and curve agreement (regression, smaller is
more faithful), and whether the fault is reproduced (classification). Each has a full variant,
fed the per-plan statistics of planner.stats, and a prior variant fed only what is known without a
checkpoint (K/E, top_k/K, experts per group, routing type, the recipe).

Fitting uses the scikit-learn learners of planner.fidelity.learners; the fitted estimator is JSON
(never pickle) and predicts with numpy alone (LinearModel, LogisticModel), so `planner suggest`
does not import scikit-learn.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from planner.errors import SpecError
from planner.rl.recipes import RECIPES as RECIPE_TABLE

__all__ = [
    "LinearModel",
    "LogisticModel",
    "FidelityEstimator",
    "FULL_FEATURES",
    "PRIOR_FEATURES",
    "LABELS",
    "features_of",
    "default_estimator_path",
]

RECIPES = tuple(RECIPE_TABLE)  # one one-hot feature per fault recipe, in the table's order
ARCH_FEATURES = ("kept_fraction", "top_k_over_k", "experts_per_group", "log2_experts", "sigmoid_router", "grouped", "norm_topk")
STAT_FEATURES = (
    "frequency_dropped_mean", "frequency_dropped_max", "gate_mass_dropped_mean", "saliency_dropped_mean",
    "saliency_dropped_max", "dispersion_mean", "silhouette_mean", "reconstruction_error_mean",
    "reconstruction_error_max", "routing_agreement_mean", "routing_agreement_min", "entropy_after_mean",
    "load_cv_after_mean", "log_kl_original_proxy",
)  # fmt: skip
RECIPE_FEATURES = tuple(f"recipe_{r}" for r in RECIPES)
PRIOR_FEATURES = ARCH_FEATURES + RECIPE_FEATURES
FULL_FEATURES = ARCH_FEATURES + STAT_FEATURES + RECIPE_FEATURES
LABELS = ("margin_ratio", "curve_agreement", "fault_reproduced")


def features_of(statistics: Mapping[str, Any], architecture: Mapping[str, Any], recipe: str) -> dict[str, float]:
    """The feature row of one (plan, recipe): plan-statistics summary (planner.stats) + architecture."""
    out = {name: float(architecture[name]) for name in ARCH_FEATURES if name in architecture}
    for key in ("kept_fraction", "top_k_over_k", "experts_per_group"):
        if key in statistics:
            out[key] = float(statistics[key])
    for name in STAT_FEATURES:
        if name == "log_kl_original_proxy":
            if "kl_original_proxy" in statistics:
                out[name] = math.log10(max(float(statistics["kl_original_proxy"]), 1e-8))
            continue
        stat, _, agg = name.rpartition("_")
        value = statistics.get(stat)
        if isinstance(value, Mapping) and agg in value:
            out[name] = float(value[agg])
    for r in RECIPES:
        out[f"recipe_{r}"] = 1.0 if r == recipe else 0.0
    return out


def _standardise(x, mean: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return (np.asarray(x, dtype=float) - mean) / scale


@dataclass(frozen=True)
class LinearModel:
    """A fitted ridge model: prediction, and an interval of fixed half-width clipped at a bound."""

    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: float
    halfwidth: float
    lower_bound: float | None = None
    coverage: float = 0.8  # the share of held-out labels the interval is meant to hold

    def predict(self, x) -> np.ndarray:
        return _standardise(x, self.mean, self.scale) @ self.coef + self.intercept

    def predict_interval(self, x) -> tuple[np.ndarray, np.ndarray]:
        p = self.predict(x)
        low, high = p - self.halfwidth, p + self.halfwidth
        if self.lower_bound is not None:
            low, high = np.maximum(low, self.lower_bound), np.maximum(high, self.lower_bound)
        return low, high

    def to_json(self) -> dict:
        return {"mean": self.mean.tolist(), "scale": self.scale.tolist(), "coef": self.coef.tolist(), "intercept": float(self.intercept),
                "halfwidth": self.halfwidth, "lower_bound": self.lower_bound, "coverage": self.coverage}  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "LinearModel":
        return cls(np.array(d["mean"]), np.array(d["scale"]), np.array(d["coef"]), d["intercept"], d["halfwidth"], d.get("lower_bound"),
                   d.get("coverage", 0.8))  # fmt: skip


@dataclass(frozen=True)
class LogisticModel:
    """A fitted logistic model: P(classes[1]), and an interval: the bootstrap refits' quantiles,
    widened on each side by `shift`, how far a held-out group's observed rate fell from its mean
    prediction (conformal over groups), so that the interval also covers an unseen (family, recipe)."""

    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray  # intercept first
    bootstrap_coef: np.ndarray
    coverage: float
    classes: np.ndarray
    shift: float = 0.0

    def decision(self, x, coef: np.ndarray | None = None) -> np.ndarray:
        w = self.coef if coef is None else coef
        return w[0] + _standardise(x, self.mean, self.scale) @ w[1:]

    def proba(self, x, coef: np.ndarray | None = None) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-np.clip(self.decision(x, coef), -30, 30)))

    def predict_interval(self, x) -> tuple[np.ndarray, np.ndarray]:
        ps = np.array([self.proba(x, c) for c in self.bootstrap_coef])
        tail = (1 - self.coverage) / 2
        low, high = np.quantile(ps, tail, axis=0), np.quantile(ps, 1 - tail, axis=0)
        return np.clip(low - self.shift, 0.0, 1.0), np.clip(high + self.shift, 0.0, 1.0)

    def to_json(self) -> dict:
        return {"mean": self.mean.tolist(), "scale": self.scale.tolist(), "coef": self.coef.tolist(),
                "bootstrap_coef": self.bootstrap_coef.tolist(), "coverage": self.coverage, "classes": self.classes.tolist(),
                "shift": self.shift}  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "LogisticModel":
        return cls(np.array(d["mean"]), np.array(d["scale"]), np.array(d["coef"]), np.array(d["bootstrap_coef"]), d["coverage"],
                   np.array(d["classes"]), float(d.get("shift", 0.0)))  # fmt: skip


def default_estimator_path() -> Path:
    """The estimator fitted on the committed calibration dataset (ships inside the wheel)."""
    from importlib import resources

    return Path(str(resources.files("planner._calibration"))) / "fidelity.json"


def training_set(rows: list[dict], label: str, names: tuple[str, ...]) -> tuple[list[dict], np.ndarray, np.ndarray, list[str]]:
    """Rows with the label and every feature finite (a censored margin is a bound, not a value:
    left out of margin_ratio), as X, y and their (family, recipe) groups."""
    used = [r for r in rows if _finite(r.get(label)) and all(_finite(r.get(n)) for n in names)
            and not (label == "margin_ratio" and r.get("censored") == 1)]  # fmt: skip
    x = np.array([[r[n] for n in names] for r in used], dtype=float).reshape(len(used), len(names))
    y = np.array([r[label] for r in used], dtype=float)
    return used, x, y, [f"{r.get('family')}/{r.get('recipe')}" for r in used]


@dataclass
class FidelityEstimator:
    """The three labels' models, full and prior variants, with their feature names and the range
    of every feature in the calibration data (a prediction outside it is an extrapolation, and says so)."""

    models: dict[str, dict[str, LinearModel | LogisticModel]]  # variant -> label -> fitted model
    features: dict[str, tuple[str, ...]]  # variant -> feature names
    info: dict[str, Any]
    domain: dict[str, tuple[float, float]] = field(default_factory=dict)  # feature -> (min, max) seen in fitting

    @classmethod
    def fit(cls, rows: list[dict], *, info: dict | None = None) -> "FidelityEstimator":
        from planner.fidelity.learners import new_model

        models: dict[str, dict[str, Any]] = {}
        features = {"full": FULL_FEATURES, "prior": PRIOR_FEATURES}
        for variant, names in features.items():
            models[variant] = {}
            for label in LABELS:
                _, x, y, groups = training_set(rows, label, names)
                if len(y) >= 5 and (label != "fault_reproduced" or len(np.unique(y)) == 2):
                    models[variant][label] = new_model(label).fit(x, y, groups=groups).model_
        domain = {}
        for name in FULL_FEATURES:
            seen = [float(r[name]) for r in rows if _finite(r.get(name))]
            if seen:
                domain[name] = (min(seen), max(seen))
        return cls(models, {k: tuple(v) for k, v in features.items()}, dict(info or {}, rows=len(rows)), domain)

    def outside(self, row: Mapping[str, float], variant: str) -> list[str]:
        """The features of `row` outside the range the calibration data covered, as readable text."""
        out = []
        for name in self.features[variant]:
            value, bounds = row.get(name), self.domain.get(name)
            if bounds and _finite(value) and not bounds[0] - 1e-9 <= float(value) <= bounds[1] + 1e-9:
                lo, hi = bounds
                out.append(f"{name} {float(value):.4g} (calibrated {lo:.4g}" + (f" to {hi:.4g})" if hi != lo else " only)"))
        return out

    def predict(self, row: Mapping[str, float], variant: str | None = None) -> dict[str, dict[str, Any]]:
        """{label: {value, low, high, variant, outside}} for one feature row; the full variant when
        its features are all present, else the prior one. `outside` lists the features beyond the
        calibration data's range: there the value is an extrapolation."""
        chosen = variant or ("full" if all(_finite(row.get(n)) for n in self.features["full"]) else "prior")
        x = np.array([[row.get(n, np.nan) for n in self.features[chosen]]], dtype=float)
        outside = self.outside(row, chosen)
        out: dict[str, dict[str, Any]] = {}
        for label, model in self.models[chosen].items():
            value = model.proba(x)[0] if isinstance(model, LogisticModel) else model.predict(x)[0]
            low, high = (float(v[0]) for v in model.predict_interval(x))
            out[label] = {"value": float(value), "low": low, "high": high, "coverage": model.coverage, "variant": chosen, "outside": outside}
        return out

    def to_json(self) -> dict:
        kinds = {LinearModel: "ridge", LogisticModel: "logistic"}
        return {
            "schema": "planner.fidelity/2",
            "features": {k: list(v) for k, v in self.features.items()},
            "models": {v: {label: {"kind": kinds[type(m)], **m.to_json()} for label, m in ms.items()} for v, ms in self.models.items()},
            "domain": {k: list(v) for k, v in self.domain.items()},
            "info": self.info,
        }

    @classmethod
    def from_json(cls, data: dict) -> "FidelityEstimator":
        if data.get("schema") != "planner.fidelity/2":
            raise ValueError(f"not a fidelity estimator file of this version (schema {data.get('schema')!r}, want planner.fidelity/2)")
        kinds = {"ridge": LinearModel, "logistic": LogisticModel}
        models = {v: {label: kinds[m["kind"]].from_json(m) for label, m in ms.items()} for v, ms in data["models"].items()}
        domain = {k: (float(v[0]), float(v[1])) for k, v in data.get("domain", {}).items()}
        return cls(models, {k: tuple(v) for k, v in data["features"].items()}, data.get("info", {}), domain)

    def save(self, path: str | Path) -> None:
        from planner.files import write_text_atomic

        write_text_atomic(path, json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "FidelityEstimator":
        from planner.files import read_json

        p = Path(path)
        data = read_json(p, "fidelity estimator", "; fit one with `planner calibrate fit`")
        try:
            return cls.from_json(data)
        except (ValueError, KeyError, TypeError) as exc:
            raise SpecError(f"{p}: {exc}") from None


def _finite(value) -> bool:
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False
