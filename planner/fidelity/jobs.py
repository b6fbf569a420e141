"""The reproduction job's dimensions in the calibration data: which of them a smaller job may shrink.

A job grid (planner.fidelity.grid: a grid with `jobs`) measures its models at the production job and
at smaller ones; its rows carry `job_grid` and the job's shares (planner.fidelity.dataset). From them,
per recipe: the extra shift of each smaller-job row against the same model at its own grid's
production job (`_job_rows`); per family and dimension, the shares down to which the label is kept
(`_job_support`) and the shift a job adds (`job_offset`); the factor a smaller job puts on the
fault's onset step (`_job_onsets`, `job_onset`); the jobs measured shrunk in several dimensions
against the summed single-dimension shifts (`_job_joint`); and what a family that no job grid
measured may borrow from those that were (`_job_transfer`). planner.fidelity.estimator fits and
applies them, planner.fidelity.job_validate scores them on held-out originals; this module imports
neither.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from planner.errors import SpecError
from planner.fidelity.model import _finite

__all__ = ["JOB_DIMENSIONS", "JOB_TOLERANCE_LOG2", "job_offset", "job_onset"]

# the job dimensions a reproduction may shrink, in words (their dataset columns: planner.fidelity.dataset.JOB_COLUMNS)
JOB_DIMENSIONS = {"prompts": "prompts per step", "samples": "samples per prompt", "length": "response length cap"}
JOB_TOLERANCE_LOG2 = 0.5  # a smaller job keeps a label when it moves it by less than half the reproduction tolerance


def _over_originals(per: Mapping[str, list[float]]) -> tuple[int, float, float]:
    """Values grouped by original: how many originals, the mean of their means and its 90%
    t-interval's half-width (infinite below 2 originals)."""
    from scipy import stats

    means = np.array([np.mean(v) for v in per.values()])
    n = len(means)
    mean = float(means.mean()) if n else float("nan")
    half = float(stats.t.ppf(0.95, n - 1) * means.std(ddof=1) / np.sqrt(n)) if n >= 2 else float("inf")
    return n, mean, half


def _job_rows(rows: list[dict], recipe: str) -> tuple[list[dict], Callable[[dict], float | None]]:
    """A recipe's job grid rows (negative controls and censored rows aside) and the extra shift of
    one of them against the same model at the production job of the same job grid (the original's
    own row: against 0; None where that grid did not measure the model at the production job)."""
    from planner.fidelity.dataset import JOB_COLUMNS, JOB_GRID, job_share
    from planner.plan import CONTROL_METHODS

    mine = [r for r in rows if r.get(JOB_GRID) and r.get("recipe") == recipe and r.get("method") not in CONTROL_METHODS
            and _finite(r.get("shift_log2")) and not (_finite(r.get("censored")) and r["censored"])]  # fmt: skip
    at_production = {(r[JOB_GRID], str(r["original"]), str(r["model"])): float(r["shift_log2"]) for r in mine
                     if all(job_share(r, c) == 1.0 for c in JOB_COLUMNS.values())}  # fmt: skip

    def extra(r: dict) -> float | None:
        base = 0.0 if r["model"] == "original" else at_production.get((r[JOB_GRID], str(r["original"]), str(r["model"])))
        return None if base is None else float(r["shift_log2"]) - base

    return mine, extra


