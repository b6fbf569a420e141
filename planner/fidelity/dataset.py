"""The calibration dataset: one row per (proxy, recipe), features and labels, as CSV.

Columns (documented in calibration/README.md): identifiers (family, the original it was made from,
model, method, recipe, experts, original_experts, top_k), the estimator's features
(planner.fidelity.estimator), and the labels with what they came from: the signed shift of the
critical knob with its noise and equivalence outcome (planner.fidelity.labels), the per-seed means,
curve agreement and its Spearman, onsets. A JSON file beside it keeps the provenance: the grid,
the commands, versions, seeds and the noise floor of every (original, recipe).
"""

from __future__ import annotations

import csv
import json
import math
import platform
from pathlib import Path
from typing import Any

from planner.arch import Architecture
from planner.fidelity.model import FULL_FEATURES, _finite, features_of
from planner.fidelity.labels import applicable, curve_agreement, knob_scale, knob_shift, spearman
from planner.files import write_csv_atomic, write_text_atomic

__all__ = ["ID_COLUMNS", "LABEL_COLUMNS", "TEXT_COLUMNS", "JOB_COLUMNS", "JOB_GRID", "job_columns", "job_key", "job_share", "production_rows", "architecture_features", "shape_key", "plan_row",
           "pair_row", "write_dataset", "read_dataset"]  # fmt: skip

ID_COLUMNS = ("family", "routing_shape", "original", "model", "method", "recipe", "experts", "original_experts", "top_k", "source")
LABEL_COLUMNS = (
    "shift_log2", "shift_sd", "noise_log2", "shift_se", "shift_low", "shift_high", "outcome", "reproduced", "censored",
    "critical_original", "critical_proxy", "resolution_log2", "curve_agreement", "spearman_grad_norm", "onset_original",
    "onset_proxy", "run_reproduced",
)  # fmt: skip
TEXT_COLUMNS = ("family", "routing_shape", "original", "model", "method", "recipe", "source", "outcome", "job_grid")
# a grid with smaller reproduction jobs: the job's share of the production job per dimension (absent: production)
JOB_COLUMNS = {"prompts": "job_prompts_share", "samples": "job_samples_share", "length": "job_length_share"}
# which job grid measured a row (its key): a job grid builds its originals and proxies in its own work
# directory, so its rows are labelled against its own models and compared with its own production job
JOB_GRID = "job_grid"


def job_columns(prompts: float = 1.0, samples: float = 1.0, length: float = 1.0) -> dict[str, float]:
    """A job's shares of the production job (prompts per step, samples per prompt, response cap) as
    the dataset's job columns."""
    return {JOB_COLUMNS["prompts"]: prompts, JOB_COLUMNS["samples"]: samples, JOB_COLUMNS["length"]: length}


def job_share(row: dict, column: str) -> float:
    """A row's share of the production job in one job column (absent: 1, the production job)."""
    value = row.get(column)
    return float(value) if _finite(value) else 1.0


def production_rows(rows: list[dict]) -> list[dict]:
    """The rows of the family grids (and pairs added with `calibrate add`): the plan models are
    fitted and validated on these. A job grid's rows, its own production job among them, are the job
    dimensions' data: its models are other weights of the same names."""
    return [r for r in rows if not r.get(JOB_GRID)]


def job_key(row: dict) -> tuple:
    """A job grid row's identity: its grid, original, model, recipe and job shares."""
    return (row.get(JOB_GRID) or "", str(row["original"]), str(row["model"]), row["recipe"], *(job_share(row, c) for c in JOB_COLUMNS.values()))


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


def shape_key(config: dict) -> str:
    """The routing shape (planner.arch.routing) of a config.json, as the dataset names it."""
    from planner.arch.routing import routing_shape

    return routing_shape(Architecture.from_config(config)).key()


def plan_row(config: dict, experts: int, statistics: dict | None, build: str = "sliced") -> dict[str, Any]:
    """What the estimator predicts from for one plan: its features (planner.stats summary, when there
    is one, and the architecture at K) and what its status needs (K, top_k, E, the routing shape, how
    the proxy is built: planner.plan.PROXY_BUILDS)."""
    arch = Architecture.from_config(config)
    row = features_of(statistics or {}, architecture_features(config, experts))
    return {**row, "experts": experts, "top_k": arch.moe.top_k, "original_experts": arch.original_num_experts,
            "routing_shape": shape_key(config), "hidden_size": arch.hidden_size, "num_layers": arch.num_layers, "proxy_build": build}  # fmt: skip


def pair_row(recipe: str, original: dict, proxy: dict, *, experts: int, top_k: int) -> dict[str, Any]:
    """Labels of one proxy under one recipe against its original's measurements.

    Each side holds what was measured: "margin" (planner.rl.margin.Margin.to_json plus its
    "resolution" in knob units), "curve" rows and "curve_onset"; the original also "replicas" (a
    list of curve runs). A label whose inputs are missing is NaN. Where the fault cannot occur at
    this K the outcome is "not applicable" and nothing else is labelled."""
    nan = float("nan")
    row: dict[str, Any] = {name: nan for name in LABEL_COLUMNS}
    if not applicable(recipe, experts, top_k):
        row["outcome"] = "not applicable"
        return row
    om, pm = original.get("margin"), proxy.get("margin")
    if om and pm:
        resolution = max(om.get("resolution", 0.0), pm.get("resolution", 0.0))
        shift = knob_shift(recipe, om["values"], pm["values"], original_censored=om["censored"], proxy_censored=pm["censored"],
                           resolution=resolution)  # fmt: skip
        row.update(shift.to_row(), critical_original=om["mean"], critical_proxy=pm["mean"], resolution_log2=resolution * knob_scale(recipe))
    if "curve" in proxy and "curve" in original:  # runs of the recipe (the grid's dynamic curves, a user's trainer runs)
        if original.get("replicas"):
            row["curve_agreement"] = curve_agreement(proxy["curve"], original["curve"], original["replicas"])
        row["spearman_grad_norm"] = spearman(proxy["curve"], original["curve"])
        row["onset_original"] = original.get("curve_onset")
        row["onset_proxy"] = proxy.get("curve_onset")
        if original.get("curve_onset") is not None:  # the original's run shows the fault: does the proxy's?
            row["run_reproduced"] = float(proxy.get("curve_onset") is not None)
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
    """The rows of a calibration dataset CSV; a file that is not one (another CSV, a row cut short,
    not text) is a SpecError naming the problem, before anything is merged into it or fitted."""
    from planner.errors import SpecError

    try:
        with open(path, encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in ID_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise SpecError(f"{path}: not a calibration dataset (no {', '.join(missing)} column{'s' if len(missing) > 1 else ''}; "
                                "see calibration/README.md, 'Dataset schema')")  # fmt: skip
            raws = list(reader)
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not a calibration dataset (not UTF-8 text at byte {exc.start})") from None
    rows = []
    for line, raw in enumerate(raws, start=2):
        if None in raw or None in raw.values():
            fields = sum(v is not None for k, v in raw.items() if k is not None) + len(raw.get(None) or [])
            raise SpecError(f"{path}: row {line} has {fields} fields where the header has {len(reader.fieldnames)} (cut short, or a stray comma?)")
        row: dict[str, Any] = {}
        for k, v in raw.items():
            if k in TEXT_COLUMNS:
                row[k] = v
            else:
                try:  # an integer stays one, so rows kept by a merge are written back as they were read
                    row[k] = float("nan") if v == "" else int(v) if v.lstrip("-").isdigit() else float(v)
                except ValueError:
                    row[k] = v
        rows.append(row)
    return rows
