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
from scipy.optimize import minimize_scalar

from planner.fidelity.transfer import between_variance, fit_transfer, load_points
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


ESTIMATORS = {"Paule-Mandel": between_variance, "REML": reml}


def planted(rng: np.random.Generator, tau: float, far: float) -> list[dict]:
    """8 points (hidden 64 and 128, 3 and 6 layers, two originals each), as the grid measures them."""
    points = []
    for hidden in (64, 128):
        for layers in (3, 6):
            for seed in range(2):
                sd = rng.uniform(0.3, 0.8)
                original, proxy = rng.normal(0, sd, 4), rng.normal(0, sd, 4)
                if rng.random() < far:
                    original[0] += rng.choice([-1, 1]) * rng.uniform(3, 8)
                shift = -1 + SLOPE * np.log2(hidden / 64) + rng.normal(0, tau) + proxy.mean() - original.mean()
                se = np.sqrt(original.var(ddof=1) / 4 + proxy.var(ddof=1) / 4)
                points.append({"recipe": "planted", "shape": "planted", "hidden": hidden, "layers": layers, "original": f"h{hidden}-l{layers}-s{seed}",
                               "shift_log2": float(shift), "shift_se": float(se)})  # fmt: skip
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=600)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for tau, far in [(0.0, 0.15), (0.3, 0.15), (0.6, 0.0), (0.6, 0.15), (1.0, 0.15)]:
        found: dict[str, list] = {name: [] for name in ESTIMATORS}
        for _ in range(args.draws):
            points = planted(rng, tau, far)
            for name, estimator in ESTIMATORS.items():
                fit = fit_transfer(points, tau2=estimator, holdout=False)["planted|planted"]
                low, high = fit["interval"]["log2_hidden"]
                found[name].append((low <= SLOPE <= high, high - low, fit["tau"]))
        for name, got in found.items():
            cover, width, taus = zip(*got)
            rows.append([tau, far, name, f"{np.mean(cover):.3f}", f"{np.mean(width):.2f}", f"{np.median(taus):.2f}"])
    print(table(["planted tau", "share of originals with a far seed", "estimator", "90% coverage of the width slope", "mean width",
                 "median tau"], rows))  # fmt: skip
    fits = {name: fit_transfer(load_points(), tau2=estimator, holdout=False) for name, estimator in ESTIMATORS.items()}
    measured = [[*key.split("|"), fit["points"], *(f"{fits[name][key].get('tau', float('nan')):.2f}" for name in ESTIMATORS)]
                for key, fit in fits["Paule-Mandel"].items() if fit.get("fitted")]  # fmt: skip
    print()
    print(table(["recipe", "shape", "points", *(f"tau {name}" for name in ESTIMATORS)], measured))


if __name__ == "__main__":
    main()
