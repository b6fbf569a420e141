"""The learner behind the fidelity estimator, in scikit-learn's conventions.

A deliberately small model, because the data are a few hundred runs per recipe: ridge regression of
the signed shift on a few standardised, monotone features, with sign constraints where the
mechanism fixes the sign (bounded least squares, scipy's lsq_linear), its penalty chosen by held-out
error leaving out whole originals, and the held-out residuals kept: they give the conformal interval
of the shift and its predictive distribution, from which P(reproduced) follows. `__init__` only
stores arguments; `fit` validates and sets attributes ending in `_`; the fitted model serialises to
JSON (never pickle) and predicts from it with numpy only (planner.fidelity.estimator.ShiftModel).
"""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted, validate_data

from planner.fidelity.model import MIN_ROWS, SIGNS, ShiftModel, design, training_rows

__all__ = ["ShiftRegressor", "ALPHAS", "fit_shift"]

ALPHAS = (0.1, 1.0, 10.0, 100.0, 1000.0)  # ridge penalties tried when alpha is None


def _folds(n: int, groups, random_state) -> np.ndarray:
    """Leave-one-group-out fold ids when there are several groups, else 5 random folds."""
    if groups is not None and len(set(groups)) > 1:
        return np.unique(np.asarray(groups), return_inverse=True)[1]
    return np.random.default_rng(random_state).permutation(n) % min(5, n)


BOUNDARY = 1e-4  # a between-original variance below this share of the within variance is zero (SD ratio 0.01)


def _variance_components(residuals: np.ndarray, groups) -> tuple[float, float]:
    """(SD between groups, SD within) of `residuals` by a random-intercept model (statsmodels
    MixedLM, REML); NaN with fewer than 3 groups."""
    if groups is None or len(set(groups)) < 3:
        return float("nan"), float("nan")
    import warnings

    from statsmodels.regression.mixed_linear_model import MixedLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # boundary (zero between-group variance) and convergence notes
        try:
            fit = MixedLM(residuals, np.ones((len(residuals), 1)), groups=np.asarray(groups)).fit(reml=True)
        except np.linalg.LinAlgError:  # a singular information matrix (a degenerate subset of rows): the ANOVA estimate
            return _anova_components(np.asarray(residuals, dtype=float), np.asarray(groups))
    between = float(np.asarray(fit.cov_re)[0, 0])
    # on the boundary the optimiser stops at a variance of 1e-10 or so, whose value differs from one
    # machine's BLAS to another's: below BOUNDARY of the within variance it is zero
    if between < BOUNDARY * fit.scale:
        between = 0.0
    return float(np.sqrt(between)), float(np.sqrt(fit.scale))


def _anova_components(y: np.ndarray, groups: np.ndarray) -> tuple[float, float]:
    """(SD between groups, SD within) by the one-way ANOVA method of moments for unbalanced groups:
    within = MSW; between = max(0, (MSB - MSW) / n0), n0 = (N - sum n_i^2 / N) / (g - 1)."""
    labels, inverse = np.unique(groups, return_inverse=True)
    g, n = len(labels), len(y)
    sizes = np.bincount(inverse).astype(float)
    means = np.bincount(inverse, weights=y) / sizes
    msw = float(((y - means[inverse]) ** 2).sum() / max(n - g, 1))
    msb = float((sizes * (means - y.mean()) ** 2).sum() / (g - 1))
    n0 = (n - (sizes**2).sum() / n) / (g - 1)
    return float(np.sqrt(max((msb - msw) / n0, 0.0))), float(np.sqrt(msw))


