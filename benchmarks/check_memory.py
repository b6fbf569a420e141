"""Predicted vs measured peak memory of the RL harness (what `planner check` compares), on CPU.

For each small model family, a K=16-of-32 proxy runs one warm-up GRPO step, then a measured one;
the prediction is planner.rl.memory.predict_peak. Precisions fp32, bf16 and fp16 (autocast over
fp32 master weights), at the grid's run size and with responses six times longer than prompts.

    python benchmarks/check_memory.py [--workdir calibration/work]

Uses the calibration grid's proxies when `planner calibrate run` has made them; otherwise makes
small models (briefly trained) and their proxies in a temporary folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [("fp32", {}), ("bf16", {}), ("fp16", {"loss_scale_log2": 8.0}),
         ("fp32", {"prompt_len": 8, "new_tokens": 48}), ("bf16", {"prompt_len": 8, "new_tokens": 48})]  # fmt: skip


def proxy_of(family: str, workdir: Path, scratch: Path) -> Path:
    made = workdir / "models" / family / "K16-kmeans"
    if (made / "expert_map.json").is_file():
        return made
    from planner.checkpoint import Checkpoint, build
    from planner.rl.models import ModelRecipe, make_model
    from planner.stats.compute import choose_plan

    original = scratch / family
    make_model(family, original, ModelRecipe(dense_steps=20, moe_steps=20))
    ckpt = Checkpoint(original)
    build(ckpt, choose_plan(ckpt, 16, "agglomerative"), scratch / f"{family}-K16", verify="never")
    return scratch / f"{family}-K16"


def main() -> int:
    from planner.checkpoint import Checkpoint
    from planner.render import table
    from planner.rl.grpo import GRPO, RLConfig
    from planner.rl.memory import measure_step_peak, predict_peak

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=str(ROOT / "calibration" / "work"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for family in ("qwen3_moe", "deepseek_v3"):
            path = proxy_of(family, Path(args.workdir), Path(scratch))
            arch = Checkpoint(path).arch
            for precision, extra in CASES:
                config = RLConfig(precision=precision, steps=2, **extra)
                trainer = GRPO(path, config)
                trainer.step(0)
                measured = measure_step_peak(trainer, 1)
                predicted = predict_peak(arch, config)["total"]
                rows.append([family, precision, f"{config.prompt_len} + {config.new_tokens}", f"{predicted / 2**20:.2f}",
                             f"{measured / 2**20:.2f}", f"{predicted / measured:.3f}"])  # fmt: skip
    print(table(["family", "precision", "prompt + response tokens", "predicted MiB", "measured MiB", "predicted / measured"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
