"""Memory predictions against bytes measured on tiny real transformers MoE models.

Two families: qwen3_moe (GQA with q/k norms, softmax top-k) and deepseek_v3 (MLA with q-LoRA, grouped
sigmoid routing with correction bias, shared expert, a dense first layer). Model states (weights,
gradients, Adam moments) must match exactly; bytes saved for backward, counted with
torch.autograd.graph.saved_tensors_hooks over unique storages (parameters excluded), within 10%,
for recompute none, moe (each MoE block checkpointed) and full, at several batch and sequence
sizes and two precisions.

The MLA model keeps v_head_dim equal to the query/key head width so CPU SDPA runs its flash kernel
(with unequal widths it falls back to the math kernel, which materialises the attention matrix).
"""

from __future__ import annotations

import pytest

from planner.arch import Architecture
from planner.catalog import load_accelerator
from planner.cost.model import CostModel
from planner.specs import Job

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "qwen3_moe": dict(
        BASE, model_type="qwen3_moe", head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
    ),
    "deepseek_v3": dict(
        BASE,
        model_type="deepseek_v3",
        num_key_value_heads=4,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        n_shared_experts=1,
    ),
}
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def build(config: dict, precision: str):
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, DTYPES[precision]), attn_implementation="sdpa")
    model.train()
    return model


def checkpointing(model) -> None:
    """Full activation recompute (transformers 5 renamed gradient checkpointing)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def rl_loss(model, ids):
    """Token log-probabilities of the sampled ids, as a policy-gradient loss gathers them."""
    logits = model(input_ids=ids, use_cache=False).logits
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).mean()


def checkpoint_moe_blocks(model):
    """Recompute "moe": every MoE block (router, experts, shared expert) runs under
    torch.utils.checkpoint, so backward rebuilds it from its input."""
    from torch.utils.checkpoint import checkpoint

    blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert blocks
    for block in blocks:
        block.forward = lambda *a, _f=block.forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)


def measured_saved_bytes(model, batch: int, seq: int) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr != 0:
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    ids = torch.randint(0, BASE["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rl_loss(model, ids)
    return sum(seen.values())


def cost_model(config: dict, precision: str, recompute: str) -> CostModel:
    job = Job(precision=precision, recompute=recompute, trainer_backend="transformers")
    return CostModel(Architecture.from_config(config), load_accelerator("h100-sxm"), job)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("recompute", ["none", "moe", "full"])
def test_saved_activation_bytes_within_10_percent(family, precision, recompute):
    config = CONFIGS[family]
    model = build(config, precision)
    if recompute == "full":
        checkpointing(model)
    elif recompute == "moe":
        checkpoint_moe_blocks(model)
    predictor = cost_model(config, precision, recompute)
    for batch, seq in [(1, 64), (2, 32), (4, 48), (2, 96)]:
        measured = measured_saved_bytes(model, batch, seq)
        predicted = predictor.saved_activation_bytes(batch * seq)
        assert predicted == pytest.approx(measured, rel=0.10), (family, precision, recompute, batch, seq)


@pytest.mark.slow
def test_full_recompute_saves_far_less_than_none():
    config = CONFIGS["qwen3_moe"]
    none = measured_saved_bytes(build(config, "bf16"), 2, 64)
    model = build(config, "bf16")
    checkpointing(model)
    full = measured_saved_bytes(model, 2, 64)
    assert full < none / 3
    ratio = cost_model(config, "bf16", "full").saved_activation_bytes(128) / cost_model(config, "bf16", "none").saved_activation_bytes(128)
    assert ratio == pytest.approx(full / none, rel=0.10)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_model_state_bytes_exact(family, precision):
    """Weights, gradients and AdamW moments after one real training step, byte for byte."""
    config = CONFIGS[family]
    model = build(config, precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, BASE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    rl_loss(model, ids).backward()
    optimizer.step()
    params = [p for p in model.parameters()]
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    moments = sum(
        optimizer.state[p][key].numel() * optimizer.state[p][key].element_size()
        for p in params
        for key in ("exp_avg", "exp_avg_sq")
    )
    predicted = cost_model(config, precision, "none").model_state_bytes()
    assert predicted == {"weights": weights, "grads": grads, "optimizer": moments}


def test_megatron_routed_copy_keeps_what_its_core_version_saves():
    """A routed copy under Megatron, from the tensor shapes (Qwen3-235B: h 4096, expert width 1536):
    Megatron-Core 0.13+ weighs the copy by its probability in the SwiGLU (fp32 probability kept, fc2
    output not); the older core under MindSpeed keeps the fc2 output for unpermute to weigh. The cost
    model takes the first on GPUs and the second on Ascend."""
    from planner.catalog import load_model
    from planner.cost.activations import layer_activation_bytes

    arch = load_model("qwen3-235b-a22b")
    h, i, k = 4096, 1536, 8
    new = layer_activation_bytes(arch, act_bytes=2, backend="megatron", recompute="none", probs="activation")
    old = layer_activation_bytes(arch, act_bytes=2, backend="megatron", recompute="none", probs="unpermute")
    assert new.routed_per_copy == 2 * (h + 3 * i) + 4 and old.routed_per_copy == 2 * (h + 3 * i + h)
    assert (new.attention, new.moe_fixed) == (old.attention, old.moe_fixed)  # only the routed copies differ
    with pytest.raises(ValueError, match="probs must be one of"):
        layer_activation_bytes(arch, act_bytes=2, backend="megatron", recompute="none", probs="combine")
    job = Job(trainer_backend="megatron")
    assert CostModel(arch, load_accelerator("h100-sxm"), job).act_routed == k * new.routed_per_copy
    assert CostModel(arch, load_accelerator("atlas-a3"), job).act_routed == k * old.routed_per_copy
