"""The router-collapse estimator on originals it never saw: fit on the first two originals of each
family, score on the third ones (a pre-registered check: the model's features were chosen before the
third originals were measured). Prints the full model and its baselines on the held-out rows: shift
MAE against the noise floor, within-K Spearman, interval coverage, AUC and Brier of P(reproduced).

    python benchmarks/fidelity_holdout.py [--dataset calibration/fidelity_dataset.csv] [--recipe router-collapse]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr
from sklearn.metrics import roc_auc_score

from planner.fidelity.dataset import read_dataset
from planner.fidelity.estimator import FidelityEstimator, baselines, design, recipe_features, training_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default=str(Path(__file__).resolve().parents[1] / "calibration" / "fidelity_dataset.csv"))
    parser.add_argument("--recipe", default="router-collapse")
    args = parser.parse_args()
    rows = read_dataset(Path(args.dataset))
    third = {r["original"] for r in rows if str(r["original"]).endswith("-s2")}
    fitted = FidelityEstimator.fit([r for r in rows if r["original"] not in third], validate=False)
    held = [r for r in training_rows(rows, args.recipe, recipe_features(args.recipe)) if r["original"] in third]
    y = np.array([r["shift_log2"] for r in held])
    se = np.array([r["shift_se"] for r in held])
    decided = np.array([math.isfinite(r.get("reproduced", math.nan)) for r in held])
    outcome = np.array([r.get("reproduced", math.nan) for r in held])[decided]
    print(f"{args.recipe}: fitted on {len({r['original'] for r in rows} - third)} originals, scored on {len(held)} rows of "
          f"{sorted({r['original'] for r in held})} (noise floor {float(np.mean(se)) * math.sqrt(2 / math.pi):.3f}; "
          f"{int(decided.sum())} decided, {int(outcome.sum())} reproduced)")  # fmt: skip
    for variant, names in {"full": recipe_features(args.recipe), **baselines(args.recipe)}.items():
        model = fitted.recipes[args.recipe]["models"][variant]
        x = design(held, names)
        pred = model.predict(x)
        low, high = model.predict_interval(x)
        p = model.p_within(x, fitted.tolerance)[0][decided]
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(held):
            groups.setdefault((r["original"], r["experts"]), []).append(i)
        ranks = [spearmanr(pred[ix], y[ix]).statistic if np.ptp(pred[ix]) > 0 else 0.0 for ix in groups.values() if len(ix) >= 3]
        by_original = {o: float(np.mean([abs(pred[i] - y[i]) for i, r in enumerate(held) if r["original"] == o])) for o in sorted(third)
                       if any(r["original"] == o for r in held)}  # fmt: skip
        auc = roc_auc_score(outcome, p) if len(set(outcome)) == 2 else float("nan")
        print(f"  {variant:14s} MAE {np.mean(np.abs(pred - y)):.3f} ({', '.join(f'{o} {v:.3f}' for o, v in by_original.items())}); "
              f"within-K Spearman {np.mean(ranks):.2f}; coverage {np.mean((y >= low) & (y <= high)):.2f}; "
              f"AUC {auc:.3f}; Brier {np.mean((p - outcome) ** 2):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
