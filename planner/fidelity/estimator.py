"""The fidelity estimator: from a plan's statistics, how faithful will the proxy be?

Three labels (planner.fidelity.labels): margin ratio and curve agreement (regression, smaller is
more faithful), and whether the fault is reproduced (classification). Each has a full variant,
fed the per-plan statistics of planner.stats, and a prior variant fed only what is known without a
checkpoint (K/E, top_k/K, experts per group, routing type, the recipe).

The models are deliberately small, because the data are a few hundred runs: ridge regression on
standardised features with split-conformal intervals (the coverage quantile of out-of-fold
absolute residuals), and L2 logistic regression (Newton's method) with bootstrap intervals on the
probability. Both follow scikit-learn's conventions (`__init__` only stores arguments; `fit`
validates and sets attributes ending in `_`; randomness through `random_state`) and serialise to
JSON, never pickle.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils.multiclass import check_classification_targets, type_of_target
from sklearn.utils.validation import check_is_fitted, validate_data

__all__ = [
    "FidelityRegressor",
    "FidelityClassifier",
    "FidelityEstimator",
    "FULL_FEATURES",
    "PRIOR_FEATURES",
    "LABELS",
    "features_of",
]

RECIPES = ("fp16-overflow", "rollout-mismatch", "entropy-collapse", "grad-blowup", "router-collapse")
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


class FidelityRegressor(RegressorMixin, BaseEstimator):
    """Ridge regression on standardised features. Interval: prediction -+ the conformal quantile
    of held-out absolute residuals (leave-one-group-out when `groups` are given to fit, else 5
    random folds), with the finite-sample correction ceil((n+1) coverage)/n; clipped below at
    `lower_bound` for labels that cannot be negative."""

    def __init__(self, alpha: float = 1.0, coverage: float = 0.8, lower_bound: float | None = None, random_state: int | None = 0):
        self.alpha = alpha
        self.coverage = coverage
        self.lower_bound = lower_bound
        self.random_state = random_state

    def _solve(self, x: np.ndarray, y: np.ndarray):
        mean = x.mean(0)
        scale = x.std(0)
        scale[scale == 0] = 1.0
        z = (x - mean) / scale
        y_mean = y.mean()
        coef = np.linalg.solve(z.T @ z + self.alpha * np.eye(z.shape[1]), z.T @ (y - y_mean))
        return mean, scale, coef, y_mean

    def fit(self, X, y, groups=None):
        X, y = validate_data(self, X, y, y_numeric=True)
        x, y = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
        self.mean_, self.scale_, self.coef_, self.intercept_ = self._solve(x, y)
        if groups is not None and len(set(groups)) > 1:
            _, folds = np.unique(np.asarray(groups), return_inverse=True)
        else:
            folds = np.random.default_rng(self.random_state).permutation(len(y)) % min(5, len(y))
        residuals = []
        for f in np.unique(folds):
            train, test = folds != f, folds == f
            if train.sum() < 2:
                continue
            m, s, c, b = self._solve(x[train], y[train])
            residuals.extend(np.abs(((x[test] - m) / s) @ c + b - y[test]))
        n = len(residuals)
        level = min(1.0, np.ceil((n + 1) * self.coverage) / n) if n else 1.0
        self.halfwidth_ = float(np.quantile(residuals, level, method="higher")) if n else float("inf")
        return self

    def predict(self, X):
        check_is_fitted(self)
        X = validate_data(self, X, reset=False)
        return ((np.asarray(X, dtype=float) - self.mean_) / self.scale_) @ self.coef_ + self.intercept_

    def predict_interval(self, X) -> tuple[np.ndarray, np.ndarray]:
        p = self.predict(X)
        low, high = p - self.halfwidth_, p + self.halfwidth_
        if self.lower_bound is not None:
            low, high = np.maximum(low, self.lower_bound), np.maximum(high, self.lower_bound)
        return low, high

    def to_json(self) -> dict:
        return {"alpha": self.alpha, "coverage": self.coverage, "lower_bound": self.lower_bound, "mean": self.mean_.tolist(), "scale": self.scale_.tolist(),
                "coef": self.coef_.tolist(), "intercept": self.intercept_, "halfwidth": self.halfwidth_}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict) -> "FidelityRegressor":
        model = cls(alpha=data["alpha"], coverage=data["coverage"], lower_bound=data.get("lower_bound"))
        model.mean_, model.scale_ = np.array(data["mean"]), np.array(data["scale"])
        model.coef_, model.intercept_, model.halfwidth_ = np.array(data["coef"]), data["intercept"], data["halfwidth"]
        model.n_features_in_ = len(model.coef_)
        return model


def _logistic(z: np.ndarray, y: np.ndarray, c: float, iters: int = 50) -> np.ndarray:
    """L2-penalised logistic regression (intercept unpenalised) by Newton's method."""
    a = np.hstack([np.ones((len(z), 1)), z])
    w = np.zeros(a.shape[1])
    penalty = np.eye(a.shape[1]) / c
    penalty[0, 0] = 0.0
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-np.clip(a @ w, -30, 30)))
        grad = a.T @ (p - y) + penalty @ w
        hess = a.T @ (a * (p * (1 - p))[:, None]) + penalty + 1e-9 * np.eye(len(w))
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


