"""The budget grammar of `planner suggest --budget`.

    8npu      8 devices (NPUs: Ascend; on Atlas A3 the framework's devices are dies)
    16gpu     16 GPUs
    2x8npu    2 nodes x 8 devices per node
    64card    64 physical cards (an A3 card holds two dies)
    64die     64 dies, on Atlas A3 (its devices; the same as 64npu there)
    40npu-h   40 accelerator-hours for a reproduction of --steps steps (devices unbounded)

The accelerator kind must match the hardware: npu for Ascend, gpu for NVIDIA; `card` fits either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from planner.cost.hardware import Accelerator
from planner.errors import SpecError
from planner.units import plural

__all__ = ["Budget", "budget_kind", "parse_budget", "MAX_DEVICES"]

# the largest allocation a budget may name: 64 Ki devices, far beyond any published RL run (the
# largest in calibration/published_runs.yaml uses 256); the search enumerates every count below it
MAX_DEVICES = 65_536

_KIND_OF_FAMILY = {"ascend": "npu", "nvidia": "gpu"}
_PATTERN = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(\d+(?:\.\d+)?)\s*(npu|gpu|card|die)s?(-h|-hours?|h)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Budget:
    text: str
    max_devices: int | None  # devices as the framework counts them; None for an hours budget
    device_hours: float | None  # accelerator-hours for the whole reproduction
    nodes: int | None = None

    def describe(self, accel: Accelerator) -> str:
        if self.device_hours is not None:
            return f"{self.device_hours:g} {accel.device_unit}-hours"
        cards = f" ({plural(self.max_devices // accel.devices_per_card, 'card')})" if accel.devices_per_card > 1 else ""
        nodes = f" on {self.nodes} nodes" if self.nodes else ""
        return f"{plural(self.max_devices, accel.device_unit)}{cards}{nodes}"


def budget_kind(accel: Accelerator) -> str:
    """The word a budget counts this accelerator's devices in: npu (Ascend), gpu (NVIDIA)."""
    return _KIND_OF_FAMILY[accel.family]


def parse_budget(text: str, accel: Accelerator) -> Budget:
    m = _PATTERN.match(str(text))
    if not m and str(text).startswith("-") and _PATTERN.match(str(text)[1:]):
        raise SpecError(f"--budget {text!r}: a budget is a positive amount (a device count is a positive integer, hours are positive)")
    if not m:
        raise SpecError(f"--budget {text!r}: expected e.g. 8npu, 16gpu, 2x8npu, 64card or 40npu-h")
    nodes, amount, kind, hours = m.group(1), float(m.group(2)), m.group(3).lower(), m.group(4)
    expected = _KIND_OF_FAMILY.get(accel.family)
    if kind == "die":
        if accel.device_unit != "die":
            raise SpecError(f"--budget {text!r} counts dies, but {accel.id}'s devices are {accel.device_unit}s; write "
                            f"{text.lower().replace('die', expected or 'card')!r}")  # fmt: skip
        kind = expected or "card"  # a die is the framework's device there
    elif kind != "card" and expected and kind != expected:
        fixed = f"{text[: m.start(3)]}{expected}{text[m.end(3) :]}".strip()
        raise SpecError(f"--budget {text!r} counts {kind.upper()}s but {accel.id} is an {accel.family} {expected.upper()}; "
                        f"write {fixed!r}")  # fmt: skip
    if nodes is not None and int(nodes) < 1:
        raise SpecError(f"--budget {text!r}: the node count must be at least 1")
    if hours:
        if nodes:
            raise SpecError(f"--budget {text!r}: an hours budget has no node count")
        if amount <= 0:
            raise SpecError(f"--budget {text!r}: hours must be positive")
        per_card = accel.devices_per_card if kind == "card" else 1  # card-hours -> device-hours
        return Budget(text, None, amount * per_card)
    if amount != int(amount) or amount < 1:
        raise SpecError(f"--budget {text!r}: a device count is a positive integer")
    count = int(amount)
    if nodes:
        if count * (accel.devices_per_card if kind == "card" else 1) > accel.devices_per_node:
            raise SpecError(f"--budget {text!r}: {count} per node, but a {accel.id} node holds {accel.devices_per_node} {accel.device_unit}s")
        count *= int(nodes)
    devices = count * accel.devices_per_card if kind == "card" else count
    if devices > MAX_DEVICES:
        raise SpecError(f"--budget {text!r}: {devices:,} {accel.device_unit}s is beyond the largest allocation planner searches "
                        f"({MAX_DEVICES:,}); an hours budget (e.g. 40{expected or 'card'}-h) leaves the device count open")  # fmt: skip
    if devices % accel.devices_per_card:
        raise SpecError(f"--budget {text!r}: {accel.id} has {accel.devices_per_card} {accel.device_unit}s per card, and {devices} is not "
                        f"a whole number of cards; write {devices - devices % accel.devices_per_card or accel.devices_per_card}{kind} "
                        f"or {devices + accel.devices_per_card - devices % accel.devices_per_card}{kind}")  # fmt: skip
    return Budget(text, devices, None, int(nodes) if nodes else None)
