"""`planner stats` with calibration text against one forward pass of the same tokens, for 1 to 6 K.

Makes a qwen3_moe checkpoint with random bf16 weights (distinct experts) of the shape given below
(default: the issue's 2 GB case, 9 decoder layers x 64 experts of top-8), then measures in one run:
  - one forward pass of the calibration tokens through transformers' model, layer by layer in float32
    (LayerwiseModel.forward: what the statistics run; its construction excluded);
  - compute_stats with calibration for growing numbers of K (default method), construction included;
and prints each as a multiple of the forward (goal <= 1.5x whatever the number of K), with the share
of the calibration pass, the plan pass and the rest. Both run on the same ids, in the same process.

    python benchmarks/stats_speed.py [--layers 9 --experts 64 --hidden 1024 --moe-inter 512 --vocab 151936]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from checkpoint_io import GIB, write_checkpoint

from planner.checkpoint import Checkpoint


def _bf16(rng, shape, scale=0.02) -> bytes:
    x = rng.standard_normal(size=shape, dtype=np.float32) * scale
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def make_checkpoint(path: Path, *, layers: int, experts: int, hidden: int, moe_inter: int, vocab: int, top_k: int) -> int:
    heads, kv, head_dim = 16, 4, 128
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "intermediate_size": 4 * hidden,
              "moe_intermediate_size": moe_inter, "num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": True,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": vocab, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}  # fmt: skip
    rng = np.random.default_rng(0)
    shapes = [("model.embed_tokens.weight", (vocab, hidden)), ("lm_head.weight", (vocab, hidden)), ("model.norm.weight", (hidden,))]
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.input_layernorm.weight", (hidden,)), (f"{p}.post_attention_layernorm.weight", (hidden,)),
                   (f"{p}.self_attn.q_proj.weight", (heads * head_dim, hidden)), (f"{p}.self_attn.k_proj.weight", (kv * head_dim, hidden)),
                   (f"{p}.self_attn.v_proj.weight", (kv * head_dim, hidden)), (f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim)),
                   (f"{p}.self_attn.q_norm.weight", (head_dim,)), (f"{p}.self_attn.k_norm.weight", (head_dim,)),
                   (f"{p}.mlp.gate.weight", (experts, hidden))]  # fmt: skip
        for x in range(experts):
            shapes += [(f"{p}.mlp.experts.{x}.gate_proj.weight", (moe_inter, hidden)), (f"{p}.mlp.experts.{x}.up_proj.weight", (moe_inter, hidden)),
                       (f"{p}.mlp.experts.{x}.down_proj.weight", (hidden, moe_inter))]  # fmt: skip
    ones = lambda shape: (np.ones(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()  # noqa: E731
    return write_checkpoint(path, ((name, shape, ones(shape) if len(shape) == 1 else _bf16(rng, shape)) for name, shape in shapes), config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-inter", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--calib-tokens", type=int, default=4096)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    import torch

    from planner.checkpoint.layerwise import LayerwiseModel
    from planner.stats.compute import compute_stats
    from planner.stats.text import calibration_ids

    work = Path(args.workdir or tempfile.mkdtemp(prefix="planner-stats-bench-"))
    try:
        src = work / "ckpt"
        total = make_checkpoint(src, layers=args.layers, experts=args.experts, hidden=args.hidden, moe_inter=args.moe_inter,
                                vocab=args.vocab, top_k=args.top_k)  # fmt: skip
        ckpt = Checkpoint(src)
        print(f"checkpoint: {total / GIB:.2f} GiB, {args.layers} layers x {args.experts} experts (top-{args.top_k}), "
              f"hidden {args.hidden}, vocab {args.vocab}; {args.calib_tokens} calibration tokens, float32")  # fmt: skip
        ids, _ = calibration_ids(src, ckpt.arch.vocab_size, text=None, tokens=args.calib_tokens, seq_len=256)
        runner = LayerwiseModel(ckpt)
        runs = []
        for _ in range(2):  # the faster of two: the first pays one-time costs that stats pays too
            start = time.perf_counter()
            runner.forward(torch.from_numpy(ids))
            runs.append(time.perf_counter() - start)
        forward = min(runs)
        del runner
        print(f"one forward pass of {ids.size} tokens: {forward:.1f} s (the faster of {runs[0]:.1f} and {runs[1]:.1f} s)")
        e = args.experts
        sets = [[e // 2], [e // 2, e // 4, e // 8], [3 * e // 4, e // 2, 3 * e // 8, e // 4, 3 * e // 16, e // 8]]
        for experts in sets:
            phases: dict[str, float] = {}
            last = [time.perf_counter(), None]

            def progress(name, done, total_, last=last, phases=phases):
                now = time.perf_counter()
                key = name.split()[0]
                phases[key] = phases.get(key, 0.0) + now - last[0]
                last[0] = now

            start = time.perf_counter()
            stats = compute_stats(ckpt, experts=experts, calib_tokens=args.calib_tokens, progress=progress)
            seconds = time.perf_counter() - start
            parts = ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
            print(f"  stats for {len(experts)} K {experts}: {seconds:.1f} s = {seconds / forward:.2f}x one forward (goal <= 1.5x); {parts}")
            assert len(stats["plans"]) == len(experts)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
