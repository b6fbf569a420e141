"""Reading the small YAML and JSON files planner takes as input, with errors that say which file
and what is wrong with it (SpecError: exit code 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from planner.errors import SpecError

__all__ = ["read_text", "read_yaml", "read_json", "read_records", "refuse_existing", "new_output", "write_text_atomic", "write_csv_atomic"]


def read_text(path: Path, what: str, hint: str = "") -> str:
    """A text file as UTF-8; an unreadable or non-UTF-8 file is a SpecError naming it and the byte."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read {what} {path}: {exc.strerror}{hint}") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not a {what} in UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}){hint}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a mapping that gives one key twice (PyYAML keeps the last;
    OmegaConf, which the trainers read their configs with, refuses it too)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden, as YAML means
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def duplicate_key(text: str) -> str | None:
    """Where a YAML text gives a key twice in one mapping ("key 'k' is given twice at line N"), else None."""
    try:
        yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.constructor.ConstructorError as exc:
        if exc.problem and "given twice" in exc.problem:
            return f"{exc.problem} at line {exc.problem_mark.line + 1}"
    except yaml.YAMLError:
        pass
    return None


def parse_yaml(text: str, where: str | Path, *, unique: bool = True) -> Any:
    """YAML text read from `where` (safe loading); with `unique`, a key given twice in one mapping is an error."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader if unique else yaml.SafeLoader)  # noqa: S506 (SafeLoaders)
    except yaml.YAMLError as exc:
        raise SpecError(f"{where}: not valid YAML: {exc}") from None


def read_yaml(path: str | Path, what: str, hint: str = "", *, unique: bool = True) -> Any:
    """A YAML file (safe loading); with `unique`, a key given twice in one mapping is an error."""
    return parse_yaml(read_text(Path(path), what, hint), path, unique=unique)


def read_json(path: str | Path, what: str, hint: str = "") -> Any:
    p = Path(path)
    try:
        return json.loads(read_text(p, what, hint))
    except json.JSONDecodeError as exc:
        raise SpecError(f"{p}: not a {what} (invalid JSON at line {exc.lineno})") from None


def read_records(path: str | Path, what: str, schema: str, key: str) -> list:
    """The list under `key` of a JSON file of `schema` (`{"schema": ..., key: [...]}`); empty where
    the file does not exist yet."""
    p = Path(path)
    if not p.is_file():
        return []
    data = read_json(p, what)
    if data.get("schema") != schema:
        raise SpecError(f"{p}: not a {what} (schema {data.get('schema')!r}, want {schema})")
    return list(data.get(key, []))


def refuse_existing(path: str | Path, force: bool, note: str = "") -> Path:
    """`path`, unless it exists and --force was not given: outputs are never silently replaced."""
    p = Path(path)
    if p.exists() and not force:
        raise SpecError(f"{p} exists; pass --force to replace it{note}")
    return p


def new_output(path: str | Path, force: bool, note: str = "") -> Path:
    """An output file `path` that may be written: its folder exists, and it is new unless --force.
    Checked before any long work, so that a run is never lost to a typo in -o."""
    p = refuse_existing(path, force, note)
    if not p.resolve().parent.is_dir():
        raise SpecError(f"{p}: folder {p.resolve().parent} does not exist")
    return p


def _part(p: Path) -> Path:
    """The temporary name a write goes to before its rename: one per process, so that two runs
    writing the same file (two calibrate runs sharing a work directory) never write into each
    other's half-written file."""
    return p.with_name(f"{p.name}.{os.getpid()}.part")


def rounded_floats(obj: Any, digits: int = 12) -> Any:
    """`obj` (JSON data) with every float rounded to `digits` significant digits: a refit on another
    machine differs from the committed file only where a number really moved, not in the last digits
    that BLAS's summation order changes."""
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: rounded_floats(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded_floats(v, digits) for v in obj]
    return obj


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to PATH.PID.part, then rename it over `path`: readers never see half a file."""
    p = Path(path)
    tmp = _part(p)
    tmp.write_text(text)
    tmp.replace(p)
    return p


def write_csv_atomic(path: str | Path, fieldnames: list[str], rows) -> Path:
    """Rows (mappings) as CSV with a header, streamed to PATH.PID.part and renamed over `path`."""
    import csv

    p = Path(path)
    tmp = _part(p)
    with open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(p)
    return p
