"""The real-scale cross-check: `planner probe` at a catalog model's real width against the estimator.

Makes a checkpoint with a catalog model's real tensor shapes and a few decoder layers, bf16, in the
Hub's per-expert naming: Qwen3-30B-A3B (hidden 2048, 128 experts of 768, the 151,936-token
vocabulary; about 3.7 GB at 2 layers) or DeepSeek-V3 (hidden 7168, multi-head latent attention, one
dense first layer, then MoE layers of 256 experts of 2048 with the correction bias and a shared
expert; about 27 GB at 2 layers, one MoE layer alone 22.5 GB). The weights are synthetic the way the
calibration families' are made: each MoE layer's experts are one dense MLP plus 5% noise (sparse
upcycling), the router rows, attention and embeddings random normal (0.02), norms 1, the correction
bias 0. Builds its K=32 proxy with `planner build` (experts chosen from the weights: no calibration
pass), bisects the static recipe's critical knob on both with `planner probe` (the grid's seeds and
resolution, one decoder layer in memory at a time), and prints the measured shift next to what the
estimator predicts for that routing shape and K/E (from its calibration family at hidden 64). The
result is appended to calibration/real_scale.json. Before making anything it checks the disk and the
memory the probe's largest layer needs, and says what is missing.

    python benchmarks/real_scale.py [--model qwen3-30b-a3b|deepseek-v3] [--layers 2] [--recipe rollout-mismatch]
                                    [--device cpu|cuda|npu] [--workdir DIR]
    python benchmarks/real_scale.py --report    # every stored check against the current estimator

The measurement stays; the prediction (for the probed checkpoint: real width, its few layers, the
estimator's scale-transfer widening included) is derived again by --report after a refit.

On a 2-core CPU one rollout-mismatch bisection step of Qwen3-30B-A3B's 2-layer checkpoint takes
about half a minute, so the whole check (2 models x 4 seeds x ~10 steps) is most of an hour; fp16
overflow needs --device cuda or npu (fp16 matmuls are emulated on this CPU). DeepSeek-V3's MoE
layer alone exceeds a 23 GB machine's memory: it needs a device (an H200 or a 64 GB NPU holds it).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
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


MODELS = ("qwen3-30b-a3b", "deepseek-v3")


def _layout(model_id: str, layers: int) -> tuple[dict, list[tuple[str, tuple, str]]]:
    """The config (cut to `layers` decoder layers) and every tensor as (name, shape, kind) in the Hub's
    per-expert naming; kind is "ones" (norms), "zeros" (the correction bias), "normal" (0.02), or
    "expert:LAYER" (that layer's dense MLP plus 5% noise: sparse upcycling)."""
    from planner.catalog import load_model_config

    _, config = load_model_config(model_id)
    h, v, e = config["hidden_size"], config["vocab_size"], config.get("num_experts") or config["n_routed_experts"]
    inter = config["moe_intermediate_size"]
    out = [("model.embed_tokens.weight", (v, h), "normal"), ("lm_head.weight", (v, h), "normal"), ("model.norm.weight", (h,), "ones")]

    def mlp(prefix: str, width: int, kind: str = "normal") -> list:
        return [(f"{prefix}.gate_proj.weight", (width, h), kind), (f"{prefix}.up_proj.weight", (width, h), kind),
                (f"{prefix}.down_proj.weight", (h, width), kind)]  # fmt: skip

    def experts(p: str) -> list:  # gate_proj first: its shape is (intermediate, hidden)
        return [(name, shape, f"expert:{p}") for x in range(e) for name, shape, _ in mlp(f"{p}.mlp.experts.{x}", inter)]

    if config["model_type"] == "qwen3_moe":
        config = {**config, "num_hidden_layers": layers}
        q, kv, hd = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"], config["head_dim"]
        for i in range(layers):
            p = f"model.layers.{i}"
            out += [(f"{p}.input_layernorm.weight", (h,), "ones"), (f"{p}.post_attention_layernorm.weight", (h,), "ones")]
            out += [(f"{p}.self_attn.{n}.weight", shape, "normal") for n, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q)))]
            out += [(f"{p}.self_attn.{n}.weight", (hd,), "ones") for n in ("q_norm", "k_norm")]
            out += [(f"{p}.mlp.gate.weight", (e, h), "normal")] + experts(p)
        return config, out
    if config["model_type"] != "deepseek_v3":
        raise SystemExit(f"no synthetic layout for {model_id} ({config['model_type']})")
    # DeepSeek-V3: multi-head latent attention; one dense first layer, the rest MoE (the real model has 3
    # dense of 61); the multi-token-prediction layer is not part of the transformers model
    dense = 1 if layers > 1 else 0
    config = {**config, "num_hidden_layers": layers, "first_k_dense_replace": dense, "num_nextn_predict_layers": 0}
    heads, nope, rope, vd = config["num_attention_heads"], config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    ql, kvl = config["q_lora_rank"], config["kv_lora_rank"]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (h,), "ones"), (f"{p}.post_attention_layernorm.weight", (h,), "ones")]
        a = f"{p}.self_attn"
        out += [(f"{a}.q_a_proj.weight", (ql, h), "normal"), (f"{a}.q_a_layernorm.weight", (ql,), "ones"),
                (f"{a}.q_b_proj.weight", (heads * (nope + rope), ql), "normal"),
                (f"{a}.kv_a_proj_with_mqa.weight", (kvl + rope, h), "normal"), (f"{a}.kv_a_layernorm.weight", (kvl,), "ones"),
                (f"{a}.kv_b_proj.weight", (heads * (nope + vd), kvl), "normal"), (f"{a}.o_proj.weight", (h, heads * vd), "normal")]  # fmt: skip
        if i < dense:
            out += mlp(f"{p}.mlp", config["intermediate_size"])
            continue
        out += [(f"{p}.mlp.gate.weight", (e, h), "normal"), (f"{p}.mlp.gate.e_score_correction_bias", (e,), "zeros")]
        out += experts(p) + mlp(f"{p}.mlp.shared_experts", inter * config["n_shared_experts"])
    return config, out


