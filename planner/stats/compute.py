"""Expert statistics of a checkpoint, the clusterings for every requested K, and per-plan statistics.

compute_stats(ckpt, ...) runs:
  1. data-free features (router rows, weight sketches; planner.stats.sketch), always;
  2. with calibration text (the default), one pass of the real model, layer by layer: per expert the
     routing frequency, gate mass, REAP saliency (mean over routed tokens of gate x ||output||), its
     outputs on a shared token sample (HC-SMoE's functional signature: every expert on the same
     tokens), router-logit profile, co-activation and max activation; per layer router entropy and
     load CV;
  3. for every K and method, the kept experts of every layer (planner.stats.cluster);
  4. per-plan statistics: share of routing frequency, gate mass and saliency dropped, intra-cluster
     dispersion and silhouette (from the features); with calibration, from the same pass's
     activations (one more visit per MoE layer, no model run per plan): top-k agreement with the
     original routing mapped through the clusters, router entropy and load CV after pruning (the
     family's router over the kept experts' logits, every token), MoE-output reconstruction error
     at the evaluation positions (teacher-forced: the kept experts on the original block input), and
     KL(original || proxy) of next-token distributions there (residual additivity). Each per layer
     and as mean/min/max.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from planner.arch.routing import load_cv
from planner.checkpoint.reader import Checkpoint
from planner.errors import CheckpointError, SpecError
from planner.plan import Plan
from planner.stats.cluster import METHODS, ROUTER_WEIGHT, cosine_distance, select, silhouette
from planner.stats.settle import balance_bias, settle
from planner.stats.sketch import SKETCH_DIM, weight_features
from planner.stats.store import STATISTICS_VERSION, load_stats, plan_key, plan_statistics

__all__ = ["LayerFeatures", "compute_stats", "plan_from_stats", "summarise", "default_experts"]

PROFILE_TOKENS = 1024  # router-logit profile length per expert
OUTPUT_PROFILE_TOKENS = 256  # shared tokens every expert is run on for its output profile
KL_POSITIONS = 256  # positions whose original next-token distribution is kept for the KL


@dataclass
class LayerFeatures:
    distance: np.ndarray  # blended expert distance (E x E)
    router_distance: np.ndarray
    frequency: np.ndarray | None = None  # share of tokens routed to each expert
    gate_mass: np.ndarray | None = None
    saliency: np.ndarray | None = None
    max_activation: np.ndarray | None = None
    coactivation: np.ndarray | None = None
    entropy: float | None = None  # mean normalised router entropy over tokens
    load_cv: float | None = None
    super_experts: list[int] = field(default_factory=list)


def _entropy_cv(probs: np.ndarray, counts: np.ndarray) -> tuple[float, float]:
    """Mean router entropy over tokens normalised by log(experts) (0 for a single expert), and the
    coefficient of variation of tokens per expert."""
    p = np.clip(probs, 1e-12, 1.0)
    n = probs.shape[-1]
    ent = float((-(p * np.log(p)).sum(-1)).mean() / np.log(n)) if n > 1 else 0.0
    return ent, load_cv(counts)


def _router_probs(logits, scoring: str):
    import torch

    if scoring in ("sigmoid", "sigmoid_topk"):
        s = torch.sigmoid(logits.float())
        return (s / s.sum(-1, keepdim=True)).numpy()
    return torch.softmax(logits.float(), dim=-1).numpy()


def _super_experts(max_act: np.ndarray, all_layers_max: float) -> list[int]:
    """Experts with extreme output activations (REAP's rule: above the layer's 99.5th percentile
    and above a tenth of the model-wide maximum)."""
    if not np.isfinite(max_act).any() or all_layers_max <= 0:
        return []
    thresh = max(np.percentile(max_act, 99.5), all_layers_max / 10)
    return [int(i) for i in np.flatnonzero(max_act >= thresh)]


def _kl_positions(ids: np.ndarray) -> np.ndarray:
    """Flattened positions whose next-token distributions the KL compares: spread evenly over
    every calibration sequence."""
    total = ids.size
    return np.linspace(0, total - 1, num=min(KL_POSITIONS, total)).astype(np.int64)


@dataclass
class _Trace:
    """What the plan pass needs from the calibration pass, per MoE layer: router logits and top-k
    routing of every token, and at the evaluation positions (_kl_positions) the block's input and
    output; the final hidden state at those positions."""

    positions: np.ndarray
    logits: dict = field(default_factory=dict)  # layer -> router logits (tokens x E, float32)
    topk_ids: dict = field(default_factory=dict)
    topk_weights: dict = field(default_factory=dict)
    x_eval: dict = field(default_factory=dict)  # layer -> block input at the positions (T x h)
    out_eval: dict = field(default_factory=dict)  # layer -> block output at the positions
    final: object = None  # decoder output before the final norm at the positions (T x h)


class _RoutedNorms:
    """Per expert, REAP's saliency (mean over its routed tokens of gate x ||output||) and max
    activation, accumulated from the outputs the forward computes anyway (`wrap`), so no expert
    runs twice."""

    def __init__(self, n: int):
        self.saliency_sum, self.count, self.max_act = np.zeros(n), np.zeros(n), np.zeros(n)

    def add(self, e: int, y, w) -> None:
        """Expert e's unweighted outputs y on its routed tokens, whose gates are w."""
        self.saliency_sum[e] += float((w.float() * y.float().norm(dim=-1)).sum())
        self.count[e] += y.shape[0]
        self.max_act[e] = max(self.max_act[e], float(y.abs().max()))

    @property
    def saliency(self) -> np.ndarray:
        return np.divide(self.saliency_sum, self.count, out=np.zeros_like(self.count), where=self.count > 0)

    def wrap(self, forward):
        """The experts' forward (hidden, top_k_index, top_k_weights) run one expert at a time through
        the module's own forward on its routed tokens, gate-weighted and summed as the block does."""
        import torch

        def run(hidden, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden)
            for e in torch.unique(top_k_index).tolist():
                rows, slots = torch.nonzero(top_k_index == e, as_tuple=True)
                y = forward(hidden[rows], torch.full((rows.numel(), 1), e, dtype=top_k_index.dtype),
                            torch.ones((rows.numel(), 1), dtype=top_k_weights.dtype))  # fmt: skip
                w = top_k_weights[rows, slots]
                self.add(e, y, w)
                out.index_add_(0, rows, (y * w[:, None]).to(out.dtype))
            return out

        return run


