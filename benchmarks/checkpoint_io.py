"""Build and weight-statistics speed on synthetic checkpoints with Qwen3-30B-A3B's real layout.

Makes checkpoints of Qwen3-30B-A3B's tensor shapes (128 experts of 768 x 2048, bf16, per-expert keys
as on the Hub) with 2 and 4 decoder layers by default (about 3.6 and 6.0 GB, shards of 1 GiB;
--layers for other sizes), then measures in the same run:
  1. `planner build` to K=32 (structural verification on) vs `cp -r` of the very bytes it wrote:
     speed ratio (goal >= 0.7 of cp);
  2. peak RSS of the build process at both sizes (goal: bounded by about a shard plus a layer and
     independent of checkpoint size);
  2b. the same build with its default check (the proxy run layer by layer in transformers, bf16; a
     pruned plan is not compared with the original, whose bytes are E/K times the proxy's experts):
     wall time against cp (goal <= 3x) and peak RSS against the largest shard plus two decoder
     layers (goal: at most that, at both sizes); between sizes, the cost of the added layers alone
     against cp's, and the fixed cost that remains (imports, model construction);
  3. weight-only statistics (router rows and count sketches of every expert) vs a plain sequential
     read of the same files: throughput ratio.
Files are fresh in the page cache for every contender alike; where the kernel lets us drop caches
(root) the cold-cache build is measured as well.

    python benchmarks/checkpoint_io.py [--workdir DIR] [--layers 2,4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from planner.catalog import load_model_config
from planner.checkpoint import Checkpoint
from planner.checkpoint.safetensors import OutTensor, write_shard

GIB = 1024**3
BLOCK = np.random.default_rng(0).normal(0, 0.02, size=16 << 20).astype(np.float32)
BF16_BLOCK = (BLOCK.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # 32 MiB of valid bf16


def _bytes(n: int) -> bytes:
    reps = -(-n // len(BF16_BLOCK))
    return (BF16_BLOCK * reps)[:n] if reps > 1 else BF16_BLOCK[:n]


def make_checkpoint(path: Path, layers: int) -> int:
    """A qwen3_moe checkpoint with Qwen3-30B-A3B's shapes and `layers` decoder layers."""
    _, config = load_model_config("qwen3-30b-a3b")
    config = {**config, "num_hidden_layers": layers}
    h, inter, e, v = config["hidden_size"], config["moe_intermediate_size"], config["num_experts"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    tensors = [("model.embed_tokens.weight", (v, h)), ("lm_head.weight", (v, h)), ("model.norm.weight", (h,))]
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
                    (f"{p}.self_attn.q_proj.weight", (q, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
                    (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, q)),
                    (f"{p}.self_attn.q_norm.weight", (128,)), (f"{p}.self_attn.k_norm.weight", (128,)),
                    (f"{p}.mlp.gate.weight", (e, h))]  # fmt: skip
        for x in range(e):
            tensors += [(f"{p}.mlp.experts.{x}.gate_proj.weight", (inter, h)), (f"{p}.mlp.experts.{x}.up_proj.weight", (inter, h)),
                        (f"{p}.mlp.experts.{x}.down_proj.weight", (h, inter))]  # fmt: skip
    return write_checkpoint(path, ((name, shape, _bytes(int(np.prod(shape)) * 2)) for name, shape in tensors), config)


def write_checkpoint(path: Path, tensors, config: dict) -> int:
    """A sharded bf16 safetensors checkpoint (shards of at most 1 GiB) from (name, shape, bytes)."""
    path.mkdir(parents=True)
    shards, current, size = [], [], 0
    for name, shape, data in tensors:
        if current and size + len(data) > GIB:
            shards.append(current)
            current, size = [], 0
        current.append(OutTensor(name, "BF16", shape, data=data))
        size += len(data)
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_shard(path / name, shard, {"format": "pt"})
        weight_map.update({t.name: name for t in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    return total


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(cmd: list[str]) -> tuple[float, str]:
    """(seconds, last line of stdout) of a child process."""
    start = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - start, (out.strip().splitlines() or [""])[-1]


# peak RSS from /proc (ru_maxrss is inherited across fork and exec, so it would report this script's)
RSS = "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) / 1024)"
BUILD = "from planner.checkpoint import Checkpoint, build; from planner.plan import Plan; import sys; " \
        "c = Checkpoint(sys.argv[1]); ids = list(range(0, 128, 4)); " \
        "build(c, Plan(model='bench', experts=32, original_experts=128, layers={i: ids for i in c.moe_layers}), " \
        "sys.argv[2], verify=sys.argv[3] if len(sys.argv) > 3 else 'never'); " + RSS  # fmt: skip
STATS = "from planner.checkpoint import Checkpoint; from planner.stats.sketch import weight_features; import sys, json; " \
        "f = weight_features(Checkpoint(sys.argv[1])); " \
        "hwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) / 1024; " \
        "print(json.dumps([f.bytes_read, f.seconds, hwm]))"  # fmt: skip


def _median(values: list[float]) -> float:
    return float(np.median(values))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", default="2,4", help="decoder layers of each synthetic checkpoint (1.2 GB each, plus 1.2 GB)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="planner-bench-"))
    py = sys.executable

    def clean(*names):
        for d in names:
            shutil.rmtree(work / d, ignore_errors=True)
        os.sync()  # no writeback of earlier runs competes with the next measurement

    checked_by_size: list[tuple[int, float]] = []  # (proxy bytes, seconds of the check alone)
    try:
        for layers in [int(x) for x in args.layers.split(",")]:
            src = work / f"qwen3-{layers}l"
            start = time.perf_counter()
            total = make_checkpoint(src, layers)
            os.sync()
            print(f"\n{layers} layers: synthetic checkpoint {total / GIB:.2f} GiB written in {time.perf_counter() - start:.1f} s")
            builds, cps, rss = [], [], []
            for _ in range(args.repeats):  # alternate, so both meet the same state of the machine
                clean("proxy", "proxy-cp")
                seconds, peak = timed([py, "-c", BUILD, str(src), str(work / "proxy")])
                builds.append(seconds)
                rss.append(float(peak))
                os.sync()
                cps.append(timed(["cp", "-r", str(work / "proxy"), str(work / "proxy-cp")])[0])
            written = sum(f.stat().st_size for f in (work / "proxy").glob("*.safetensors"))
            b, c = _median(builds), _median(cps)
            print(f"  build to K=32 (median of {args.repeats}): {b:.2f} s for {written / GIB:.2f} GiB ({written / GIB / b:.2f} GiB/s), "
                  f"peak RSS {max(rss):.0f} MiB")  # fmt: skip
            print(f"  cp -r of the same {written / GIB:.2f} GiB (median): {c:.2f} s -> build runs at {c / b:.2f} of cp's speed "
                  f"(cp runs: {', '.join(f'{x:.2f}' for x in cps)} s; its writes meet whatever the page cache holds)")  # fmt: skip
            checked, checked_rss = [], []
            for _ in range(args.repeats):
                clean("proxy")
                seconds, peak = timed([py, "-c", BUILD, str(src), str(work / "proxy"), "auto"])
                checked.append(seconds)
                checked_rss.append(float(peak))
            ckpt = Checkpoint(src)
            largest = max(f.stat().st_size for f in src.glob("*.safetensors"))
            layer = sum(t.nbytes for n, t in ckpt.tensors.items() if n.startswith("model.layers.0."))
            bound = (largest + 2 * layer) / 2**20
            k = _median(checked)
            print(f"  build with its default check (the proxy run layer by layer in bf16 in transformers, its import included; median): {k:.2f} s = {k / c:.1f}x cp "
                  f"(goal <= 3x); peak RSS {max(checked_rss):.0f} MiB = {max(checked_rss) / bound:.2f} of the largest shard "
                  f"({largest / 2**20:.0f} MiB) + 2 decoder layers ({layer / 2**20:.0f} MiB each) (goal <= 1)")  # fmt: skip
            print(f"  the check alone (build with check - build without): {k - b:.2f} s = {(k - b) / c:.1f}x cp; against the "
                  f"fastest cp run ({min(cps):.2f} s) build with check is {k / min(cps):.1f}x")  # fmt: skip
            checked_by_size.append((written, k - b))
            if len(checked_by_size) > 1:  # how the check's cost grows with the proxy: per GiB, and what stays fixed
                (w0, k0), (w1, k1) = checked_by_size[0], checked_by_size[-1]
                per_gib = (k1 - k0) / ((w1 - w0) / GIB)
                print(f"  the check from {w0 / GIB:.2f} to {w1 / GIB:.2f} GiB of proxy: {k0:.2f} -> {k1:.2f} s, i.e. {per_gib:.2f} s per GiB "
                      f"and {k0 - per_gib * w0 / GIB:.1f} s fixed (imports of torch and transformers, the model on the meta device)")  # fmt: skip
            clean("proxy-cp")
            if drop_caches():
                clean("proxy")
                drop_caches()
                cold_s, _ = timed([py, "-c", BUILD, str(src), str(work / "proxy")])
                os.sync()
                drop_caches()
                cold_cp, _ = timed(["cp", "-r", str(work / "proxy"), str(work / "proxy-cp")])
                print(f"  cold page cache: build {cold_s:.2f} s (reads kept ranges scattered over {total / GIB:.2f} GiB), "
                      f"cp {cold_cp:.2f} s (reads {written / GIB:.2f} GiB contiguously) -> {cold_cp / cold_s:.2f} of cp's speed")  # fmt: skip
            clean("proxy", "proxy-cp")
            def plain_read() -> tuple[int, float]:
                start, n = time.perf_counter(), 0
                for shard in sorted(src.glob("*.safetensors")):
                    with open(shard, "rb") as fh:
                        while chunk := fh.read(64 << 20):
                            n += len(chunk)
                return n, time.perf_counter() - start

            plain_read()  # warm: every contender reads from the page cache
            stats, plains = [], []
            for _ in range(args.repeats):
                _, out = timed([py, "-c", STATS, str(src)])
                read, stats_s, stats_rss = json.loads(out)
                stats.append(stats_s)
                plain, seconds = plain_read()
                plains.append(seconds)
            s_, p_ = _median(stats), _median(plains)
            print(f"  weight-only stats, warm cache: {read / GIB:.2f} GiB in {s_:.2f} s ({read / GIB / s_:.2f} GiB/s); "
                  f"plain sequential read {plain / GIB:.2f} GiB in {p_:.2f} s ({plain / GIB / p_:.2f} GiB/s) "
                  f"-> {read / s_ / (plain / p_):.2f} of read throughput; peak RSS {stats_rss:.0f} MiB")  # fmt: skip
            if drop_caches():
                _, out = timed([py, "-c", STATS, str(src)])
                read, cold_stats, _ = json.loads(out)
                drop_caches()
                plain, cold_plain = plain_read()
                print(f"  weight-only stats, cold cache: {read / GIB / cold_stats:.2f} GiB/s; plain read "
                      f"{plain / GIB / cold_plain:.2f} GiB/s -> {read / cold_stats / (plain / cold_plain):.2f} of read throughput")
            shutil.rmtree(src)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
