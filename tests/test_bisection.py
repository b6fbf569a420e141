"""The margin's bisection on planted monotone faults: the critical knob, its censoring and the
probes it costs, against a bisection written out here that probes both ends first."""

from __future__ import annotations

import numpy as np
import pytest

from planner.rl.margin import _bisect


def ends_first(fault, lo, hi, iters):
    """The textbook order: both ends, then the midpoints."""
    if fault(lo):
        return lo, True
    if not fault(hi):
        return hi, True
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if fault(mid) else (mid, hi)
    return 0.5 * (lo + hi), False


@pytest.mark.parametrize("critical", [-9.0, -4.0, -3.99, -2.5, 0.0, 0.123, 1.7, 1.999, 2.0, 5.0])
def test_the_knob_and_its_censoring_match_probing_the_ends_first(critical):
    calls = []

    def fault(knob):
        calls.append(knob)
        return knob >= critical

    value, censored, probes = _bisect(fault, -4.0, 2.0, 7)
    assert (value, censored) == ends_first(lambda k: k >= critical, -4.0, 2.0, 7)
    assert probes == len(calls)
    if censored:
        assert value == (-4.0 if critical <= -4.0 else 2.0)
    else:
        assert abs(value - critical) <= 6.0 / 2**8  # half the final bracket
    # an end is probed only where the bracket never left it: 7 midpoints, plus the end beside the result
    inside = -4.0 + 6.0 / 2**7 < critical <= 2.0 - 6.0 / 2**7
    assert probes == (7 if inside else 8)
    assert (-4.0 in calls) == (critical <= -4.0 + 6.0 / 2**7) and (2.0 in calls) == (critical > 2.0 - 6.0 / 2**7)


def test_a_fault_at_every_knob_is_censored_at_the_floor_and_none_at_the_ceiling():
    assert _bisect(lambda k: True, 0.0, 1.0, 5)[:2] == (0.0, True)
    assert _bisect(lambda k: False, 0.0, 1.0, 5)[:2] == (1.0, True)
    rng = np.random.default_rng(0)
    for critical in rng.uniform(0.0, 1.0, 50):
        assert not _bisect(lambda k, c=critical: k >= c, 0.0, 1.0, 10)[1]
