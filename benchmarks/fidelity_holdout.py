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

from planner.fidelity.dataset import production_rows, read_dataset
from planner.fidelity.estimator import FidelityEstimator, design, recipe_features, training_rows
from planner.fidelity.validate import score_predictions, variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default=str(Path(__file__).resolve().parents[1] / "calibration" / "fidelity_dataset.csv"))
    parser.add_argument("--recipe", default="router-collapse")
    args = parser.parse_args()
    rows = production_rows(read_dataset(Path(args.dataset)))  # the plan models are the production job's
    third = {r["original"] for r in rows if str(r["original"]).endswith("-s2")}
    train = [r for r in rows if r["original"] not in third]
    fitted = FidelityEstimator.fit(train, validate=False)
    held = [r for r in training_rows(rows, args.recipe, recipe_features(args.recipe)) if r["original"] in third]
    decided = [r["reproduced"] for r in train if r["recipe"] == args.recipe and math.isfinite(r.get("reproduced", math.nan))]
    print(f"{args.recipe}: fitted on {len({r['original'] for r in train})} originals, scored on {len(held)} rows of "
          f"{sorted({r['original'] for r in held})}")  # fmt: skip
    for variant, names in variants(args.recipe).items():
        model = fitted.recipes[args.recipe]["models"][variant]
        x = design(held, names)
        low, high = model.predict_interval(x)
        h = {"rows": held, "key": "original", "pred": model.predict(x), "low": low, "high": high,
             "p": model.p_within(x, fitted.tolerance)[0], "base": np.full(len(held), np.mean(decided))}  # fmt: skip
        sc = score_predictions(h)
        by = ", ".join(f"{o} {v:.3f}" for o, v in sc["mae_by_group"].items())
        print(f"  {variant:14s} MAE {sc['mae']:.3f} ({by}; noise floor {sc['noise_mae']:.3f}); within-K Spearman "
              f"{sc['spearman_within_k']:.2f}; coverage {sc['coverage']:.2f}; {sc['decided']} decided ({sc['positive_rate']:.2f} "
              f"reproduced): AUC {sc.get('auc', math.nan):.3f}, Brier {sc.get('brier', math.nan):.3f} "
              f"(base rate {sc.get('brier_base_rate', math.nan):.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
