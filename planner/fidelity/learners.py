"""The learners behind the fidelity estimator, in scikit-learn's conventions.

Deliberately small models, because the data are a few hundred runs: ridge regression on
standardised features with conformal intervals from held-out residuals, and L2 logistic regression
(Newton's method) with bootstrap intervals on the probability; each chooses its penalty by held-out
error, leaving out whole (family, recipe) groups when it is told them. `__init__` only stores
arguments; `fit` validates and sets attributes ending in `_`; randomness goes through
`random_state`; both serialise to JSON (never pickle), and predicting from the JSON needs numpy
only (planner.fidelity.estimator).
"""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils.multiclass import check_classification_targets, type_of_target
from sklearn.utils.validation import check_is_fitted, validate_data

from planner.fidelity.estimator import LinearModel, LogisticModel

__all__ = ["FidelityRegressor", "FidelityClassifier", "new_model", "ALPHAS", "CS"]

ALPHAS = (0.3, 3.0, 30.0, 300.0, 3000.0)  # ridge penalties tried when alpha is None
CS = (0.003, 0.03, 0.3, 3.0)  # inverse logistic penalties tried when C is None


def _folds(n: int, groups, random_state) -> np.ndarray:
    """Leave-one-group-out fold ids when there are groups, else 5 random folds."""
    if groups is not None and len(set(groups)) > 1:
        return np.unique(np.asarray(groups), return_inverse=True)[1]
    return np.random.default_rng(random_state).permutation(n) % min(5, n)