class ShiftRegressor(RegressorMixin, BaseEstimator):
    """Ridge regression with per-feature sign constraints.

    signs: one of +1 (coefficient >= 0), -1 (<= 0) or 0 (free) per feature, in the standardised
    space (a positive scale keeps the sign); None leaves every coefficient free. The penalty:
    `alpha`, or when None the one of ALPHAS with the least held-out squared error. The held-out
    residuals (leave-one-group-out when `groups` are given to fit, else 5 random folds) are kept in
    `residuals_` with their groups: the interval is their conformal quantile at `coverage` with the
    finite-sample correction ceil((n+1) coverage)/n, widened to the normal interval of the fit's
    variance components (between originals: `original_sd_`, within: `within_sd_`) where that is
    wider."""

    def __init__(self, signs=None, alpha: float | None = None, coverage: float = 0.8, random_state: int | None = 0):
        self.signs = signs
        self.alpha = alpha
        self.coverage = coverage
        self.random_state = random_state

    def _bounds(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        signs = np.zeros(d) if self.signs is None else np.asarray(self.signs, dtype=float)
        if signs.shape != (d,):
            raise ValueError(f"signs has {signs.size} entries for {d} features")
        low = np.where(signs > 0, 0.0, -np.inf)  # +1: coefficient >= 0
        high = np.where(signs < 0, 0.0, np.inf)  # -1: coefficient <= 0
        return low, high

    def _solve(self, x: np.ndarray, y: np.ndarray, alpha: float):
        from scipy.optimize import lsq_linear

        mean, scale = x.mean(0), x.std(0)
        scale[scale == 0] = 1.0
        z = (x - mean) / scale
        y_mean = float(y.mean())
        d = z.shape[1]
        a = np.vstack([z, np.sqrt(alpha) * np.eye(d)])
        b = np.concatenate([y - y_mean, np.zeros(d)])
        low, high = self._bounds(d)
        coef = lsq_linear(a, b, bounds=(low, high), method="bvls").x if d else np.zeros(0)
        return mean, scale, coef, y_mean

    def _held_out(self, x: np.ndarray, y: np.ndarray, folds: np.ndarray, alpha: float) -> np.ndarray:
        pred = np.full(len(y), np.nan)
        for f in np.unique(folds):
            test = folds == f
            if (~test).sum() < 2:
                continue
            mean, scale, coef, y_mean = self._solve(x[~test], y[~test], alpha)
            pred[test] = ((x[test] - mean) / scale) @ coef + y_mean
        return pred

    def fit(self, X, y, groups=None):
        X, y = validate_data(self, X, y, y_numeric=True)
        if len(y) < 3:
            raise ValueError(f"ShiftRegressor needs at least 3 rows, got n_samples={len(y)}")
        folds = _folds(len(y), groups, self.random_state)
        alphas = ALPHAS if self.alpha is None else (self.alpha,)
        held = {a: self._held_out(X, y, folds, a) for a in alphas}
        self.alpha_ = min(alphas, key=lambda a: np.nanmean((held[a] - y) ** 2) if np.isfinite(held[a]).any() else np.inf)
        self.mean_, self.scale_, self.coef_, self.intercept_ = self._solve(X, y, self.alpha_)
        ok = np.isfinite(held[self.alpha_])
        self.residuals_ = (y - held[self.alpha_])[ok]
        keys = np.asarray(groups if groups is not None else folds).astype(str)
        self.residual_groups_ = keys[ok]
        n = len(self.residuals_)
        level = min(1.0, np.ceil((n + 1) * self.coverage) / n) if n else 1.0
        self.halfwidth_ = float(np.quantile(np.abs(self.residuals_), level)) if n else float("inf")
        # the original-to-original spread: a random intercept per original on the fit's residuals
        # (REML); with few originals the held-out residuals under-represent it, so the interval is
        # at least the normal interval of both variance components, and P's predictive
        # distribution (the held-out residuals) is stretched to match
        self.original_sd_, self.within_sd_ = _variance_components(y - self._predict_fitted(X), groups)
        residuals = self.residuals_
        if np.isfinite(self.original_sd_) and n:
            from scipy.stats import norm

            parametric = float(norm.ppf((1 + self.coverage) / 2) * np.hypot(self.original_sd_, self.within_sd_))
            if parametric > self.halfwidth_ > 0:
                residuals = self.residuals_ * (parametric / self.halfwidth_)
                self.halfwidth_ = parametric
        self.model_ = ShiftModel(self.mean_, self.scale_, self.coef_, float(self.intercept_), self.halfwidth_, residuals,
                                 self.residual_groups_, self.coverage, self.original_sd_, self.within_sd_)  # fmt: skip
        return self

    def _predict_fitted(self, X) -> np.ndarray:
        return ((X - self.mean_) / self.scale_) @ self.coef_ + self.intercept_

    def predict(self, X):
        check_is_fitted(self)
        X = validate_data(self, X, reset=False)
        return self.model_.predict(X)

    def predict_interval(self, X) -> tuple[np.ndarray, np.ndarray]:
        check_is_fitted(self)
        X = validate_data(self, X, reset=False)
        return self.model_.predict_interval(X)


def fit_shift(rows: list[dict], recipe: str, names: tuple[str, ...]) -> ShiftModel | None:
    """The shift model of one recipe on `names` (groups: originals), or None with too few rows."""
    used = training_rows(rows, recipe, names)
    groups = [str(r.get("original")) for r in used]
    if len(used) < MIN_ROWS or len(set(groups)) < 2:
        return None
    x = design(used, names)
    y = np.array([r["shift_log2"] for r in used], dtype=float)
    signs = [SIGNS.get(recipe, {}).get(n, 0) for n in names] or [0]
    return ShiftRegressor(signs=signs).fit(x, y, groups=groups).model_
