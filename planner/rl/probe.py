"""`planner probe`: the static fault recipes' critical knob on a real checkpoint and its proxy.

The calibration grid measures the critical knob on tiny models the harness holds whole. A user's
original has 30B-671B parameters: here the model runs one decoder layer in memory at a time
(planner.checkpoint.layerwise), forward and, for fp16 overflow, backward, on calibration text, so a
checkpoint that fits on disk can be probed on a CPU or one device. The labels are the grid's: the
critical knob per seed (at least 4), the signed shift proxy minus original in log2 units with its
Welch interval and the equivalence outcome (planner.fidelity.labels.knob_shift).

  rollout-mismatch  the rollout copy's matrices rounded to 23 - knob mantissa bits (the harness's
                    rounding); the fault: the mean per-position KL(rollout || train) over the whole
                    vocabulary on the text above the recipe's threshold (0.01). Exact, not sampled: a
                    rollout through a streamed model would cost one pass per generated token.
  fp16-overflow     one backward of the GRPO loss at the initial weights (ratio 1, advantages +-1 per
                    sequence, normalised) under fp16 autocast, scaled by 2^knob; the fault: a
                    non-finite gradient of any parameter or activation (the harness's skipped step).

Seeds choose the calibration windows (and the advantages' signs). The text and its windows are the
same for the original and the proxy, so the shift compares like with like; its values are not the
harness's (different batches), only its differences are meant to agree.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from planner.errors import SpecError

__all__ = ["PROBE_RECIPES", "Probe", "probe_pair"]

PROBE_RECIPES = ("fp16-overflow", "rollout-mismatch")


@dataclass(frozen=True)
class ProbeBatch:
    ids: object  # (sequences, tokens) long tensor
    advantages: object  # (sequences,) float tensor: +-1, zero mean, unit variance


class Probe:
    """One checkpoint, streamed: fault(knob) of a recipe on one seed's batch."""

    def __init__(self, path: str | Path, recipe_name: str, *, device: str = "cpu"):
        from planner.checkpoint import Checkpoint
        from planner.rl.device import Device
        from planner.rl.recipes import recipe
        from planner.checkpoint.layerwise import LayerwiseModel

        if recipe_name not in PROBE_RECIPES:
            raise SpecError(f"planner probe measures the static recipes {', '.join(PROBE_RECIPES)}; {recipe_name} needs training runs "
                            "(`planner rl margin` on a model that fits)")  # fmt: skip
        self.device = Device(device)
        self.torch = self.device.torch
        self.recipe = recipe(recipe_name)
        self.ckpt = Checkpoint(path)
        # fp16 backward through grouped_mm fails on CPU: the probe runs transformers' eager experts
        self.lw = LayerwiseModel(self.ckpt, device=self.device.name, experts="eager" if recipe_name == "fp16-overflow" else None)
        self._reference: dict[int, object] = {}

    @property
    def vocab(self) -> int:
        return int(self.lw.config.vocab_size)

    # ---- rollout mismatch ---------------------------------------------------------------------
    def _logp(self, ids, bits: float | None):
        from planner.rl.grpo import _round_mantissa

        torch, lw = self.torch, self.lw
        held = list(lw.model.get_input_embeddings().parameters()) + list(lw.final_norm.parameters()) + list(lw.model.lm_head.parameters())
        outside = list({id(t): t for t in held if t.dim() > 1}.values())  # a tied head is the embedding
        if bits is None:
            return torch.log_softmax(lw.forward(ids.to(self.device.name)).float(), dim=-1)
        kept = [t.detach().clone() for t in outside]  # the embeddings and head are held: round in place, then restore
        lw.transform = lambda w: _round_mantissa(torch, w, bits)
        try:
            with torch.no_grad():
                for t in outside:
                    t.copy_(lw.transform(t))
            return torch.log_softmax(lw.forward(ids.to(self.device.name)).float(), dim=-1)
        finally:
            lw.transform = None
            with torch.no_grad():
                for t, k in zip(outside, kept):
                    t.copy_(k)

    def mismatch(self, batch: ProbeBatch, knob: float, seed: int) -> float:
        """Mean per-position KL(rollout || train) with the rollout's matrices rounded to 23 - knob bits."""
        if seed not in self._reference:
            self._reference[seed] = self._logp(batch.ids, None)
        train = self._reference[seed]
        rollout = self._logp(batch.ids, 23.0 - knob)
        return float((rollout.exp() * (rollout - train)).sum(-1).mean())

    # ---- fp16 overflow ------------------------------------------------------------------------
    def overflow(self, batch: ProbeBatch, knob: float) -> bool:
        """Does one fp16-autocast backward of the GRPO loss scaled by 2^knob give a non-finite gradient?"""
        torch, lw = self.torch, self.lw
        ids = batch.ids.to(self.device.name)
        inputs: list = []
        captured: dict = {}

        def keep(module, args, kwargs):
            inputs.append(args[0].detach() if args else kwargs["hidden_states"].detach())
            captured.setdefault("args", args[1:])
            captured.setdefault("kwargs", {k: v for k, v in kwargs.items() if k != "hidden_states"})

        hooks = [layer.register_forward_pre_hook(keep, with_kwargs=True) for layer in lw.decoder.layers]
        last: dict = {}
        hooks.append(lw.decoder.layers[-1].register_forward_hook(lambda m, a, out: last.setdefault("h", out[0] if isinstance(out, tuple) else out)))
        try:
            with torch.no_grad(), self.device.autocast(torch.float16):
                lw.model(input_ids=ids, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        scale = 2.0**knob

        def finite(*tensors) -> bool:
            return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)

        # the head: final norm, lm_head, the loss (its parameters are loaded for the whole run)
        h = last["h"].detach().requires_grad_(True)
        head = [p for p in list(lw.final_norm.parameters()) + list(lw.model.lm_head.parameters())]
        for p in head:
            p.requires_grad_(True)
            p.grad = None
        with self.device.autocast(torch.float16):
            logits = lw.model.lm_head(lw.final_norm(h))
            logp = torch.log_softmax(logits.float()[:, :-1], dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            loss = -(batch.advantages.to(logp.device).unsqueeze(-1) * logp).mean()
        (loss * scale).backward()
        if not (finite(loss) and finite(h.grad, *(p.grad for p in head))):
            return True
        grad = h.grad
        lw.auto_load = False
        try:
            for i in reversed(range(len(lw.decoder.layers))):
                layer = lw.load_layer(i)
                for p in layer.parameters():  # a released layer's gradients came back uninitialised
                    p.grad = None
                try:
                    x = inputs[i].detach().requires_grad_(True)
                    with self.device.autocast(torch.float16):
                        out = layer(x, *captured["args"], **captured["kwargs"])
                    out = out[0] if isinstance(out, tuple) else out
                    torch.autograd.backward(out, grad)
                    if not finite(x.grad, *(p.grad for p in layer.parameters())):
                        return True
                    grad = x.grad
                finally:
                    lw.release_layer(i)
        finally:
            lw.auto_load = True
        return not finite(grad)  # the embedding's gradient is this, scattered into its rows

    def fault(self, batch: ProbeBatch, knob: float, seed: int) -> bool:
        if self.recipe.name == "fp16-overflow":
            return self.overflow(batch, knob)
        return self.mismatch(batch, knob, seed) > self.recipe.threshold


def batches(path: Path, vocab: int, seeds: list[int], *, sequences: int, seq_len: int, calib_text: str | None):
    """One batch per seed: windows of the calibration text (the same for original and proxy)."""
    import torch

    from planner.stats.text import calibration_ids

    ids, _ = calibration_ids(path, vocab, text=calib_text, tokens=sequences * seq_len * len(seeds), seq_len=seq_len)
    ids = np.asarray(ids).reshape(-1, seq_len)
    if len(ids) < sequences * len(seeds):
        raise SpecError(f"the calibration text gives {len(ids)} windows of {seq_len} tokens; {sequences * len(seeds)} are needed")
    out = {}
    for n, seed in enumerate(seeds):
        rng = np.random.default_rng(seed)
        signs = rng.permutation(np.r_[np.ones(sequences // 2), -np.ones(sequences - sequences // 2)])
        adv = (signs - signs.mean()) / (signs.std() or 1.0)
        out[seed] = ProbeBatch(ids=torch.from_numpy(ids[n * sequences:(n + 1) * sequences].astype(np.int64)), advantages=torch.tensor(adv, dtype=torch.float32))
    return out


def probe_pair(original: str | Path, proxy: str | Path, recipe_name: str, *, seeds: list[int], iters: int | None = None, device: str = "cpu",
               sequences: int = 4, seq_len: int = 64, calib_text: str | None = None,
               say: Callable[[str], None] = lambda s: None) -> dict:  # fmt: skip
    """The critical knob of both checkpoints per seed, and the grid's labels of their shift."""
    from planner.fidelity.labels import knob_shift
    from planner.rl.margin import DEFAULT_ITERS, Margin, _bisect

    if len(seeds) < 2:
        raise SpecError(f"--seeds: at least 2 (4 or more for a decision worth having), got {seeds}")
    from planner.checkpoint import Checkpoint

    vocab = {name: Checkpoint(path).arch.vocab_size for name, path in (("original", original), ("proxy", proxy))}
    if vocab["original"] != vocab["proxy"]:
        raise SpecError(f"the proxy's vocabulary ({vocab['proxy']}) differs from the original's ({vocab['original']})")
    first = Probe(original, recipe_name, device=device)
    r = first.recipe
    iters = DEFAULT_ITERS["static"] if iters is None else iters
    data = batches(Path(original), first.vocab, seeds, sequences=sequences, seq_len=seq_len, calib_text=calib_text)
    timings: list[float] = []
    done: dict[tuple, bool] = {}  # (model, seed, knob) -> fault: the timing pass is the bisection's first probe

    def measure(name: str, probe: Probe, seed: int, knob: float) -> bool:
        if (name, seed, knob) not in done:
            start = time.perf_counter()
            done[name, seed, knob] = probe.fault(data[seed], knob, seed)
            timings.append(time.perf_counter() - start)
        return done[name, seed, knob]

    measure("original", first, seeds[0], 0.5 * (r.lo + r.hi))  # the bisection's first probe, timed before the long part
    once = timings[0]
    passes = 2 * len(seeds) * (iters + 1)
    say(f"{recipe_name}: one probe pass took {once:.1f} s; at most {passes} passes (2 models x {len(seeds)} seeds x {iters + 1} "
        f"bisection steps): up to {passes * once / 60:.1f} min")  # fmt: skip
    margins = {}
    for name, path in (("original", original), ("proxy", proxy)):
        probe = first if name == "original" else Probe(path, recipe_name, device=device)  # one model in memory at a time
        values, censored, count = [], [], 0
        for seed in seeds:
            value, cens, n = _bisect(lambda knob: measure(name, probe, seed, knob), r.lo, r.hi, iters)  # noqa: B023 - called in this iteration
            values.append(value), censored.append(cens)
            count += n
            say(f"  {name} seed {seed}: critical {r.knob} = {value:.3f}" + (" (censored)" if cens else ""))
        margins[name] = Margin(recipe=recipe_name, values=tuple(values), censored=tuple(censored), probes=count)
        probe = first = None  # release the original before the proxy loads
    resolution = (r.hi - r.lo) / 2 ** (iters + 1)
    shift = knob_shift(recipe_name, list(margins["original"].values), list(margins["proxy"].values),
                       original_censored=list(margins["original"].censored), proxy_censored=list(margins["proxy"].censored),
                       resolution=resolution)  # fmt: skip
    return {"recipe": recipe_name, "knob": r.knob, "seeds": seeds, "iters": iters, "resolution": resolution,
            "original": {"path": str(original), **margins["original"].to_json()}, "proxy": {"path": str(proxy), **margins["proxy"].to_json()},
            "labels": shift.to_row(), "seconds_per_pass": float(np.median(timings)) if timings else math.nan,
            "passes": len(timings), "sequences": sequences, "seq_len": seq_len}  # fmt: skip
