"""Routing shapes and the calibration families: every catalog model has a family of its own shape,
whose small model transformers builds with exactly that router."""

from __future__ import annotations

import pytest

from planner.arch.routing import RoutingShape, routing_shape
from planner.catalog import catalog_models, load_model
from planner.families import family_architecture, family_config, family_configs, family_of_shape


@pytest.mark.parametrize("model", sorted(catalog_models()))
def test_every_catalog_model_has_a_family_of_its_routing_shape(model):
    shape = routing_shape(load_model(model))
    family = family_of_shape(shape)
    assert family is not None, f"{model}: no calibration family of shape {shape.key()}"
    small = routing_shape(family_architecture(family))
    assert small == shape, small.differences(shape)
    arch = family_architecture(family)
    # only width, depth, vocabulary shrink (a Nemotron-H layer is one block: three mixer + MLP pairs)
    assert arch.hidden_size == 64 and arch.num_layers == 3 * (2 if arch.norms_per_layer == 1 else 1) and arch.vocab_size == 256


@pytest.mark.parametrize("model", sorted(catalog_models()))
def test_every_catalog_models_family_has_a_grid_file_with_legal_counts(model):
    """The grid that calibrates a catalog model's family is shipped, loads, and asks only for expert
    counts the family's checkpoint can be cut to (from top_k to half the experts)."""
    from pathlib import Path

    from planner.fidelity.grid import Grid

    family = family_of_shape(routing_shape(load_model(model)))
    grids = [Grid.load(p) for p in sorted((Path(__file__).parents[1] / "calibration" / "grids").glob("*.yaml"))]
    mine = [g for g in grids if family in g.families]
    assert mine, f"{model}: no grid file under calibration/grids lists its family {family}"
    arch = family_architecture(family)
    for grid in mine:
        counts = grid.experts(family)
        assert counts and all(c in arch.legal_expert_counts() and arch.moe.top_k <= c <= arch.original_num_experts // 2 for c in counts), counts


def test_shapes_name_what_pruning_touches():
    shapes = {m: routing_shape(load_model(m)) for m in catalog_models()}
    assert shapes["qwen3-30b-a3b"] == shapes["qwen3-235b-a22b"]  # one shape, one family
    assert shapes["mixtral-8x7b"].mechanism == shapes["qwen3-30b-a3b"].mechanism  # always-renormalised softmax is softmax + renorm
    v3 = shapes["deepseek-v3"]
    assert (v3.experts, v3.top_k, v3.scoring, v3.groups, v3.groups_kept, v3.scaling) == (256, 8, "sigmoid", 8, 4, 2.5)
    assert v3.correction_bias and v3.shared_experts and v3.dense_layers and v3.renormalised
    assert shapes["qwen1.5-moe-a2.7b"].shared_gate and not shapes["qwen1.5-moe-a2.7b"].renormalised
    assert shapes["gpt-oss-20b"].router_bias and shapes["gpt-oss-20b"].scored_after_top_k
    assert shapes["llama-4-scout"].scoring == "sigmoid_topk" and not shapes["llama-4-scout"].renormalised
    assert len({s.key() for s in shapes.values()}) == len(set(shapes.values())) == 11
    assert RoutingShape.from_json(v3.to_json()) == v3
    assert "top-8 of 256" in v3.describe() and "8 groups, top-4 kept" in v3.describe()


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(family_configs()))
def test_transformers_builds_each_family_with_its_router(family):
    """The small model's real transformers class: its router module has E rows, and its config
    carries every routing key of the shape."""
    import torch
    import transformers

    config = family_config(family)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    shape = routing_shape(family_architecture(family))
    rows = [p.shape[0] for n, p in model.named_parameters() if n.endswith(("gate.weight", "router.weight")) and "shared" not in n]
    assert rows and set(rows) == {shape.experts}
    text = model.config
    assert text.num_experts_per_tok == shape.top_k
    if shape.groups > 1:
        assert (text.n_group, text.topk_group) == (shape.groups, shape.groups_kept)
    logits = model(input_ids=torch.arange(16).reshape(1, 16)).logits
    assert logits.shape == (1, 16, 256) and torch.isfinite(logits).all()
