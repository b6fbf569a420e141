"""The critical knob value at which a fault appears, by bisection, per seed.

For a recipe whose knob grows towards the fault, bisection over [lo, hi] finds the smallest knob
that provokes it: on fixed batches at the initial weights for static recipes (the pilot's probe,
cheap and repeatable), over short training runs for dynamic ones. Each seed is a separate
bisection; the spread across seeds is the noise floor of the margin. A fault already present at lo
gives lo, one absent at hi gives hi, and both are flagged as censored; an end is probed only when the
bisection ends beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from planner.rl.grpo import GRPO, Models
from planner.rl.recipes import Recipe

__all__ = ["Margin", "critical_knob", "DEFAULT_ITERS", "DEFAULT_PROBE_STEPS"]

# bisection steps by recipe kind: a static probe is cheap, a dynamic one is a short training run
DEFAULT_ITERS = {"static": 8, "dynamic": 5}
DEFAULT_PROBE_STEPS = 12  # run length of one dynamic probe


@dataclass(frozen=True)
class Margin:
    recipe: str
    values: tuple[float, ...]  # critical knob per seed
    censored: tuple[bool, ...]
    probes: int

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))

    @property
    def spread(self) -> float:
        return float(np.std(self.values, ddof=1)) if len(self.values) > 1 else 0.0

    def to_json(self) -> dict:
        return {"recipe": self.recipe, "values": list(self.values), "censored": list(self.censored), "mean": self.mean,
                "spread": self.spread, "probes": self.probes}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> Margin:
        return cls(d["recipe"], tuple(d["values"]), tuple(d["censored"]), d["probes"])


def _bisect(fault, lo: float, hi: float, iters: int) -> tuple[float, bool, int]:
    """Bisect [lo, hi] for the smallest faulting knob: (value, censored, probes).

    The ends are probed only where the bracket never moved off them: a bisection that found no
    clean knob asks lo (faulting there: the crossing lies at or below lo, censored), one that found
    no faulting knob asks hi (clean there: at or above hi, censored). For a fault that is monotone
    in the knob this visits the same midpoints as probing both ends first and gives the same value
    and censoring, two probes sooner (the clean end is the dearest probe of a dynamic recipe: a run
    to its last step)."""
    a, b, probes = lo, hi, 0
    for _ in range(iters):
        mid = 0.5 * (a + b)
        probes += 1
        if fault(mid):
            b = mid
        else:
            a = mid
    if a == lo:
        probes += 1
        if fault(lo):
            return lo, True, probes
    if b == hi:
        probes += 1
        if not fault(hi):
            return hi, True, probes
    return 0.5 * (a + b), False, probes


def critical_knob(models: Models, recipe: Recipe, seeds: list[int], *, iters: int | None = None, steps: int = DEFAULT_PROBE_STEPS,
                  settings: Mapping[str, object] | None = None) -> Margin:  # fmt: skip
    """The critical knob per seed; `settings` are RLConfig settings on top of the recipe's (e.g. a
    smaller job: prompts, group, new_tokens)."""
    iters = DEFAULT_ITERS[recipe.kind] if iters is None else iters
    extra = dict(settings or {})
    values, censored, probes = [], [], 0
    for seed in seeds:
        if recipe.name == "fp16-overflow":
            trainer = GRPO(models, recipe.config(recipe.lo, seed=seed, **extra))
            fault = trainer.overflow_probe(trainer._batch(seed))  # one forward, a backward per knob

        elif recipe.name == "rollout-mismatch":

            def fault(knob, seed=seed):
                return GRPO(models, recipe.config(knob, seed=seed, **extra)).probe_mismatch(seed) > recipe.threshold

        else:

            def fault(knob, seed=seed):
                trainer = GRPO(models, recipe.config(knob, seed=seed, steps=steps, **extra))
                rows = trainer.run(stop=lambda rows: recipe.onset(rows) is not None)
                return recipe.onset(rows) is not None

        value, cens, n = _bisect(fault, recipe.lo, recipe.hi, iters)
        values.append(value)
        censored.append(cens)
        probes += n
    return Margin(recipe.name, tuple(values), tuple(censored), probes)
