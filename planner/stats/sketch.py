"""Data-free expert features, streamed from the checkpoint: router rows and weight sketches.

A weight sketch is a bilinear random projection of each expert weight matrix, S = R1^T W R2 with
R1 (rows x 16) and R2 (cols x 16) Gaussian of variance 1/16, the same R for every expert of a role
and shape: E[<S, S'>] = <W, W'>, so inner products (and cosine distances) between experts' weights
are preserved in expectation (a Johnson-Lindenstrauss-type sketch for matrices). 256 numbers per
matrix, for the price of one thin matrix product, so it runs at about the speed weights come off
disk. Experts are read one tensor at a time in file order and nothing else is read.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from planner.checkpoint.reader import Checkpoint, to_float32

__all__ = ["WeightFeatures", "weight_features", "SKETCH_DIM"]

SIDE = 16
SKETCH_DIM = SIDE * SIDE


@dataclass
class WeightFeatures:
    router: dict[int, np.ndarray]  # layer -> (E, hidden) float32 router rows
    sketch: dict[int, np.ndarray]  # layer -> (E, SKETCH_DIM) float32
    bytes_read: int
    seconds: float
    unsketched: list[str]  # quantised fused tensors left out (MXFP4 blocks): the router decides there


class _Projections:
    """The pair of Gaussian projections of a (role, shape), generated once and reused."""

    def __init__(self, seed: int):
        self.seed = seed
        self.cache: dict[tuple[str, tuple[int, int]], tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, role: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        key = (role, shape)
        if key not in self.cache:
            rng = np.random.default_rng([self.seed, zlib.crc32(role.encode()), *shape])  # stable across runs
            scale = 1.0 / np.sqrt(SIDE)
            self.cache[key] = (
                (rng.standard_normal((shape[0], SIDE)) * scale).astype(np.float32),
                (rng.standard_normal((shape[1], SIDE)) * scale).astype(np.float32),
            )
        return self.cache[key]


def _sketch(values: np.ndarray, role: str, proj: _Projections) -> np.ndarray:
    matrix = values.reshape(values.shape[0], -1) if values.ndim > 1 else values.reshape(1, -1)
    r1, r2 = proj(role, matrix.shape)
    return (r1.T @ (matrix @ r2)).reshape(-1)


def _dequantise(values: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """W = q * s per block: blocks are values.shape / scale_inv.shape (128 x 128 in DeepSeek-V3)."""
    bh = -(-values.shape[0] // scale_inv.shape[0])
    bw = -(-values.shape[1] // scale_inv.shape[1])
    full = np.repeat(np.repeat(scale_inv, bh, axis=0), bw, axis=1)[: values.shape[0], : values.shape[1]]
    return values * full


def weight_features(
    ckpt: Checkpoint, *, layers: list[int] | None = None, seed: int = 0, progress: Callable[[int, int], None] | None = None
) -> WeightFeatures:
    """Router rows and per-expert weight sketches of the given MoE layers (default: all), in one
    pass over their expert and router tensors in file order."""
    start = time.perf_counter()
    proj = _Projections(seed)
    wanted = list(ckpt.moe_layers) if layers is None else layers
    work = []  # (file, offset, layer, kind, expert, role, info) in file order
    unsketched = []
    for idx in wanted:
        layer = ckpt.moe_layers[idx]
        work.append((layer.router.path, layer.router.begin, idx, "router", -1, "", layer.router))
        for eid, tensors in layer.experts.items():
            for suffix, info in tensors.items():
                if info.dtype in ("F32", "F16", "BF16", "F8_E4M3", "F8_E5M2") and info.name.endswith("weight"):
                    work.append((info.path, info.begin, idx, "expert", eid, suffix, info))
        for name, info in layer.fused.items():
            if name.endswith(("_bias", "_scales")):
                continue
            if info.dtype in ("F32", "F16", "BF16"):
                work.append((info.path, info.begin, idx, "fused", -1, name, info))
            else:
                unsketched.append(info.name)
    work.sort(key=lambda w: (str(w[0]), w[1]))
    total = sum(w[6].nbytes for w in work)
    router: dict[int, np.ndarray] = {}
    sketch = {idx: np.zeros((ckpt.moe_layers[idx].num_experts, SKETCH_DIM), dtype=np.float32) for idx in wanted}
    done = 0
    for _path, _offset, idx, kind, eid, role, info in work:
        if kind == "router":
            router[idx] = ckpt.read_float32(info)
        elif kind == "expert":
            values = ckpt.read_float32(info)
            scales = ckpt.moe_layers[idx].experts[eid].get(role + "_scale_inv")
            if scales is not None:  # FP8 with 128x128 block scales (DeepSeek-V3 layout): dequantise
                values = _dequantise(values, ckpt.read_float32(scales))
            sketch[idx][eid] += _sketch(values, role, proj)
        else:  # fused: one expert row at a time keeps memory to one expert
            row = info.row_bytes()
            for e in range(info.shape[0]):
                raw = ckpt.read_range(info.path, info.begin + e * row, row)
                sketch[idx][e] += _sketch(to_float32(raw, info.dtype, info.shape[1:]), role, proj)
        done += info.nbytes
        if progress:
            progress(done, total)
    return WeightFeatures(router=router, sketch=sketch, bytes_read=done, seconds=time.perf_counter() - start, unsketched=unsketched)
