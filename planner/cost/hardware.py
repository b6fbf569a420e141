"""Accelerator profiles: per-device figures in SI units, with their sources.

A device is what the training framework counts (a torch_npu or CUDA device). On Atlas A3 that is a
die; `devices_per_card` converts to physical cards for reports.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from planner.errors import ConfigError, SpecError
from planner.units import GIB

__all__ = ["Accelerator"]

_REQUIRED = (
    "name",
    "family",
    "hbm_gib",
    "reserved_gib",
    "hbm_tb_per_s",
    "intra_node_gb_per_s",
    "inter_node_gb_per_s",
    "devices_per_node",
)
_OPTIONAL = (
    "device_unit",
    "devices_per_card",
    "scale_up_devices",
    "peak_bf16_tflops",
    "peak_from_cube",
    "peak_fp8_tflops",
    "host_link_gb_per_s",
    "host_memory_gib_per_node",
    "collective_latency_us",
    "scale_out_latency_us",
    "host_adam_gparams_per_s",
    "eager_layer_us",
    "a2a_dispatch_gb_per_s",
    "a2a_combine_gb_per_s",
    "sources",
)


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    id: str
    name: str
    family: str  # knobs are fitted per family: ascend | nvidia
    device_unit: str
    devices_per_card: int
    devices_per_node: int
    scale_up_devices: int  # devices in one high-bandwidth (HCCS / NVLink / UB) domain
    hbm_bytes: float
    reserved_bytes: float
    hbm_bytes_per_s: float
    peak_bf16_flops: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    host_link_bytes_per_s: float
    host_memory_bytes_per_node: float
    collective_latency_s: float  # one small-message collective inside the scale-up domain
    scale_out_latency_s: float  # the same across the scale-out network
    host_adam_params_per_s: float  # Adam steps the host CPUs of one node apply per second
    eager_layer_s: float  # what one decoder layer's kernel launches from Python add to a decode step in eager mode
    peak_fp8_flops: float | None = None  # dense FP8 matmul peak; None: the device has no FP8 format
    a2a_dispatch: tuple[tuple[int, float], ...] = ()  # (ep, bytes/s) measured points
    a2a_combine: tuple[tuple[int, float], ...] = ()
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def usable_bytes(self) -> float:
        """Device memory the framework can allocate."""
        return self.hbm_bytes - self.reserved_bytes

    def peak_flops(self, precision: str) -> float:
        """Dense matmul peak. fp32 runs on the matrix units as TF32/HF32 at half the bf16 rate
        (NVIDIA A100/H100 datasheets: TF32 dense = BF16 dense / 2); fp16 equals bf16; fp8 is the
        profile's own figure, refused where the device has none."""
        if precision == "fp8":
            if self.peak_fp8_flops is None:
                raise SpecError(f"{self.id} ({self.name}) has no FP8 matmul format in its profile: use bf16 there, or give peak_fp8_tflops "
                                "in a custom profile (planner cost --hardware my.yaml) if your devices have one")  # fmt: skip
            return self.peak_fp8_flops
        return self.peak_bf16_flops / 2 if precision == "fp32" else self.peak_bf16_flops

    def link_bytes_per_s(self, group_size):
        """Per-device bandwidth of a collective over `group_size` devices (array-friendly): the
        scale-up links (HCCS, NVLink, UB) within the scale-up domain, the NIC beyond it."""
        group = np.asarray(group_size, dtype=float)
        return np.where(group <= self.scale_up_devices, self.intra_node_bytes_per_s, self.inter_node_bytes_per_s)

    def latency_s(self, span):
        """Latency of one small collective over a group whose ranks spread over `span`
        consecutive devices (array-friendly): within the scale-up domain or across the network."""
        span = np.asarray(span, dtype=float)
        return np.where(span <= self.scale_up_devices, self.collective_latency_s, self.scale_out_latency_s)

    def a2a_bytes_per_s(self, ep, kind: str = "dispatch", span=None):
        """Achieved all-to-all bandwidth per device at EP size `ep` (array-friendly), for an EP
        group spread over `span` consecutive devices (default `ep`; Megatron's expert rank order
        etp-ep-edp-pp puts EP ranks `etp` apart, so an EP4 x ETP8 group spans 32 devices).

        Measured points (DeepEP / DeepEP-Ascend) interpolate in log2(ep). Without them the link
        bandwidth rules. Beyond the measured range the figure is capped by the link (below the
        smallest measured EP, the larger of the two; above the largest, the smaller). A group the
        table measured inside one scale-up domain but that here crosses it gets at most the network.
        """
        ep = np.asarray(ep, dtype=float)
        span = ep if span is None else np.asarray(span, dtype=float)
        link = self.link_bytes_per_s(span)
        table = self.a2a_dispatch if kind == "dispatch" else self.a2a_combine
        if not table:
            return link
        xs = np.log2([p[0] for p in table])
        ys = np.array([p[1] for p in table])
        inside = (ep >= 2 ** xs[0]) & (ep <= 2 ** xs[-1])
        measured = np.interp(np.log2(np.maximum(ep, 1)), xs, ys)
        below = ep < 2 ** xs[0]
        value = np.where(inside, measured, np.where(below, np.maximum(ys[0], link), np.minimum(ys[-1], link)))
        return np.where(span > np.maximum(ep, self.scale_up_devices), np.minimum(value, link), value)

    @classmethod
    def from_dict(cls, accel_id: str, data: Mapping[str, Any], where: str) -> "Accelerator":
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: an accelerator profile must be a mapping")
        unknown = [k for k in data if k not in _REQUIRED + _OPTIONAL]
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(_REQUIRED + _OPTIONAL)}"
            )
        missing = [k for k in _REQUIRED if k not in data]
        if "peak_bf16_tflops" not in data and "peak_from_cube" not in data:
            missing.append("peak_bf16_tflops (or peak_from_cube)")
        if missing:
            raise ConfigError(f"{where}: missing required key(s) {', '.join(missing)}")

        def num(key: str, default: float | None = None, *, positive: bool = True) -> float:
            value = data.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or (positive and value == 0):
                raise ConfigError(f"{where}: {key} must be a finite {'positive' if positive else 'non-negative'} number, got {value!r}")
            return float(value)

        if "peak_from_cube" in data:
            cube = data["peak_from_cube"]
            if not isinstance(cube, Mapping) or set(cube) != {"cube_cores", "cube_freq_ghz"}:
                raise ConfigError(f"{where}: peak_from_cube needs exactly cube_cores and cube_freq_ghz")
            # One cube core does a 16x16x16 MAC per cycle: 4096 MACs = 8192 FLOPs.
            peak = float(cube["cube_cores"]) * 8192 * float(cube["cube_freq_ghz"]) * 1e9
        else:
            peak = num("peak_bf16_tflops") * 1e12
        family = str(data["family"])
        if family not in ("ascend", "nvidia"):
            raise ConfigError(f"{where}: family must be ascend or nvidia (knobs are fitted per family), got {family!r}")
        per_node = num("devices_per_node")
        if per_node != int(per_node):
            raise ConfigError(f"{where}: devices_per_node must be a whole number, got {per_node}")
        per_node = int(per_node)
        hbm = num("hbm_gib") * GIB
        reserved = num("reserved_gib", positive=False) * GIB
        if reserved >= hbm:
            raise ConfigError(f"{where}: reserved_gib {reserved / GIB} >= hbm_gib {hbm / GIB}")
        per_card = int(num("devices_per_card", 1))
        if per_node % per_card:
            raise ConfigError(f"{where}: devices_per_node {per_node} is not a multiple of devices_per_card {per_card}")

        def table(key: str) -> tuple[tuple[int, float], ...]:
            raw = data.get(key) or {}
            if not isinstance(raw, Mapping):
                raise ConfigError(f"{where}: {key} must map EP size to GB/s")
            return tuple(sorted((int(k), float(v) * 1e9) for k, v in raw.items()))

        return cls(
            id=accel_id,
            name=str(data["name"]),
            family=family,
            device_unit=str(data.get("device_unit", "device")),
            devices_per_card=per_card,
            devices_per_node=per_node,
            scale_up_devices=int(num("scale_up_devices", per_node)),
            hbm_bytes=hbm,
            reserved_bytes=reserved,
            hbm_bytes_per_s=num("hbm_tb_per_s") * 1e12,
            peak_bf16_flops=peak,
            peak_fp8_flops=num("peak_fp8_tflops") * 1e12 if data.get("peak_fp8_tflops") is not None else None,
            intra_node_bytes_per_s=num("intra_node_gb_per_s") * 1e9,
            inter_node_bytes_per_s=num("inter_node_gb_per_s") * 1e9,
            host_link_bytes_per_s=num("host_link_gb_per_s", 25) * 1e9,
            host_memory_bytes_per_node=num("host_memory_gib_per_node", 1024) * GIB,
            collective_latency_s=num("collective_latency_us", 10) * 1e-6,
            scale_out_latency_s=num("scale_out_latency_us", 20) * 1e-6,
            host_adam_params_per_s=num("host_adam_gparams_per_s", 4) * 1e9,
            eager_layer_s=num("eager_layer_us", 300) * 1e-6,
            a2a_dispatch=table("a2a_dispatch_gb_per_s"),
            a2a_combine=table("a2a_combine_gb_per_s"),
            sources=dict(data.get("sources") or {}),
        )
