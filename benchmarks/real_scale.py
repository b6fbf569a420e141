"""The real-scale cross-check: `planner probe` at a catalog model's real width against the estimator.

Makes a checkpoint with Qwen3-30B-A3B's real tensor shapes and a few decoder layers (hidden 2048,
128 experts of 768, the 151,936-token vocabulary; bf16) whose weights are synthetic the way the
calibration families' are made: each MoE layer's experts are one dense MLP plus 5% noise (sparse
upcycling), the router rows, attention and embeddings random normal (0.02), norms 1. Builds its
K=32 proxy with `planner build` (experts chosen from the weights: no calibration pass), bisects the
static recipe's critical knob on both with `planner probe` (the grid's seeds and resolution, one
decoder layer in memory at a time), and prints the measured shift next to what the estimator
predicts for that routing shape and K/E (from its calibration family at hidden 64). The result is
appended to calibration/real_scale.json.

    python benchmarks/real_scale.py [--layers 2] [--recipe rollout-mismatch] [--device cpu|cuda|npu] [--workdir DIR]

On a 2-core CPU one rollout-mismatch bisection step of a 2-layer checkpoint takes about half a
minute, so the whole check (2 models x 4 seeds x ~10 steps) is most of an hour; fp16 overflow
needs --device cuda or npu (fp16 matmuls are emulated on this CPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_io import write_checkpoint  # noqa: E402  (sharded bf16 safetensors from (name, shape, bytes))


def bf16(x: np.ndarray) -> bytes:
    """float32 -> bf16 bytes, rounded to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def upcycled_qwen3(path: Path, layers: int, seed: int = 0) -> int:
    """A qwen3_moe checkpoint of Qwen3-30B-A3B's shapes, `layers` decoder layers, upcycled-style weights."""
    from planner.catalog import load_model_config

    _, config = load_model_config("qwen3-30b-a3b")
    config = {**config, "num_hidden_layers": layers}
    h, inter, e, v = config["hidden_size"], config["moe_intermediate_size"], config["num_experts"], config["vocab_size"]
    q, kv, hd = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"], config["head_dim"]
    rng = np.random.default_rng(seed)

    def normal(*shape, std=0.02):
        return rng.standard_normal(shape, dtype=np.float32) * std

    def tensors():
        yield "model.embed_tokens.weight", (v, h), bf16(normal(v, h))
        yield "lm_head.weight", (v, h), bf16(normal(v, h))
        yield "model.norm.weight", (h,), bf16(np.ones(h, np.float32))
        for i in range(layers):
            p = f"model.layers.{i}"
            for name in ("input_layernorm", "post_attention_layernorm"):
                yield f"{p}.{name}.weight", (h,), bf16(np.ones(h, np.float32))
            for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
                yield f"{p}.self_attn.{name}.weight", shape, bf16(normal(*shape))
            for name in ("q_norm", "k_norm"):
                yield f"{p}.self_attn.{name}.weight", (hd,), bf16(np.ones(hd, np.float32))
            yield f"{p}.mlp.gate.weight", (e, h), bf16(normal(e, h))
            base = {"gate_proj": normal(inter, h), "up_proj": normal(inter, h), "down_proj": normal(h, inter)}
            for x in range(e):
                for name, w in base.items():
                    yield f"{p}.mlp.experts.{x}.{name}.weight", w.shape, bf16(w + normal(*w.shape, std=0.02 * 0.05))

    return write_checkpoint(path, tensors(), config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--recipe", default="rollout-mismatch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("-o", "--output", default=str(ROOT / "calibration" / "real_scale.json"))
    args = parser.parse_args()
    from planner.catalog import load_model_config
    from planner.fidelity.dataset import plan_row
    from planner.fidelity.estimator import FidelityEstimator, default_estimator_path
    from planner.fidelity.grid import Grid
    from planner.files import write_text_atomic
    from planner.rl.probe import probe_pair

    grid = Grid()
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        size = upcycled_qwen3(root / "original", args.layers)
        subprocess.run([sys.executable, "-m", "planner.cli", "build", str(root / "original"), str(root / "proxy"), "--experts",
                        str(args.experts), "--verify", "never"], check=True, capture_output=True)  # fmt: skip
        made = time.perf_counter() - t0
        print(f"checkpoint {size / 1e9:.2f} GB ({args.layers} decoder layers of Qwen3-30B-A3B's shapes), K={args.experts} proxy: {made:.0f} s",
              flush=True)  # fmt: skip
        t0 = time.perf_counter()
        probed = probe_pair(root / "original", root / "proxy", args.recipe, seeds=list(grid.margin_seeds), iters=grid.iters(args.recipe),
                            device=args.device, say=lambda s: print(s, flush=True))  # fmt: skip
        seconds = time.perf_counter() - t0
    config = load_model_config("qwen3-30b-a3b")[1]
    predicted = FidelityEstimator.load(default_estimator_path()).predict(plan_row(config, args.experts, None), args.recipe)
    labels = probed["labels"]
    inside = None
    if predicted.get("shift_interval"):
        lo, hi = predicted["shift_interval"]
        inside = bool(lo <= labels["shift_log2"] <= hi)
    record = {"model": "qwen3-30b-a3b", "decoder_layers": args.layers, "experts": args.experts, "recipe": args.recipe, "device": args.device,
              "weights": "synthetic upcycled (dense + 5% noise per expert), seed 0", "measured": labels,
              "original": probed["original"], "proxy": probed["proxy"], "seconds": round(seconds, 1),
              "predicted": {k: predicted.get(k) for k in ("status", "basis", "shift_log2", "shift_interval", "p_reproduced", "interval", "reason")},
              "measured_inside_predicted_interval": inside, "machine": platform.machine(), "python": platform.python_version()}  # fmt: skip
    out = Path(args.output)
    data = json.loads(out.read_text()) if out.is_file() else {"checks": []}
    data["checks"].append(record)
    write_text_atomic(out, json.dumps(data, indent=1))
    print(f"measured at real width: shift {labels['shift_log2']:+.3f} log2 (90% interval [{labels['shift_low']:+.3f}, {labels['shift_high']:+.3f}], "
          f"noise {labels['noise_log2']:.3f}, {labels['outcome']}) in {seconds / 60:.1f} min")  # fmt: skip
    if predicted["status"] == "calibrated":
        print(f"predicted from the calibration family ({predicted['basis']}): shift {predicted['shift_log2']:+.3f} "
              f"[{predicted['shift_interval'][0]:+.3f}, {predicted['shift_interval'][1]:+.3f}], P(reproduced) {predicted['p_reproduced']:.2f}; "
              f"measured {'inside' if inside else 'outside'} the predicted interval")  # fmt: skip
    else:
        print(f"predicted: {predicted['status']}: {predicted['reason']}")


if __name__ == "__main__":
    main()
