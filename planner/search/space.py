"""An Optuna sampler that visits every point of a small, finite space once, in a seeded order.

Optuna's BruteForceSampler does the same but builds its tree from every trial in the storage, and a
trial cut short by a kill (left RUNNING or FAIL with only some of its parameters) breaks it for good
("param_name mismatch"), while the point that trial held is never visited again. Here a trial takes
all its parameters at once (relative sampling); a point counts as visited only when a trial holding
all of it is COMPLETE, and as taken while a complete-parameter trial runs it elsewhere (another
worker on the same storage). Partial trials are ignored, so their points are visited again. When no
point is left untaken, a point that is only running elsewhere is taken too (a worker that died
would otherwise leave it unvisited); when every point is complete, `exhausted` is set and the
caller stops the study.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import TrialState

__all__ = ["SpaceSampler"]


class SpaceSampler(optuna.samplers.BaseSampler):
    def __init__(self, space: dict[str, Sequence[Any]], seed: int = 0):
        self.names = tuple(space)
        self.distributions = {n: CategoricalDistribution(list(v)) for n, v in space.items()}
        points = [()]
        for n in self.names:
            points = [p + (v,) for p in points for v in space[n]]
        self.order = random.Random(seed).sample(points, len(points))  # the seeded visiting order
        self.exhausted = False
        self._fallback = optuna.samplers.RandomSampler(seed=seed)  # the trial that finds every point done

    def _points(self, study, states) -> set[tuple]:
        trials = study.get_trials(deepcopy=False, states=states)
        return {tuple(t.params[n] for n in self.names) for t in trials if all(n in t.params for n in self.names)}

    def missing(self, study) -> list[tuple]:
        """The points no COMPLETE trial holds, in visiting order."""
        done = self._points(study, (TrialState.COMPLETE,))
        return [p for p in self.order if p not in done]

    def infer_relative_search_space(self, study, trial) -> dict[str, BaseDistribution]:
        return dict(self.distributions)

    def sample_relative(self, study, trial, search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        missing = self.missing(study)
        if not missing:
            self.exhausted = True
            return {}  # every point is complete: the caller stops; this trial re-evaluates a random one
        running = self._points(study, (TrialState.RUNNING,))
        point = next((p for p in missing if p not in running), missing[0])
        return dict(zip(self.names, point))

    def sample_independent(self, study, trial, param_name: str, param_distribution: BaseDistribution) -> Any:
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)
