"""The RL cost model: hardware profiles, layouts, memory per device, phase times (numpy only)."""

from planner.cost.evaluate import CostResult, candidate_device_counts, evaluate, min_devices
from planner.cost.hardware import Accelerator
from planner.cost.knobs import Knobs, load_knobs
from planner.cost.model import CostModel

__all__ = [
    "Accelerator",
    "CostModel",
    "CostResult",
    "Knobs",
    "candidate_device_counts",
    "evaluate",
    "load_knobs",
    "min_devices",
]
