"""Peak memory of the RL harness on one device: predicted from the model's exact accounting,
and measured.

Predicted: the tensors a GRPO step holds at its peak (the backward of one mini-batch) - policy
weights, their gradients, Adam's two moments, the frozen reference, the rollout copy in its own
precision, the saved initial weights that runs reset from, under bf16/fp16 autocast's cached
half-precision weight copies - plus what the forward of one mini-batch saves for backward:
the decoder layers from planner.cost.activations (the `transformers` backend: what transformers'
modeling code saves, measured op by op in tests/test_activation_memory.py), and the loss's own
vocabulary-sized tensors, on response tokens only (log_softmax's fp32 output and the exp of it the
entropy keeps).

The harness keeps fp32 master weights, so under bf16/fp16 autocast only matmul outputs are half:
the residual stream, norms and everything downstream of an fp32 weight stay fp32 (measured on the
tiny models: 70% of the saved bytes of qwen3_moe, 48% of deepseek_v3's). The layers are counted at
fp32 then, an upper bound measured within 0-22% of the saved bytes (tests/test_report_and_check.py
checks the whole peak under fp16).

Measured: on cuda or npu, the allocator's peak (`max_memory_allocated`) over a step. On CPU, where
no allocator keeps one, the bytes of every live tensor storage at the start of a step plus the
peak of allocations minus frees during it, read from torch.profiler's memory events: the same
quantity, tensor memory, without the process's runtime and page cache.
"""

from __future__ import annotations

import contextlib
import os

from planner.arch import Architecture
from planner.arch.params import count_parameters
from planner.cost.activations import layer_activation_bytes, output_activation_bytes
from planner.hf import require_torch

__all__ = ["predict_peak", "measure_step_peak"]

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def predict_peak(arch: Architecture, config) -> dict[str, float]:
    """Bytes by component at the harness's peak, and their total (`total`)."""
    params = count_parameters(arch).total
    weights = 4.0 * params  # fp32 master weights; autocast casts on the fly
    act = 4  # fp32 masters: see the module docstring for autocast
    layer = layer_activation_bytes(arch, act_bytes=act, backend="transformers", recompute="none")
    per_token = output_activation_bytes(arch, act_bytes=act, backend="transformers", logits=False)
    per_token += sum(layer.per_layer(arch)) + arch.num_moe_layers * layer.routed_per_copy * arch.moe.top_k
    sequences = config.prompts * config.group / config.mini_batches
    tokens = sequences * (config.prompt_len + config.new_tokens)
    vocab = 2 * 4.0 * arch.vocab_size * sequences * config.new_tokens  # log_softmax output and its exp, fp32, response tokens
    parts = {
        "policy weights": weights,
        "gradients": weights,
        "adam moments": 2 * weights,
        "reference": weights,
        "rollout copy": _BYTES[config.rollout_precision] * float(params),
        "initial weights": weights,
        # autocast caches a half-precision copy of every weight it casts, for the forward's duration
        "autocast weight copies": 0.0 if config.precision == "fp32" else _BYTES[config.precision] * float(params),
        "activations": per_token * tokens,
        "loss over the vocabulary": vocab,
    }
    parts["total"] = sum(parts.values())
    return parts


def _live_storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


@contextlib.contextmanager
def _native_stderr_silenced():
    """The profiler's C++ side writes its start/stop and allocator notices ("profiler_start",
    "Memory block of unknown size ...") straight to file descriptor 2, past Python's sys.stderr:
    point that descriptor at /dev/null for the profiled step only. Python errors still surface:
    they are raised, and printed after the descriptor is restored."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def measure_step_peak(trainer, step: int) -> float:
    """Run one step of `trainer` (planner.rl.grpo.GRPO) and return its peak tensor bytes."""
    torch, _ = require_torch("measuring memory")
    device = trainer.device
    if device.kind != "cpu":
        device.synchronize()
        device.reset_peak()
        trainer.step(step)
        device.synchronize()
        return float(device.peak_bytes())
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's own start/stop chatter
    from torch.profiler import ProfilerActivity, profile

    # the step sets gradients to None before each backward anyway; dropping them now keeps every
    # free during the step visible to the profiler (it misses frees of blocks allocated before it)
    trainer.optimizer.zero_grad(set_to_none=True)
    models = [trainer.policy, trainer.reference, trainer.rollout]
    tensors = [t for m in models for t in list(m.parameters()) + list(m.buffers())]
    tensors += [v for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    tensors += list((trainer.models.initial or {}).values())
    live = _live_storage_bytes(tensors)
    with _native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.step(step)
    events = []
    for e in prof.events():
        if e.name == "[memory]":
            events.append((e.time_range.start, e.cpu_memory_usage))
        elif e.self_cpu_memory_usage:
            events.append((e.time_range.start, e.self_cpu_memory_usage))
    current = peak = 0
    for _, delta in sorted(events):
        current += delta
        peak = max(peak, current)
    return float(live + peak)