def _job_support(rows: list[dict], recipe: str) -> dict[str, dict[str, dict]]:
    """Per family and job dimension: does a smaller job keep the production job's label? At each
    share of the dimension measured (the other dimensions at production), the extra shift of every
    row against the same model at the production job (the original's own row: against 0), averaged
    per original; the dimension is supported down to the smallest share at which that and every
    larger share keep the mean extra shift's 90% interval over originals (2 or more) within
    +-JOB_TOLERANCE_LOG2. Negative controls and censored rows aside."""
    from planner.fidelity.dataset import JOB_COLUMNS

    mine, extra = _job_rows(rows, recipe)
    out: dict[str, dict[str, dict]] = {}
    for family in sorted({str(r["family"]) for r in rows if r.get("recipe") == recipe}):
        out[family] = {}
        for dim, column in JOB_COLUMNS.items():
            others = [c for c in JOB_COLUMNS.values() if c != column]
            at = [r for r in mine if str(r["family"]) == family and _finite(r.get(column)) and float(r[column]) < 1
                  and all(not _finite(r.get(o)) or float(r[o]) == 1.0 for o in others)]  # fmt: skip
            levels = []
            for share in sorted({float(r[column]) for r in at}, reverse=True):
                per: dict[str, list[float]] = {}
                for r in (r for r in at if float(r[column]) == share):
                    if (delta := extra(r)) is not None:
                        per.setdefault(str(r["original"]), []).append(delta)
                n, mean, half = _over_originals(per)
                levels.append({"share": share, "rows": sum(len(v) for v in per.values()), "originals": n, "delta_mean": mean,
                               "delta_interval": [mean - half, mean + half],
                               "ok": bool(n >= 2 and -JOB_TOLERANCE_LOG2 < mean - half and mean + half < JOB_TOLERANCE_LOG2)})  # fmt: skip
            kept = []
            for level in levels:  # from the largest share down: supported while every level so far keeps the label
                if not level["ok"]:
                    break
                kept.append(level)
            entry = {"ok": bool(kept), "rows": len(at), "levels": levels}
            if kept:
                entry["min_share"] = kept[-1]["share"]
            elif levels:
                bad = levels[0]
                lo, hi = bad["delta_interval"]
                entry["reason"] = (f"at {bad['share']:g} of the production value the label moves by {bad['delta_mean']:+.2f} log2 [{lo:+.2f}, "
                                   f"{hi:+.2f}] over {bad['originals']} originals: not within +-{JOB_TOLERANCE_LOG2}")  # fmt: skip
            out[family][dim] = entry
    return out


def _level_at(levels: list[Mapping], share: float) -> Mapping | None:
    """The measured level nearest at or below `share` (more shrinkage is the safer bound); None if
    every level is above it."""
    below = [lv for lv in levels if lv["share"] <= share + 1e-12]
    return max(below, key=lambda lv: lv["share"]) if below else None


def job_offset(support: Mapping[str, Mapping], row: Mapping[str, Any], *, every_level: bool = False) -> tuple[float, float]:
    """The measured extra shift of `row`'s job and the half-width it adds to the interval: per
    supported dimension, the nearest measured share at or below the row's (more shrinkage is the
    safer bound), its mean extra shift, and the larger distance from that mean to its interval's ends.
    With `every_level`, every measured level counts, supported or not (the job term as measured, for
    its held-out validation)."""
    from planner.fidelity.dataset import JOB_COLUMNS

    offset = width = 0.0
    for dim, column in JOB_COLUMNS.items():
        share = row.get(column)
        entry = support.get(dim) or {}
        if not _finite(share) or float(share) >= 1.0 or not (entry.get("ok") or (every_level and entry.get("levels"))):
            continue
        ok = ([lv for lv in entry["levels"] if lv["originals"] >= 2] if every_level else
              [lv for lv in entry["levels"] if lv["ok"] and lv["share"] >= entry["min_share"] - 1e-12])  # the kept levels only
        if not ok:
            continue
        level = _level_at(ok, float(share)) or min(ok, key=lambda lv: lv["share"])
        lo, hi = level["delta_interval"]
        offset += level["delta_mean"]
        width += max(level["delta_mean"] - lo, hi - level["delta_mean"])
    return offset, width


