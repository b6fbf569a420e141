"""A run's step metrics from whatever the trainer wrote, mapped to canonical names.

Formats (a file, or a directory holding one of them):

    metrics.csv (+ run.json)   `planner rl run` / `rl margin -o` / `planner check`
    events.out.tfevents.*      TensorBoard event files (verl, MindSpeed-RL, NeMo RL), read with the
                               tensorboard package's own EventAccumulator
    *.jsonl                    verl's file logger ({"step": N, "data": {...}} per line), or flat
                               records with a step key (wandb's history stream: _step)
    *.csv                      a wandb history export (run.history().to_csv(): _step, keys...) or
                               any table with a step column; a W&B chart's "Export panel data" CSV
                               (Step, "<run> - <key>", its __MIN/__MAX), or a folder of them (one per
                               chart), merged on the step
    *.log, *.txt, *.out        console logs: verl's `step:N - key:value - ...` lines and
                               MindSpeed-RL's `iteration: N / M | key : value | ...` lines

Which trainer wrote it is told by its metric names; planner/runs/metrics.yaml maps each trainer's
names to the canonical ones (data, not code). NeMo RL prints a summary block to its console, not
metrics lines: read its TensorBoard directory (log_dir/tensorboard) or a wandb export instead.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from planner.errors import SpecError

__all__ = ["Run", "read_run", "mapping", "TEXT_SUFFIXES"]

TEXT_SUFFIXES = (".log", ".txt", ".out", ".err")
_VERL = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
_MINDSPEED = re.compile(r"iteration:\s*(\d+)\s*/\s*\d+\s*\|(.*)$")
_NUMBER = re.compile(r"^(?:np\.\w+\()?\s*([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf|infinity))\s*\)?$", re.I)


@lru_cache(maxsize=1)
def mapping() -> dict[str, Any]:
    return yaml.safe_load((Path(__file__).with_name("metrics.yaml")).read_text())


@dataclass
class Run:
    path: Path
    kind: str  # planner | tensorboard | jsonl | csv | verl-console | mindspeed-console
    trainer: str  # planner | verl | mindspeed-rl | nemo-rl
    metrics: Any  # pandas.DataFrame: canonical metric columns, index "step"
    sources: dict[str, str]  # canonical metric -> the key it was read from
    logged_nonfinite: dict[str, np.ndarray] = field(default_factory=dict)  # canonical -> rows logged as NaN/inf
    info: dict = field(default_factory=dict)  # run.json where there is one
    notes: list[str] = field(default_factory=list)  # what the reader dropped or read as NaN, and why

    @property
    def steps(self) -> np.ndarray:
        return self.metrics.index.to_numpy(dtype=int)

    def signals(self) -> dict[str, np.ndarray]:
        """Canonical metric -> values (the detectors' input), with which values were logged non-finite."""
        out = {c: self.metrics[c].to_numpy(dtype=float) for c in self.metrics.columns}
        out.update({f"{c}:logged_nonfinite": v for c, v in self.logged_nonfinite.items()})
        return out

    def rows(self) -> list[dict]:
        """One dict per step with "step" and the canonical metrics (the harness's metrics.csv rows);
        a metric the step did not log is left out of its dict, and NAME:logged_nonfinite says which
        NaN/inf values were logged, so a detector reading the rows (planner.runs.detect.signals_of)
        sees what it sees in the run."""
        frame = self.metrics.reset_index()
        out = []
        for i, rec in enumerate(frame.to_dict("records")):
            row = {k: float(v) for k, v in rec.items() if k == "step" or math.isfinite(v) or self._logged(k, i)}
            row.update({f"{c}:logged_nonfinite": bool(v[i]) for c, v in self.logged_nonfinite.items()})
            out.append(row)
        return out

    def _logged(self, canonical: str, i: int) -> bool:
        v = self.logged_nonfinite.get(canonical)
        return v is not None and bool(v[i])

    def ideal(self) -> dict[str, float]:
        return {k: float(v["ideal"]) for k, v in mapping()["metrics"].items() if "ideal" in v}


def _number(text: str) -> float | None:
    m = _NUMBER.match(text.strip())
    return float(m.group(1)) if m else None


_CONSOLES = (("verl-console", _VERL, " - "), ("mindspeed-console", _MINDSPEED, "|"))  # line pattern, item separator


def _console(lines: list[str], path: Path, notes: list[str], cut: bool = False) -> tuple[str, list[dict]]:
    """Console records; `cut`: the file does not end with a newline (a run killed mid-write), so its
    last line may be a partial record: dropped where it holds fewer metrics than the one before."""
    records: dict[str, list[dict]] = {kind: [] for kind, _, _ in _CONSOLES}
    for line in lines:
        for kind, pattern, separator in _CONSOLES:
            if (m := pattern.search(line)) is None:
                continue
            rec = {"step": int(m.group(1))}
            for item in m.group(2).split(separator):
                key, sep, value = item.rpartition(":")
                if sep and (v := _number(value)) is not None:
                    rec[key.strip()] = v
            records[kind].append(rec)
            break
    kind = max(records, key=lambda k: len(records[k]))
    found = records[kind]
    if cut and len(found) > 1 and len(found[-1]) < len(found[-2]):  # an unterminated last line with fewer keys: cut mid-record
        notes.append(f"{path.name}: its last line has no newline and fewer metrics than the one before (cut when the run was killed?): "
                     "dropped")  # fmt: skip
        found.pop()
    if not records[kind]:
        raise SpecError(f"{path}: no step metrics found: expected verl console lines (`step:N - key:value - ...`) or MindSpeed-RL "
                        f"lines (`iteration: N / M | key : value | ...`); NeMo RL: pass its TensorBoard directory")  # fmt: skip
    return kind, records[kind]


def _jsonl(path: Path, notes: list[str]) -> list[dict]:
    """Records of a JSON-lines file; null stays None (verl's file logger serialises NaN as null), a
    torn last line (a run killed mid-write) is dropped with a note."""
    out = []
    lines = [(n, line) for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    for n, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if n == lines[-1][0] and out:
                notes.append(f"{path.name}:{n}: the last line is not complete JSON (cut when the run was killed?): dropped")
                break
            raise SpecError(f"{path}:{n}: not a JSON line") from None
        if not isinstance(obj, dict):
            raise SpecError(f"{path}:{n}: a JSON line must be an object, got {type(obj).__name__}")
        if isinstance(obj.get("data"), dict) and "step" in obj:  # verl's file logger
            obj = {"step": obj["step"], **obj["data"]}
        out.append({k: v for k, v in obj.items() if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))})
    return out


