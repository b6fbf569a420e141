"""The accelerator a run uses: cpu, cuda or npu, each read through its own API.

torch_npu is imported only when npu is asked for. Memory and synchronisation go through the
device's module (torch.cuda, torch.npu); the CPU reports the process's peak RSS instead.

On the CPU, the RL harness has glibc's malloc keep the memory a training step frees
(`keep_freed_memory`, unless the environment sets malloc's thresholds itself). By default malloc
hands the top of its heap back to the kernel whenever more than twice its mmap threshold is free,
so every step's optimizer temporaries and activations of a few MB land on fresh pages and fault
them in again. Measured (`python benchmarks/rl_harness.py --model DIR`, a 12-step
router-collapse run in a fresh process each way, one thread): 547 thousand minor page faults -> 48
thousand and 1.09x less CPU time on the 512-expert calibration original, 1.07x on the 128-expert
one, nothing on 32-expert models (their tensors are small enough for malloc's heap anyway); an Adam
step of the 512-expert model 72 -> 27 ms; the same peak RSS and the same metrics bit for bit (torch
aligns every tensor to 64 bytes wherever malloc puts it).
"""

from __future__ import annotations

import functools
import resource
from dataclasses import dataclass

from planner.errors import SpecError
from planner.hf import require_torch

__all__ = ["Device", "keep_freed_memory"]


@dataclass
class Device:
    kind: str  # cpu | cuda | npu

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "cuda", "npu"):
            raise SpecError(f"--device must be cpu, cuda or npu, got {self.kind!r}")
        torch, _ = require_torch(f"running on {self.kind}")
        if self.kind == "npu":
            try:
                import torch_npu  # noqa: F401  (registers torch.npu)
            except ImportError:
                raise SpecError("--device npu needs torch_npu (Ascend's PyTorch adapter); it is not installed") from None
        module = self.module
        if self.kind != "cpu" and not module.is_available():
            raise SpecError(f"--device {self.kind}: no {self.kind} device is available on this machine")
        self.torch = torch

    @property
    def module(self):
        torch, _ = require_torch("device access")
        return {"cpu": None, "cuda": getattr(torch, "cuda", None), "npu": getattr(torch, "npu", None)}[self.kind]

    @property
    def name(self) -> str:
        return self.kind if self.kind == "cpu" else f"{self.kind}:0"

    def synchronize(self) -> None:
        if self.kind != "cpu":
            self.module.synchronize()

    def reset_peak(self) -> None:
        if self.kind != "cpu":
            self.module.reset_peak_memory_stats()

    def peak_bytes(self) -> int:
        """Peak allocated device memory since reset (CPU: the process's peak RSS)."""
        if self.kind == "cpu":
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return int(self.module.max_memory_allocated())

    def autocast(self, dtype):
        return self.torch.autocast(device_type=self.kind, dtype=dtype)


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc's malloc serve blocks up to 32 MiB from its heap and return the heap's free top to
    the kernel only past 1 GiB (the module's doc says why); once per process, for the whole process.
    False, changing nothing, where the environment sets malloc's thresholds (MALLOC_*_ or a
    glibc.malloc tunable: the user's choice stands) or the C library has no mallopt (macOS, musl,
    Windows) or refuses the values."""
    import ctypes
    import os

    if any(k.startswith("MALLOC_") for k in os.environ) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))
