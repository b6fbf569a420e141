"""One calibration family's proxies built sliced and with their correction bias settled, paired.

A grid with `proxy_build: settled` (grids/deepseek_v3-e256-settled.yaml) builds every proxy of a
sliced grid again with its kept experts' correction bias settled (`planner build --settle-bias`) and
measures it against the same originals' measurements, so each (original, plan) has both labels.
This prints, per K and per plan rule, the mean router-collapse shift of each build, the mean paired
difference (settled - sliced) with a 90% interval from a bootstrap over the originals (the unit the
labels vary by), and the outcomes; then the same over every plan.

    python benchmarks/settled_family.py --dataset calibration/fidelity_dataset.csv --family deepseek_v3-e256-bal

With `--twin unbalanced` it pairs a family whose originals trained with the shape's published
balancing (`-bal`) with the family of the same seeds trained without, each plan rule and K against
the same rule and K on the same seed's other original (other models, so the pair is the rule's, not
one proxy's): what training the originals as published does to the label.

    python benchmarks/settled_family.py --family glm4_moe-e128-bal --twin unbalanced
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd


def paired(rows: pd.DataFrame, first: str, second: str, labels: tuple[str, str], by_seed: bool = False) -> pd.DataFrame:
    """The rows of both families with a shift, one line per (original, model); `by_seed`: per
    (original's seed, model), the originals named apart by their training mark (the models are
    named by K and plan rule)."""
    from planner.families import how_trained

    keep = ["original", "model", "method", "experts", "shift_log2", "reproduced"]
    a = rows[(rows["family"] == first) & rows["shift_log2"].notna()][keep]
    b = rows[(rows["family"] == second) & rows["shift_log2"].notna()][keep]
    if by_seed:  # the same plan rule and K on the same seed's other original: pair on the name without the mark
        a, b = (f.assign(original=f["original"].map(lambda o: how_trained(o)[0])) for f in (a, b))
    out = a.merge(b, on=["original", "model", "method", "experts"], suffixes=tuple(f"_{label}" for label in labels))
    out["difference"] = out[f"shift_log2_{labels[1]}"] - out[f"shift_log2_{labels[0]}"]
    return out.astype({"experts": int})


def bootstrap(pairs: pd.DataFrame, draws: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """The mean paired difference and its 90% interval, resampling whole originals."""
    by = {o: g["difference"].to_numpy() for o, g in pairs.groupby("original")}
    names = list(by)
    mean = float(pairs["difference"].mean())
    if len(names) < 2:
        return mean, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = [np.concatenate([by[names[i]] for i in rng.integers(0, len(names), len(names))]).mean() for _ in range(draws)]
    low, high = np.quantile(means, [0.05, 0.95])
    return mean, float(low), float(high)


def interval(mean: float, low: float, high: float) -> str:
    return f"{mean:+.2f} [{low:+.2f}, {high:+.2f}]" if np.isfinite(low) else f"{mean:+.2f} (one original: no interval)"


def outcomes(values: pd.Series) -> str:
    """reproduced / not / undetermined counts of a `reproduced` column."""
    return f"{int((values == 1).sum())}/{int((values == 0).sum())}/{int(values.isna().sum())}"


def table(pairs: pd.DataFrame, by: str, labels: tuple[str, str]) -> pd.DataFrame:
    first, second = labels
    out = []
    for key, g in pairs.groupby(by):
        mean, low, high = bootstrap(g)
        out.append({by: key, "pairs": len(g), "originals": g["original"].nunique(), first: g[f"shift_log2_{first}"].mean(),
                    second: g[f"shift_log2_{second}"].mean(), f"{second} - {first}": mean, "90% low": low, "90% high": high,
                    f"outcomes {first}": outcomes(g[f"reproduced_{first}"]), f"outcomes {second}": outcomes(g[f"reproduced_{second}"])})  # fmt: skip
    return pd.DataFrame(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="calibration/fidelity_dataset.csv")
    ap.add_argument("--family", default="deepseek_v3-e256-bal", help="The sliced family (with --twin unbalanced: the balanced one).")
    ap.add_argument("--twin", choices=("settled", "unbalanced"), default="settled",
                    help="settled: FAMILY-settled, the same originals' proxies with their bias settled; "
                         "unbalanced: the family of the same seeds' originals trained without balancing.")  # fmt: skip
    ap.add_argument("--recipe", default="router-collapse")
    args = ap.parse_args(argv)
    from planner.families import built_name, how_trained

    rows = pd.read_csv(args.dataset, low_memory=False)
    rows = rows[rows["recipe"] == args.recipe]
    if args.twin == "settled":
        first, second, labels = args.family, built_name(args.family, "settled"), ("sliced", "settled")
    else:
        base, made = how_trained(args.family)
        if made != "published":
            print(f"--twin unbalanced needs a family trained with published balancing (a name ending -bal), not {args.family}", file=sys.stderr)
            return 2
        first, second, labels = base, args.family, ("unbalanced", "balanced")
    pairs = paired(rows, first, second, labels, by_seed=args.twin == "unbalanced")
    if pairs.empty:
        print(f"no plan has a shift in both {first} and {second} in {args.dataset}", file=sys.stderr)
        return 2
    pd.set_option("display.width", 200)
    fmt = {c: "{:+.2f}".format for c in (*labels, f"{labels[1]} - {labels[0]}", "90% low", "90% high")}
    unit = "seeds" if args.twin == "unbalanced" else "originals"
    print(f"{args.recipe}: {second} against {first}, {len(pairs)} paired plans of {pairs['original'].nunique()} {unit} "
          f"(shift log2; outcomes reproduced/not/undetermined; 90% interval over {unit})")  # fmt: skip
    for by in ("experts", "method"):
        print()
        print(table(pairs, by, labels).to_string(index=False, formatters=fmt))
    from planner.plan import CONTROL_METHODS

    plans = pairs[~pairs["method"].isin(CONTROL_METHODS)]  # the negative controls are no plans
    mean, low, high = bootstrap(plans)
    clustered = plans[plans["method"].isin(["agglomerative", "kmeans", "saliency"])]
    c_mean, c_low, c_high = bootstrap(clustered)
    a, b = labels
    print(f"\nevery plan (no controls): {b} - {a} {interval(mean, low, high)} log2 over {len(plans)} plans; "
          f"clustered and saliency plans {interval(c_mean, c_low, c_high)} over {len(clustered)}; "
          f"outcomes {a} {outcomes(plans[f'reproduced_{a}'])}, {b} {outcomes(plans[f'reproduced_{b}'])}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
