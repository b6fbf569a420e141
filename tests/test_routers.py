"""The routers seen from outside (planner.rl.routers) and the published load balancing the small
originals can be trained with (planner.rl.models, calibration/families.yaml)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_switch_loss_reads_one_balanced_and_e_over_k_collapsed_over_the_batch_or_per_sequence():
    from planner.rl.routers import collapse_share, expert_counts, switch_loss

    e, k, tokens = 8, 2, 16
    even_ids = torch.arange(tokens * k).reshape(tokens, k) % e
    assert float(switch_loss(torch.full((tokens, e), 1 / e), even_ids)) == pytest.approx(1.0)
    # two sequences, each on its own two experts: collapsed within each, spread over four in the batch
    ids = torch.cat([torch.tensor([[0, 1]]).repeat(tokens // 2, 1), torch.tensor([[2, 3]]).repeat(tokens // 2, 1)])
    probs = torch.zeros(tokens, e)
    probs[: tokens // 2, :2] = 0.5
    probs[tokens // 2 :, 2:4] = 0.5
    assert float(switch_loss(probs, ids, sequences=2)) == pytest.approx(e / k)
    assert float(switch_loss(probs, ids)) == pytest.approx(e / (2 * k))
    share, normalised = collapse_share(expert_counts(ids, e), k)
    assert share == pytest.approx(0.5) and normalised == pytest.approx((0.5 - k / e) / (1 - k / e))
    assert float(switch_loss(torch.full((4, 2), 0.5), torch.tensor([[0, 1]] * 4))) == 1.0  # E <= k: nothing to balance


def _tiny(family: str):
    import transformers

    from planner.families import family_config

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**family_config(family)))


def test_the_correction_bias_moves_by_the_rate_towards_an_even_load():
    """Every router with a correction bias moves each expert's bias by exactly the rate: up where
    the expert took fewer than the mean of the routed slots, down where it took more."""
    from planner.rl.routers import Routers, expert_counts, update_correction_bias

    model = _tiny("deepseek_v3")
    routers = Routers(model)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (4, 32)))
    assert len(routers.calls) == 2  # the MoE layers (the first layer is dense)
    counts = [expert_counts(ids, 32) for _, _, ids in routers.calls]
    assert update_correction_bias(routers.calls, 0.01) == 2
    for (module, _, _), c in zip(routers.calls, counts):
        bias = module.e_score_correction_bias
        np.testing.assert_allclose(bias.numpy(), 0.01 * np.sign(float(c.mean()) - c.numpy()), atol=1e-7)
    routers.remove()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (1, 8)))
    assert routers.calls == []
    # a router without a correction bias is left alone
    softmax = _tiny("qwen3_moe")
    hooked = Routers(softmax)
    with torch.no_grad():
        softmax(input_ids=torch.randint(0, 256, (1, 8)))
    assert update_correction_bias(hooked.calls, 0.01) == 0


def test_every_family_states_its_published_balancing():
    from planner.arch.routing import routing_shape
    from planner.families import family_architecture, family_balancing, family_configs

    for family in family_configs():
        b = family_balancing(family)
        assert b["source"] and b["scope"] in ("batch", "sequence")
        shape = routing_shape(family_architecture(family))
        # the correction-bias routers balance by moving it; the others by a balance loss
        assert (b["bias_rate"] > 0) == shape.correction_bias or family == "nemotron_h-e128", family
        assert b["loss"] > 0, family


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_published_balancing_enters_only_the_moe_stage(tmp_path, family):
    """The dense stage and the first MoE step's language-model loss are the same either way; the
    balanced original's routers differ, and on a correction-bias shape its bias is a sum of steps of
    the published rate, settled after training, where the unbalanced one's stays zero."""
    from safetensors.torch import load_file

    from planner.families import family_balancing
    from planner.rl.models import ModelRecipe, make_model

    reports, weights = {}, {}
    for mode in ("none", "published"):
        reports[mode] = make_model(family, tmp_path / mode, ModelRecipe(dense_steps=3, moe_steps=5, balancing=mode))
        weights[mode] = load_file(tmp_path / mode / "model.safetensors")
        saved = json.loads((tmp_path / mode / "make_report.json").read_text())
        assert saved["balancing"]["mode"] == mode and 0.0 <= saved["routing_end"]["collapse_max"] <= 1.0
    assert reports["none"]["dense_loss"] == reports["published"]["dense_loss"]
    assert reports["none"]["moe_loss"][0] == reports["published"]["moe_loss"][0]
    gates = [n for n in weights["none"] if n.endswith("mlp.gate.weight")]
    assert gates and any(not torch.equal(weights["none"][n], weights["published"][n]) for n in gates)
    rate = family_balancing(family)["bias_rate"]
    biases = [n for n in weights["none"] if n.endswith("e_score_correction_bias")]
    if rate:
        from planner.stats.settle import SETTLE_PASSES, SETTLE_WINDOW

        assert biases and all(float(weights["none"][n].abs().max()) == 0.0 for n in biases)
        # the training steps and the settling passes move a bias by +-rate times a power of two: a whole number of rates
        for n in biases:
            steps = weights["published"][n].numpy() / rate
            assert np.allclose(steps, np.round(steps), atol=1e-3) and np.abs(steps).max() >= 1
        settled = reports["published"]["routing_end"]["settle"]
        assert settled["passes"] % SETTLE_WINDOW == 0 and settled["passes"] <= SETTLE_PASSES
        # it stopped where nothing drifted at the published rate, or at its cap
        assert settled["drift"] < SETTLE_WINDOW * rate / 2 or settled["passes"] == SETTLE_PASSES
        assert reports["published"]["routing_end"]["correction_bias_abs_max"] == pytest.approx(
            max(float(weights["published"][n].abs().max()) for n in biases), abs=1e-4)
    else:
        assert not biases and reports["published"]["routing_end"]["correction_bias_abs_max"] is None
        assert "settle" not in reports["published"]["routing_end"]


