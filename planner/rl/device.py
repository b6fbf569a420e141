"""The accelerator a run uses: cpu, cuda or npu, each read through its own API.

torch_npu is imported only when npu is asked for. Memory and synchronisation go through the
device's module (torch.cuda, torch.npu); the CPU reports the process's peak RSS instead.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from planner.errors import SpecError
from planner.hf import require_torch

__all__ = ["Device"]


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
