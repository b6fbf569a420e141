"""Does the default clustering keep more than random choices? On a briefly trained tiny MoE whose
experts come in clusters (upcycled, then trained), compare every selection method at K = 4 and 8 of
16 experts against five random draws: routing frequency dropped, saliency dropped, MoE-output
reconstruction error and KL(original || proxy), each the mean over MoE layers.

    python benchmarks/clustering_quality.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from trained import train_clustered_moe  # noqa: E402

from planner.checkpoint import Checkpoint  # noqa: E402
from planner.render import table  # noqa: E402
from planner.stats.compute import compute_stats  # noqa: E402

METRICS = ("frequency_dropped", "saliency_dropped", "reconstruction_error")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = train_clustered_moe(Path(tmp) / "moe")
        print(f"trained tiny qwen3_moe (16 experts in 4 upcycled clusters, top-2) in {time.perf_counter() - start:.1f} s, "
              f"loss {(path / 'train_loss.txt').read_text().strip()}")  # fmt: skip
        ckpt = Checkpoint(path)
        runs = {}
        methods = ("agglomerative", "kmeans", "router", "saliency", "frequency")
        base = compute_stats(ckpt, experts=[4, 8], methods=methods, calib_tokens=2048, seq_len=64)
        for key, plan in base["plans"].items():
            runs[key] = [plan["summary"]]
        for seed in range(5):
            r = compute_stats(ckpt, experts=[4, 8], methods=("random",), calib_tokens=2048, seq_len=64, seed=seed)
            for key, plan in r["plans"].items():
                runs.setdefault(key + " (5 seeds)", []).append(plan["summary"])
        rows = []
        for key in sorted(runs, key=lambda k: (int(k.split("/")[0][2:]), k)):
            summaries = runs[key]
            rows.append([key, *(f"{np.mean([s[m]['mean'] for s in summaries]):.3f}" for m in METRICS),
                         f"{np.mean([s['kl_original_proxy'] for s in summaries]):.4f}"])  # fmt: skip
        print(table(["plan", "freq dropped", "saliency dropped", "recon error", "KL(orig||proxy)"], rows))


if __name__ == "__main__":
    main()