def _tensorboard(path: Path) -> list[dict]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
    except ImportError:
        raise SpecError("reading TensorBoard event files needs the tensorboard package: pip install 'planner[runs]'") from None
    acc = EventAccumulator(str(path), size_guidance={SCALARS: 0})
    acc.Reload()
    by_step: dict[int, dict] = {}
    for tag in acc.Tags().get("scalars", []):
        for event in acc.Scalars(tag):
            by_step.setdefault(int(event.step), {"step": int(event.step)})[tag] = float(event.value)
    return [by_step[s] for s in sorted(by_step)]


_PANEL = re.compile(r"^(.+?) - (.+?)(__MIN|__MAX)?$")


def _read_table(path: Path):
    import pandas as pd

    try:  # as text: an empty cell stays None (read_run takes a training metric's as a NaN pandas wrote that way)
        return pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
    except (pd.errors.ParserError, UnicodeDecodeError, pd.errors.EmptyDataError) as exc:
        raise SpecError(f"{path}: not a CSV table ({type(exc).__name__})") from None


def _panel(frame, path: Path, notes: list[str]):
    """A W&B chart's panel export (`Step`, `<run> - <key>`, `<run> - <key>__MIN`, `__MAX`) as a table
    of the one run's keys, or None where the table is not one. Its __MIN/__MAX columns (the range of
    a downsampled bucket) are left out; a panel of several runs is refused, naming them."""
    if "Step" not in frame.columns:
        return None
    columns = {c: _PANEL.match(str(c)) for c in frame.columns if c != "Step"}
    if not columns or not all(columns.values()):
        return None
    runs = sorted({m.group(1) for m in columns.values()})
    if len(runs) > 1:
        raise SpecError(f"{path}: a W&B panel of {len(runs)} runs ({', '.join(runs[:5])}); export the chart with one run shown")
    kept = {c: m.group(2) for c, m in columns.items() if m.group(3) is None}
    notes.append(f"{path.name}: a W&B panel export of run {runs[0]!r} ({', '.join(kept.values())}); its __MIN/__MAX columns left out")
    return frame[["Step", *kept]].rename(columns={"Step": "step", **kept})


