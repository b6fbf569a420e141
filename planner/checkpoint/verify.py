"""Load a built proxy in transformers and check it runs like a model should.

Strict load (no missing, unexpected or mismatched keys, MTP layers aside), a forward pass and a short
greedy generation with no NaN or inf; against the original on the same tokens: bit-identical logits
for a keep-all plan, otherwise the mean KL(original || proxy) of next-token distributions.
"""

from __future__ import annotations

import re
from pathlib import Path

from planner.errors import CheckpointError
from planner.hf import require_torch
from planner.plan import Plan

__all__ = ["verify_proxy", "load_strict"]


def load_strict(path: Path, *, num_layers: int | None = None):
    """The model in float32 with transformers' loading report checked: nothing missing, unexpected
    (except layers numbered from `num_layers`: MTP, which transformers does not build) or resized."""
    torch, transformers = require_torch("verifying a build")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True, use_safetensors=True, local_files_only=True
    )
    unexpected = list(info.get("unexpected_keys", []))
    if num_layers is not None:
        mtp = re.compile(r"(?:^|\.)layers\.(\d+)\.")
        unexpected = [k for k in unexpected if not ((m := mtp.search(k)) and int(m.group(1)) >= num_layers)]
    problems = {k: v for k, v in (("missing", info.get("missing_keys")), ("unexpected", unexpected),
                                  ("mismatched", info.get("mismatched_keys"))) if v}  # fmt: skip
    if problems:
        raise CheckpointError(f"{path}: transformers does not load the proxy cleanly: {problems}")
    model.eval()
    return model


def verify_proxy(source: Path, proxy: Path, plan: Plan, *, num_layers: int, tokens: int = 24, seed: int = 0) -> dict:
    """Load the proxy strictly, run it, and compare its logits with the source's (`num_layers`:
    the decoder layers of both; MTP layers beyond them are not part of the causal LM)."""
    torch, _ = require_torch("verifying a build")
    model = load_strict(proxy, num_layers=num_layers)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        generated = model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
    if not torch.isfinite(logits).all():
        raise CheckpointError(f"{proxy}: the proxy's logits contain NaN or inf")
    original = load_strict(source, num_layers=num_layers)
    with torch.no_grad():
        reference = original(input_ids=ids).logits
    out = {"load": "strict ok", "forward": "finite", "generated_tokens": int(generated.shape[1] - 8)}
    if plan.experts == plan.original_experts:
        identical = bool(torch.equal(logits, reference))
        if not identical:
            raise CheckpointError(f"{proxy}: a keep-all plan must give bit-identical logits; max difference "
                                  f"{(logits - reference).abs().max().item():.3g}")
        out["logits"] = "bit-identical to the original"
    else:
        p = torch.log_softmax(reference.double(), -1)
        q = torch.log_softmax(logits.double(), -1)
        out["kl_original_proxy"] = float((p.exp() * (p - q)).sum(-1).mean())
    return out

