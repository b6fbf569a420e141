"""`planner probe` on a checkpoint of about 2 GB: seconds per bisection step, against reading its bytes.

Makes a checkpoint with Qwen3-30B-A3B's real tensor shapes and one decoder layer (128 experts of
768 x 2048 and the 151,936-token embedding and head, bf16: about 2.4 GB; synthetic weights), builds
its K=32 proxy with `planner build`, then probes both (2 seeds, 1 bisection step: enough to time a
step). Each probe pass streams the model one decoder layer at a time, so its time is compared with a
sequential read of the same checkpoint's bytes measured in the same run (page cache warm for both),
and the peak RSS with the checkpoint's size. fp16-overflow runs only with --device cuda/npu or
--recipes naming it: on this CPU fp16 matmuls are emulated (one backward pass of this checkpoint
took over 15 minutes), so a CPU figure would time the emulation, not the probe.

    python benchmarks/probe.py [--workdir DIR] [--device cpu|cuda|npu] [--recipes rollout-mismatch,fp16-overflow]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_io import make_checkpoint  # noqa: E402  (the same synthetic Qwen3-30B-A3B layout)

from planner.rl.probe import probe_pair  # noqa: E402


def read_seconds(path: Path) -> float:
    start = time.perf_counter()
    for f in sorted(path.glob("*.safetensors")):
        with f.open("rb") as fh:
            while fh.read(64 << 20):
                pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--recipes", default=None, help="default: both on a device, rollout-mismatch on cpu")
    args = parser.parse_args()
    recipes = args.recipes.split(",") if args.recipes else (["rollout-mismatch"] if args.device == "cpu" else ["rollout-mismatch", "fp16-overflow"])
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        size = make_checkpoint(root / "original", layers=1)
        subprocess.run([sys.executable, "-m", "planner.cli", "build", str(root / "original"), str(root / "proxy"), "--experts", "32",
                        "--verify", "never"], check=True, capture_output=True)  # fmt: skip
        proxy_size = sum(f.stat().st_size for f in (root / "proxy").glob("*.safetensors"))
        read_seconds(root / "original")  # warm the page cache, as the probe's first pass does
        baseline = read_seconds(root / "original")
        print(f"checkpoint {size / 1e9:.2f} GB (proxy K=32: {proxy_size / 1e9:.2f} GB); sequential read {baseline:.2f} s "
              f"({size / 1e9 / baseline:.2f} GB/s, page cache warm)")  # fmt: skip
        for recipe in recipes:
            start = time.perf_counter()
            r = probe_pair(root / "original", root / "proxy", recipe, seeds=[0, 1], iters=1, device=args.device, say=print)
            wall = time.perf_counter() - start
            print(f"{recipe}: {r['passes']} passes in {wall:.1f} s; median {r['seconds_per_pass']:.2f} s per bisection step "
                  f"(original and proxy alike) = {r['seconds_per_pass'] / baseline:.1f} x reading the original's bytes")  # fmt: skip
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if "fp16-overflow" not in recipes:
            print("fp16-overflow: not timed on cpu (fp16 matmuls are emulated here); pass --device cuda or npu")
        print(f"peak RSS {rss / 1e9:.2f} GB = {rss / size:.2f} x the checkpoint (fp32 compute: one layer, embeddings and head held)")


if __name__ == "__main__":
    main()