def _csv(path: Path, notes: list[str] | None = None) -> list[dict]:
    frame = _read_table(path)
    panel = _panel(frame, path, notes if notes is not None else [])
    return _records(frame) if panel is None else _records(panel, empty_is_nan=False)


def _panels(paths: list[Path], notes: list[str]) -> list[dict] | None:
    """A folder of W&B panel exports (one chart each) merged on the step, or None where one is not."""
    import pandas as pd

    frames = []
    for path in paths:
        panel = _panel(_read_table(path), path, notes)
        if panel is None:
            return None
        frames.append(panel.set_index("step"))
    merged = pd.concat(frames, axis=1)
    return _records(merged.loc[:, ~merged.columns.duplicated()].reset_index(), empty_is_nan=False)


def _records(frame, empty_is_nan: bool = True) -> list[dict]:
    """Numeric records of a table read as text. An empty cell is None, a NaN written that way (pandas
    writes NaN as one), or, in a W&B panel export, where the run logged nothing: left out."""
    records = []
    for rec in frame.to_dict("records"):
        parsed = {str(k): (_number(v) if isinstance(v, str) else None) for k, v in rec.items()}
        records.append({k: v for k, v in parsed.items() if v is not None or (empty_is_nan and not isinstance(rec[k], str))})
    return records


def _locate(path: Path) -> tuple[str, Path]:
    """(kind, file or event directory) of a run path."""
    if not path.exists():
        raise SpecError(f"{path}: no such run file or directory")
    if path.is_file():
        name = path.name
        if name.startswith("events.out.tfevents"):
            return "tensorboard", path
        if name == "metrics.csv":
            return "planner", path.parent
        return {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}.get(path.suffix.lower(), "console"), path
    if (path / "metrics.csv").is_file():
        return "planner", path
    event_dirs = sorted({p.parent for p in path.rglob("events.out.tfevents*")})
    if len(event_dirs) == 1:
        return "tensorboard", event_dirs[0]
    if len(event_dirs) > 1:
        listed = ", ".join(str(d.relative_to(path)) or "." for d in event_dirs[:5])
        raise SpecError(f"{path}: TensorBoard events in {len(event_dirs)} folders ({listed}); pass the one run's folder")
    files = [p for p in sorted(path.iterdir()) if p.is_file() and p.suffix.lower() in (".jsonl", ".csv", *TEXT_SUFFIXES)]
    if len(files) == 1:
        return _locate(files[0])
    if files and all(p.suffix.lower() == ".csv" for p in files):
        return "csv-folder", path  # W&B panel exports, one chart each (read_run checks they are)
    if not files:
        raise SpecError(f"{path}: no run metrics here (metrics.csv, TensorBoard events, *.jsonl, *.csv or a console log)")
    raise SpecError(f"{path}: {len(files)} candidate metric files ({', '.join(p.name for p in files[:5])}); pass one of them")


def _trainer(keys: set[str]) -> tuple[str, dict[str, str]]:
    """The trainer whose names match the most canonical metrics, and canonical -> key."""
    table = mapping()
    best, best_sources = None, {}
    for trainer in ("planner", "verl", "mindspeed-rl", "nemo-rl"):
        prefixes = ["", *table.get("prefixes", {}).get(trainer, [])]
        sources = {}
        for canonical, spec in table["metrics"].items():
            for key in spec["keys"].get(trainer, []):
                hit = next((p + key for p in prefixes if p + key in keys), None)
                if hit is not None:
                    sources[canonical] = hit
                    break
        if len(sources) > len(best_sources):
            best, best_sources = trainer, sources
    if best is None:
        shown = ", ".join(sorted(keys)[:8])
        raise SpecError(f"no known metric among the run's keys ({shown}{', ...' if len(keys) > 8 else ''}); "
                        f"known: {', '.join(sorted(table['metrics']))} under planner, verl, MindSpeed-RL or NeMo RL names "
                        "(planner/runs/metrics.yaml)")  # fmt: skip
    return best, best_sources


