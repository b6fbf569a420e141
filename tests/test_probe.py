"""`planner probe`: the static recipes' critical knob on checkpoints streamed one decoder layer at a
time gives the calibration grid's shift (the harness holding the whole model) within the noise."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from click.testing import CliRunner

from planner.cli import main

pytestmark = pytest.mark.slow
SEEDS = [0, 1, 2, 3]


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def pair(rl_model, tmp_path_factory):
    """The small upcycled original (32 experts) and a K=8 proxy clustered from its weights."""
    model = rl_model[0]
    root = tmp_path_factory.mktemp("probe")
    assert run_cli("build", model, root / "proxy", "--experts", "8").exit_code == 0
    return model, root / "proxy"


@pytest.mark.parametrize("recipe_name", ["rollout-mismatch", "fp16-overflow"])
def test_probe_gives_the_grids_shift_within_the_noise(pair, recipe_name):
    from planner.fidelity.labels import knob_shift
    from planner.rl.grpo import Models
    from planner.rl.margin import critical_knob
    from planner.rl.probe import probe_pair
    from planner.rl.recipes import recipe

    original, proxy = pair
    r, iters = recipe(recipe_name), 6
    grid = {name: critical_knob(Models(path), r, SEEDS, iters=iters) for name, path in (("original", original), ("proxy", proxy))}
    resolution = (r.hi - r.lo) / 2 ** (iters + 1)
    harness = knob_shift(recipe_name, list(grid["original"].values), list(grid["proxy"].values), resolution=resolution)
    probed = probe_pair(original, proxy, recipe_name, seeds=SEEDS, iters=iters)
    labels = probed["labels"]
    assert probed["passes"] >= 2 * len(SEEDS) * 3 and probed["seconds_per_pass"] > 0
    assert not any(probed["original"]["censored"] + probed["proxy"]["censored"])
    both = math.hypot(labels["shift_se"], harness.se)
    assert abs(labels["shift_log2"] - harness.shift) <= 2 * both + 2 * resolution, (labels, harness)


def test_probe_cli_writes_the_labels_and_refuses_bad_input(pair, tmp_path):
    original, proxy = pair
    out = tmp_path / "probe.json"
    result = run_cli("probe", original, proxy, "--recipe", "rollout-mismatch", "--seeds", "0,1", "--iters", "3", "-o", out, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["labels"] == json.loads(result.stdout)["labels"]
    labels, side_o, side_p = data["labels"], data["original"], data["proxy"]
    assert len(side_o["values"]) == len(side_p["values"]) == 2
    # by hand: the knob's bracket is [0, 23] mantissa bits (log2 units), halved 3 + 1 times: 23 / 16 = 1.4375 bits
    assert data["resolution"] == 23 / 16
    assert labels["shift_log2"] == pytest.approx(statistics.mean(side_p["values"]) - statistics.mean(side_o["values"]), abs=1e-12)
    assert labels["noise_log2"] == pytest.approx(max(statistics.stdev(side_o["values"]), 23 / 16))  # seed SD, floored
    # two seeds a side: each side's SD counts at least the resolution, so the shift's standard error is at least
    # sqrt(1.4375^2 / 2 + 1.4375^2 / 2) = 1.4375 bits and its Welch degrees of freedom at most 2 + 2 - 2 = 2; the 90%
    # interval reaches t(0.95, 2) = 2.919986 standard errors either side, 4.20 bits: wider than the +-1 bit the
    # equivalence test needs, so 2 seeds cannot show "reproduced"; beyond +-1 entirely it is "not reproduced"
    shift, low, high = labels["shift_log2"], labels["shift_low"], labels["shift_high"]
    assert high - shift == pytest.approx(shift - low) and high - shift >= 2.919986 * 1.4375 - 1e-6
    decided = "not reproduced" if low > 1 or high < -1 else "undetermined"
    if any(side_o["censored"]) or (any(side_p["censored"]) and decided != "not reproduced"):
        decided = "undetermined"  # a censored side is a bound: only a "not reproduced" it settles stands
    assert labels["outcome"] == decided, labels
    again = run_cli("probe", original, proxy, "--recipe", "rollout-mismatch", "--seeds", "0,1", "-o", out)
    assert again.exit_code == 2 and "--force" in again.output
    one = run_cli("probe", original, proxy, "--recipe", "fp16-overflow", "--seeds", "0")
    assert one.exit_code == 2 and "at least 2" in one.output
    (tmp_path / "empty.txt").write_text("  \n")
    empty = run_cli("probe", original, proxy, "--recipe", "fp16-overflow", "--calib-text", tmp_path / "empty.txt")
    assert empty.exit_code == 2 and "is empty" in empty.output
