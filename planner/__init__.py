"""planner: cost model and fidelity planner for proxy MoE models in RL post-training."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("planner")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"

__all__ = ["__version__"]
