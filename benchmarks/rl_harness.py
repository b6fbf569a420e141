"""RL harness throughput on CPU and the calibration grid's wall time.

1. GRPO steps per second for the small models of each family, per training precision, at the
   grid's run size (8 prompts x 4 samples x 16 new tokens, 2 PPO epochs x 2 mini-batches). The
   baseline, measured in the same run on the same model: one plain next-token training step
   (forward + backward + Adam) on the same number of sequences, so the ratio says what a GRPO
   step costs in units of ordinary training steps (sampling, three extra forward passes, four
   updates).
2. What the harness's savings buy, each against the harness without it (the baseline): keeping
   freed memory (planner.rl.device.keep_freed_memory; without it glibc's malloc defaults) and the
   chunked scans fitted to the sequence (planner.rl.experts.fit_scan_chunks; without it the
   padded chunk). A router-collapse run of each model in a fresh process each way, its CPU time
   and minor page faults, and whether the metrics are the same bit for bit. `--model DIR` adds a
   model of your own (e.g. a grid's 512-expert original; the scans are only in the hybrid
   families, Nemotron-H and Qwen3-Next).
3. The grid's wall time, read from the Optuna storage of `planner calibrate run` (default
   sqlite:///calibration.db): per phase, trials, wall time from the first start to the last
   completion, summed trial time, and the workers' parallel efficiency.

    python benchmarks/rl_harness.py [--storage sqlite:///calibration.db] [--steps 6] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
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


def harness(paths: dict[str, Path], steps: int) -> None:
    from planner.render import table
    from planner.rl.grpo import GRPO, Models, RLConfig

    rows = []
    for family, path in paths.items():
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


# one run in a fresh process (malloc's settings are per process); "off" runs the harness without
# the saving named (a no-op in its place), "on" as it is
_ON_OR_OFF = """
import hashlib, json, resource, sys
sys.path.insert(0, sys.argv[5])
import planner.rl.grpo as grpo
from planner.rl.experts import fit_scan_chunks
if not callable(getattr(grpo, sys.argv[2], None)):
    sys.exit(f"planner.rl.grpo calls no {sys.argv[2]}")
if sys.argv[3] == "off":
    setattr(grpo, sys.argv[2], lambda *args: 0)
from planner.rl.recipes import recipe
config = recipe("router-collapse").config(-0.5, seed=0, steps=int(sys.argv[4]))
run = grpo.GRPO(sys.argv[1], config)
r0 = resource.getrusage(resource.RUSAGE_SELF)
rows = run.run()
r1 = resource.getrusage(resource.RUSAGE_SELF)
values = [{k: v for k, v in r.items() if k not in ("wall_s", "peak_mem_bytes")} for r in rows]
print(json.dumps({"cpu": r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, "faults": r1.ru_minflt - r0.ru_minflt,
                  "metrics": hashlib.sha256(repr(values).encode()).hexdigest(),
                  "scans": fit_scan_chunks(run.policy, config.prompt_len + config.new_tokens)}))
"""
SAVINGS = {"keep_freed_memory": "freed memory kept against glibc's malloc defaults",
           "fit_scan_chunks": "chunked scans fitted to the sequence against the padded chunk"}  # fmt: skip


def _has_scans(path: Path) -> bool:
    """Whether the model at `path` has a chunked scan that fit_scan_chunks fits (a hybrid family)."""
    out = subprocess.run([sys.executable, "-c", _ON_OR_OFF, str(path), "fit_scan_chunks", "on", "1", str(ROOT)], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"the run of {path} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])["scans"] > 0


def savings(paths: dict[str, Path], steps: int) -> None:
    """Per saving and model, two runs each way in the order off, on, on, off (so neither side
    always runs first on a busy machine); the means. Without MALLOC_* or glibc.malloc tunables set,
    memory's off side is glibc's own."""
    from planner.render import table

    for saving, what in SAVINGS.items():
        rows = []
        for name, path in paths.items():
            if saving == "fit_scan_chunks" and not _has_scans(path):
                rows.append([name, "-", "-", "no chunked scan", "-", "-", "-"])
                continue
            got = {"off": [], "on": []}
            for mode in ("off", "on", "on", "off"):
                out = subprocess.run([sys.executable, "-c", _ON_OR_OFF, str(path), saving, mode, str(steps), str(ROOT)], capture_output=True,
                                     text=True)  # fmt: skip
                if out.returncode != 0:
                    sys.exit(f"the run of {path} with {saving} {mode} failed:\n{out.stderr}")
                got[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            off, on = ({key: statistics.mean(r[key] for r in runs) for key in ("cpu", "faults")} for runs in (got["off"], got["on"]))
            same = len({r["metrics"] for runs in got.values() for r in runs}) == 1
            rows.append([name, f"{off['cpu']:.2f}", f"{on['cpu']:.2f}", f"{off['cpu'] / on['cpu']:.2f}x", f"{off['faults']:,.0f}",
                         f"{on['faults']:,.0f}", "yes" if same else "NO"])  # fmt: skip
        print(f"\nrouter-collapse run of {steps} steps, {what} ({saving}; fresh processes, mean of 2 each)")
        print(table(["model", "CPU s without", "CPU s with", "ratio", "page faults without", "page faults with", "same metrics"], rows))


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
    parser.add_argument("--model", type=Path, action="append", default=[], help="another model directory for part 2")
    args = parser.parse_args()
    from planner.rl.models import ModelRecipe, make_model

    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for family in ("qwen3_moe", "deepseek_v3"):
            paths[family] = Path(tmp) / family
            make_model(family, paths[family], ModelRecipe(dense_steps=20, moe_steps=20))
        harness(paths, args.steps)
        savings({**paths, **{str(m): m for m in args.model}}, 12)
    grid_wall(args.storage)
