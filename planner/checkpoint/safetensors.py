"""safetensors files read header-first and written streamed, with every structural check.

Format (huggingface/safetensors): 8-byte little-endian header length N, N bytes of JSON mapping each
tensor name to {dtype, shape, data_offsets [begin, end)} relative to the data buffer that follows,
plus an optional "__metadata__" object. Nothing here imports torch; tensors are byte ranges until a
caller asks for an array.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from planner.errors import CheckpointError

__all__ = ["DTYPE_BYTES", "TensorInfo", "ShardHeader", "read_header", "Segment", "OutTensor", "write_shard", "copy_range"]

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 0.5,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
                "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}  # fmt: skip
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int
    path: Path

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def row_bytes(self) -> int:
        """Bytes of one index along dim 0."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    header_bytes: bytes  # the raw JSON, for fingerprints
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    file_size: int


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_header(path: Path) -> ShardHeader:
    """Parse and validate one shard's header; reads no tensor data."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated header: file has {size} bytes, the length prefix needs 8")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{path}: truncated header: it declares {n} header bytes but the file has {size - 8} after the prefix"
                )
            raw = fh.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings, got {metadata!r:.200}")
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in doc.items():
        try:
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            begin, end = offsets
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry: {entry!r:.200}") from None
        if not all(_is_int(v) for v in (*shape, begin, end)):
            raise CheckpointError(f"{path}: tensor {name!r}: shape and data_offsets must be integers, got {entry!r:.200}")
        shape = tuple(shape)
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        want = math.prod(shape) * DTYPE_BYTES[dtype]
        if any(d < 0 for d in shape) or end - begin != want or begin < 0:
            raise CheckpointError(
                f"{path}: tensor {name!r}: header/data length mismatch: {dtype} {list(shape)} needs {want:g} bytes, "
                f"data_offsets [{begin}, {end}] give {end - begin}"
            )
        if end > data_len:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {end} of the data section, which has {data_len} bytes (truncated file?)"
            )
        spans.append((begin, end, name))
        tensors[name] = TensorInfo(name, dtype, shape, data_start + begin, data_start + end, path)
    spans.sort()
    covered = 0
    for begin, end, name in spans:  # the reference reader requires the tensors to tile the data section
        if begin < covered:
            raise CheckpointError(f"{path}: tensor {name!r} overlaps the previous tensor in the data section")
        if begin > covered:
            raise CheckpointError(f"{path}: {begin - covered} bytes before tensor {name!r} belong to no tensor")
        covered = end
    if covered != data_len:
        raise CheckpointError(f"{path}: the tensors cover {covered} of the {data_len} data bytes (trailing bytes)")
    return ShardHeader(path, raw, tensors, dict(metadata), size)


@dataclass(frozen=True)
class Segment:
    """A byte range of a source file to copy into an output tensor."""

    path: Path
    offset: int
    length: int


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    segments: tuple[Segment, ...] = ()
    data: bytes | None = None  # small tensors built in memory

    @property
    def nbytes(self) -> int:
        return len(self.data) if self.data is not None else sum(s.length for s in self.segments)


def copy_range(src_fd: int, dst_fd: int, offset: int, length: int, chunk: int = 64 << 20) -> None:
    """Copy bytes [offset, offset+length) of src to dst's current position, kernel-side when the
    platform allows (copy_file_range), else through a bounded buffer."""
    done = 0
    use_kernel = hasattr(os, "copy_file_range")
    while done < length:
        n = min(chunk, length - done)
        if use_kernel:
            try:
                copied = os.copy_file_range(src_fd, dst_fd, n, offset + done)
            except OSError:
                use_kernel = False
                continue
            if copied == 0:
                raise CheckpointError(f"source ended early at byte {offset + done}")
        else:
            buf = os.pread(src_fd, n, offset + done)
            if len(buf) < n:
                raise CheckpointError(f"source ended early at byte {offset + done + len(buf)}")
            copied = os.write(dst_fd, buf)
        done += copied


def _prefetch(fd: int, segments: list[Segment]) -> None:
    """Ask the kernel to read the kept ranges of a source file ahead (kept experts are scattered
    between dropped ones; many requests in flight read them faster than one at a time)."""
    if hasattr(os, "posix_fadvise"):
        for seg in segments:
            os.posix_fadvise(fd, seg.offset, seg.length, os.POSIX_FADV_WILLNEED)


def _header(tensors: Iterable[OutTensor], metadata: Mapping[str, str]) -> bytes:
    doc: dict = {"__metadata__": dict(metadata)} if metadata else {}
    pos = 0
    for t in tensors:
        doc[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the reference writer pads the header to 8 bytes


def write_shard(path: Path, tensors: list[OutTensor], metadata: Mapping[str, str] | None = None) -> int:
    """Write one shard: header first (every size is known), then each tensor's bytes streamed from
    its source ranges. Memory stays bounded by the copy chunk. Returns the data bytes written."""
    header = _header(tensors, metadata or {})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sources: dict[Path, int] = {}
    try:
        os.write(fd, struct.pack("<Q", len(header)) + header)
        for t in tensors:
            if t.data is not None:
                os.write(fd, t.data)
                continue
            for seg in t.segments:
                src = sources.get(seg.path)
                if src is None:
                    for old in sources.values():  # one source file open at a time
                        os.close(old)
                    sources = {seg.path: os.open(seg.path, os.O_RDONLY)}
                    src = sources[seg.path]
                    _prefetch(src, [s for tt in tensors for s in tt.segments if s.path == seg.path])
                copy_range(src, fd, seg.offset, seg.length)
    finally:
        for src in sources.values():
            os.close(src)
        os.close(fd)
    return sum(t.nbytes for t in tensors)