def _job_onsets(rows: list[dict], recipe: str) -> dict[str, dict[str, list[dict]]]:
    """Per family and job dimension, at each share measured with that dimension alone shrunk: the
    job's effect on the fault's onset, as the onset step of a model's curve at the smaller job over
    the same model's at its job grid's production job (the original's own row: over its curve at the
    production job), median and 10-90% range over models and originals; a curve at the smaller job
    that showed no fault counts as never (the range is then open). Rows whose production-job curve
    showed no fault have no ratio. Negative controls aside."""
    from planner.fidelity.dataset import JOB_COLUMNS, JOB_GRID, job_share
    from planner.plan import CONTROL_METHODS

    used = [r for r in rows if r.get(JOB_GRID) and r.get("recipe") == recipe and r.get("method") not in CONTROL_METHODS
            and _finite(r.get("onset_original")) and float(r["onset_original"]) > 0]  # fmt: skip
    production = {(r[JOB_GRID], str(r["original"]), str(r["model"])): r.get("onset_proxy") for r in used
                  if all(job_share(r, c) == 1.0 for c in JOB_COLUMNS.values())}  # fmt: skip

    def ratio(r: dict) -> float | None:
        base = r["onset_original"] if r["model"] == "original" else production.get((r[JOB_GRID], str(r["original"]), str(r["model"])))
        if not _finite(base) or float(base) <= 0:
            return None
        return float(r["onset_proxy"]) / float(base) if _finite(r.get("onset_proxy")) else float("inf")

    out: dict[str, dict[str, list[dict]]] = {}
    for dim, column in JOB_COLUMNS.items():
        alone = [r for r in used if job_share(r, column) < 1.0 and all(job_share(r, c) == 1.0 for c in JOB_COLUMNS.values() if c != column)]
        for family, share in sorted({(str(r["family"]), job_share(r, column)) for r in alone}, key=lambda fs: (fs[0], -fs[1])):
            ratios = np.array([v for r in alone if str(r["family"]) == family and job_share(r, column) == share if (v := ratio(r)) is not None])
            if not len(ratios):
                continue
            low, median, high = (float(v) for v in np.quantile(ratios, [0.1, 0.5, 0.9], method="inverted_cdf"))
            out.setdefault(family, {}).setdefault(dim, []).append({"share": share, "rows": len(ratios), "never": int(np.isinf(ratios).sum()),
                                                                  "low": low, "median": median, "high": high})  # fmt: skip
    return out


def job_onset(measured: Mapping[str, list[dict]], row: Mapping[str, Any]) -> dict[str, Any] | None:
    """The onset factor of `row`'s job from a family's `_job_onsets`: None at the production job;
    per shrunk dimension the level measured at the nearest share at or below the row's (more
    shrinkage: the safer bound), several dimensions combined as the product of their factors (each
    measured alone); {ok: False, reason} where a shrunk dimension has no measured onset."""
    from planner.fidelity.dataset import JOB_COLUMNS, job_share

    shrunk = {dim: share for dim, column in JOB_COLUMNS.items() if (share := job_share(dict(row), column)) < 1.0}
    if not shrunk:
        return None
    parts, words = [], []
    for dim, share in shrunk.items():
        if (level := _level_at(measured.get(dim) or [], share)) is None:
            return {"ok": False, "reason": f"no calibration curve measured the onset at {share:g} of the production {JOB_DIMENSIONS[dim]} or below"}
        parts.append(level)
        words.append(f"{JOB_DIMENSIONS[dim]} x{level['share']:g} ({level['rows']} curves)")
    low, median, high = (float(np.prod([lv[k] for lv in parts])) for k in ("low", "median", "high"))
    text = ", ".join(words) + (": each dimension measured alone, their factors multiplied" if len(parts) > 1 else "")
    return {"ok": True, "low": low, "median": median, "high": high, "rows": sum(lv["rows"] for lv in parts), "job": text}


def _job_joint(rows: list[dict], recipe: str, support: Mapping[str, Mapping[str, dict]]) -> dict[str, list[dict]]:
    """Per family: at each job measured with two or more dimensions shrunk together, the extra shift
    against the same model at the production job (mean over originals, 90% interval) beside the sum
    of the single-dimension extra shifts `job_offset` adds for that job, and their difference; `ok`
    when the difference's interval lies within +-JOB_TOLERANCE_LOG2 (the sum then stands for the
    joint job). Negative controls and censored rows aside."""
    from planner.fidelity.dataset import JOB_COLUMNS

    mine, extra = _job_rows(rows, recipe)

    def shares(r) -> tuple[float, ...]:
        return tuple(float(r[c]) if _finite(r.get(c)) else 1.0 for c in JOB_COLUMNS.values())

    out: dict[str, list[dict]] = {}
    for family in sorted({str(r["family"]) for r in mine}):
        joint = [r for r in mine if str(r["family"]) == family and sum(v < 1.0 for v in shares(r)) >= 2]
        for key in sorted({shares(r) for r in joint}, reverse=True):
            delta: dict[str, list[float]] = {}
            diff: dict[str, list[float]] = {}
            summed = job_offset(support.get(family) or {}, dict(zip(JOB_COLUMNS.values(), key)))[0]
            for r in (r for r in joint if shares(r) == key):
                if (d := extra(r)) is not None:
                    delta.setdefault(str(r["original"]), []).append(d)
                    diff.setdefault(str(r["original"]), []).append(d - summed)
            n, mean, half = _over_originals(delta)
            _, dmean, dhalf = _over_originals(diff)
            out.setdefault(family, []).append({
                "shares": dict(zip(JOB_COLUMNS, key)), "rows": sum(len(v) for v in delta.values()), "originals": n, "delta_mean": mean,
                "delta_interval": [mean - half, mean + half], "summed": summed, "difference_mean": dmean,
                "difference_interval": [dmean - dhalf, dmean + dhalf],
                "ok": bool(n >= 2 and -JOB_TOLERANCE_LOG2 < dmean - dhalf and dmean + dhalf < JOB_TOLERANCE_LOG2)})  # fmt: skip
    return out


