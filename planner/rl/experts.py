"""Training through transformers' eager experts without the cost that grows with E squared.

transformers keeps a MoE layer's experts as stacked parameters (experts x out x in), and its eager
path loops over the experts a batch routes to, taking one expert's weights as `param[expert]`.
Autograd's backward of that slice writes a zero tensor the size of the whole stack for every expert
and adds them up: memory traffic of E stacks per layer and step, 83% of a training step of the
512-expert calibration family on this CPU. `fast_eager_experts` hooks every such experts module so
that, while a forward pass records gradients, `param[expert]` returns one row of a single
`param.unbind(0)`, whose backward stacks the experts' gradients once. The values are the same
slices and the gradient the same sums (a sum of disjoint slices and zeros), so training is bitwise
unchanged (tests/test_rl.py checks it) and models made before and after are the same bytes; only
the time changes (measured by `python benchmarks/eager_experts.py`).

`fit_scan_chunks` does the same for the chunked scans of Mamba-2 mixers and of Qwen3-Next's gated
DeltaNet: the harness's short sequences without the padding to a whole chunk, the same values in
less time.
"""

from __future__ import annotations

__all__ = ["fast_eager_experts", "fit_scan_chunks"]


class _Rows:
    """A stacked expert parameter seen as its rows: an integer index returns that row of one unbind;
    anything else indexes the parameter itself."""

    __slots__ = ("param", "rows")

    def __init__(self, param):
        self.param = param
        self.rows = param.unbind(0)

    def __getitem__(self, key):
        import torch

        if isinstance(key, int) or (isinstance(key, torch.Tensor) and key.ndim == 0 and not key.is_floating_point()):
            return self.rows[int(key)]
        return self.param[key]


def _stacked_experts(module) -> bool:
    """An experts module of transformers' experts interface (the decorator marks it), whose eager
    path indexes one expert at a time; Llama-4's experts, which multiply whole stacks, are not."""
    return hasattr(module, "_is_expert_parallel") and any(p.ndim >= 2 for p in module.parameters(recurse=False))


def fast_eager_experts(model) -> int:
    """Hook every stacked-experts module of `model` (once; a second call does nothing); returns the
    number of modules hooked. Forward passes without gradients are left as they are."""
    import torch

    if getattr(model, "_planner_fast_experts", None) is not None:
        return model._planner_fast_experts
    hooked = 0
    for module in model.modules():
        if not _stacked_experts(module):
            continue
        names = [n for n, p in module.named_parameters(recurse=False) if p.ndim >= 2]

        def swap_in(mod, args, names=names):
            if torch.is_grad_enabled():
                for n in names:
                    if mod._parameters[n].requires_grad:
                        mod.__dict__[n] = _Rows(mod._parameters[n])  # found before nn.Module's own lookup

        def swap_out(mod, args, out, names=names):
            for n in names:
                mod.__dict__.pop(n, None)

        module.register_forward_pre_hook(swap_in)
        module.register_forward_hook(swap_out, always_call=True)  # also when the forward raises
        hooked += 1
    model._planner_fast_experts = hooked
    return hooked


def fit_scan_chunks(model, length: int) -> int:
    """Shrink the chunk of every chunked scan in `model` that transformers runs on its PyTorch path
    (where the CUDA kernels cannot run) to `length`, the longest sequence the caller runs, where the
    scan's chunk is longer: the Mamba-2 mixers' (the config's chunk) and Qwen3-Next's gated DeltaNet
    layers' (the chunked delta rule's default, 64); returns the number of layers whose chunk is now
    shorter than their own. A later call with another length sets it again. (Where flash-linear-
    attention's kernel runs the delta rule instead, transformers drops a keyword it does not take.)

    A scan pads a sequence to a whole chunk and builds chunk x chunk decay matrices: Nemotron-H's 128
    for the harness's 32 tokens is 16 times the work of the matrices it needs, the delta rule's 64
    four times. A sequence no longer than the chunk is one chunk either way, and the padded
    positions only add zeros to its sums, so the values do not change (on this project's grid models
    the GRPO runs' metrics are bitwise the same; tests/test_rl.py checks a training step of each) and
    a probe takes about a half (Nemotron-H) or four fifths (Qwen3-Next) of the time."""
    changed = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("Mamba2Mixer") and hasattr(module, "chunk_size"):
            config_chunk = module.__dict__.setdefault("_planner_config_chunk", module.chunk_size)  # a model reused for longer runs gets it back
            module.chunk_size = min(config_chunk, length)
            changed += module.chunk_size < config_chunk
        elif name in _DELTA_RULE_LAYERS and (default := _delta_rule_chunk(module)) is not None:
            if "_planner_chunk" not in module.__dict__:
                module.register_forward_pre_hook(_pass_chunk, with_kwargs=True)
            module._planner_chunk = length if length < default else None
            changed += module._planner_chunk is not None
    return changed


# gated-DeltaNet layers whose forward hands its keyword arguments on to the chunked delta rule (the
# chunk is one of them); another model's layer may not, so each is named here once checked
_DELTA_RULE_LAYERS = ("Qwen3NextGatedDeltaNet",)


def _delta_rule_chunk(module) -> int | None:
    """The default chunk of the chunked delta rule in `module`'s transformers module, or None."""
    import inspect
    import sys

    rule = getattr(sys.modules.get(type(module).__module__), "torch_chunk_gated_delta_rule", None)
    try:
        return int(inspect.signature(rule).parameters["chunk_size"].default)
    except (TypeError, ValueError, KeyError):
        return None


def _pass_chunk(module, args, kwargs):
    """A forward pre-hook: the layer's fitted chunk among the keywords its forward hands to the rule."""
    if module._planner_chunk is None:
        return None
    return args, {**kwargs, "chunk_size": module._planner_chunk}
