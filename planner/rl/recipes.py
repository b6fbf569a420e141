"""Fault recipes: a knob that provokes one failure, a detector that says when it appears.

Every knob grows towards the fault, so the critical knob value is found by bisection (planner.rl.
margin). Detector rules and thresholds were fixed on the original models' runs before any proxy ran
(docs: calibration/README.md); they are stated here and never tuned per model.

static recipes are probed at the initial weights on fixed batches (no training): cheap and exact.
dynamic recipes need a short training run per probe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from planner.errors import SpecError
from planner.rl.grpo import RLConfig
from planner.runs.detect import THRESHOLDS

__all__ = ["Recipe", "RECIPES", "recipe"]


@dataclass(frozen=True, kw_only=True)
class Recipe:
    name: str
    fault: str
    knob: str
    lo: float  # bisection bracket; larger values provoke the fault
    hi: float
    kind: str  # static | dynamic
    base: Mapping[str, object] = field(default_factory=dict)  # RLConfig settings of the recipe
    steps: int = 16  # run length of one probe (dynamic) / of a curve run
    threshold: float = 0.0  # the detector's threshold (meaning per recipe)
    version: int = 1  # bump when the measurement changes: the calibration grid re-measures this recipe

    def config(self, knob: float, *, seed: int, steps: int | None = None, **extra) -> RLConfig:
        settings = {**self.base, **extra, "seed": seed, "steps": self.steps if steps is None else steps}
        if not math.isfinite(knob) or abs(knob) > 300:  # the log10 knobs would overflow a float; RLConfig bounds the rest
            raise SpecError(f"{self.name}: knob {knob} is not a finite number of at most 300 in magnitude (its bracket: {self.lo} to {self.hi})")
        if self.name == "fp16-overflow":
            settings["loss_scale_log2"] = knob
        elif self.name == "rollout-mismatch":
            settings["rollout_mantissa_bits"] = 23.0 - knob
        elif self.name == "router-collapse":
            settings["balance_coef"] = -(10.0**knob)
        else:  # entropy-collapse, grad-blowup: the learning rate (a ramp's peak for grad-blowup)
            settings["lr"] = 10.0**knob
        return RLConfig(**settings)

    def onset(self, rows: list[dict]) -> int | None:
        """First step at which the fault shows in a run's metrics, or None: the detector of
        planner.runs.detect that `planner detect` runs on any trainer's logs, at this recipe's threshold."""
        from planner.runs.detect import onset_of

        if self.name == "fp16-overflow":
            return onset_of("fp16-overflow", rows)
        found = onset_of(self.name, rows, threshold=self.threshold)
        if self.name == "grad-blowup":  # a non-finite update is where a blow-up ends
            hits = [s for s in (found, onset_of("non-finite", rows)) if s is not None]
            return min(hits) if hits else None
        return found


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            name="fp16-overflow",
            fault="a non-finite gradient under fp16 autocast with a static loss scale (a skipped step)",
            knob="log2 of the static loss scale",
            lo=4.0,
            hi=40.0,
            kind="static",
            base={"precision": "fp16", "lr": 3e-5, "kl_coef": 0.05},
        ),
        Recipe(
            name="rollout-mismatch",
            fault="train-rollout mismatch: mean k3 KL between rollout and trainer token log-probs above 0.01",
            knob="mantissa bits removed from the rollout weights (23 - bits)",
            lo=0.0,
            hi=23.0,  # no mantissa bit left (powers of two); v1's 22 censored trained models whose crossing sits at 21.5-22
            kind="static",
            base={"lr": 3e-5, "kl_coef": 0.05},
            threshold=THRESHOLDS["rollout-mismatch"],
            version=2,  # v2: bracket [0, 23] (v1: [0, 22])
        ),
        Recipe(
            name="entropy-collapse",
            fault="policy entropy below 0.2 x its first-step value",
            knob="log10 learning rate, no KL anchor, no entropy bonus",
            lo=-5.0,
            hi=-1.0,
            kind="dynamic",
            base={"kl_coef": 0.0, "entropy_coef": 0.0, "grad_clip": 1.0},
            threshold=THRESHOLDS["entropy-collapse"],
        ),
        Recipe(
            name="grad-blowup",
            fault="grad norm above 5 x the median of the first 5 steps (or non-finite) after step 5",
            knob="log10 peak of a linear learning-rate ramp, KL anchor 1.0, no clipping",
            lo=-5.0,
            hi=-0.5,
            kind="dynamic",
            base={"kl_coef": 1.0, "grad_clip": None, "lr_schedule": "ramp"},
            threshold=THRESHOLDS["grad-blowup"],
        ),
        Recipe(
            name="router-collapse",
            fault="in some MoE layer, the top-k share of routed tokens is over 90% of the way from balanced (k/E) to collapsed (1)",
            knob="log10 of a negative balance-loss coefficient (anti-balance strength)",
            lo=-4.0,
            hi=2.0,
            kind="dynamic",
            base={"lr": 1e-3, "kl_coef": 0.05, "grad_clip": None},  # at 3e-3 routers collapsed unprovoked on some seeds
            threshold=THRESHOLDS["router-collapse"],
            version=2,  # v2: detector on the normalised top-k share, balance loss normalised to [0, 1] for any E
        ),
    )
}


def recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise SpecError(f"unknown recipe {name!r}; one of {', '.join(RECIPES)}")
    return RECIPES[name]
