"""A correction bias run to where auxiliary-loss-free balancing leaves it.

Sigmoid routers with a correction bias (DeepSeek-V3, GLM-4.5, Nemotron-H) choose experts by score
plus bias; during pretraining every bias moves by a small step towards an even load after each
batch (Wang et al. 2024; DeepSeek-V3's update speed is 0.001), so a trained model's biases balance
its E experts. A proxy that keeps K of them slices the biases, which then balance experts that are
gone: the kept experts' load is uneven from the first step. Settling runs the same update again,
in windows of SETTLE_WINDOW passes: the step starts at 2^SETTLE_HALVINGS times the rate and halves
after each window in which no bias drifted one way (each moved less than half of what the window
could move it); the search ends after such a window at the rate itself, or after SETTLE_PASSES
passes. The small calibration models settle this way after training (forward passes on training
batches: planner.rl.models), and `planner stats --settle-bias` settles each plan's kept experts on
the original's router logits of the calibration text (planner.stats.compute).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

__all__ = ["BIAS_RATE", "SETTLE_WINDOW", "SETTLE_HALVINGS", "SETTLE_PASSES", "balance_bias", "settle"]

BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed (technical report, section 4.2); GLM-4.5 and Nemotron 3 publish the same
SETTLE_WINDOW, SETTLE_HALVINGS, SETTLE_PASSES = 50, 4, 1500  # passes a window, halvings of its step, passes at most


def balance_bias(bias, counts, step: float) -> None:
    """One update of auxiliary-loss-free balancing, in place: every expert's bias moves by `step`,
    up where it took fewer than the mean of the routed slots `counts`, down where it took more."""
    import torch

    with torch.no_grad():
        bias.add_(torch.sign(counts.mean() - counts).to(bias.dtype), alpha=step)


def settle(one_pass: Callable[[float], None], biases: Sequence, rate: float = BIAS_RATE, *,
           new_window: Callable[[], None] | None = None, progress: Callable[[int, int], None] | None = None) -> dict:  # fmt: skip
    """Run `one_pass(step)` (one batch's routing and its bias update at `step`) until the biases stop
    drifting (the module docstring says how); `new_window()` runs before each window. Returns the
    passes and the last window's largest drift."""
    passes, step, drift = 0, rate * 2**SETTLE_HALVINGS, math.inf
    while passes < SETTLE_PASSES:
        before = [b.clone() for b in biases]
        if new_window:
            new_window()
        for _ in range(SETTLE_WINDOW):
            one_pass(step)
            passes += 1
        drift = max(float((b - a).abs().max()) for b, a in zip(biases, before))
        if progress:
            progress(passes, SETTLE_PASSES)
        if drift < SETTLE_WINDOW * step / 2:  # settled at this step
            if step <= rate:
                break
            step = max(rate, step / 2)
    return {"passes": passes, "drift": round(drift, 5)}
