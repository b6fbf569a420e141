"""An HF safetensors checkpoint, read index-first: config, index, shard headers; data on demand.

`Checkpoint(path)` validates everything it can without reading tensor data: the index's paths stay
inside the directory and every shard exists; headers parse and their byte ranges fit the files;
every MoE layer holds as many experts as config.json says, and the expert, router and embedding
shapes agree with config.json. Tensor names come from the family data in families.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np

from planner.arch import Architecture
from planner.arch.families import TEXT_CONFIG_WRAPPERS
from planner.checkpoint.safetensors import NUMPY_DTYPES, ShardHeader, TensorInfo, read_header
from planner.errors import CheckpointError, ConfigError

__all__ = ["Checkpoint", "MoELayer", "family_names", "to_float32"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@lru_cache(maxsize=1)
def _family_table() -> dict:
    data = json.loads(resources.files("planner.checkpoint").joinpath("families.json").read_text())
    data.pop("_doc", None)
    return data


def family_names(model_type: str) -> dict:
    table = _family_table()
    if model_type not in table:
        raise ConfigError(f"checkpoint surgery does not know family {model_type!r}; known: {', '.join(sorted(table))}")
    return table[model_type]


@dataclass
class MoELayer:
    """The expert-indexed tensors of one MoE block on disk."""

    index: int  # decoder layer index (MTP layers continue after the trunk)
    prefix: str  # e.g. "model.layers.3.mlp"
    mtp: bool
    router: TensorInfo | None = None
    router_bias: TensorInfo | None = None
    correction_bias: TensorInfo | None = None
    correction_dim: int = 0
    experts: dict[int, dict[str, TensorInfo]] = field(default_factory=dict)  # per-expert: id -> suffix -> info
    fused: dict[str, TensorInfo] = field(default_factory=dict)  # name under the block -> info (dim 0 = expert)

    @property
    def num_experts(self) -> int:
        if self.experts:
            return len(self.experts)
        if self.fused:
            return next(iter(self.fused.values())).shape[0]
        return self.router.shape[0] if self.router is not None else 0


def to_float32(raw: bytes | memoryview, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Decode safetensors bytes to float32 without torch (bf16 by bit shift; fp8 by table)."""
    if dtype == "BF16":
        halves = np.frombuffer(raw, dtype="<u2")
        bits = np.empty(halves.size, dtype=np.uint32)
        np.left_shift(halves, 16, out=bits, dtype=np.uint32)
        return bits.view(np.float32).reshape(shape)
    if dtype in ("F8_E4M3", "F8_E5M2"):
        return _fp8_table(dtype)[np.frombuffer(raw, dtype=np.uint8)].reshape(shape)
    if dtype in NUMPY_DTYPES:
        return np.frombuffer(raw, dtype=NUMPY_DTYPES[dtype]).astype(np.float32).reshape(shape)
    raise CheckpointError(f"cannot decode dtype {dtype} to floats")


