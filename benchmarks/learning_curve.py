"""How many originals and plans a calibration family needs: held-out error against training rows.

For one family and recipe, every original is held out in turn; the shift models (the full model and
K/E alone) are fitted on n of the other originals of the family (the first 10 choices of n) with
m plans per (original, K) (a seeded draw of the plans), and scored on the held-out original's rows.
The table is the mean held-out shift MAE over those folds, next to the family's noise floor: where
it stops falling as n or m grow, more of them buys nothing.

    python benchmarks/learning_curve.py --family qwen3_moe-e128 --recipe router-collapse
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from planner.fidelity.dataset import production_rows, read_dataset
    from planner.fidelity.learners import fit_shift
    from planner.fidelity.model import baselines, design, recipe_features, training_rows
    from planner.render import table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default=str(ROOT / "calibration" / "fidelity_dataset.csv"))
    parser.add_argument("--family", required=True)
    parser.add_argument("--recipe", default="router-collapse")
    parser.add_argument("--plans", default="2,4,6,8,10", help="plans per (original, K) to train on")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = recipe_features(args.recipe)
    rows = [r for r in training_rows(production_rows(read_dataset(Path(args.dataset))), args.recipe, names) if r["family"] == args.family]
    originals = sorted({r["original"] for r in rows})
    if len(originals) < 3:
        raise SystemExit(f"{args.family}/{args.recipe}: {len(originals)} originals with labelled rows; a curve needs 3 or more")
    rng = np.random.default_rng(args.seed)
    noise = float(np.nanmean([r["shift_se"] for r in rows]) * math.sqrt(2 / math.pi))
    variants = {"full": names, "K/E only": baselines(args.recipe)["K/E only"]}
    body = []
    for n in range(2, len(originals)):
        for m in (int(x) for x in args.plans.split(",")):
            errors = {v: [] for v in variants}
            for held in originals:
                others = [o for o in originals if o != held]
                test = [r for r in rows if r["original"] == held]
                for chosen in itertools.islice(itertools.combinations(others, n), 10):
                    train = []
                    for o in chosen:
                        for k in sorted({r["experts"] for r in rows if r["original"] == o}):
                            cell = [r for r in rows if r["original"] == o and r["experts"] == k]
                            train += [cell[i] for i in rng.permutation(len(cell))[:m]]
                    for v, features in variants.items():
                        model = fit_shift(train, args.recipe, features)
                        if model is not None:
                            pred = model.predict(design(test, features))
                            errors[v].append(float(np.mean(np.abs(pred - np.array([r["shift_log2"] for r in test])))))
            body.append([n, m, *(f"{np.mean(e):.3f}" if e else "-" for e in errors.values()), len(errors["full"])])
    print(f"{args.family} / {args.recipe}: {len(rows)} rows from {len(originals)} originals; noise floor {noise:.3f} log2")
    print(table(["originals", "plans per K", *(f"held-out MAE, {v}" for v in variants), "folds"], body))


if __name__ == "__main__":
    main()
