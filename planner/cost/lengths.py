"""Response-length distribution of an RL step.

Published RL runs state the mean and the cap of response lengths, rarely the shape. We model a
response length as min(G, max) with G ~ Gamma(shape, scale), the scale solved so the truncated mean
equals the stated mean; the mass above the cap piles up at the cap (truncated generations). A mean
at the cap means every response runs to the cap (random-weight runs that never emit EOS).

What the cost model reads from it:
  survival(j)  P(R >= j): the share of sequences still decoding at step j (the shrinking batch)
  moments      E[R], E[(P+R)^2] for attention FLOPs, the length-biased mean context for KV,
               E[max of n R] for micro-batches padded to their longest sequence
It is discretised once into `bins` equal-width decode-step bins, so rollout time is a sum over bins,
vectorised over layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from planner.errors import SpecError
from planner.specs import Lengths

__all__ = ["LengthModel"]


def _gamma_survival(x: np.ndarray, shape: float, scale: float) -> np.ndarray:
    """P(G >= x) by numerical integration of the gamma density on a fine grid (no scipy)."""
    top = float(x.max())
    grid = np.linspace(0.0, top, 8193)
    mid = 0.5 * (grid[1:] + grid[:-1])
    z = mid / scale
    log_pdf = (shape - 1) * np.log(np.maximum(z, 1e-300)) - z - math.lgamma(shape) - math.log(scale)
    mass = np.exp(log_pdf) * np.diff(grid)
    cdf = np.concatenate([[0.0], np.cumsum(mass)])
    cdf = np.minimum(cdf, 1.0)
    return 1.0 - np.interp(x, grid, cdf)


@dataclass(frozen=True)
class LengthModel:
    max_len: int
    mean: float
    step_edges: np.ndarray  # decode-step bin edges, 0 .. max_len
    survival: np.ndarray  # P(R >= bin midpoint) per bin
    pmf_lengths: np.ndarray  # support points of R for moment sums
    pmf: np.ndarray

    @classmethod
    def from_spec(cls, spec: Lengths, bins: int = 64) -> "LengthModel":
        return _build(cls, spec, bins)

    @classmethod
    def _build(cls, spec: Lengths, bins: int) -> "LengthModel":
        m = int(spec.max)
        if spec.mean >= m * 0.999:
            lengths = np.array([float(m)])
            return cls(
                max_len=m,
                mean=float(m),
                step_edges=np.linspace(0, m, min(bins, m) + 1),
                survival=np.ones(min(bins, m)),
                pmf_lengths=lengths,
                pmf=np.array([1.0]),
            )
        support = np.arange(1, m + 1, dtype=float)

        def truncated_mean(scale: float) -> float:
            surv = _gamma_survival(support, spec.shape, scale)
            return float(surv.sum())  # E[min(G, m)] = sum_{j=1..m} P(G >= j) on the integer grid

        lo, hi = 1e-3, 1e3 * m
        if truncated_mean(hi) < spec.mean:
            raise SpecError(f"response_tokens: mean {spec.mean} unreachable below max {m} with shape {spec.shape}")
        for _ in range(80):
            mid = math.sqrt(lo * hi)
            if truncated_mean(mid) < spec.mean:
                lo = mid
            else:
                hi = mid
        scale = math.sqrt(lo * hi)
        surv_int = _gamma_survival(np.arange(1, m + 2, dtype=float), spec.shape, scale)  # P(G >= j), j=1..m+1
        pmf = surv_int[:-1] - surv_int[1:]
        pmf[-1] += surv_int[-1]  # mass beyond the cap sits at the cap
        pmf = pmf / pmf.sum()
        n_bins = min(bins, m)
        edges = np.linspace(0, m, n_bins + 1)
        mids = 0.5 * (edges[1:] + edges[:-1])
        survival = _gamma_survival(np.maximum(mids, 1.0), spec.shape, scale)
        survival[-1] = max(survival[-1], surv_int[-2])  # truncated responses decode to the last step
        return cls(
            max_len=m,
            mean=float((support * pmf).sum()),
            step_edges=edges,
            survival=survival,
            pmf_lengths=support,
            pmf=pmf,
        )

    @property
    def bin_steps(self) -> np.ndarray:
        return np.diff(self.step_edges)

    @property
    def bin_mid(self) -> np.ndarray:
        return 0.5 * (self.step_edges[1:] + self.step_edges[:-1])

    def expect(self, fn) -> float:
        """E[fn(R)] over the discrete length distribution."""
        return float((fn(self.pmf_lengths) * self.pmf).sum())

    def expected_max(self, n: int) -> float:
        """E[max of n independent lengths]: what a micro-batch of n sequences is padded to."""
        cdf = np.cumsum(self.pmf)
        return float((self.pmf_lengths * np.diff(np.concatenate([[0.0], np.minimum(cdf, 1.0) ** n]))).sum())

    @property
    def live_context_extra(self) -> float:
        """Mean response progress of a sequence that is decoding at a random moment:
        E[R^2] / (2 E[R]) (length-biased: long responses are live for longer)."""
        return self.expect(lambda r: r * r) / (2.0 * self.mean)

    @property
    def p_at_max(self) -> float:
        return float(self.pmf[-1])


@lru_cache(maxsize=64)
def _build(cls: type, spec: Lengths, bins: int) -> LengthModel:
    """Solving for the gamma scale is the costly part; specs are frozen, so cache by value."""
    return cls._build(spec, bins)
