"""The stats file: schema-versioned JSON carrying the checkpoint's fingerprint.

Arrays are stored as base64 of their little-endian float32 bytes with dtype and shape, so a file
of a 256-expert, 58-layer model stays tens of megabytes. A stats file from another checkpoint (a
different fingerprint) is refused.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

import numpy as np

from planner.errors import SpecError
from planner.files import read_json, refuse_existing, write_text_atomic

__all__ = ["STATS_SCHEMA", "save_stats", "load_stats", "check_stats_model", "plan_key", "plan_statistics"]

STATS_SCHEMA = "planner.stats/1"


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if np.issubdtype(obj.dtype, np.integer) or obj.dtype == bool:
            return obj.tolist()
        arr = np.ascontiguousarray(obj, dtype="<f4")
        return {"__array__": "float32", "shape": list(arr.shape), "base64": base64.b64encode(arr.tobytes()).decode()}
    if isinstance(obj, dict):
        return {str(k): _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    return obj


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if obj.get("__array__") == "float32":
            return np.frombuffer(base64.b64decode(obj["base64"]), dtype="<f4").reshape(obj["shape"]).astype(np.float64)
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


# 2: every plan measured from the calibration pass's activations (teacher-forced per layer, the KL
# through residual additivity); 1 (files without the key): one free-running proxy pass per plan
STATISTICS_VERSION = 2


# what a stats file records of its model's routing shape, and the Architecture attribute each is
_SHAPE = {"model_type": lambda a: a.model_type, "num_experts": lambda a: a.original_num_experts, "top_k": lambda a: a.moe.top_k,
          "n_group": lambda a: a.moe.n_group, "scoring": lambda a: a.moe.scoring, "num_layers": lambda a: a.num_layers}


def check_stats_model(stats: dict, arch: Any, name: str) -> None:
    """Refuse a stats file measured on a model of another shape than `arch` (every field that differs named)."""
    ck = stats["checkpoint"]
    differ = [f"{key} {ck[key]!r} against {get(arch)!r}" for key, get in _SHAPE.items() if key in ck and ck[key] != get(arch)]
    if differ:
        raise SpecError(f"the stats file is of another model ({ck.get('path')}) than {name}: {'; '.join(differ)}; "
                        f"run planner stats on {name}'s checkpoint")  # fmt: skip


def plan_key(experts: int, method: str) -> str:
    """The key of one plan in a stats file and everywhere plans are named: 'K=32/agglomerative'."""
    return f"K={experts}/{method}"


def plan_statistics(stats: dict, key: str) -> dict | None:
    """The summary of plan `key` ("K=32/agglomerative") with the version its measures were taken
    by, so the fidelity estimator can tell measures it was not fitted on (None: no such plan)."""
    plan = stats.get("plans", {}).get(key)
    return {**plan["summary"], "statistics_version": stats.get("statistics_version", 1)} if plan else None


def stale_note(stats: dict) -> str | None:
    """Why a stats file's plan measures are not used, or None when they are."""
    version = stats.get("statistics_version", 1)
    if version == STATISTICS_VERSION:
        return None
    return (f"the stats file's plan measures are version {version}, the fidelity estimator's version {STATISTICS_VERSION}: "
            "they are not used (routing mass and selection figures are); run planner stats again")


def save_stats(stats: dict, path: str | Path, *, force: bool = False) -> None:
    p = Path(path)
    refuse_existing(p, force)
    write_text_atomic(p, json.dumps({"schema": STATS_SCHEMA, **_encode(stats)}))


def load_stats(path: str | Path, *, fingerprint: str | None = None) -> dict:
    p = Path(path)
    doc = read_json(p, "stats file")
    if not isinstance(doc, dict) or doc.get("schema") != STATS_SCHEMA:
        raise SpecError(f"{p}: schema {doc.get('schema') if isinstance(doc, dict) else None!r} is not {STATS_SCHEMA}")
    ck = doc.get("checkpoint")
    missing = [k for k in ("fingerprint", "path") if not isinstance(ck, dict) or k not in ck]
    missing += [k for k in ("layers", "plans") if not isinstance(doc.get(k), dict)]
    if missing:
        raise SpecError(f"{p}: a {STATS_SCHEMA} file without {', '.join(missing)} (cut short or edited?); run planner stats again")
    try:
        stats = _decode(doc)
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise SpecError(f"{p}: an array in the stats file does not decode ({type(exc).__name__}: {exc}); run planner stats again") from None
    have = stats["checkpoint"]["fingerprint"]
    if fingerprint is not None and have != fingerprint:
        raise SpecError(
            f"{p} was computed on checkpoint {have[:12]}... ({stats['checkpoint']['path']}), not on this one "
            f"({fingerprint[:12]}...); run planner stats on this checkpoint"
        )
    return stats
