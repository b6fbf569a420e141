"""The catalog: real model configs and accelerator profiles shipped with planner, loaded on demand.

One loader serves catalog ids and user paths: `load_model("qwen3-30b-a3b")`,
`load_model("path/to/config.json")`, `load_model("path/to/checkpoint_dir")`. Accelerators likewise:
`load_accelerator("ascend-910b2")` or a user's YAML file.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import yaml

from planner.arch import Architecture
from planner.cost.hardware import Accelerator
from planner.errors import ConfigError, UnknownModelError
from planner.files import read_yaml

__all__ = [
    "catalog_accelerators",
    "load_accelerator",
    "CatalogModel",
    "parse_count",
    "catalog_models",
    "load_model",
    "load_model_config",
    "resolve_model_id",
]


def parse_count(text: Any) -> float:
    """'30.5B' -> 30.5e9, '1T' -> 1e12, as publishers write parameter counts."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    s = str(text).strip()
    if s and s[-1].upper() in scale:
        return float(s[:-1]) * scale[s[-1].upper()]
    return float(s)


@dataclass(frozen=True)
class CatalogModel:
    id: str
    name: str
    hf_repo: str
    config_file: str
    config_source: str
    published: Mapping[str, Any]
    aliases: tuple[str, ...] = ()
    notes: str = ""


def _data_dir() -> Path:
    return Path(str(resources.files("planner._models")))


@lru_cache(maxsize=1)
def catalog_models() -> dict[str, CatalogModel]:
    raw = yaml.safe_load((_data_dir() / "catalog.yaml").read_text())["models"]
    out = {}
    for model_id, entry in raw.items():
        out[model_id] = CatalogModel(
            id=model_id,
            name=entry["name"],
            hf_repo=entry["hf_repo"],
            config_file=f"configs/{model_id}.json",
            config_source=entry["config_source"],
            published=entry.get("published", {}),
            aliases=tuple(entry.get("aliases", ())),
            notes=entry.get("notes", ""),
        )
    return out


def _lookup_table() -> dict[str, str]:
    table = {}
    for model in catalog_models().values():
        for key in (model.id, model.name, model.hf_repo, model.hf_repo.split("/")[-1], *model.aliases):
            table[key.lower()] = model.id
    return table


def resolve_model_id(ref: str) -> str | None:
    """The catalog id `ref` names (id, display name, HF repo or alias; any case), or None."""
    return _lookup_table().get(ref.strip().lower())


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})") from None


def _read_json(path: Path) -> dict:
    text = _text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def load_model_config(ref: str) -> tuple[str, dict]:
    """(display name, parsed config.json) for a catalog reference or a path."""
    model_id = resolve_model_id(ref)
    if model_id is not None:
        model = catalog_models()[model_id]
        return model.id, _read_json(_data_dir() / model.config_file)
    if not str(ref).strip():
        raise UnknownModelError(f"no model given (an empty name): a catalog id ({', '.join(sorted(catalog_models()))}) or a path")
    path = Path(ref).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ConfigError(f"{path}: a checkpoint directory needs a config.json; none found")
        return path.name, _read_json(config)
    if path.is_file():
        return path.stem if path.name != "config.json" else path.parent.name, _read_json(path)
    known = sorted(_lookup_table())
    close = difflib.get_close_matches(ref.lower(), known, n=4, cutoff=0.5)
    ids = sorted(catalog_models())
    hint = f"; did you mean: {', '.join(close)}?" if close else ""
    raise UnknownModelError(
        f"unknown model {ref!r}: not a catalog id and not a path to a config.json or checkpoint "
        f"directory{hint} (catalog: {', '.join(ids)})"
    )


def load_model(ref: str, *, experts: int | None = None) -> Architecture:
    """Architecture of a catalog model or a user config; `experts` keeps K routed experts."""
    name, config = load_model_config(ref)
    arch = Architecture.from_config(config, name=name)
    return arch if experts is None else arch.with_experts(experts)


@lru_cache(maxsize=1)
def catalog_accelerators() -> dict[str, Accelerator]:
    raw = yaml.safe_load((_data_dir() / "accelerators.yaml").read_text())["accelerators"]
    return {
        accel_id: Accelerator.from_dict(accel_id, entry, where=f"accelerators.yaml:{accel_id}")
        for accel_id, entry in raw.items()
    }


def load_accelerator(ref: str) -> Accelerator:
    """A catalog accelerator by id (any case) or a user's YAML profile file.

    A user file holds one profile (the keys of models/accelerators.yaml), or `accelerators:` with
    one or more named profiles of which the first is used.
    """
    accels = catalog_accelerators()
    if ref.strip().lower() in accels:
        return accels[ref.strip().lower()]
    path = Path(ref).expanduser()
    if path.is_file():
        data = read_yaml(path, "accelerator profile")
        if isinstance(data, dict) and isinstance(data.get("accelerators"), dict) and data["accelerators"]:
            accel_id, entry = next(iter(data["accelerators"].items()))
            return Accelerator.from_dict(str(accel_id), entry, where=f"{path}:{accel_id}")
        return Accelerator.from_dict(path.stem, data, where=str(path))
    close = difflib.get_close_matches(ref.lower(), sorted(accels), n=3, cutoff=0.4)
    hint = f"; did you mean: {', '.join(close)}?" if close else ""
    raise UnknownModelError(
        f"unknown accelerator {ref!r}: not a catalog id and not a YAML profile file{hint} "
        f"(catalog: {', '.join(sorted(accels))})"
    )
