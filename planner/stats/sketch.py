"""Data-free expert features, streamed from the checkpoint: router rows and weight sketches.

A weight sketch is a count sketch (Charikar et al. 2002; a sparse Johnson-Lindenstrauss
projection) of an expert's flattened gate, up and down weights into `dim` buckets: every weight
position hashes to one bucket with a random sign, the same hash for every expert of a layer, so
inner products between experts' weights are preserved in expectation. It costs one pass over the
weights (no matrix multiply), so it runs near disk speed; experts are read one tensor at a time
in file order and nothing else is read.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from planner.checkpoint.reader import Checkpoint, to_float32

__all__ = ["WeightFeatures", "weight_features"]

SKETCH_DIM = 256


@dataclass
class WeightFeatures:
    router: dict[int, np.ndarray]  # layer -> (E, hidden) float32 router rows
    sketch: dict[int, np.ndarray]  # layer -> (E, SKETCH_DIM) float32
    bytes_read: int
    seconds: float


class _Hasher:
    """Bucket and sign of each position of a tensor role, cached per (role, size): computed once
    and reused for every expert and layer."""

    def __init__(self, dim: int, seed: int):
        self.dim, self.seed = dim, seed
        self.cache: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, role: str, n: int) -> tuple[np.ndarray, np.ndarray]:
        key = (role, n)
        if key not in self.cache:
            rng = np.random.default_rng([self.seed, zlib.crc32(role.encode()), n])  # stable across runs
            buckets = rng.integers(0, self.dim, size=n, dtype=np.uint16)
            signs = (rng.integers(0, 2, size=n, dtype=np.int8) * 2 - 1).astype(np.float32)
            self.cache[key] = (buckets, signs)
        return self.cache[key]


def _sketch(values: np.ndarray, role: str, hasher: _Hasher) -> np.ndarray:
    flat = values.reshape(-1)
    buckets, signs = hasher(role, flat.size)
    return np.bincount(buckets, weights=flat * signs, minlength=hasher.dim).astype(np.float32)


def weight_features(
    ckpt: Checkpoint, *, dim: int = SKETCH_DIM, seed: int = 0, progress: Callable[[int, int], None] | None = None
) -> WeightFeatures:
    """Router rows and per-expert weight sketches of every MoE layer, in one pass over the expert
    and router tensors in file order."""
    start = time.perf_counter()
    hasher = _Hasher(dim, seed)
    work = []  # (file, offset, layer, kind, expert, role, info) in file order
    for idx, layer in ckpt.moe_layers.items():
        work.append((layer.router.path, layer.router.begin, idx, "router", -1, "", layer.router))
        for eid, tensors in layer.experts.items():
            for suffix, info in tensors.items():
                if info.dtype in ("F32", "F16", "BF16", "F8_E4M3", "F8_E5M2") and info.name.endswith("weight"):
                    work.append((info.path, info.begin, idx, "expert", eid, suffix, info))
        for name, info in layer.fused.items():
            if info.dtype in ("F32", "F16", "BF16") and not name.endswith(("_bias", "_scales")):
                work.append((info.path, info.begin, idx, "fused", -1, name, info))
    work.sort(key=lambda w: (str(w[0]), w[1]))
    total = sum(w[6].nbytes for w in work)
    router: dict[int, np.ndarray] = {}
    sketch = {idx: np.zeros((layer.num_experts, dim), dtype=np.float32) for idx, layer in ckpt.moe_layers.items()}
    done = 0
    for _path, _offset, idx, kind, eid, role, info in work:
        if kind == "router":
            router[idx] = ckpt.read_float32(info)
        elif kind == "expert":
            sketch[idx][eid] += _sketch(ckpt.read_float32(info), role, hasher)
        else:  # fused: one expert row at a time keeps memory to one expert
            row = info.row_bytes()
            for e in range(info.shape[0]):
                raw = _read_range(info.path, info.begin + e * row, row)
                sketch[idx][e] += _sketch(to_float32(raw, info.dtype, info.shape[1:]), role, hasher)
        done += info.nbytes
        if progress:
            progress(done, total)
    return WeightFeatures(router=router, sketch=sketch, bytes_read=done, seconds=time.perf_counter() - start)


def _read_range(path, offset: int, length: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(length)