class FidelityRegressor(RegressorMixin, BaseEstimator):
    """Ridge regression on standardised features. The penalty: `alpha`, or when None the one of
    ALPHAS with the least held-out squared error. Interval: prediction -+ the conformal quantile
    of held-out absolute residuals, with the finite-sample correction ceil((n+1) coverage)/n,
    clipped below at `lower_bound` for labels that cannot be negative. Held out means
    leave-one-group-out when `groups` are given to fit (the intervals then cover unseen groups),
    else 5 random folds."""

    def __init__(self, alpha: float | None = None, coverage: float = 0.8, lower_bound: float | None = None,
                 random_state: int | None = 0):  # fmt: skip
        self.alpha = alpha
        self.coverage = coverage
        self.lower_bound = lower_bound
        self.random_state = random_state

    @staticmethod
    def _solve(x: np.ndarray, y: np.ndarray, alpha: float):
        mean = x.mean(0)
        scale = x.std(0)
        scale[scale == 0] = 1.0
        z = (x - mean) / scale
        y_mean = y.mean()
        coef = np.linalg.solve(z.T @ z + alpha * np.eye(z.shape[1]), z.T @ (y - y_mean))
        return mean, scale, coef, y_mean

    def _held_out(self, x: np.ndarray, y: np.ndarray, folds: np.ndarray, alpha: float) -> np.ndarray:
        residuals = []
        for f in np.unique(folds):
            train, test = folds != f, folds == f
            if train.sum() < 2:
                continue
            m, s, c, b = self._solve(x[train], y[train], alpha)
            residuals.extend(((x[test] - m) / s) @ c + b - y[test])
        return np.asarray(residuals)

    def fit(self, X, y, groups=None):
        X, y = validate_data(self, X, y, y_numeric=True)
        x, y = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
        folds = _folds(len(y), groups, self.random_state)
        if self.alpha is None:
            errors = [float(np.mean(self._held_out(x, y, folds, a) ** 2)) if len(y) > 2 else 0.0 for a in ALPHAS]
            self.alpha_ = ALPHAS[int(np.argmin(errors))]
        else:
            self.alpha_ = float(self.alpha)
        mean, scale, self.coef_, intercept = self._solve(x, y, self.alpha_)
        residuals = np.abs(self._held_out(x, y, folds, self.alpha_))
        n = len(residuals)
        level = min(1.0, np.ceil((n + 1) * self.coverage) / n) if n else 1.0
        halfwidth = float(np.quantile(residuals, level, method="higher")) if n else float("inf")
        self.model_ = LinearModel(mean, scale, self.coef_, float(intercept), halfwidth, self.lower_bound, self.coverage)
        return self

    def predict(self, X):
        check_is_fitted(self)
        return self.model_.predict(validate_data(self, X, reset=False))

    def predict_interval(self, X) -> tuple[np.ndarray, np.ndarray]:
        check_is_fitted(self)
        return self.model_.predict_interval(validate_data(self, X, reset=False))


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
    """L2 logistic regression; `C`, or when None the one of CS with the least held-out log loss
    (folds as FidelityRegressor's). Interval on P(class 1): the quantiles of `n_bootstrap` refits on
    resamples (sampling noise), widened by the conformal quantile, over held-out folds, of
    |observed rate - mean predicted P| (with groups: the shift to an unseen group, which the
    bootstrap alone does not see)."""

    def __init__(self, C: float | None = None, n_bootstrap: int = 50, coverage: float = 0.8, random_state: int | None = 0):
        self.C = C
        self.n_bootstrap = n_bootstrap
        self.coverage = coverage
        self.random_state = random_state

    @staticmethod
    def _held_out(z: np.ndarray, target: np.ndarray, folds: np.ndarray, c: float):
        """(held-out P, its fold) for every fold whose training part has both classes."""
        for f in np.unique(folds):
            train, test = folds != f, folds == f
            if len(np.unique(target[train])) < 2:
                continue
            w = _logistic(z[train], target[train], c)
            yield np.clip(1.0 / (1.0 + np.exp(-np.clip(w[0] + z[test] @ w[1:], -30, 30))), 1e-6, 1 - 1e-6), test

    def _log_loss(self, z: np.ndarray, target: np.ndarray, folds: np.ndarray, c: float) -> float:
        losses = [-(target[t] * np.log(p) + (1 - target[t]) * np.log(1 - p)) for p, t in self._held_out(z, target, folds, c)]
        return float(np.mean(np.concatenate(losses))) if losses else 0.0

    def _shift(self, z: np.ndarray, target: np.ndarray, folds: np.ndarray) -> float:
        shifts = np.array([abs(target[t].mean() - p.mean()) for p, t in self._held_out(z, target, folds, self.C_)])
        n = len(shifts)
        return float(np.quantile(shifts, min(1.0, np.ceil((n + 1) * self.coverage) / n), method="higher")) if n else 0.0

    def fit(self, X, y, groups=None):
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
        mean, scale = x.mean(0), x.std(0)
        scale[scale == 0] = 1.0
        z = (x - mean) / scale
        folds = _folds(len(z), groups, self.random_state)
        if self.C is None:
            self.C_ = CS[int(np.argmin([self._log_loss(z, target, folds, c) for c in CS]))]
        else:
            self.C_ = float(self.C)
        self.shift_ = self._shift(z, target, folds)
        self.coef_ = _logistic(z, target, self.C_)
        rng = np.random.default_rng(self.random_state)
        boots = []
        for _ in range(self.n_bootstrap):
            idx = rng.integers(0, len(z), len(z))
            if len(np.unique(target[idx])) == 2:
                boots.append(_logistic(z[idx], target[idx], self.C_))
        self.model_ = LogisticModel(mean, scale, self.coef_, np.array(boots) if boots else self.coef_[None, :], self.coverage, self.classes_,
                                    self.shift_)  # fmt: skip
        return self

    def predict_proba(self, X):
        check_is_fitted(self)
        p = self.model_.proba(validate_data(self, X, reset=False))
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
        return self.model_.decision(validate_data(self, X, reset=False))

    def predict_interval(self, X) -> tuple[np.ndarray, np.ndarray]:
        check_is_fitted(self)
        return self.model_.predict_interval(validate_data(self, X, reset=False))


def new_model(label: str):
    """The model of one label: both regression labels are >= 0 (0 = the proxy matches)."""
    return FidelityClassifier() if label == "fault_reproduced" else FidelityRegressor(lower_bound=0.0)