def read_run(path: str | Path) -> Run:
    """Read a run's step metrics in any supported format (see the module doc)."""
    import pandas as pd

    path = Path(path)
    kind, where = _locate(path)
    info: dict = {}
    notes: list[str] = []
    if kind == "planner":
        records = _csv(where / "metrics.csv")
        if (where / "run.json").is_file():
            from planner.files import read_json

            info = read_json(where / "run.json", "run record")
    elif kind == "tensorboard":
        records = _tensorboard(where)
    elif kind == "jsonl":
        records = _jsonl(where, notes)
    elif kind == "csv":
        records = _csv(where, notes)
    elif kind == "csv-folder":
        files = sorted(where.glob("*.csv"))
        records = _panels(files, notes)
        if records is None:
            raise SpecError(f"{where}: {len(files)} CSV files ({', '.join(p.name for p in files[:5])}) that are not all W&B panel exports; "
                            "pass one of them")  # fmt: skip
        kind = "csv"
    else:
        try:
            text = where.read_text(errors="replace")
        except OSError as exc:
            raise SpecError(f"cannot read {where}: {exc.strerror}") from None
        kind, records = _console(text.splitlines(), where, notes, cut=bool(text) and not text.endswith("\n"))
    step_keys = mapping()["step_keys"]
    step_key = next((k for k in step_keys if any(k in r and r[k] is not None for r in records)), None)
    if not records or step_key is None:
        raise SpecError(f"{where}: no steps found" + ("" if not records else f" (no step column: one of {', '.join(step_keys)})"))
    keys = {k for r in records for k in r if any(isinstance(x.get(k), float | int) for x in records)} - set(step_keys)
    trainer, sources = _trainer(keys)  # a metrics.csv with verl's column names reads as verl's
    mapped = set(sources.values())
    rows, skipped = [], []
    for r in records:
        if r.get(step_key) is None or not math.isfinite(r[step_key]):
            continue
        if r[step_key] != int(r[step_key]) or abs(r[step_key]) >= 2**53:  # past 2**53 a float no longer holds every whole number
            raise SpecError(f"{where}: {step_key} {r[step_key]!r} is not a step number (a whole number below 2**53)")
        # a step that logs no training metric (verl's and NeMo RL's validation before training, an
        # evaluator's own records) is not a training step: it would be missing values everywhere
        (rows if mapped & set(r) else skipped).append(r)
    if skipped:
        shown = ", ".join(str(int(r[step_key])) for r in skipped[:5]) + (", ..." if len(skipped) > 5 else "")
        notes.append(f"{len(skipped)} record(s) with no training metric (validation or evaluation only) left out: step(s) {shown}")
    if not rows:
        raise SpecError(f"{where}: no training step: no record holds any of {', '.join(sorted(mapped))}")
    # a null or empty value of a training metric at a training step is a NaN the trainer wrote that way
    nulls: dict[str, list[int]] = {}
    for r in rows:
        for c, key in sources.items():
            if key in r and r[key] is None:
                nulls.setdefault(c, []).append(int(r[step_key]))
    for c, steps in nulls.items():
        how = "null (verl's file logger writes NaN as null)" if kind == "jsonl" else "an empty cell (pandas writes NaN as one)"
        notes.append(f"{sources[c]}: {len(steps)} training step(s) logged it as {how}: read as NaN, from step {steps[0]}")
    raw = pd.DataFrame.from_records([{k: (math.nan if v is None else v) for k, v in r.items()} for r in rows])
    raw["step"] = raw[step_key].astype(int)
    grouped = raw.groupby("step", sort=True)
    metrics = grouped[[sources[c] for c in sources]].last().rename(columns={v: k for k, v in sources.items()}).astype(float)
    # a value logged as NaN or inf (not merely absent) at a step: the non-finite detector's evidence
    # (only where the step's kept value is one: a step with a finite record of the metric is finite)
    logged = {}
    for c in sources:
        explicit = {int(r[step_key]) for r in rows if sources[c] in r and (r[sources[c]] is None or not math.isfinite(r[sources[c]]))}
        logged[c] = np.isin(metrics.index.to_numpy(), sorted(explicit)) & ~np.isfinite(metrics[c].to_numpy())
    metrics.index.name = "step"
    return Run(path=path, kind=kind, trainer=trainer, metrics=metrics, sources=sources, logged_nonfinite=logged, info=info, notes=notes)
