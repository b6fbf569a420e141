"""The calibration dataset: one row per (proxy, recipe), features and labels, as CSV.

Columns (documented in calibration/README.md): identifiers (family, model, method, recipe, experts,
original_experts), the estimator's features (planner.fidelity.estimator), and the labels with what
they came from: critical knobs and spreads, curve agreement and its Spearman, onsets, and whether
the fault was reproduced. A JSON file beside it keeps the provenance: the grid, the commands,
versions and seeds.
"""

from __future__ import annotations

import csv
import json
import math
import platform
from pathlib import Path
from typing import Any

from planner.arch import Architecture
from planner.fidelity.estimator import FULL_FEATURES
from planner.fidelity.labels import curve_agreement, fault_reproduced, knob_scale, margin_ratio, spearman
from planner.files import write_csv_atomic, write_text_atomic

__all__ = ["ID_COLUMNS", "LABEL_COLUMNS", "architecture_features", "pair_row", "write_dataset", "read_dataset"]

ID_COLUMNS = ("family", "model", "method", "recipe", "experts", "original_experts", "source")
LABEL_COLUMNS = (
    "margin_ratio", "margin_noise", "critical_original", "critical_proxy", "censored",
    "curve_agreement", "spearman_grad_norm", "onset_original", "onset_proxy", "fault_reproduced",
)  # fmt: skip


def architecture_features(config: dict, experts: int) -> dict[str, float]:
    arch = Architecture.from_config(config)
    moe = arch.moe
    return {
        "kept_fraction": experts / arch.original_num_experts,
        "top_k_over_k": moe.top_k / experts,
        "experts_per_group": experts / moe.n_group,
        "log2_experts": math.log2(arch.original_num_experts),
        "sigmoid_router": float(moe.scoring in ("sigmoid", "sigmoid_topk")),
        "grouped": float(moe.grouped),
        "norm_topk": float(moe.norm_topk_prob),
    }


def pair_row(recipe: str, kind: str, original: dict, proxy: dict, *, knob_offset: float) -> dict[str, Any]:
    """Labels of one proxy under one recipe against the original's measurements.

    Each side holds what was measured: "margin" (planner.rl.margin.Margin.to_json), "curve" rows
    and "curve_onset"; the original also "replica" rows. A label whose inputs are missing is NaN;
    `censored` flags a margin where some seed's bisection found no crossing in the bracket."""
    nan = float("nan")
    row: dict[str, Any] = {name: nan for name in LABEL_COLUMNS}
    if original.get("margin") and proxy.get("margin"):
        co, cp = original["margin"]["mean"], proxy["margin"]["mean"]
        original_censored = any(original["margin"]["censored"])
        row.update(margin_ratio=margin_ratio(recipe, cp, co), margin_noise=original["margin"]["spread"] * knob_scale(recipe),
                   critical_original=co, critical_proxy=cp,
                   censored=int(original_censored or any(proxy["margin"]["censored"])))  # fmt: skip
        if kind == "static" and not original_censored:  # monotone probes: faults at co + offset iff cp <= co + offset
            row["fault_reproduced"] = fault_reproduced(cp <= co + knob_offset, True)
    if kind == "dynamic" and "curve" in proxy and "curve" in original:
        if "replica" in original:
            row["curve_agreement"] = curve_agreement(proxy["curve"], original["curve"], original["replica"])
        row["spearman_grad_norm"] = spearman(proxy["curve"], original["curve"])
        row["onset_original"] = original.get("curve_onset")
        row["onset_proxy"] = proxy.get("curve_onset")
        row["fault_reproduced"] = fault_reproduced(proxy.get("curve_onset") is not None, original.get("curve_onset") is not None)
    return {k: (nan if v is None else v) for k, v in row.items()}


def write_dataset(rows: list[dict], path: Path, provenance: dict) -> None:
    columns = list(ID_COLUMNS) + list(FULL_FEATURES) + list(LABEL_COLUMNS)
    extra = sorted({k for r in rows for k in r} - set(columns))
    blank = lambda v: "" if v is None or (isinstance(v, float) and math.isnan(v)) else v  # noqa: E731
    write_csv_atomic(path, columns + extra, ({k: blank(v) for k, v in r.items()} for r in rows))
    versions = {"python": platform.python_version(), **{p: _version(p) for p in ("torch", "transformers", "numpy", "scikit-learn", "optuna")}}
    write_text_atomic(path.with_suffix(".json"), json.dumps({"rows": len(rows), "columns": columns + extra, "versions": versions, **provenance}, indent=2))


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def read_dataset(path: Path) -> list[dict]:
    rows = []
    with open(path) as fh:
        for raw in csv.DictReader(fh):
            row: dict[str, Any] = {}
            for k, v in raw.items():
                if k in ("family", "model", "method", "recipe", "source"):
                    row[k] = v
                else:
                    try:
                        row[k] = float(v) if v != "" else float("nan")
                    except ValueError:
                        row[k] = v
            rows.append(row)
    return rows
