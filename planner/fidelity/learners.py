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

__all__ = ["ShiftRegressor", "ALPHAS", "fit_shift", "reml_loglik"]

ALPHAS = (0.1, 1.0, 10.0, 100.0, 1000.0)  # ridge penalties tried when alpha is None


def _folds(n: int, groups, random_state) -> np.ndarray:
    """Leave-one-group-out fold ids when there are several groups, else 5 random folds."""
    if groups is not None and len(set(groups)) > 1:
        return np.unique(np.asarray(groups), return_inverse=True)[1]
    return np.random.default_rng(random_state).permutation(n) % min(5, n)


BOUNDARY = 1e-4  # a between-original variance below this share of the within variance is zero (SD ratio 0.01)
_LOG_RATIOS = np.arange(-12.0, 8.0 + 1e-9, 0.25)  # the grid of log variance ratios the REML criterion is first scanned on


def _variance_components(residuals: np.ndarray, groups) -> tuple[float, float]:
    """(SD between groups, SD within) of `residuals` under a random intercept per group, by REML;
    NaN with fewer than 3 groups.

    For this one-way model (a mean and one variance per level) the REML criterion profiles to the
    variance ratio g = between / within alone. With n_i rows and mean m_i in group i, w_i = n_i /
    (1 + n_i g), mu = sum w_i m_i / sum w_i and Q = (within-group sum of squares) + sum w_i (m_i - mu)^2,
    -2 REML = (N - 1) log Q + sum log(1 + n_i g) + log sum w_i + const, and within = Q / (N - 1). It is
    scanned on a grid of log g and refined by bounded Brent around the best point: the optimum to
    1e-10 in log g. statsmodels' MixedLM agrees inside the parameter space and stops short of the
    optimum near g = 0 (tests/test_fidelity.py), at some 140 times the time; the estimator's fit and
    its validation make over a thousand of these."""
    if groups is None or len(set(groups)) < 3:
        return float("nan"), float("nan")
    from scipy.optimize import minimize_scalar

    y = np.asarray(residuals, dtype=float)
    inverse = np.unique(np.asarray(groups).astype(str), return_inverse=True)[1]
    n = np.bincount(inverse).astype(float)
    means = np.bincount(inverse, weights=y) / n
    ssw = float(((y - means[inverse]) ** 2).sum())
    if ssw == 0.0:  # no spread within any group: all of it lies between them (or there is none)
        return float(np.std(means, ddof=1)), 0.0

    def criterion(log_ratio):
        ratio = np.exp(np.asarray(log_ratio, dtype=float))[..., None]
        w = n / (1.0 + n * ratio)
        mu = (w * means).sum(-1, keepdims=True) / w.sum(-1, keepdims=True)
        q = ssw + (w * (means - mu) ** 2).sum(-1)
        return (len(y) - 1) * np.log(q) + np.log1p(n * ratio).sum(-1) + np.log(w.sum(-1)), q

    best = int(np.argmin(criterion(_LOG_RATIOS)[0]))
    low, high = _LOG_RATIOS[max(best - 1, 0)], _LOG_RATIOS[min(best + 1, len(_LOG_RATIOS) - 1)]
    log_ratio = float(minimize_scalar(lambda t: float(criterion(t)[0]), bounds=(low, high), method="bounded",
                                      options={"xatol": 1e-10}).x)  # fmt: skip
    ratio = float(np.exp(log_ratio))
    # at the boundary the optimum is a ratio of 0, which the log scale only approaches: below
    # BOUNDARY it is 0, and the within variance is the rows' own about their mean (Q at ratio 0)
    if ratio < BOUNDARY:
        return 0.0, float(np.sqrt(((y - y.mean()) ** 2).sum() / (len(y) - 1)))
    within = float(criterion(log_ratio)[1]) / (len(y) - 1)
    return float(np.sqrt(ratio * within)), float(np.sqrt(within))


def reml_loglik(y: np.ndarray, groups: np.ndarray, between: float, within: float) -> float:
    """The REML log-likelihood of a random intercept per group at SDs (between, within), from its
    definition with dense matrices: what _variance_components maximises, for its checks (tests,
    benchmarks/variance_components.py), never on a fit's path."""
    y, groups = np.asarray(y, dtype=float), np.asarray(groups)
    z = (groups[:, None] == np.unique(groups)[None]).astype(float)
    v = within**2 * np.eye(len(y)) + between**2 * z @ z.T
    vi, x = np.linalg.inv(v), np.ones((len(y), 1))
    xvx = x.T @ vi @ x
    r = y - x @ np.linalg.solve(xvx, x.T @ vi @ y)
    return float(-0.5 * (np.linalg.slogdet(v)[1] + np.linalg.slogdet(xvx)[1] + r @ vi @ r))


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

    def _solve(self, x: np.ndarray, y: np.ndarray, alphas) -> list[tuple]:
        """(mean, scale, coef, y mean) of the fit of y on the standardised x, per penalty in alphas:
        the ridge solution from one SVD where it keeps the signs (then it is the bounded problem's
        optimum too), else bounded least squares on the penalised system."""
        from scipy.optimize import lsq_linear

        mean, scale = x.mean(0), x.std(0)
        scale[scale == 0] = 1.0
        z = (x - mean) / scale
        y_mean = float(y.mean())
        d = z.shape[1]
        if not d:
            return [(mean, scale, np.zeros(0), y_mean) for _ in alphas]
        low, high = self._bounds(d)
        u, s, vt = np.linalg.svd(z, full_matrices=False)
        projected = u.T @ (y - y_mean)
        out = []
        for alpha in alphas:
            coef = vt.T @ (s / (s**2 + alpha) * projected)
            if np.any(coef < low) or np.any(coef > high):
                a = np.vstack([z, np.sqrt(alpha) * np.eye(d)])
                coef = lsq_linear(a, np.concatenate([y - y_mean, np.zeros(d)]), bounds=(low, high), method="bvls").x
            out.append((mean, scale, coef, y_mean))
        return out

    def _held_out(self, x: np.ndarray, y: np.ndarray, folds: np.ndarray, alphas) -> dict[float, np.ndarray]:
        pred = {alpha: np.full(len(y), np.nan) for alpha in alphas}
        for f in np.unique(folds):
            test = folds == f
            if (~test).sum() < 2:
                continue
            for alpha, (mean, scale, coef, y_mean) in zip(alphas, self._solve(x[~test], y[~test], alphas)):
                pred[alpha][test] = ((x[test] - mean) / scale) @ coef + y_mean
        return pred

    def fit(self, X, y, groups=None):
        X, y = validate_data(self, X, y, y_numeric=True)
        if len(y) < 3:
            raise ValueError(f"ShiftRegressor needs at least 3 rows, got n_samples={len(y)}")
        folds = _folds(len(y), groups, self.random_state)
        alphas = ALPHAS if self.alpha is None else (self.alpha,)
        held = self._held_out(X, y, folds, alphas)
        self.alpha_ = min(alphas, key=lambda a: np.nanmean((held[a] - y) ** 2) if np.isfinite(held[a]).any() else np.inf)
        self.mean_, self.scale_, self.coef_, self.intercept_ = self._solve(X, y, (self.alpha_,))[0]
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
