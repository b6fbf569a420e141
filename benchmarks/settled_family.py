"""One calibration family's proxies built sliced and with their correction bias settled, paired.

A grid with `proxy_build: settled` (grids/deepseek_v3-e256-settled.yaml) builds every proxy of a
sliced grid again with its kept experts' correction bias settled (`planner build --settle-bias`) and
measures it against the same originals' measurements, so each (original, plan) has both labels.
This prints, per K and per plan rule, the mean router-collapse shift of each build, the mean paired
difference (settled - sliced) with a 90% interval from a bootstrap over the originals (the unit the
labels vary by), and the outcomes; then the same over every plan.

    python benchmarks/settled_family.py --dataset calibration/fidelity_dataset.csv --family deepseek_v3-e256-bal
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd


def paired(rows: pd.DataFrame, family: str, settled: str) -> pd.DataFrame:
    """The rows of both builds with a shift, one line per (original, model)."""
    keep = ["original", "model", "method", "experts", "shift_log2", "reproduced"]
    a = rows[(rows["family"] == family) & rows["shift_log2"].notna()][keep]
    b = rows[(rows["family"] == settled) & rows["shift_log2"].notna()][keep]
    out = a.merge(b, on=["original", "model", "method", "experts"], suffixes=("_sliced", "_settled"))
    return out.astype({"experts": int})


def bootstrap(pairs: pd.DataFrame, draws: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """The mean paired difference and its 90% interval, resampling whole originals."""
    by = {o: g["settled_minus_sliced"].to_numpy() for o, g in pairs.groupby("original")}
    names = list(by)
    mean = float(pairs["settled_minus_sliced"].mean())
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


def table(pairs: pd.DataFrame, by: str) -> pd.DataFrame:
    out = []
    for key, g in pairs.groupby(by):
        mean, low, high = bootstrap(g)
        out.append({by: key, "pairs": len(g), "originals": g["original"].nunique(), "sliced": g["shift_log2_sliced"].mean(),
                    "settled": g["shift_log2_settled"].mean(), "settled - sliced": mean, "90% low": low, "90% high": high,
                    "outcomes sliced": outcomes(g["reproduced_sliced"]), "outcomes settled": outcomes(g["reproduced_settled"])})  # fmt: skip
    return pd.DataFrame(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="calibration/fidelity_dataset.csv")
    ap.add_argument("--family", default="deepseek_v3-e256-bal", help="The sliced family; its settled twin is FAMILY-settled.")
    ap.add_argument("--recipe", default="router-collapse")
    args = ap.parse_args(argv)
    from planner.families import built_name

    rows = pd.read_csv(args.dataset, low_memory=False)
    rows = rows[rows["recipe"] == args.recipe]
    settled = built_name(args.family, "settled")
    pairs = paired(rows, args.family, settled)
    if pairs.empty:
        print(f"no (original, plan) has a shift in both {args.family} and {settled} in {args.dataset}", file=sys.stderr)
        return 2
    pairs["settled_minus_sliced"] = pairs["shift_log2_settled"] - pairs["shift_log2_sliced"]
    pd.set_option("display.width", 200)
    fmt = {c: "{:+.2f}".format for c in ("sliced", "settled", "settled - sliced", "90% low", "90% high")}
    print(f"{args.recipe}: {settled} against {args.family}, {len(pairs)} paired plans of {pairs['original'].nunique()} originals "
          "(shift log2; outcomes reproduced/not/undetermined; 90% interval over originals)")  # fmt: skip
    for by in ("experts", "method"):
        print()
        print(table(pairs, by).to_string(index=False, formatters=fmt))
    from planner.plan import CONTROL_METHODS

    plans = pairs[~pairs["method"].isin(CONTROL_METHODS)]  # the negative controls are no plans
    mean, low, high = bootstrap(plans)
    clustered = plans[plans["method"].isin(["agglomerative", "kmeans", "saliency"])]
    c_mean, c_low, c_high = bootstrap(clustered)
    print(f"\nevery plan (no controls): settled - sliced {interval(mean, low, high)} log2 over {len(plans)} plans; "
          f"clustered and saliency plans {interval(c_mean, c_low, c_high)} over {len(clustered)}; "
          f"outcomes sliced {outcomes(plans['reproduced_sliced'])}, settled {outcomes(plans['reproduced_settled'])}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