@lru_cache(maxsize=2)
def _fp8_table(dtype: str) -> np.ndarray:
    exp_bits, man_bits, bias = (4, 3, 7) if dtype == "F8_E4M3" else (5, 2, 15)
    out = np.zeros(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e = (code >> man_bits) & ((1 << exp_bits) - 1)
        m = code & ((1 << man_bits) - 1)
        if dtype == "F8_E4M3" and e == 15 and m == 7:
            out[code] = np.nan
        elif dtype == "F8_E5M2" and e == 31:
            out[code] = np.nan if m else sign * np.inf
        elif e == 0:
            out[code] = sign * (m / (1 << man_bits)) * 2.0 ** (1 - bias)
        else:
            out[code] = sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
    return out


class Checkpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a checkpoint directory")
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{self.path}: no config.json")
        self.config_bytes = config_path.read_bytes()
        self._fingerprint: str | None = None
        try:
            self.config = json.loads(self.config_bytes)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{config_path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
        self.arch = Architecture.from_config(self.config, name=self.path.name)
        self.names = family_names(self.arch.model_type)
        self.shards = self._read_shards()
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self.shards.values():
            self.tensors.update(shard.tensors)
        self._check_index_against_headers()
        self.layer_prefix = self._layer_prefix()
        self.moe_layers = self._find_moe_layers()
        self._check_against_config()

    # ---- files ------------------------------------------------------------------------------
    def _safe_file(self, name: str) -> Path:
        """A weight_map entry: a relative path that stays in the directory as written. The file may
        be a symlink (the Hugging Face cache links snapshot files to ../blobs) to a regular file."""
        norm = os.path.normpath(name)
        if os.path.isabs(name) or norm == ".." or norm.startswith(".." + os.sep):
            raise CheckpointError(f"{self.path / INDEX_NAME}: weight_map path {name!r} escapes the checkpoint directory")
        return self.path / norm

    def _read_shards(self) -> dict[str, ShardHeader]:
        # a single file wins over an index beside it, as transformers' from_pretrained loads them
        single = self.path / SINGLE_NAME
        if single.is_file():
            header = read_header(single)
            self.weight_map = {n: SINGLE_NAME for n in header.tensors}
            return {SINGLE_NAME: header}
        index = self.path / INDEX_NAME
        if index.is_file():
            try:
                doc = json.loads(index.read_text())
                weight_map = doc["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index}: not a safetensors index (needs a weight_map object)") from None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: weight_map is empty or not an object")
            self.weight_map = {str(k): str(v) for k, v in weight_map.items()}
            files = sorted(set(self.weight_map.values()))
            shards = {}
            for name in files:
                path = self._safe_file(name)
                if not path.is_file():
                    count = sum(1 for v in self.weight_map.values() if v == name)
                    raise CheckpointError(f"{index}: shard {name} is missing ({count} tensors map to it)")
                shards[name] = read_header(path)
            return shards
        pickles = [p.name for p in self.path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
        hint = f" (found {', '.join(sorted(pickles)[:3])}: pickled weights are never loaded; convert them to safetensors)" if pickles else ""
        raise CheckpointError(f"{self.path}: no {SINGLE_NAME} or {INDEX_NAME}{hint}")

    def _check_index_against_headers(self) -> None:
        for name, shard_name in self.weight_map.items():
            if name not in self.shards[shard_name].tensors:
                raise CheckpointError(f"{self.path}: the index maps {name!r} to {shard_name}, whose header lacks it")
        for shard_name, shard in self.shards.items():
            for name in shard.tensors:
                if self.weight_map.get(name) != shard_name:
                    raise CheckpointError(f"{self.path}: {shard_name} holds {name!r}, which the index does not map to it")

    # ---- structure --------------------------------------------------------------------------
    def _layer_prefix(self) -> str:
        root, embed = self.names.get("root", "model"), self.names.get("embed", "embed_tokens")
        for prefix in ["", *self.names.get("prefixes", [])]:
            if f"{prefix}{root}.{embed}.weight" in self.tensors or any(n.startswith(f"{prefix}{root}.layers.") for n in self.tensors):
                return f"{prefix}{root}.layers"
        raise CheckpointError(f"{self.path}: no tensor under {root}.layers; is this a {self.arch.model_type} checkpoint?")

    def _find_moe_layers(self) -> dict[int, MoELayer]:
        arch, names = self.arch, self.names
        mtp_count = arch.mtp_layers if names.get("mtp") else 0
        wanted = {i: False for i in arch.moe_layers} | {arch.num_layers + j: True for j in range(mtp_count)}
        block = names["moe"]
        pattern = re.compile(rf"^{re.escape(self.layer_prefix)}\.(\d+)\.{re.escape(block)}\.(.+)$")
        layers: dict[int, MoELayer] = {}
        fused_bases = [f for f in names.get("fused", {}).values()]
        for name, info in self.tensors.items():
            m = pattern.match(name)
            if not m or int(m.group(1)) not in wanted:
                continue
            idx, rest = int(m.group(1)), m.group(2)
            layer = layers.setdefault(idx, MoELayer(idx, f"{self.layer_prefix}.{idx}.{block}", wanted[idx]))
            if rest == names["router"][0]:
                layer.router = info
            elif "router_bias" in names and rest == names["router_bias"][0]:
                layer.router_bias = info
            elif "correction_bias" in names and rest == names["correction_bias"][0]:
                layer.correction_bias, layer.correction_dim = info, names["correction_bias"][1]
            elif rest.startswith("experts.") and "per_expert" in names and rest.split(".")[1].isdigit():
                _, eid, suffix = rest.split(".", 2)
                layer.experts.setdefault(int(eid), {})[suffix] = info
            elif any(rest == base or rest.startswith(base + "_") for base in fused_bases):
                layer.fused[rest] = info
        present = {i for i, is_mtp in wanted.items() if not is_mtp} | {i for i in layers if wanted[i]}
        missing = sorted(i for i in present if i not in layers or layers[i].router is None)
        if missing:
            raise CheckpointError(
                f"{self.path}: config.json makes layers {missing[:8]} MoE layers, but the checkpoint has no router "
                f"({block}.{names['router'][0]}) for them"
            )
        return dict(sorted(layers.items()))

    def _check_against_config(self) -> None:
        arch = self.arch
        e, h, inter = arch.original_num_experts, arch.hidden_size, arch.moe.expert_intermediate
        embed = self.tensors.get(self.layer_prefix[: -len("layers")] + self.names.get("embed", "embed_tokens") + ".weight")
        if embed is not None and embed.shape != (arch.vocab_size, h):
            raise CheckpointError(
                f"{self.path}: embed_tokens has shape {list(embed.shape)}, config.json says [{arch.vocab_size}, {h}]"
            )
        for layer in self.moe_layers.values():
            where = f"{self.path}: layer {layer.index}"
            if layer.router.shape[0] != e:
                raise CheckpointError(f"{where}: router has {layer.router.shape[0]} rows, config.json says {e} experts")
            if layer.router.shape[-1] != h:
                raise CheckpointError(f"{where}: router shape {list(layer.router.shape)} disagrees with hidden_size {h}")
            for label, info, dim in (("router bias", layer.router_bias, 0), ("correction bias", layer.correction_bias, layer.correction_dim)):
                if info is not None and (len(info.shape) <= dim or info.shape[dim] != e):
                    raise CheckpointError(
                        f"{where}: {label} {info.name} has shape {list(info.shape)}; config.json says {e} experts on dim {dim}"
                    )
            if layer.experts:
                ids = sorted(layer.experts)
                if ids != list(range(e)):
                    raise CheckpointError(
                        f"{where}: holds {len(ids)} experts (ids {ids[0]}..{ids[-1]}), config.json says {e}"
                    )
                roles = self.names["per_expert"]
                expected = {roles[r]: (inter, h) for r in ("gate", "up") if r in roles} | {roles["down"]: (h, inter)}
                for eid, tensors in layer.experts.items():
                    for suffix, shape in expected.items():
                        got = tensors.get(suffix)
                        if got is None:
                            raise CheckpointError(f"{where}: expert {eid} lacks {suffix}")
                        if got.shape != shape:
                            raise CheckpointError(
                                f"{where}: expert {eid} {suffix} has shape {list(got.shape)}, config.json implies {list(shape)}"
                            )
            for name, info in layer.fused.items():
                if info.shape[0] != e:
                    raise CheckpointError(f"{where}: {name} holds {info.shape[0]} experts on dim 0, config.json says {e}")
            if not layer.experts and not layer.fused:
                raise CheckpointError(f"{where}: no expert tensors found under {layer.prefix}")

    # ---- access -----------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """sha256 over config.json, every shard's header and size, and 8 samples of 4 KiB spread
        over each shard's data: it changes with any tensor's name, dtype, shape or placement and
        with retrained weights, yet reads only 32 KiB per shard."""
        if self._fingerprint is None:
            digest = hashlib.sha256(self.config_bytes)
            for name in sorted(self.shards):
                shard = self.shards[name]
                digest.update(name.encode() + b"\0" + shard.header_bytes + str(shard.file_size).encode())
                start = 8 + len(shard.header_bytes)
                span = max(shard.file_size - start - 4096, 0)
                with open(shard.path, "rb") as fh:
                    for j in range(8):
                        fh.seek(start + span * j // 7)
                        digest.update(fh.read(4096))
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    @staticmethod
    def read_range(path: Path, offset: int, length: int) -> bytes:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read(length)
        if len(data) != length:
            raise CheckpointError(f"{path}: ended {length - len(data)} bytes early reading [{offset}, {offset + length})")
        return data

    def read_bytes(self, info: TensorInfo) -> bytes:
        return self.read_range(info.path, info.begin, info.nbytes)

    def read_float32(self, info: TensorInfo) -> np.ndarray:
        return to_float32(self.read_bytes(info), info.dtype, info.shape)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def text_wrapper(self) -> bool:
        return self.config.get("model_type") in TEXT_CONFIG_WRAPPERS

