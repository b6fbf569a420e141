"""RL harness throughput on CPU and the calibration grid's wall time.

1. GRPO steps per second for the small models of each family, per training precision, at the
   grid's run size (8 prompts x 4 samples x 16 new tokens, 2 PPO epochs x 2 mini-batches). The
   baseline, measured in the same run on the same model: one plain next-token training step
   (forward + backward + Adam) on the same number of sequences, so the ratio says what a GRPO
   step costs in units of ordinary training steps (sampling, three extra forward passes, four
   updates).
2. The grid's wall time, read from the Optuna storage of `planner calibrate run` (default
   sqlite:///calibration.db): per phase, trials, wall time from the first start to the last
   completion, summed trial time, and the workers' parallel efficiency.

    python benchmarks/rl_harness.py [--storage sqlite:///calibration.db] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def plain_step_seconds(model_dir: Path, sequences: int, length: int, repeats: int) -> float:
    import torch
    import transformers

    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (sequences, length), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def harness(steps: int) -> None:
    from planner.render import table
    from planner.rl.grpo import GRPO, Models, RLConfig
    from planner.rl.models import ModelRecipe, make_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("qwen3_moe", "deepseek_v3"):
            path = Path(tmp) / family
            make_model(family, path, ModelRecipe(dense_steps=20, moe_steps=20))
            models = Models(path)
            base = None
            for precision in ("fp32", "bf16", "fp16"):
                cfg = RLConfig(steps=steps + 1, precision=precision, rollout_precision="bf16" if precision != "fp32" else "fp32")
                run = GRPO(models, cfg).run()
                per_step = statistics.median(r["wall_s"] for r in run[1:])  # the first step warms up
                if base is None:
                    base = plain_step_seconds(path, cfg.prompts * cfg.group, cfg.prompt_len + cfg.new_tokens, steps)
                rows.append([family, precision, f"{1 / per_step:.2f}", f"{per_step * 1000:.0f}", f"{base * 1000:.0f}",
                             f"{per_step / base:.1f}x"])  # fmt: skip
    print("GRPO harness on CPU, 1 thread (grid run size: 8 prompts x 4 samples, 16 new tokens)")
    print(table(["family", "precision", "steps/s", "ms/step", "plain train step ms", "GRPO / plain"], rows))


def grid_wall(storage: str) -> None:
    import optuna

    from planner.render import table

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        summaries = [s for s in optuna.get_all_study_summaries(storage) if s.study_name.startswith("calibration-")]
    except Exception as exc:  # noqa: BLE001 - a missing or foreign database: say so and go on
        print(f"\ngrid: no calibration storage at {storage} ({type(exc).__name__}); run `planner calibrate run` first")
        return
    groups: dict[tuple[str, str], list] = {}  # (phase, recipe) -> trials of its studies (one per original)
    for summary in summaries:
        key = (summary.user_attrs.get("phase", "?"), summary.user_attrs.get("recipe", summary.study_name))
        groups.setdefault(key, []).extend(optuna.load_study(study_name=summary.study_name, storage=storage).get_trials(deepcopy=False))
    rows, starts, ends, busy_total = [], [], [], 0.0
    for (phase, recipe), trials in sorted(groups.items()):
        done = [t for t in trials if t.state.name == "COMPLETE" and t.datetime_complete]
        if not done:
            continue
        start, end = min(t.datetime_start for t in done), max(t.datetime_complete for t in done)
        wall = (end - start).total_seconds()
        busy = sum((t.datetime_complete - t.datetime_start).total_seconds() for t in done)
        starts.append(start), ends.append(end)
        busy_total += busy
        rows.append([phase, recipe, len(done), len(trials) - len(done), f"{wall / 60:.1f}",
                     f"{busy / 60:.1f}", f"{busy / len(done):.0f}", f"{busy / wall:.2f}"])  # fmt: skip
    if not rows:
        print(f"\ngrid: no finished trials in {storage}")
        return
    span = (max(ends) - min(starts)).total_seconds()
    rows.append(["all", "", sum(r[2] for r in rows), sum(r[3] for r in rows), f"{span / 60:.1f}", f"{busy_total / 60:.1f}", "", ""])
    print(f"\ncalibration grid in {storage} (wall: first start to last completion, interruptions included)")
    print(table(["phase", "recipe", "trials", "failed/retried", "wall min", "trial min", "s/trial", "busy workers (trial/wall)"], rows))

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", default="sqlite:///calibration.db")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    harness(args.steps)
    grid_wall(args.storage)
