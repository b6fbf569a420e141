"""`planner detect`: the fault signature of a run (type, onset step, evidence), from any trainer's logs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planner.runs.detect import detect, first_fault
from planner.runs.precursors import precursors
from planner.runs.read import Run, read_run

__all__ = ["signature", "signature_of", "render_signature"]


def signature_of(run: Run) -> dict[str, Any]:
    findings = detect(run.steps, run.signals(), ideal=run.ideal())
    first = first_fault(findings)

    def with_source(f) -> dict:
        out = f.to_json()
        # the trainer's key(s) behind the canonical metric(s) the finding read ("a, b" where it read two)
        keys = [run.sources.get(name, name) for name in f.metric.split(", ")] if f.metric else []
        out["source_key"] = ", ".join(keys) if keys else None
        return out

    steps = run.steps
    return {
        "run": str(run.path),
        "format": run.kind,
        "trainer": run.trainer,
        "steps": int(len(steps)),
        "step_range": [int(steps[0]), int(steps[-1])] if len(steps) else None,
        "metrics": dict(sorted(run.sources.items())),
        "notes": list(run.notes),
        "fault": with_source(first) if first else None,
        "detectors": [with_source(f) for f in findings],
        # signals that build up before a fault (planner.runs.precursors): listed, never the fault
        "precursors": [with_source(f) for f in precursors(run.steps, run.signals())],
    }


def signature(path: str | Path) -> dict[str, Any]:
    return signature_of(read_run(path))


def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def render_signature(sig: dict[str, Any]) -> str:
    from planner.render import table

    lo, hi = sig["step_range"] or (None, None)
    lines = [f"run {sig['run']}: {sig['format']} ({sig['trainer']}), {sig['steps']} steps ({lo}-{hi}), "
             f"{len(sig['metrics'])} canonical metrics"]  # fmt: skip
    lines.extend(f"note: {n}" for n in sig.get("notes", []))
    f = sig["fault"]
    if f is None:
        lines.append("fault: none found by any detector that had its metric")
    else:
        key = f" [{f['source_key']}]" if f["source_key"] and f["source_key"] != f["metric"] else ""
        limit = f", threshold {_num(f['threshold'])}" if f["threshold"] is not None else ""
        lines.append(f"fault: {f['fault']} from step {f['onset_step']} ({f['rule']}{limit})")
        lines.append(table(["step", f"{f['metric']}{key}"], [[e["step"], e["value"]] for e in f["evidence"]], title="evidence"))
    rows = []
    for d in sig["detectors"]:
        result = "not logged" if not d["logged"] else ("-" if d["onset_step"] is None else f"step {d['onset_step']}")
        rows.append([d["fault"], result, d["source_key"] or d["metric"] or "-", d["rule"]])
    lines.append(table(["detector", "onset", "metric", "rule"], rows, title="every detector"))
    pre = [d for d in sig.get("precursors", []) if d["logged"]]
    if pre:
        rows = [[d["fault"], "-" if d["onset_step"] is None else f"step {d['onset_step']}", d["source_key"] or d["metric"] or "-",
                 "-" if d["threshold"] is None else _num(d["threshold"]), d["rule"]] for d in pre]  # fmt: skip
        lines.append(table(["precursor", "first seen", "metric", "threshold", "rule"], rows,
                           title="precursors (signals reported before a collapse; not faults)"))  # fmt: skip
    return "\n\n".join(lines)