class FidelityClassifier(ClassifierMixin, BaseEstimator):
    """L2 logistic regression; interval on P(class 1) from `n_bootstrap` refits on resamples."""

    def __init__(self, C: float = 1.0, n_bootstrap: int = 50, coverage: float = 0.8, random_state: int | None = 0):
        self.C = C
        self.n_bootstrap = n_bootstrap
        self.coverage = coverage
        self.random_state = random_state

    def fit(self, X, y, groups=None):  # groups: accepted like FidelityRegressor's; the bootstrap ignores them
        X, y = validate_data(self, X, y)
        check_classification_targets(y)
        self.classes_ = np.unique(y)
        if len(self.classes_) == 1:
            raise ValueError("FidelityClassifier needs two classes; got 1 class")
        y_type = type_of_target(y, input_name="y", raise_unknown=True)
        if y_type != "binary":
            raise ValueError(f"Only binary classification is supported. The type of the target is {y_type}.")
        x = np.asarray(X, dtype=float)
        target = (y == self.classes_[1]).astype(float)
        self.mean_ = x.mean(0)
        self.scale_ = x.std(0)
        self.scale_[self.scale_ == 0] = 1.0
        z = (x - self.mean_) / self.scale_
        self.coef_ = _logistic(z, target, self.C)
        rng = np.random.default_rng(self.random_state)
        boots = []
        for _ in range(self.n_bootstrap):
            idx = rng.integers(0, len(z), len(z))
            if len(np.unique(target[idx])) == 2:
                boots.append(_logistic(z[idx], target[idx], self.C))
        self.bootstrap_coef_ = np.array(boots) if boots else self.coef_[None, :]
        return self

    def _p(self, X, coef: np.ndarray) -> np.ndarray:
        z = (np.asarray(X, dtype=float) - self.mean_) / self.scale_
        return 1.0 / (1.0 + np.exp(-np.clip(coef[0] + z @ coef[1:], -30, 30)))

    def predict_proba(self, X):
        check_is_fitted(self)
        X = validate_data(self, X, reset=False)
        p = self._p(X, self.coef_)
        return np.column_stack([1 - p, p])

    def predict(self, X):
        positive = self.predict_proba(X)[:, 1] >= 0.5
        return self.classes_[positive.astype(int)]

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.classifier_tags.multi_class = False  # reproduced or not
        return tags

    def decision_function(self, X):
        check_is_fitted(self)
        X = validate_data(self, X, reset=False)
        z = (np.asarray(X, dtype=float) - self.mean_) / self.scale_
        return self.coef_[0] + z @ self.coef_[1:]

    def predict_interval(self, X) -> tuple[np.ndarray, np.ndarray]:
        check_is_fitted(self)
        ps = np.array([self._p(X, c) for c in self.bootstrap_coef_])
        tail = (1 - self.coverage) / 2
        return np.quantile(ps, tail, axis=0), np.quantile(ps, 1 - tail, axis=0)

    def to_json(self) -> dict:
        return {"C": self.C, "coverage": self.coverage, "classes": self.classes_.tolist(), "mean": self.mean_.tolist(),
                "scale": self.scale_.tolist(), "coef": self.coef_.tolist(), "bootstrap_coef": self.bootstrap_coef_.tolist()}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict) -> "FidelityClassifier":
        model = cls(C=data["C"], coverage=data["coverage"])
        model.classes_ = np.array(data["classes"])
        model.mean_, model.scale_ = np.array(data["mean"]), np.array(data["scale"])
        model.coef_, model.bootstrap_coef_ = np.array(data["coef"]), np.array(data["bootstrap_coef"])
        model.n_features_in_ = len(model.mean_)
        return model


