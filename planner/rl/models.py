"""The small real MoE models calibration runs on, made deterministically by one command.

One family per routing shape (planner.families: calibration/families.yaml). Each is made the way
production MoEs often are (sparse upcycling, Komatsuzaki et al. 2022): a dense model of the same backbone is pretrained briefly on Python standard-library source (bytes), every
expert starts as a copy of its dense MLP plus small noise, and the MoE then trains further. Experts
end up partly redundant, as in upcycled models, rather than nearly orthogonal as from-scratch tiny
MoEs are. The pairwise cosine similarity of experts' weights is reported per family.

`ModelRecipe(balancing="published")` trains the MoE stage with the load balancing its shape was
published with (planner.families.family_balancing: the balance loss at the published coefficient,
over the batch or per sequence, the router z-loss, and for the sigmoid routers with a correction
bias the auxiliary-loss-free bias update at the published speed, then run on to where it settles:
`settle_correction_bias`; planner.rl.routers), so that the original starts its RL runs as evenly
loaded as its training made it. With "none" (the first grids'
models) the routers train on the language-model loss alone, and the correction bias stays zero.
The report gives where the routing ended: the router-collapse detector's statistic (normalised top-k
share) of the most collapsed MoE layer over the last 20 steps, and the largest correction bias.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from planner.errors import SpecError
from planner.families import BALANCINGS, NO_BALANCING, arch_family, family_balancing, family_config
from planner.hf import require_torch
from planner.rl.corpus import split_bytes
from planner.rl.experts import fast_eager_experts
from planner.rl.routers import Routers, collapse_share, expert_counts, routing_probs, sigmoid_scored, switch_loss, update_correction_bias, z_loss
from planner.stats.settle import settle

__all__ = ["ModelRecipe", "make_model", "expert_similarity", "settle_correction_bias"]

@dataclass(frozen=True)
class ModelRecipe:
    dense_steps: int = 300
    moe_steps: int = 300
    batch: int = 16
    seq: int = 64
    lr: float = 2e-3
    noise: float = 0.05  # relative std of the noise that breaks the symmetry between upcycled experts
    seed: int = 0
    balancing: str = "none"  # "published": the MoE stage trains with the family's published load balancing

    def __post_init__(self) -> None:
        if self.balancing not in BALANCINGS:
            raise SpecError(f"balancing {self.balancing!r}: one of {', '.join(BALANCINGS)}")


TAIL = 20  # the last steps whose routing the report summarises


def _batch(torch, data, rng, recipe: ModelRecipe, device: str):
    """A batch of `recipe.batch` random windows of `recipe.seq` bytes of the training corpus."""
    starts = rng.integers(0, data.size - recipe.seq - 1, size=recipe.batch)
    return torch.from_numpy(np.stack([data[s : s + recipe.seq] for s in starts]).astype(np.int64)).to(device)


def _biased(model) -> list:
    """The routers of `model` that steer selection by a correction bias."""
    return [m for m in model.modules() if getattr(m, "e_score_correction_bias", None) is not None]


def _tally(slots: dict[int, tuple], calls) -> None:
    """Add one step's routed slots per expert to `slots` (per router call, with its top-k)."""
    for i, (_, logits, ids) in enumerate(calls):
        slots[i] = (ids.shape[-1], slots.get(i, (0, 0.0))[1] + expert_counts(ids.detach().cpu(), logits.shape[-1]))


def _routing_end(slots: dict[int, tuple], biased: list) -> dict[str, Any]:
    """Where the routing ended over the tallied steps: the router-collapse detector's statistic of
    the most collapsed layer, and the largest correction bias."""
    shares = [collapse_share(counts, k)[1] for k, counts in slots.values()]
    finite = [v for v in shares if not math.isnan(v)]
    return {"collapse_max": round(max(finite), 4) if finite else None,
            "correction_bias_abs_max": round(max(float(m.e_score_correction_bias.abs().max()) for m in biased), 4) if biased else None}  # fmt: skip