def upcycled(path: Path, model_id: str, layers: int, seed: int = 0) -> int:
    """A checkpoint of `model_id`'s real shapes, `layers` decoder layers, upcycled-style bf16 weights."""
    config, layout = _layout(model_id, layers)
    rng = np.random.default_rng(seed)
    bases: dict[str, np.ndarray] = {}  # the current layer's dense MLP, which its experts share
    layer = None

    def weights(name: str, shape, kind: str) -> np.ndarray:
        nonlocal layer
        if kind in ("ones", "zeros"):
            return np.full(shape, 1.0 if kind == "ones" else 0.0, np.float32)
        if kind == "normal":
            return rng.standard_normal(shape, dtype=np.float32) * 0.02
        if kind != layer:  # a new layer's experts: draw its dense MLP first (gate, up, down)
            layer, (f, h) = kind, shape
            bases.clear()
            bases.update({n: rng.standard_normal(s, dtype=np.float32) * 0.02 for n, s in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f)))})
        return bases[name.rsplit(".", 2)[-2]] + rng.standard_normal(shape, dtype=np.float32) * (0.02 * 0.05)

    return write_checkpoint(path, ((name, shape, bf16(weights(name, shape, kind))) for name, shape, kind in layout), config)


def footprint(model_id: str, layers: int, experts: int) -> tuple[int, int]:
    """(bytes on disk of the original and its `experts`-expert proxy, bytes the probe holds at once:
    the embeddings and head, and the original's largest decoder layer twice, as read and rounded)."""
    config, layout = _layout(model_id, layers)
    e = config.get("num_experts") or config["n_routed_experts"]
    disk = held = 0
    per_layer: dict[str, int] = {}
    for name, shape, _ in layout:
        b = 2 * int(np.prod(shape))
        disk += b + (b * experts // e if ".experts." in name else b)
        if name.startswith("model.layers."):
            key = ".".join(name.split(".")[:3])
            per_layer[key] = per_layer.get(key, 0) + b
        else:
            held += b
    return disk, held + 2 * max(per_layer.values())


def available_memory(device: str) -> int:
    """Bytes free for the probe: the device's free memory, or the host's MemAvailable on CPU."""
    if device != "cpu":
        from planner.rl.device import Device

        torch = Device(device).torch
        module = getattr(torch, device.split(":")[0], None)
        if module is not None and hasattr(module, "mem_get_info"):
            return int(module.mem_get_info()[0])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62  # not Linux: not checked


def predict(check: dict) -> dict:
    """The current estimator's prediction for a stored check's model as it was probed (real width, its
    decoder layers), and whether the measured shift lies inside the predicted interval: re-derived
    whenever the estimator is refitted, while the measurement stays."""
    from planner.fidelity.dataset import plan_row
    from planner.fidelity.estimator import FidelityEstimator, default_estimator_path

    config, _ = _layout(check["model"], check["decoder_layers"])
    predicted = FidelityEstimator.load(default_estimator_path()).predict(plan_row(config, check["experts"], None), check["recipe"])
    inside = None
    if predicted.get("shift_interval"):
        lo, hi = predicted["shift_interval"]
        inside = bool(lo <= check["measured"]["shift_log2"] <= hi)
    keys = ("status", "basis", "shift_log2", "shift_interval", "p_reproduced", "interval", "reason")
    scale = (predicted.get("family") or {}).get("scale")  # the scale-transfer widening and its note
    return {"predicted": {**{k: predicted.get(k) for k in keys}, "scale": scale}, "measured_inside_predicted_interval": inside}


def _without_paths(check: dict) -> dict:
    """A check as stored: the probed models' temporary paths left out."""
    return {**check, **{m: {k: v for k, v in check[m].items() if k != "path"} for m in ("original", "proxy")}}


def report(checks: list[dict]) -> None:
    print("model           layers   K  recipe            measured shift [90%]       outcome       predicted shift [interval]   inside")
    for c in checks:
        m, p = c["measured"], c["predicted"]
        pred = f"{p['shift_log2']:+.3f} [{p['shift_interval'][0]:+.3f}, {p['shift_interval'][1]:+.3f}]" if p.get("shift_interval") else p["status"]
        print(f"{c['model']:<15} {c['decoder_layers']:>6} {c['experts']:>3}  {c['recipe']:<16}  {m['shift_log2']:+.3f} [{m['shift_low']:+.3f}, "
              f"{m['shift_high']:+.3f}]  {m['outcome']:<12}  {pred:<27}  {c['measured_inside_predicted_interval']}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default=MODELS[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--recipe", default="rollout-mismatch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--report", action="store_true", help="measure nothing: predict every stored check again with the current estimator")
    parser.add_argument("-o", "--output", default=str(ROOT / "calibration" / "real_scale.json"))
    args = parser.parse_args()
    from planner.fidelity.grid import Grid
    from planner.files import write_text_atomic
    from planner.rl.probe import probe_pair

    out = Path(args.output)
    data = json.loads(out.read_text()) if out.is_file() else {"checks": []}
    if args.report:
        data["checks"] = [_without_paths({**c, **predict(c)}) for c in data["checks"]]
        write_text_atomic(out, json.dumps(data, indent=1))
        report(data["checks"])
        return
    grid = Grid()
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    disk, held = footprint(args.model, args.layers, args.experts)
    free_disk, free_memory = shutil.disk_usage(args.workdir or tempfile.gettempdir()).free, available_memory(args.device)
    if disk > free_disk or held > free_memory:
        sys.exit(f"{args.model} with {args.layers} decoder layers needs {disk / 1e9:.1f} GB of disk (original and K={args.experts} proxy; "
                 f"{free_disk / 1e9:.1f} free) and about {held / 1e9:.1f} GB of {args.device} memory for the probe's largest layer "
                 f"({free_memory / 1e9:.1f} available): run it where both fit (--device cuda on a large GPU, --workdir on a larger disk)")  # fmt: skip
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        size = upcycled(root / "original", args.model, args.layers)
        subprocess.run([sys.executable, "-m", "planner.cli", "build", str(root / "original"), str(root / "proxy"), "--experts",
                        str(args.experts), "--verify", "never"], check=True, capture_output=True)  # fmt: skip
        made = time.perf_counter() - t0
        print(f"checkpoint {size / 1e9:.2f} GB ({args.layers} decoder layers of {args.model}'s shapes), K={args.experts} proxy: {made:.0f} s",
              flush=True)  # fmt: skip
        t0 = time.perf_counter()
        probed = probe_pair(root / "original", root / "proxy", args.recipe, seeds=list(grid.margin_seeds), iters=grid.iters(args.recipe),
                            device=args.device, say=lambda s: print(s, flush=True))  # fmt: skip
        seconds = time.perf_counter() - t0
    check = {"model": args.model, "decoder_layers": args.layers, "experts": args.experts, "recipe": args.recipe, "device": args.device,
             "weights": "synthetic upcycled (dense + 5% noise per expert), seed 0", "measured": probed["labels"],
             "original": probed["original"], "proxy": probed["proxy"], "seconds": round(seconds, 1),
             "machine": platform.machine(), "python": platform.python_version()}  # fmt: skip
    data["checks"].append(_without_paths({**check, **predict(check)}))
    write_text_atomic(out, json.dumps(data, indent=1))
    print(f"measured at real width in {seconds / 60:.1f} min; predicted: {data['checks'][-1]['predicted']['reason']}")
    report(data["checks"])


if __name__ == "__main__":
    main()