def _calibration_pass(ckpt: Checkpoint, ids: np.ndarray, progress, seed: int = 0) -> tuple[dict, "object", _Trace]:
    import torch

    from planner.checkpoint.layerwise import LayerwiseModel

    runner = LayerwiseModel(ckpt)
    scoring = ckpt.arch.moe.scoring
    trunk = [i for i, layer in ckpt.moe_layers.items() if not layer.mtp]
    raw: dict[int, dict] = {}
    rng = np.random.default_rng(seed)  # which tokens are profiled: compute_stats(seed=...)
    trace = _Trace(positions=_kl_positions(ids))
    at = torch.from_numpy(trace.positions)
    e = ckpt.arch.original_num_experts
    norms: dict[int, _RoutedNorms] = {}

    def wrapper(i):
        def wrap(module, args):  # before the block runs: its experts report their outputs' norms
            if not runner.weights_inputs(module):  # experts that take the routing (all but llama4)
                norms[i] = _RoutedNorms(e)
                module.experts.forward = norms[i].wrap(module.experts.forward)

        return wrap

    def collect(i, block, x, out):
        tokens = x.reshape(-1, x.shape[-1]).float()
        original = (out[0] if isinstance(out, tuple) else out).reshape(-1, x.shape[-1])
        if i in norms:
            del block.experts.forward  # the module's own forward again
        call = runner.route(block, tokens)
        topk = call.topk_ids.numpy()
        weights = call.topk_weights.float().numpy()
        counts = np.bincount(topk.reshape(-1), minlength=e).astype(float)
        gate = np.bincount(topk.reshape(-1), weights=weights.reshape(-1), minlength=e)
        n_tok = tokens.shape[0]
        pick = np.sort(rng.choice(n_tok, size=min(PROFILE_TOKENS, n_tok), replace=False))
        shared = tokens[torch.from_numpy(np.sort(rng.choice(n_tok, size=min(OUTPUT_PROFILE_TOKENS, n_tok), replace=False)))]
        out_profile = np.zeros((e, shared.shape[0] * tokens.shape[1]), dtype=np.float32)
        for ex in range(e):  # function: the expert's output on the same shared tokens, whatever the router does
            out_profile[ex] = runner.expert_output(block, ex, shared).float().reshape(-1).numpy()
        routed = norms.pop(i, None)
        if routed is None:  # experts that take no routing (llama4): evaluate the routed tokens again
            routed = _RoutedNorms(e)
            for ex in range(e):
                rows, slots = np.nonzero(topk == ex)
                if rows.size:
                    routed.add(ex, runner.expert_output(block, ex, tokens[torch.from_numpy(rows)]), torch.from_numpy(weights[rows, slots]))
        onehot = np.zeros((n_tok, e))
        np.put_along_axis(onehot, topk, 1.0, axis=1)
        entropy, cv = _entropy_cv(_router_probs(call.logits, scoring), counts)
        profile = call.logits.float().numpy()[pick].T
        raw[i] = {  # distances now, so no layer's expert outputs outlive its forward
            "frequency": counts / n_tok,
            "gate_mass": gate / n_tok,
            "saliency": routed.saliency,
            "max_activation": routed.max_act,
            "output_distance": cosine_distance(out_profile),
            "router_distance": cosine_distance(profile),
            "coactivation": (onehot.T @ onehot) / n_tok,
            "entropy": entropy,
            "load_cv": cv,
            "tokens": (n_tok, len(pick), shared.shape[0]),
        }
        trace.logits[i], trace.topk_ids[i], trace.topk_weights[i] = call.logits.float(), call.topk_ids, call.topk_weights.float()
        trace.x_eval[i], trace.out_eval[i] = tokens[at].clone(), original[at].float().clone()
        if progress:
            progress(len(raw), len(trunk))
        return None

    def final(module, args):
        trace.final = args[0].reshape(-1, args[0].shape[-1])[at].float().clone()

    handles = [getattr(runner.decoder.layers[i], runner.mem_moe).register_forward_pre_hook(wrapper(i)) for i in trunk]
    handles.append(runner.final_norm.register_forward_pre_hook(final))
    try:
        with runner.moe(collect):
            runner.hidden(torch.from_numpy(ids))  # the head runs only at the KL positions (the plan pass)
    finally:
        for h in handles:
            h.remove()
    return raw, runner, trace