def test_an_unknown_balancing_is_refused():
    from planner.errors import SpecError
    from planner.rl.models import ModelRecipe

    with pytest.raises(SpecError, match="balancing 'loss-free'"):
        ModelRecipe(balancing="loss-free")


@pytest.mark.slow
def test_a_grid_of_balanced_originals_names_them_apart_and_keeps_earlier_grids_keys(tmp_path):
    """`balancing: published` trains the grid's originals with the shape's balancing; their names end
    in -bal, so their rows never meet the unbalanced originals' of the same seeds, and the setting
    enters the key only when set (the grids measured before keep their studies)."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from planner.fidelity.grid import Grid, prepare, study_name

    grid = Grid(families=("deepseek_v3",), originals=1, recipes=("router-collapse",), kept_fractions=(0.25,), methods=("agglomerative",),
                random_draws=1, calib_tokens=128, dense_steps=3, moe_steps=5, balancing="published")  # fmt: skip
    plain = replace(grid, balancing="none")
    assert plain.key() != grid.key()
    assert plain.model_settings().get("balancing") is None and grid.model_settings()["balancing"] == "published"
    assert "deepseek_v3-s0-bal" in study_name(grid, "router-collapse", "originals", grid.original("deepseek_v3", 0))
    records = prepare(grid, tmp_path / "w")
    assert records and all(key.startswith("deepseek_v3-s0-bal/") for key in records)
    original = records["deepseek_v3-s0-bal/original"]["path"]
    report = json.loads((tmp_path / "w" / "models" / "deepseek_v3-s0-bal" / "original" / "make_report.json").read_text())
    assert report["balancing"]["mode"] == "published" and report["balancing"]["bias_rate"] == 0.001
    biases = [v for n, v in load_file(f"{original}/model.safetensors").items() if n.endswith("e_score_correction_bias")]
    assert biases and max(float(b.abs().max()) for b in biases) > 0
    with pytest.raises(Exception, match="balancing 'some'"):
        Grid(balancing="some")
