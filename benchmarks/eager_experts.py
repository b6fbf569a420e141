"""Training steps through transformers' eager experts, with and without planner's unbind hooks.

For each calibration family (its own config: hidden 64, the real E), times a few AdamW steps of the
same model on the same batches the way `make_model` trains (one thread, batch 16 x 64 bytes), once
with transformers' eager experts as they are and once with `planner.rl.experts.fast_eager_experts`,
and prints the ratio (llama4 has no hooked module: its experts multiply whole stacks) with a check that the trained weights are bitwise equal.

    python benchmarks/eager_experts.py [--families qwen3_next-e512,deepseek_v3-e256] [--steps 3]
"""

from __future__ import annotations

import argparse
import time

from planner.families import family_config, family_configs
from planner.hf import require_torch
from planner.render import table
from planner.rl.experts import fast_eager_experts

HEADER = ["family", "modules hooked", "eager s/step", "hooked s/step", "speed-up", "bitwise equal"]


def timed_steps(config, fast: bool, steps: int):
    torch, transformers = require_torch("the benchmark")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    hooked = fast_eager_experts(model) if fast else 0
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps + 1):  # the first step (allocations, lazy set-up) is not timed
        if step == 1:
            start = time.perf_counter()
        x = torch.randint(0, 256, (16, 64), generator=gen)
        opt.zero_grad(set_to_none=True)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    return time.perf_counter() - start, model.state_dict(), hooked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(family_configs()))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch, transformers = require_torch("the benchmark")
    torch.set_num_threads(1)
    rows = []
    for family in args.families.split(","):
        config = transformers.AutoConfig.for_model(**family_config(family))
        slow, eager, _ = timed_steps(config, False, args.steps)
        fast, hooked, modules = timed_steps(config, True, args.steps)
        same = eager.keys() == hooked.keys() and all(torch.equal(eager[k], hooked[k]) for k in eager)
        rows.append([family, modules, f"{slow / args.steps:.2f}", f"{fast / args.steps:.2f}", f"{slow / fast:.2f}x", "yes" if same else "NO"])
        print(table(HEADER, rows[-1:]), flush=True)
    print()
    print(table(HEADER, rows))


if __name__ == "__main__":
    main()
