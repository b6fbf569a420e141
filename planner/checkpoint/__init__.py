"""Checkpoint surgery: index-first safetensors reading, streamed proxy building, verification."""

from planner.checkpoint.build import EXPERT_MAP_NAME, BuildReport, build
from planner.checkpoint.reader import Checkpoint, MoELayer

__all__ = ["BuildReport", "Checkpoint", "EXPERT_MAP_NAME", "MoELayer", "build"]
