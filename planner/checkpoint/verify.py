"""Check that a built proxy runs as transformers' model, one decoder layer in memory at a time.

transformers builds the proxy's model from its config (on the meta device); every parameter is then
filled from the proxy's files, one decoder layer at a time in the checkpoint's own dtype
(planner.checkpoint.layerwise), so memory stays at about the embeddings and head plus one layer
whatever the checkpoint's size. Checked: every parameter has a tensor of its size and every tensor
feeds a parameter (none missing or unexpected; MTP layers aside, which transformers does not
build), the logits of a forward pass are finite, and, when asked (`compare`), against the original
on the same tokens, run the same way after the proxy is released: bit-identical logits for a
keep-all plan, otherwise the mean KL(original || proxy) of the next-token distributions. The
comparison reads the whole original (E/K times the proxy's expert bytes), so the build compares by
default only where it proves the copy exact (keep-all); `planner stats` measures the KL on real text.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

from planner.checkpoint.reader import Checkpoint
from planner.errors import CheckpointError
from planner.hf import require_torch
from planner.plan import Plan

__all__ = ["verify_proxy", "compute_dtype"]

def compute_dtype(ckpt: Checkpoint):
    """The dtype holding most of the checkpoint's bytes, as torch's (fp8 and others: bfloat16)."""
    from planner.checkpoint.layerwise import NATIVE_DTYPES

    torch, _ = require_torch("verifying a build")
    by_dtype: dict[str, int] = {}
    for t in ckpt.tensors.values():
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
    main = max(by_dtype, key=by_dtype.get) if by_dtype else "BF16"
    return getattr(torch, NATIVE_DTYPES.get(main, "bfloat16"))


def _logits(ckpt: Checkpoint, ids, dtype, num_layers: int):
    """Logits of `ids` (float32), and the tensors of `ckpt` that no parameter used."""
    from planner.checkpoint.layerwise import LayerwiseModel

    lw = LayerwiseModel(ckpt, dtype=dtype)
    logits = lw.forward(ids).float()
    mtp = re.compile(r"(?:^|\.)layers\.(\d+)\.")
    unused = sorted(n for n in set(ckpt.tensors) - lw.read if not ((m := mtp.search(n)) and int(m.group(1)) >= num_layers))
    del lw
    gc.collect()
    return logits, unused


def verify_proxy(source: Path, proxy: Path, plan: Plan, *, num_layers: int, compare: bool = True, tokens: int = 24, seed: int = 0) -> dict:
    """Run the proxy layer by layer, check it, and (`compare`) compare its logits with the source's
    (`num_layers`: the decoder layers of both; MTP layers beyond them are not part of the causal LM)."""
    torch, _ = require_torch("verifying a build")
    built = Checkpoint(proxy)
    dtype = compute_dtype(built)
    ids = torch.randint(0, built.arch.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(seed))
    try:
        logits, unused = _logits(built, ids, dtype, num_layers)
    except (RuntimeError, ValueError, KeyError) as exc:  # transformers or torch refusing the proxy's config or tensors
        raise CheckpointError(f"{proxy}: the proxy does not run as transformers' model: {exc}") from None
    if unused:
        raise CheckpointError(f"{proxy}: {len(unused)} tensor(s) feed no parameter of transformers' model, e.g. {unused[:3]}")
    if not torch.isfinite(logits).all():
        raise CheckpointError(f"{proxy}: the proxy's logits contain NaN or inf")
    name = str(dtype).removeprefix("torch.")
    out = {"load": f"every tensor feeds a parameter, none missing (layer by layer, {name})", "forward": "finite"}
    if not compare:
        return out
    reference, _ = _logits(Checkpoint(source), ids, dtype, num_layers)
    if plan.experts == plan.original_experts and not plan.correction_bias:  # a copy: nothing may differ
        if not torch.equal(logits, reference):
            raise CheckpointError(f"{proxy}: a keep-all plan must give bit-identical logits; max difference "
                                  f"{(logits - reference).abs().max().item():.3g}")  # fmt: skip
        out["logits"] = "bit-identical to the original"
    else:
        p = torch.log_softmax(reference.double(), -1)
        q = torch.log_softmax(logits.double(), -1)
        out["kl_original_proxy"] = float((p.exp() * (p - q)).sum(-1).mean())
    return out