def training_set(rows: list[dict], label: str, names: tuple[str, ...]) -> tuple[list[dict], np.ndarray, np.ndarray, list[str]]:
    """Rows with the label and every feature finite (a censored margin is a bound, not a value:
    left out of margin_ratio), as X, y and their (family, recipe) groups."""
    used = [r for r in rows if _finite(r.get(label)) and all(_finite(r.get(n)) for n in names)
            and not (label == "margin_ratio" and r.get("censored") == 1)]  # fmt: skip
    x = np.array([[r[n] for n in names] for r in used], dtype=float).reshape(len(used), len(names))
    y = np.array([r[label] for r in used], dtype=float)
    return used, x, y, [f"{r.get('family')}/{r.get('recipe')}" for r in used]


def new_model(label: str):
    """The model of one label: both regression labels are >= 0 (0 = the proxy matches)."""
    return FidelityClassifier() if label == "fault_reproduced" else FidelityRegressor(lower_bound=0.0)


@dataclass
class FidelityEstimator:
    """The three labels' models, full and prior variants, with their feature names."""

    models: dict[str, dict[str, Any]]  # variant -> label -> fitted model
    features: dict[str, tuple[str, ...]]  # variant -> feature names
    info: dict[str, Any]

    @classmethod
    def fit(cls, rows: list[dict], *, info: dict | None = None) -> "FidelityEstimator":
        models: dict[str, dict[str, Any]] = {}
        features = {"full": FULL_FEATURES, "prior": PRIOR_FEATURES}
        for variant, names in features.items():
            models[variant] = {}
            for label in LABELS:
                _, x, y, groups = training_set(rows, label, names)
                if len(y) >= 5 and (label != "fault_reproduced" or len(np.unique(y)) == 2):
                    models[variant][label] = new_model(label).fit(x, y, groups=groups)
        return cls(models, {k: tuple(v) for k, v in features.items()}, dict(info or {}, rows=len(rows)))

    def predict(self, row: Mapping[str, float], variant: str | None = None) -> dict[str, dict[str, float]]:
        """{label: {value, low, high}} for one feature row; the full variant when its features are
        all present, else the prior one (said in `variant`)."""
        chosen = variant or ("full" if all(_finite(row.get(n)) for n in self.features["full"]) else "prior")
        x = np.array([[row.get(n, np.nan) for n in self.features[chosen]]], dtype=float)
        out: dict[str, dict[str, float]] = {}
        for label, model in self.models[chosen].items():
            if label == "fault_reproduced":
                value = float(model.predict_proba(x)[0, 1])
            else:
                value = float(model.predict(x)[0])
            low, high = (float(v[0]) for v in model.predict_interval(x))
            out[label] = {"value": value, "low": low, "high": high, "variant": chosen}
        return out

    def to_json(self) -> dict:
        return {
            "schema": "planner.fidelity/1",
            "features": {k: list(v) for k, v in self.features.items()},
            "models": {v: {label: {"kind": type(m).__name__, **m.to_json()} for label, m in ms.items()} for v, ms in self.models.items()},
            "info": self.info,
        }

    @classmethod
    def from_json(cls, data: dict) -> "FidelityEstimator":
        if data.get("schema") != "planner.fidelity/1":
            raise ValueError(f"not a fidelity estimator file (schema {data.get('schema')!r})")
        kinds = {"FidelityRegressor": FidelityRegressor, "FidelityClassifier": FidelityClassifier}
        models = {v: {label: kinds[m["kind"]].from_json(m) for label, m in ms.items()} for v, ms in data["models"].items()}
        return cls(models, {k: tuple(v) for k, v in data["features"].items()}, data.get("info", {}))

    def save(self, path: str | Path) -> None:
        p = Path(path)
        tmp = p.with_name(p.name + ".part")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(p)

    @classmethod
    def load(cls, path: str | Path) -> "FidelityEstimator":
        return cls.from_json(json.loads(Path(path).read_text()))


def _finite(value) -> bool:
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False