def _job_transfer(rows: list[dict], recipe: str, support: Mapping[str, Mapping[str, dict]],
                  joint: Mapping[str, list[dict]]) -> dict[str, Any]:  # fmt: skip
    """The job support a family that no job grid measured may borrow: a dimension every measured
    family supports (2 or more families), down to the largest of their smallest supported shares, at
    each share they all kept the mean of their extra shifts with the hull of their intervals; their
    joint checks; and the transfer validated one family out: each measured family's job rows'
    extra shifts predicted by the others' measured levels (MAE against predicting no term)."""
    from planner.fidelity.dataset import JOB_COLUMNS

    measured = sorted(f for f, dims in support.items() if any(e.get("rows") for e in dims.values()))
    out: dict[str, Any] = {"families": measured, "mixers": sorted({_token_mixer(f) or "unknown" for f in measured}), "dims": {}, "joint": [],
                           "held_out": {}}  # fmt: skip
    if len(measured) < 2:
        return out
    for dim in JOB_DIMENSIONS:
        entries = [support[f][dim] for f in measured]
        if not all(e.get("ok") for e in entries):
            bad = [f for f, e in zip(measured, entries) if not e.get("ok")]
            out["dims"][dim] = {"ok": False, "rows": 0, "reason": f"not kept on {', '.join(bad)}"}
            continue
        floor = max(e["min_share"] for e in entries)
        levels = []
        for share in sorted({lv["share"] for lv in entries[0]["levels"]}, reverse=True):
            at = [next((lv for lv in e["levels"] if lv["share"] == share and lv["ok"]), None) for e in entries]
            if share < floor - 1e-12 or any(lv is None for lv in at):
                continue
            levels.append({"share": share, "rows": sum(lv["rows"] for lv in at), "originals": sum(lv["originals"] for lv in at),
                           "delta_mean": float(np.mean([lv["delta_mean"] for lv in at])),
                           "delta_interval": [min(lv["delta_interval"][0] for lv in at), max(lv["delta_interval"][1] for lv in at)],
                           "ok": True})  # fmt: skip
        if levels:
            out["dims"][dim] = {"ok": True, "min_share": levels[-1]["share"], "rows": sum(e["rows"] for e in entries), "levels": levels,
                                "families": measured}  # fmt: skip
    out["joint"] = [{**level, "family": f} for f in measured for level in joint.get(f, [])]
    mine, extra = _job_rows(rows, recipe)
    for family in measured:
        others = {f: support[f] for f in measured if f != family}
        pairs = []
        for r in (r for r in mine if str(r["family"]) == family and any(_finite(r.get(c)) and float(r[c]) < 1 for c in JOB_COLUMNS.values())):
            if (delta := extra(r)) is not None:
                predicted = np.mean([job_offset(s, r, every_level=True)[0] for s in others.values()])
                pairs.append((delta, float(predicted)))
        if pairs:
            d, p_ = np.array(pairs).T
            out["held_out"][family] = {"rows": len(pairs), "mae": float(np.mean(np.abs(d - p_))), "mae_zero": float(np.mean(np.abs(d))),
                                       "from": sorted(others)}  # fmt: skip
    return out


def _token_mixer(family: str) -> str | None:
    """A calibration family's token mixer: "attention", or the linear mixer of a hybrid backbone
    (gdn, mamba2); None for a family the catalog does not define (pairs added by hand)."""
    from planner.families import family_architecture, how_trained

    try:
        arch = family_architecture(how_trained(family)[0])
    except SpecError:
        return None
    return arch.linear.kind if arch.is_hybrid else "attention"
