"""The scale-transfer fit's between-original variance: Paule-Mandel (what planner.fidelity.transfer
uses) against REML, on planted points shaped like the measured ones.

Each draw plants 8 points (hidden 64 and 128, 3 and 6 layers, two originals each) with a width slope
of +0.5 log2 per doubling, a between-original SD tau, and margin seeds as the grid measures them: 4
seeds a side, each point's standard error estimated from them, and in some draws one seed of an
original far off (an original that collapses on its own at one seed, as DeepSeek-V3's hidden-128
seed-1 original did). Both estimators feed the same weighted fit with Knapp-Hartung's floor; the
script prints how often the 90% interval of the width slope covers the planted one, its mean width
and the median estimated tau; then both estimates on the measured points (calibration/transfer.json).
A few seconds.

    python benchmarks/transfer_tau.py [--draws 600]
"""

from __future__ import annotations

import argparse

import numpy as np
import statsmodels.api as sm
from scipy.optimize import minimize_scalar
from scipy.stats import t as student_t

from planner.fidelity.transfer import BASE_HIDDEN, BASE_LAYERS, _usable, between_variance, load_points
from planner.render import table

SLOPE = 0.5


def reml(y: np.ndarray, x: np.ndarray, variance: np.ndarray) -> float:
    """tau^2 maximising the restricted likelihood of the meta-regression."""

    def minus_loglik(tau2: float) -> float:
        w = 1.0 / (variance + tau2)
        a = x.T @ (x * w[:, None])
        r = y - x @ np.linalg.solve(a, x.T @ (w * y))
        return 0.5 * (np.sum(np.log(variance + tau2)) + np.linalg.slogdet(a)[1] + np.sum(w * r * r))

    return float(minimize_scalar(minus_loglik, bounds=(0.0, 4 * np.var(y) + variance.max() + 1), method="bounded").x)


def slope_interval(y: np.ndarray, x: np.ndarray, variance: np.ndarray, tau2: float) -> tuple[float, float]:
    fit = sm.WLS(y, x, weights=1.0 / (variance + tau2)).fit()
    se = np.sqrt(np.diag(fit.normalized_cov_params * max(float(fit.scale), 1.0)))
    half = float(student_t.ppf(0.95, fit.df_resid)) * se[1]
    return float(fit.params[1] - half), float(fit.params[1] + half)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=600)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    hidden, layers = np.repeat([0.0, 1.0], 4), np.tile(np.repeat([0.0, 1.0], 2), 2)
    x = np.column_stack([np.ones(8), hidden, layers])
    rows = []
    for tau, far in [(0.0, 0.15), (0.3, 0.15), (0.6, 0.0), (0.6, 0.15), (1.0, 0.15)]:
        found = {"Paule-Mandel": [], "REML": []}
        for _ in range(args.draws):
            shifts, variances = [], []
            for i in range(8):
                sd = rng.uniform(0.3, 0.8)
                original, proxy = rng.normal(0, sd, 4), rng.normal(0, sd, 4)
                if rng.random() < far:
                    original[0] += rng.choice([-1, 1]) * rng.uniform(3, 8)
                shifts.append(-1 + SLOPE * hidden[i] + rng.normal(0, tau) + proxy.mean() - original.mean())
                variances.append(max(original.var(ddof=1) / 4 + proxy.var(ddof=1) / 4, 0.05**2))
            y, v = np.array(shifts), np.array(variances)
            for name, tau2 in (("Paule-Mandel", between_variance(y, x, v)), ("REML", reml(y, x, v))):
                low, high = slope_interval(y, x, v, tau2)
                found[name].append((low <= SLOPE <= high, high - low, np.sqrt(tau2)))
        for name, got in found.items():
            cover, width, taus = zip(*got)
            rows.append([tau, far, name, f"{np.mean(cover):.3f}", f"{np.mean(width):.2f}", f"{np.median(taus):.2f}"])
    print(table(["planted tau", "share of originals with a far seed", "estimator", "90% coverage of the width slope", "mean width",
                 "median tau"], rows))  # fmt: skip
    measured = []
    points = _usable(load_points())
    for key in sorted({(p["recipe"], p["shape"]) for p in points}):
        at = [p for p in points if (p["recipe"], p["shape"]) == key]
        xm = np.column_stack([np.ones(len(at)), np.log2([p["hidden"] / BASE_HIDDEN for p in at]), np.log2([p["layers"] / BASE_LAYERS for p in at])])
        y, v = np.array([p["shift_log2"] for p in at]), np.array([max(p["shift_se"], 0.05) ** 2 for p in at])
        measured.append([key[0], key[1], len(at), f"{np.sqrt(between_variance(y, xm, v)):.2f}", f"{np.sqrt(reml(y, xm, v)):.2f}"])
    print()
    print(table(["recipe", "shape", "points", "tau Paule-Mandel", "tau REML"], measured))


if __name__ == "__main__":
    main()