def _features(ckpt: Checkpoint, weights, raw: dict | None) -> dict[int, LayerFeatures]:
    out = {}
    global_max = max((float(r["max_activation"].max()) for r in (raw or {}).values()), default=0.0)
    for i in ckpt.moe_layers:
        if raw is None or i not in raw:  # weights only, or an MTP layer the model never runs
            router_d = cosine_distance(weights.router[i])
            dist = (1 - ROUTER_WEIGHT) * cosine_distance(weights.sketch[i]) + ROUTER_WEIGHT * router_d
            out[i] = LayerFeatures(dist, router_d)
            continue
        r = raw[i]
        dist = (1 - ROUTER_WEIGHT) * r["output_distance"] + ROUTER_WEIGHT * r["router_distance"]
        out[i] = LayerFeatures(
            distance=dist,
            router_distance=r["router_distance"],
            frequency=r["frequency"],
            gate_mass=r["gate_mass"],
            saliency=r["saliency"],
            max_activation=r["max_activation"],
            coactivation=r["coactivation"],
            entropy=r["entropy"],
            load_cv=r["load_cv"],
            super_experts=_super_experts(r["max_activation"], global_max),
        )
    return out


def default_experts(arch) -> list[int]:
    """E/2, E/4 and E/8 where legal for the model (top-k and routing groups allowing)."""
    legal = set(arch.legal_expert_counts())
    e = arch.original_num_experts
    return [k for k in (e // 2, e // 4, e // 8) if k in legal] or [max(legal)]


def summarise(per_layer: dict[int, float]) -> dict[str, float]:
    values = np.array(list(per_layer.values()), dtype=float)
    return {"mean": float(values.mean()), "min": float(values.min()), "max": float(values.max())}


def _selection_stats(f: LayerFeatures, kept: list[int], labels: np.ndarray) -> dict[str, float]:
    rep_of = {int(labels[k]): k for k in kept}
    dispersion = float(np.mean([f.distance[e, rep_of[int(labels[e])]] for e in range(len(labels))]))
    out = {"dispersion": dispersion, "silhouette": silhouette(f.distance, labels) if len(kept) > 1 else 0.0}
    dropped = np.setdiff1d(np.arange(len(labels)), kept)
    for name in ("frequency", "gate_mass", "saliency"):
        values = getattr(f, name)
        if values is not None and values.sum() > 0:
            out[f"{name}_dropped"] = float(values[dropped].sum() / values.sum())
    return out


def _pruned_router(runner, block, kept: list[int]):
    """The family's own router over the kept experts, fed the original router logits: its weight
    selects the kept experts' logits (their router rows are copies of the original's, so the pruned
    router's logits are exactly those columns); a linear bias is already in those logits (zeroed),
    other per-expert tensors (a correction bias) are sliced."""
    import torch

    router = runner.router(block)
    e = runner.ckpt.arch.original_num_experts
    cfg = copy.deepcopy(runner.config)
    setattr(cfg, runner.ckpt.arch.moe.experts_key, len(kept))
    cfg.hidden_size = e
    with torch.device("meta"):
        pruned = type(router)(cfg)
    pruned.to_empty(device="cpu")
    index = torch.tensor(kept, dtype=torch.long)
    full = router.state_dict()
    with torch.no_grad():
        for name, tensor in pruned.state_dict().items():
            src = full[name]
            dims = [d for d, (a, b) in enumerate(zip(src.shape, tensor.shape)) if a != b]
            if name == "weight":
                tensor.zero_()
                tensor[torch.arange(len(kept)), index] = 1.0
            elif name == "bias":
                tensor.zero_()
            elif dims:
                if len(dims) != 1 or src.shape[dims[0]] != e:
                    raise CheckpointError(f"cannot slice router tensor {name}: {list(src.shape)} -> {list(tensor.shape)}")
                tensor.copy_(src.index_select(dims[0], index))
            else:
                tensor.copy_(src)
    return pruned.float().eval()


def _jaccard(a: np.ndarray, b: np.ndarray, n: int) -> float:
    """Mean over rows of |A & B| / |A | B|, A and B the sets of ids (< n) in each row of a and b."""
    rows = np.arange(len(a))[:, None]
    sa, sb = np.zeros((len(a), n), bool), np.zeros((len(b), n), bool)
    sa[rows, a], sb[rows, b] = True, True
    return float(((sa & sb).sum(1) / (sa | sb).sum(1)).mean())


def _plan_pass(ckpt, runner, trace: _Trace, plans: dict[str, dict[int, tuple[list[int], np.ndarray]]], progress,
               settle_bias: bool = False) -> dict:  # fmt: skip
    """Every plan from the calibration pass's activations, one more visit per MoE layer: the pruned
    router (the family's own) on every token's router logits gives the routing after pruning (entropy,
    load CV, agreement with the original routing mapped through the clusters); at the evaluation
    positions the kept experts the pruned router picks run on the original block input, so each
    layer's change of the MoE output is exact there (reconstruction error, teacher-forced). The
    proxy's next-token distribution is the original's final hidden state plus every layer's change,
    through the final norm and head (residual additivity: what a layer changes downstream is not
    followed), against the original's: KL(original || proxy)."""
    import torch

    scoring = ckpt.arch.moe.scoring
    layers = list(trace.logits)
    per_layer = {key: {} for key in plans}
    settled: dict[str, dict[int, dict]] = {key: {} for key in plans}
    delta = {key: torch.zeros_like(trace.final) for key in plans}
    e, t = ckpt.arch.original_num_experts, len(trace.positions)
    at = torch.from_numpy(trace.positions)
    for n, i in enumerate(layers):
        block = runner.load_block(i)
        logits, before, x = trace.logits[i], trace.topk_ids[i].numpy(), trace.x_eval[i]
        w_orig = torch.zeros(t, e).scatter_(1, trace.topk_ids[i][at], trace.topk_weights[i][at])
        weights = {}
        for key, selections in plans.items():
            kept, labels = selections[i]
            pruned = _pruned_router(runner, block, kept)
            call = runner.route(block, logits, router=pruned)
            pl, pw, pid = call.logits, call.topk_weights.float(), call.topk_ids
            kept_t = torch.tensor(kept, dtype=torch.long)
            rep_index = {int(labels[k]): m for m, k in enumerate(kept)}
            mapped = np.array([rep_index[int(labels[x_])] for x_ in range(e)])[before]  # original routing through the clusters
            proxy = pid.numpy()
            counts = np.bincount(proxy.reshape(-1), minlength=len(kept)).astype(float)
            entropy, cv = _entropy_cv(_router_probs(pl, scoring), counts)
            per_layer[key][i] = {"routing_agreement": _jaccard(mapped, proxy, len(kept)), "entropy_after": entropy, "load_cv_after": cv}
            if settle_bias and (bias := _correction_bias(pruned)) is not None:
                settled[key][i] = _settle_pruned(runner, block, logits, pruned, bias)
                per_layer[key][i]["load_cv_settled"] = settled[key][i].pop("load_cv")
            weights[key] = torch.zeros(t, e).scatter_(1, kept_t[pid[at]], pw[at])
        if runner.weights_inputs(block):  # the change is not linear in the weights: each routing in full

            def routed(w):  # the routed part of the block's output at the positions, for routing weights w
                r, c = torch.nonzero(w, as_tuple=True)
                return torch.zeros_like(x).index_add_(0, r, runner.expert_outputs(block, c, x[r], w[r, c]).float())

            original = routed(w_orig)
            change = {key: routed(w) - original for key, w in weights.items()}
        else:  # linear: each needed (token, expert) once, in one call, scaled by each plan's change of weight
            diff = {key: w - w_orig for key, w in weights.items()}
            rows, cols = torch.nonzero(torch.stack(list(diff.values())).ne(0).any(0), as_tuple=True)
            y = runner.expert_outputs(block, cols, x[rows]).float()
            change = {key: torch.zeros_like(x).index_add_(0, rows, y * d[rows, cols][:, None]) for key, d in diff.items()}
        scale = trace.out_eval[i].norm().clamp_min(1e-12)
        for key, d in change.items():
            per_layer[key][i]["reconstruction_error"] = float(d.norm() / scale)
            delta[key] += d
        runner.release_layer(i)
        if progress:
            progress(n + 1, len(layers))
    kl = _head_kl(runner, trace.final, [trace.final + delta[key] for key in plans])
    return {key: {"per_layer": per_layer[key], "kl_original_proxy": kl[n], **({"settled_bias": settled[key]} if settled[key] else {})}
            for n, key in enumerate(plans)}  # fmt: skip


def _correction_bias(router):
    """The correction bias tensor of a router module (its own, or its submodule's: ERNIE-4.5 keeps it
    in `moe_statics`), or None."""
    return next((m.e_score_correction_bias for m in router.modules() if getattr(m, "e_score_correction_bias", None) is not None), None)


def _settle_pruned(runner, block, logits, pruned, bias) -> dict:
    """The pruned router's correction bias `bias` settled (planner.stats.settle) on the original's
    router logits of every calibration token, in place: each pass routes them all and moves the bias
    towards an even load of the kept experts. The inputs are the original's, as everywhere in the
    plan pass (a layer's change of what reaches later routers is not followed). Returns the settled
    bias, the passes, the last window's drift and the kept experts' load CV after settling."""
    import torch


    def counts():
        ids = runner.route(block, logits, router=pruned).topk_ids.reshape(-1)
        return torch.bincount(ids, minlength=bias.numel()).float().view(bias.shape)

    info = settle(lambda step: balance_bias(bias, counts(), step), [bias])
    return {"bias": bias.flatten().tolist(), **info, "load_cv": load_cv(counts())}


HEAD_CHUNK_BYTES = 384 << 20  # float32 logits of the plans the head runs on at once


def _head_kl(runner, final, proxies: list) -> list[float]:
    """Mean KL(original || proxy) over the positions of the final hidden states, through the final
    norm and head. With dz = z_proxy - z_original, m = E_p[dz]: KL = log(1 + E_p[expm1(dz - m)]),
    free of the cancellation the difference of two log-partition functions has, so float32
    elementwise work with float64 sums keeps about 1e-6 relative; the head runs on several plans'
    positions at once."""
    import torch

    head, norm = runner.model.lm_head, runner.final_norm  # the causal LMs here apply nothing after the head
    with torch.no_grad():
        z0 = head(norm(final.to(runner.dtype))).float()
        p = torch.softmax(z0, -1)
        mass = p.sum(-1, dtype=torch.float64)
        per_chunk = max(1, HEAD_CHUNK_BYTES // max(1, z0.numel() * 4))
        kl = []
        for start in range(0, len(proxies), per_chunk):
            group = proxies[start : start + per_chunk]
            z = head(norm(torch.cat(group).to(runner.dtype))).float().view(len(group), *z0.shape)
            for dz in z.sub_(z0):
                m = (p * dz).sum(-1, dtype=torch.float64) / mass
                m32 = m.float()  # centred on the float32 mean: KL = log(1 + s) - (m - m32) exactly
                s = (p * torch.expm1(dz - m32[:, None])).sum(-1, dtype=torch.float64) / mass
                kl.append(max(0.0, float((torch.log1p(s) - (m - m32.double())).mean())))
    return kl


CALIBRATED_METHODS = ("saliency", "frequency", "least-used")  # need routing statistics from calibration text


def compute_stats(
    ckpt: Checkpoint,
    *,
    experts: list[int],
    methods: tuple[str, ...] = ("agglomerative",),
    calib_text: str | None = None,
    calib_tokens: int = 4096,
    seq_len: int = 256,
    weights_only: bool = False,
    seed: int = 0,
    settle_bias: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict:
    """Features, clusterings and per-plan statistics of `ckpt` for every kept count in `experts` and
    selection method in `methods`. `settle_bias`: also settle each plan's correction bias on the
    calibration text (planner.stats.settle), for proxies built with their bias settled."""
    start = time.perf_counter()
    arch = ckpt.arch
    for k in experts:
        arch.with_experts(k)  # raises, naming the rule, when K cannot be kept
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SpecError(f"unknown method(s) {unknown}; one of {', '.join(METHODS)}")
    if settle_bias and (weights_only or arch.moe.correction_bias == "none"):
        raise SpecError("settling the correction bias needs calibration text and a router that has one: "
                        + ("drop --weights-only" if weights_only else f"{arch.model_type} routes without a correction bias"))  # fmt: skip
    ranking = [m for m in methods if m in CALIBRATED_METHODS]
    if weights_only and ranking:
        raise SpecError(f"{ranking} rank experts by calibration statistics; drop --weights-only to compute them")
    quantised = sorted({t.dtype for t in ckpt.tensors.values() if t.dtype.startswith(("F8", "F4")) or t.dtype == "U8"})
    if quantised and not weights_only:
        raise SpecError(
            f"{ckpt.path} holds quantised weights ({', '.join(quantised)}): calibration statistics need a bf16, fp16 or "
            "fp32 checkpoint; use --weights-only (FP8 experts are dequantised with their block scales for the sketches)"
        )

    def step(name):
        return (lambda done, total: progress(name, done, total)) if progress else None

    # data-free features for the layers the model does not run on calibration text
    data_free = [i for i, layer in ckpt.moe_layers.items() if weights_only or layer.mtp]
    weights = weight_features(ckpt, layers=data_free, progress=step("weights"))
    raw = runner = trace = ids = provenance = None
    if not weights_only:
        from planner.stats.text import calibration_ids

        ids, provenance = calibration_ids(ckpt.path, arch.vocab_size, text=calib_text, tokens=calib_tokens, seq_len=seq_len)
        raw, runner, trace = _calibration_pass(ckpt, ids, step("calibration"), seed=seed)
    features = _features(ckpt, weights, raw)
    spec = []
    if raw:
        n_tok, n_profile, n_shared = next(iter(raw.values()))["tokens"]
        spec.append(
            f"calibrated layers: distance = {1 - ROUTER_WEIGHT:g} x cosine(expert outputs on {n_shared} shared tokens) + "
            f"{ROUTER_WEIGHT:g} x cosine(router logits on {n_profile} of {n_tok} tokens)"
        )
    if data_free:
        spec.append(
            f"{'MTP ' if raw else ''}layers {data_free[:4]}{'...' if len(data_free) > 4 else ''}: distance = "
            f"{1 - ROUTER_WEIGHT:g} x cosine(bilinear weight sketch, {SKETCH_DIM} per matrix) + {ROUTER_WEIGHT:g} x cosine(router rows)"
        )
        if weights.unsketched:
            spec.append(f"not sketched (quantised fused tensors; their distance is the router's): {weights.unsketched[:4]}")

    layers_doc = {}
    for i, f in features.items():
        entry: dict = {"distance": f.distance, "router_distance": f.router_distance}
        for name in ("frequency", "gate_mass", "saliency", "max_activation", "coactivation"):
            if getattr(f, name) is not None:
                entry[name] = getattr(f, name)
        if f.entropy is not None:
            entry.update(entropy=f.entropy, load_cv=f.load_cv, super_experts=f.super_experts)
        layers_doc[str(i)] = entry

    chosen: dict[str, tuple[int, str, dict]] = {}
    for k in sorted(set(experts)):
        for method in methods:
            chosen[plan_key(k, method)] = (k, method, {
                i: select(method, k, distance=f.distance, router_distance=f.router_distance, saliency=f.saliency,
                          frequency=f.frequency, protected=set(f.super_experts), n_group=arch.moe.n_group, seed=seed)
                for i, f in features.items()
            })  # fmt: skip
    measured = _plan_pass(ckpt, runner, trace, {key: sel for key, (_, _, sel) in chosen.items()}, step("plans"),
                          settle_bias) if runner else {}  # fmt: skip
    plans: dict[str, dict] = {}
    for key, (k, method, selections) in chosen.items():
        per_layer = {i: _selection_stats(features[i], kept, lab) for i, (kept, lab) in selections.items()}
        for i, values in measured.get(key, {}).get("per_layer", {}).items():
            per_layer[i].update(values)
        names = sorted({n for v in per_layer.values() for n in v})
        plans[key] = {
            "experts": k,
            "method": method,
            "kept": {str(i): kept for i, (kept, _) in selections.items()},
            "labels": {str(i): [int(x) for x in lab] for i, (_, lab) in selections.items()},
            "per_layer": {str(i): v for i, v in per_layer.items()},
            "summary": {
                "kept_fraction": k / arch.original_num_experts,
                "top_k_over_k": arch.moe.top_k / k,
                "experts_per_group": k // arch.moe.n_group,
                **{n: summarise({i: v[n] for i, v in per_layer.items() if n in v}) for n in names},
                **({"kl_original_proxy": measured[key]["kl_original_proxy"]} if key in measured else {}),
            },
        }
        if "settled_bias" in measured.get(key, {}):
            plans[key]["settled_bias"] = {str(i): v for i, v in measured[key]["settled_bias"].items()}
    return {
        "checkpoint": {
            "path": str(ckpt.path),
            "fingerprint": ckpt.fingerprint(),
            "model_type": arch.model_type,
            "num_experts": arch.original_num_experts,
            "top_k": arch.moe.top_k,
            "n_group": arch.moe.n_group,
            "scoring": arch.moe.scoring,
            "norm_topk_prob": arch.moe.norm_topk_prob,
            "moe_layers": list(ckpt.moe_layers),
            "num_layers": arch.num_layers,
        },
        "calibration": provenance,
        "feature_spec": "; ".join(spec),
        "seed": seed,
        "statistics_version": STATISTICS_VERSION,
        "weights": {"bytes_read": weights.bytes_read, "seconds": weights.seconds},
        "seconds": time.perf_counter() - start,
        "layers": layers_doc,
        "plans": plans,
    }


def plan_from_stats(stats: dict, experts: int, method: str, *, model: str, mtp: str = "drop",
                    target_ep: tuple[int, ...] = (), seed: int = 0, settle_bias: bool = False) -> Plan:  # fmt: skip
    """A plan from stored features: a stored clustering when it matches, else a new one.
    `settle_bias`: with the correction bias the stats settled for that clustering (the MTP layers,
    which calibration text does not reach, keep theirs sliced)."""
    ck = stats["checkpoint"]
    key = plan_key(experts, method)
    stored = stats["plans"].get(key) if stats.get("seed", 0) == seed else None  # the clustering the stats measured
    statistics = bias = None
    if settle_bias and "settled_bias" not in (stored or {}):
        raise SpecError(f"the stats hold no settled correction bias for K={experts} by {method} (seed {seed}): run "
                        f"`planner stats {ck['path']} --experts {experts} --methods {method} --seed {seed} --settle-bias -o ...` "
                        "and pass that file")  # fmt: skip
    if stored:
        kept = {int(i): v for i, v in stored["kept"].items()}
        labels = {int(i): v for i, v in stored["labels"].items()}
        statistics = plan_statistics(stats, key)
        if settle_bias:
            bias = {int(i): v["bias"] for i, v in stored["settled_bias"].items()}
    else:
        kept, labels = {}, {}
        for i, entry in stats["layers"].items():
            ids, lab = select(
                method, experts, distance=np.asarray(entry["distance"]), router_distance=np.asarray(entry["router_distance"]),
                saliency=_opt(entry, "saliency"), frequency=_opt(entry, "frequency"),
                protected=set(entry.get("super_experts", [])), n_group=ck["n_group"], seed=seed,
            )  # fmt: skip
            kept[int(i)], labels[int(i)] = ids, [int(x) for x in lab]
    trunk = [i for i in kept if i < ck["num_layers"]]
    mtp_layers = [i for i in kept if i >= ck["num_layers"]]  # MTP layers are numbered from num_layers
    for i in mtp_layers:
        if mtp == "drop":
            del kept[i], labels[i]
        else:  # docs/proxy-rules.md "MTP layers": prune MTP with the same map; it continues from the last trunk layer
            kept[i], labels[i] = kept[max(trunk)], labels[max(trunk)]
    return Plan(
        model=model,
        experts=experts,
        original_experts=ck["num_experts"],
        layers=kept,
        labels=labels,
        method=method,
        mtp=mtp,
        checkpoint_fingerprint=ck["fingerprint"],
        target_ep=target_ep,
        seed=seed,
        feature_spec=stats["feature_spec"],
        statistics=statistics,
        correction_bias=bias,
    )


def choose_plan(ckpt, experts: int, method: str, *, stats_path=None, mtp: str = "drop", target_ep: tuple[int, ...] = (),
                seed: int = 0, settle_bias: bool = False) -> Plan:  # fmt: skip
    """A plan for the checkpoint: from a stats file when given, else from data-free features computed
    now. `settle_bias`: with the correction bias settled in the stats file (planner stats --settle-bias)."""
    if settle_bias and not stats_path:
        raise SpecError(f"a settled correction bias comes from calibration statistics: run `planner stats {ckpt.path} --experts "
                        f"{experts} --methods {method} --settle-bias -o stats.json` and pass --stats stats.json")  # fmt: skip
    if experts == ckpt.arch.moe.num_experts and not stats_path:  # keep-all: nothing to choose, no expert to read
        keep = list(range(experts))
        layers = {i: keep for i, layer in ckpt.moe_layers.items() if not (layer.mtp and mtp == "drop")}
        return Plan(model=str(ckpt.path), experts=experts, original_experts=experts, layers=layers, labels={i: keep for i in layers},
                    method=method, mtp=mtp, checkpoint_fingerprint=ckpt.fingerprint(), target_ep=tuple(target_ep), seed=seed)  # fmt: skip
    if stats_path:
        data = load_stats(stats_path, fingerprint=ckpt.fingerprint())
    elif method in CALIBRATED_METHODS:
        raise SpecError(f"method {method!r} ranks experts by calibration statistics: run `planner stats {ckpt.path} --methods {method} "
                        f"-o stats.json`, then `planner plan {ckpt.path} --experts {experts} --method {method} --stats stats.json -o plan.yaml` "
                        "and build with --plan plan.yaml")  # fmt: skip
    else:
        data = compute_stats(ckpt, experts=[experts], methods=(method,), weights_only=True, seed=seed)
    return plan_from_stats(data, experts, method, model=str(ckpt.path), mtp=mtp, target_ep=tuple(target_ep), seed=seed,
                           settle_bias=settle_bias)  # fmt: skip


def resolve_plan(ckpt, plan: Plan, *, stats_path=None, settle_bias: bool = False) -> Plan:
    """A deferred plan (no kept sets: planner suggest without a checkpoint) made concrete for this
    checkpoint by its own method, its correction bias settled where `settle_bias` or the plan asks
    (suggest --settle-bias); its deployment carries over. Other plans come back unchanged."""
    if not plan.deferred:
        if settle_bias and plan.correction_bias is None:
            raise SpecError("the plan names its experts and holds no settled correction bias; make it with `planner plan ... "
                            "--settle-bias`, or build it as written without --settle-bias")  # fmt: skip
        return plan
    chosen = choose_plan(ckpt, plan.experts, plan.method, stats_path=stats_path, mtp=plan.mtp, target_ep=plan.target_ep,
                         seed=plan.seed or 0, settle_bias=settle_bias or plan.build == "settled")  # fmt: skip
    return dataclasses.replace(chosen, deployment=plan.deployment)


def _opt(entry: dict, name: str) -> np.ndarray | None:
    return np.asarray(entry[name]) if name in entry else None

