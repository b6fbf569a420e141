"""The estimator's per-original spread: its profiled REML against statsmodels' MixedLM, in one run.

The shift models' intervals carry the original-to-original spread as a random intercept per
original, fitted by REML on each fit's residuals (planner.fidelity.learners._variance_components);
the estimator's fit and its validation make over a thousand of them. On planted designs like the
grid's (3-40 originals, 50-600 rows, between-original SD from 0 to 3x the within SD) this prints,
for both, the time and the REML log-likelihood reached (from its definition, dense matrices), and
the estimates where they differ. With --fit it also times `FidelityEstimator.fit` on the committed
dataset with each of the two inside (about 4 minutes on 2 cores).

    python benchmarks/variance_components.py [--fit]
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def mixedlm_components(residuals, groups) -> tuple[float, float]:
    """(SD between, SD within) by statsmodels' MixedLM (REML), with the estimator's boundary rule."""
    from statsmodels.regression.mixed_linear_model import MixedLM

    from planner.fidelity.learners import BOUNDARY

    if groups is None or len(set(groups)) < 3:
        return float("nan"), float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = MixedLM(np.asarray(residuals, dtype=float), np.ones((len(residuals), 1)), groups=np.asarray(groups)).fit(reml=True)
    between = float(np.asarray(fit.cov_re)[0, 0])
    return (0.0 if between < BOUNDARY * fit.scale else float(np.sqrt(between))), float(np.sqrt(fit.scale))


def main() -> None:
    from planner.fidelity import learners
    from planner.fidelity.learners import reml_loglik
    from planner.render import table

    rng = np.random.default_rng(0)
    designs = []
    for _ in range(60):
        g = int(rng.integers(3, 41))
        n = int(rng.integers(max(50, 3 * g), 601))
        groups = rng.integers(0, g, n)
        within = float(rng.choice([0.2, 1.0]))
        y = rng.normal(0.0, within, n) + rng.normal(0.0, within * float(rng.choice([0.0, 0.05, 0.3, 1.0, 3.0])), g)[groups]
        designs.append((y, groups))
    results = {}
    for name, fn in (("profiled REML (planner)", learners._variance_components), ("statsmodels MixedLM", mixedlm_components)):
        start = time.perf_counter()
        estimates = [fn(y, g) for y, g in designs]
        results[name] = (time.perf_counter() - start, estimates)
    ours, theirs = results["profiled REML (planner)"][1], results["statsmodels MixedLM"][1]
    gaps = [reml_loglik(y, g, *a) - reml_loglik(y, g, *b) for (y, g), a, b in zip(designs, ours, theirs)]
    apart = [(i, a, b, gap) for i, (a, b, gap) in enumerate(zip(ours, theirs, gaps)) if max(abs(a[0] - b[0]), abs(a[1] - b[1])) > 1e-3 * b[1]]
    print(table(["fit", "seconds for 60 designs", "x the fastest"],
                [[name, f"{t:.3f}", f"{t / min(r[0] for r in results.values()):.0f}"] for name, (t, _) in results.items()]))  # fmt: skip
    print(f"\nREML log-likelihood, planner minus MixedLM: min {min(gaps):+.2e}, max {max(gaps):+.2e} "
          f"({sum(g > 1e-6 for g in gaps)} of {len(gaps)} designs higher with planner's, {sum(g < -1e-6 for g in gaps)} lower)")  # fmt: skip
    if apart:
        print(f"\n{len(apart)} designs where the estimates differ by more than 0.1% of the within SD:")
        print(table(["design", "between (planner)", "between (MixedLM)", "within (planner)", "within (MixedLM)", "log-lik gain"],
                    [[i, f"{a[0]:.4f}", f"{b[0]:.4f}", f"{a[1]:.4f}", f"{b[1]:.4f}", f"{gap:+.3f}"] for i, a, b, gap in apart]))  # fmt: skip
    if "--fit" in sys.argv:
        from planner.fidelity.dataset import read_dataset
        from planner.fidelity.estimator import FidelityEstimator

        rows = read_dataset(ROOT / "calibration" / "fidelity_dataset.csv")
        times, own = {}, learners._variance_components
        for name, fn in (("profiled REML (planner)", own), ("statsmodels MixedLM", mixedlm_components)):
            learners._variance_components = fn  # fit_shift looks it up in the module at each call
            start = time.perf_counter()
            FidelityEstimator.fit(rows)
            times[name] = time.perf_counter() - start
        learners._variance_components = own
        print()
        print(table(["FidelityEstimator.fit on the committed dataset", "seconds", "x the fastest"],
                    [[name, f"{t:.1f}", f"{t / min(times.values()):.1f}"] for name, t in times.items()]))  # fmt: skip


if __name__ == "__main__":
    main()
