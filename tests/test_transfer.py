"""Scale transfer on planted points: the fitted slope recovers the planted one within its interval,
the widening grows with the distance beyond the measured scale, and an unmeasured shape says so."""

from __future__ import annotations

import math

import numpy as np

from planner.fidelity.transfer import fit_transfer, widening


def planted(slope_h: float, slope_l: float, noise: float = 0.05, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    points = []
    for hidden in (64, 128, 256):
        for layers in (3, 6):
            for s in range(3):
                shift = 0.1 + slope_h * math.log2(hidden / 64) + slope_l * math.log2(layers / 3) + rng.normal(scale=noise)
                points.append({"recipe": "fp16-overflow", "shape": "softmax/top8of128/renorm", "hidden": hidden, "layers": layers,
                               "original": f"h{hidden}-l{layers}-s{s}", "shift_log2": shift, "shift_se": noise, "censored": False})  # fmt: skip
    return points


def test_the_fit_recovers_planted_slopes_and_the_widening_grows_with_distance():
    fits = fit_transfer(planted(-0.2, 0.1))
    fit = fits["fp16-overflow|softmax/top8of128/renorm"]
    assert fit["fitted"] and fit["points"] == 18 and fit["hidden"] == [64, 128, 256] and fit["layers"] == [3, 6]
    assert abs(fit["coef"]["log2_hidden"] + 0.2) < 0.05 and abs(fit["coef"]["log2_layers"] - 0.1) < 0.05
    # the 90% intervals cover the planted slopes about 90% of the time
    covered = []
    for seed in range(40):
        f = fit_transfer(planted(-0.2, 0.1, seed=seed))["fp16-overflow|softmax/top8of128/renorm"]
        covered.append([f["interval"]["log2_hidden"][0] < -0.2 < f["interval"]["log2_hidden"][1],
                        f["interval"]["log2_layers"][0] < 0.1 < f["interval"]["log2_layers"][1]])  # fmt: skip
    assert 0.75 <= np.mean(covered) <= 1.0
    near = widening(fits, "fp16-overflow", "softmax/top8of128/renorm", 128, 3)
    inside = widening(fits, "fp16-overflow", "softmax/top8of128/renorm", 256, 6)
    far = widening(fits, "fp16-overflow", "softmax/top8of128/renorm", 2048, 48)
    assert 0 < near["halfwidth"] < inside["halfwidth"] < far["halfwidth"]
    # beyond the data: at least the planted change to the target (|-0.2 x 5 + 0.1 x 4| = 0.6)
    assert far["halfwidth"] > 0.6 and "beyond the measured hidden 256" in far["text"]
    assert "beyond" not in inside["text"]


def test_an_unmeasured_shape_or_direction_is_said_not_measured():
    fits = fit_transfer(planted(0.0, 0.0))
    other = widening(fits, "fp16-overflow", "sigmoid/top8of256/renorm", 7168, 61)
    assert other["halfwidth"] is None and other["text"].startswith("transfer not measured beyond hidden 64")
    few = fit_transfer([p for p in planted(0.0, 0.0) if (p["hidden"], p["layers"]) in ((64, 3), (64, 6), (128, 3)) and p["original"].endswith("-s0")])
    (key, entry), = few.items()
    sparse = widening(few, *key.split("|"), 7168, 61)  # too few points for a slope: where they lie, and why none
    assert sparse["halfwidth"] is None and not entry["fitted"]
    assert sparse["text"].startswith(f"transfer not fitted (points at hidden {', '.join(map(str, entry['hidden']))}") and entry["reason"] in sparse["text"]
    widths_only = fit_transfer([p for p in planted(0.0, 0.0) if p["layers"] == 3])
    fit = widths_only["fp16-overflow|softmax/top8of128/renorm"]
    assert fit["interval"]["log2_layers"] is None
    deeper = widening(widths_only, "fp16-overflow", "softmax/top8of128/renorm", 128, 12)
    assert deeper["halfwidth"] is None and "layers not measured" in deeper["text"]
    assert widening(widths_only, "fp16-overflow", "softmax/top8of128/renorm", 128, 3)["halfwidth"] is not None