def _train(model, steps: int, recipe: ModelRecipe, seed: int, progress=None, device: str = "cpu",
           balance: Mapping[str, Any] | None = None) -> tuple[list[float], dict]:  # fmt: skip
    """Train `model` on the corpus; (its language-model losses, where its routing ended over the last
    TAIL steps). `balance`: the load balancing (planner.families.family_balancing, or NO_BALANCING),
    or None where the routing is not followed (the dense stage)."""
    torch, _ = require_torch("training the small models")
    model.to(device)
    data = split_bytes("train")
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30) * (0.1 + 0.9 * (1 - s / steps)))
    routers = Routers(model) if balance is not None else None
    sigmoid = routers is not None and sigmoid_scored(model.config)
    sequences = recipe.batch if balance is not None and balance["scope"] == "sequence" else 1
    tail: dict[int, tuple] = {}
    losses = []
    model.train()
    for step in range(steps):
        batch = _batch(torch, data, rng, recipe, device)
        if routers is not None:
            routers.clear()
        lm = model(input_ids=batch, labels=batch).loss
        loss = lm
        if routers is not None and routers.calls:
            calls = routers.calls
            if balance["loss"]:
                loss = loss + balance["loss"] * torch.stack([switch_loss(routing_probs(lg, sigmoid), ids, sequences) for _, lg, ids in calls]).mean()
            if balance["z_loss"]:
                loss = loss + balance["z_loss"] * torch.stack([z_loss(lg) for _, lg, _ in calls]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if routers is not None:
            if balance["bias_rate"]:
                update_correction_bias(routers.calls, balance["bias_rate"])
            if step >= steps - TAIL:
                _tally(tail, routers.calls)
        losses.append(lm.item())
        if progress:
            progress(step + 1, steps)
    if routers is None:
        return losses, {}
    routers.remove()
    return losses, _routing_end(tail, _biased(model))


def settle_correction_bias(model, recipe: ModelRecipe, rate: float, seed: int, device: str = "cpu",
                           progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Loss-free balancing run to where it settles (planner.stats.settle). A real model's bias updates
    over hundreds of thousands of steps (DeepSeek-V3: 14.3T tokens); the grid's 300 MoE steps move a
    bias by 0.3 at most, short of where a wider model's scores need it. So, with the weights as
    trained: forward passes without gradients on training batches, each moving every correction bias
    by the settling's step towards an even load as a training step does, from `rate` * 2^4 down to
    `rate`. Returns the passes, the last window's largest drift, and where the routing ended (as
    `_train` reports it) over that window."""
    torch, _ = require_torch("settling the correction bias")
    biased = _biased(model)
    if not biased:
        return {}
    routers = Routers(model)
    data = split_bytes("train")
    rng = np.random.default_rng(seed)
    window: dict[int, tuple] = {}

    def one_pass(step: float) -> None:
        routers.clear()
        model(input_ids=_batch(torch, data, rng, recipe, device))
        update_correction_bias(routers.calls, step)
        _tally(window, routers.calls)

    model.eval()
    with torch.no_grad():
        settled = settle(one_pass, [m.e_score_correction_bias for m in biased], rate,
                         new_window=window.clear, progress=(lambda done, total: progress("settle", done, total)) if progress else None)  # fmt: skip
    routers.remove()
    return {**settled, **_routing_end(window, biased)}


def expert_similarity(model) -> dict[str, float]:
    """Pairwise cosine similarity of experts' flattened weights within each MoE layer, pooled."""
    sims = []
    for module in model.modules():
        experts = getattr(module, "experts", None)
        # the fused gate and up projections, or (experts without a gate, Nemotron-H) the up projection
        first = getattr(experts, "gate_up_proj", None)
        first = getattr(experts, "up_proj", None) if first is None else first
        if getattr(first, "ndim", 0) != 3:  # (experts, out, in)
            continue
        flat = np.concatenate([first.detach().reshape(first.shape[0], -1).numpy(),
                               experts.down_proj.detach().reshape(experts.down_proj.shape[0], -1).numpy()], axis=1)  # fmt: skip
        unit = flat / np.linalg.norm(flat, axis=1, keepdims=True)
        cos = unit @ unit.T
        sims.append(cos[np.triu_indices(len(cos), 1)])
    values = np.concatenate(sims)
    return {f"p{q}": float(np.percentile(values, q)) for q in (5, 25, 50, 75, 95)} | {"mean": float(values.mean())}


def make_model(family: str, out_dir: Path, recipe: ModelRecipe = ModelRecipe(),
               progress: Callable[[str, int, int], None] | None = None, config: Mapping[str, Any] | None = None,
               device: str = "cpu") -> dict:  # fmt: skip
    """Pretrain dense, upcycle, train the MoE; save to `out_dir`; return a report. `config`: another
    config of the family's shape (scaled_family_config) instead of its own."""
    torch, transformers = require_torch("making the small models")
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(1)
    start = time.perf_counter()
    config = dict(config) if config is not None else family_config(family)
    fam = arch_family(config)
    # the dense stage: every token uses all of its experts (1; 2 where the router scores groups,
    # even a single group, by the sum of their top two experts), i.e. one dense MLP
    seeds = 2 if fam.grouped else 1
    keys = {fam.experts_key: seeds, fam.top_k_key: seeds}
    keys.update({alias: keys[target] for alias, target in fam.aliases.items() if target in keys and alias in config})
    dense_cfg = dict(config, **keys)
    if fam.grouped:
        dense_cfg.update(n_group=1, topk_group=1)
    dense = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**dense_cfg), experts_implementation="eager")
    fast_eager_experts(dense)
    dense_losses, _ = _train(dense, recipe.dense_steps, recipe, recipe.seed, progress and (lambda d, t: progress("dense", d, t)), device)
    dense.to("cpu")
    moe = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config), experts_implementation="eager")
    dense_state = dense.state_dict()
    gen = torch.Generator().manual_seed(recipe.seed + 1)
    with torch.no_grad():
        for name, param in moe.named_parameters():
            source = dense_state.get(name)
            if ".experts." in name and source is not None:  # expert e <- dense expert e mod seeds, plus noise
                index = torch.arange(param.shape[0]) % source.shape[0]
                noise = torch.randn(param.shape, generator=gen) * source.std() * recipe.noise
                param.copy_(source[index] + noise)
            elif source is not None and source.shape == param.shape:
                param.copy_(source)
    fast_eager_experts(moe)
    balance = family_balancing(family) if recipe.balancing == "published" else NO_BALANCING  # the routing is still followed, for the report
    moe_losses, ended = _train(moe, recipe.moe_steps, recipe, recipe.seed + 2, progress and (lambda d, t: progress("moe", d, t)), device,
                               balance)  # fmt: skip
    if balance["bias_rate"]:  # the bias where its updates settle, as a long pretraining leaves it
        settled = settle_correction_bias(moe, recipe, balance["bias_rate"], recipe.seed + 3, device, progress)
        ended = {**{k: settled[k] for k in ("collapse_max", "correction_bias_abs_max")}, "settle": settled} if settled else ended
    moe.to("cpu").eval()
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")  # renamed to out_dir once complete
    shutil.rmtree(tmp, ignore_errors=True)
    moe.save_pretrained(tmp)
    report = {
        "family": family,
        "parameters": int(sum(p.numel() for p in moe.parameters())),
        "dense_loss": [round(dense_losses[0], 4), round(float(np.mean(dense_losses[-20:])), 4)],
        "moe_loss": [round(moe_losses[0], 4), round(float(np.mean(moe_losses[-20:])), 4)],
        "expert_cosine_similarity": expert_similarity(moe),
        "balancing": {"mode": recipe.balancing, **balance},
        "routing_end": ended,
        "recipe": recipe.__dict__,
        "seconds": round(time.perf_counter() - start, 1),
    }
    (tmp / "make_report.json").write_text(json.dumps(report, indent=2))
    tmp.replace(out_dir)
    return report
