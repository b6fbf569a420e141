"""Where the calibration originals' routing starts (planner.fidelity.starts), on planted rows, and
the words the estimator puts beside a router-collapse prediction."""

from __future__ import annotations

import json

import pytest

from planner.fidelity.starts import STARTS_SCHEMA, load_starts, merge_starts, start_text, summarise


def row(family="deepseek_v3-e256", seed=0, balancing="none", original=(0.6, 0.7), proxy=(0.4, 0.5), hidden=64, k=64):
    return {"family": family, "hidden": hidden, "layers": 3, "seed": seed, "steps": 300, "balancing": balancing, "proxy_experts": k,
            "original": list(original), "proxy": list(proxy), "threshold": 0.9}  # fmt: skip


def test_starts_are_averaged_per_original_at_the_calibration_scale_and_merged_by_identity(tmp_path):
    rows = [row(), row(seed=1, original=(0.2, 0.5)), row(k=128, proxy=(0.55, 0.65)), row(balancing="published", original=(0.1, 0.1)),
            row(hidden=512, original=(0.9, 0.9))]  # fmt: skip
    got = summarise(rows)["deepseek_v3-e256"]
    # two originals (seed 0 counted once for its two proxies), hidden 512 left out; every proxy row counts
    assert got["none"] == {"original": pytest.approx(0.5), "proxy": pytest.approx(0.5), "originals": 2, "threshold": 0.9}
    assert got["published"]["original"] == pytest.approx(0.1)
    text = start_text(got)
    assert "trained without load balancing and start 0.50 of the way from balanced to collapsed before any push (proxies 0.50" in text
    assert "trained with the shape's published load balancing an original starts at 0.10" in text and "fires at 0.9" in text
    assert start_text(None) == "" and start_text({"published": got["published"]}) == ""
    own = start_text(got, "published")  # a family of balanced originals: its own start first, the other beside it
    assert own.startswith("its originals were trained with the shape's published load balancing and start 0.10")
    assert own.endswith("; trained without load balancing an original starts at 0.50")
    assert start_text({"none": got["none"]}, "published") == ""
    again = merge_starts(rows, [row(original=(0.0, 0.0))])
    assert len(again) == len(rows) and again[-1]["original"] == [0.0, 0.0]
    path = tmp_path / "starts.json"
    path.write_text(json.dumps({"schema": STARTS_SCHEMA, "rows": again}))
    assert load_starts(path) == again and load_starts(tmp_path / "absent.json") == []
    path.write_text(json.dumps({"schema": "other/1", "rows": []}))
    from planner.errors import SpecError

    with pytest.raises(SpecError, match="not a routing-starts file"):
        load_starts(path)


def test_a_router_collapse_prediction_says_where_its_familys_originals_start():
    from planner.catalog import load_model_config
    from planner.fidelity.dataset import plan_row
    from planner.fidelity.estimator import FidelityEstimator, default_estimator_path, family_text

    estimator = FidelityEstimator.load(default_estimator_path())
    estimator.info["starts"] = summarise([row(), row(balancing="published", original=(0.1, 0.1))])
    r = plan_row(load_model_config("deepseek-v3")[1], 64, None)
    f = estimator.predict(r, "router-collapse")
    # the shape's family of originals trained with its published balancing has 3 or more: it answers
    assert f["family"]["name"] == "deepseek_v3-e256-bal" and f["family"]["start"]["published"]["original"] == pytest.approx(0.1)
    text = family_text(f["family"])
    assert "trained with the shape's published load balancing and start 0.10" in text
    assert "trained without load balancing an original starts at 0.65" in text
    other = estimator.predict(r, "rollout-mismatch")  # a static fault is not read against the routing's start
    assert "start" not in other.get("family", {})
