"""Model architectures: family data, config reading, exact parameter accounting (pure Python)."""

from planner.arch.families import FAMILIES, Family, supported_model_types
from planner.arch.model import Architecture, Attention, LayerWindow, LinearMixer, MoE, config_with_experts
from planner.arch.params import LayerParams, ParamBreakdown, count_parameters, expert_params, layer_params, linear_mixer_params

__all__ = [
    "FAMILIES",
    "Family",
    "supported_model_types",
    "Architecture",
    "LinearMixer",
    "Attention",
    "LayerWindow",
    "MoE",
    "config_with_experts",
    "LayerParams",
    "ParamBreakdown",
    "count_parameters",
    "expert_params",
    "linear_mixer_params",
    "layer_params",
]
