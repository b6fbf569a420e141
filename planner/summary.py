"""Readable text for cost results, the proxy comparison of `planner demo`, and the catalog."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.arch import count_parameters
from planner.catalog import catalog_accelerators, catalog_models, load_model, parse_count
from planner.cost.evaluate import DEFAULT_MEMORY_MARGIN, CostResult, min_devices
from planner.cost.hardware import Accelerator
from planner.render import count, table
from planner.specs import Job
from planner.units import GIB, gib

__all__ = ["render_stats", "render_cost", "ProxyComparison", "compare_proxies", "render_comparison", "catalog_listing", "render_catalog"]


def render_terms(r: CostResult) -> str:
    """The step's terms with the inputs of each formula (`planner cost --explain`)."""
    rows = [[t["phase"], t["term"], f"{t['seconds']:,.1f}", t["inputs"]] for t in r.terms]
    return table(["phase", "term", "seconds", "inputs"], rows, title=f"step terms at {r.num_devices} {r.device_unit}s "
                 f"({r.train_layout.describe()} / {r.rollout_layout.describe()}): where the time goes")  # fmt: skip


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def validation_text(v: dict | None) -> str:
    """The line under step times: the leave-one-run-out check behind them (planner.cost.fit.step_validation)."""
    if v is None:
        return "step times: uncalibrated (the knobs file holds no leave-one-run-out check; `planner fit-knobs` writes one)"
    who = f"published {v['family']} runs" if v["family"] else "published runs"
    text = (f"step times out of sample: {v['runs_within_25']} of {v['runs']} {who} within 25% of their step time when left "
            f"out of the fit (worst {v['worst_step']:.0%}; `planner fit-knobs` lists them)")
    if v.get("accelerators") and not v["accelerator_measured"]:
        text += (f"; none of them ran on {v['accelerator']} (they ran on {', '.join(v['accelerators'])}): its step times rest on its "
                 "profile's sourced rates and the fractions fitted on those")
    return text


def feature_validation_lines(rows: list[dict]) -> list[str]:
    """One line per job feature that no fitted run has (planner.cost.fit.feature_validation): the
    published rows behind it, out of sample."""
    out = []
    for v in rows:
        if not v["runs"]:
            out.append(f"{v['feature']}: no published {v['family']} run has it, so its step time is not validated on {v['family']}")
            continue
        outside = ", ".join(f"{rid} x{ratio:.2f}" for rid, ratio in v["outside"].items())
        out.append(f"{v['feature']}: {v['runs_within_25']} of {v['runs']} published {v['family']} runs with it within 25% of their step "
                   f"time (none of them in the fit; worst {v['worst_step']:.0%}" + (f"; outside: {outside})" if outside else ")"))
    return out


def published_fit_rows(fit: dict[str, Any]) -> list[dict[str, Any]]:
    """Per run and published phase of a `planner fit-knobs` result: published seconds, the prediction
    of the knobs fitted to every run ("fitted") and of knobs refitted without the run ("left_out")."""
    fitted = {(r["run"], r["phase"]): r for r in fit["residuals"]}
    return [{"run": o["run"], "family": o["family"], "phase": o["phase"], "published_s": o["published_s"],
             "fitted_s": fitted[(o["run"], o["phase"])]["predicted_s"], "fitted_ratio": fitted[(o["run"], o["phase"])]["ratio"],
             "left_out_s": o["predicted_s"], "left_out_ratio": o["ratio"]}
            for o in fit["leave_one_out"] if o["published_s"] > 0]  # fmt: skip


def published_fit_summary(fit: dict[str, Any]) -> str:
    from planner.cost.fit import loo_summary

    s = loo_summary(fit["leave_one_out"])
    in_step = max(abs(r["ratio"] - 1) for r in fit["residuals"] if r["phase"] == "step" and r["ratio"] is not None)
    runs = ", ".join(f"{n} {family}" for family, n in fit["runs"].items())
    return (f"{s['runs']} runs ({runs}), {fit['free_parameters']} free parameters. Step error in sample: worst {in_step:.1%}. "
            f"Leaving each run out of the fit: {s['runs_within_25']} of {s['runs']} runs within 25% on the step, "
            f"worst step error {s['worst_step']:.1%}, worst phase error {s['worst_phase']:.1%}.")


def render_published_fit(fit: dict[str, Any]) -> str:
    """`planner fit-knobs` output as a table and its summary line."""
    rows = [[r["run"], r["family"], r["phase"], f"{r['published_s']:,.1f}", f"{r['fitted_s']:,.1f}", fmt_ratio(r["fitted_ratio"]),
             f"{r['left_out_s']:,.1f}", fmt_ratio(r["left_out_ratio"]),
             "ok" if r["left_out_ratio"] is not None and abs(r["left_out_ratio"] - 1) <= 0.25 else "OUT"]
            for r in published_fit_rows(fit)]  # fmt: skip
    head = ["run", "family", "phase", "published s", "fitted s", "ratio", "left out s", "ratio", "+-25%"]
    return table(head, rows) + "\n\n" + published_fit_summary(fit)


def render_cost(r: CostResult) -> str:
    unit = r.device_unit
    cards = f"{r.num_devices} {unit}s" + (f" ({r.num_cards:g} physical cards)" if r.devices_per_card > 1 else "")
    head = f"{r.model}  K={r.experts}/{r.original_experts} experts  on {cards} of {r.accelerator}"
    lines = [head]
    if not r.feasible:
        lines.append("INFEASIBLE")
        lines.extend(f"  - {reason}" for reason in r.reasons)
        return "\n".join(lines)
    pools = r.pools or {}
    train_on = f" on {pools['train_devices']} {unit}s" if pools else ""
    rollout_devices = pools.get("rollout_devices", r.num_devices)
    lines.append(f"  train layout    {r.train_layout.describe()}{train_on}")
    instances = rollout_devices // (r.rollout_layout.tp * r.rollout_layout.dp)
    lines.append(f"  rollout layout  {r.rollout_layout.describe()} ({instances} instance{'s' if instances > 1 else ''}"
                 + (f" on {rollout_devices} {unit}s)" if pools else ")"))
    lines.append("")
    phase_rows = [[p, f"{t:,.1f}", f"{100 * t / r.step_time_s:.0f}%"] for p, t in r.phase_times_s.items()]
    if r.overlap_s:
        phase_rows.append(["overlapped", f"-{r.overlap_s:,.1f}", f"-{100 * r.overlap_s / r.step_time_s:.0f}%"])
    phase_rows.append(["step", f"{r.step_time_s:,.1f}", "100%"])
    lines.append(table(["phase", "seconds", "share"], phase_rows))
    lines.append("")
    mem_rows = []
    for phase, parts in r.memory_per_device_bytes.items():
        detail = ", ".join(f"{k} {gib(v, suffix=False)}" for k, v in parts.items() if k != "total")
        mark = " <- peak" if phase == r.peak_phase else ""
        mem_rows.append([phase, gib(parts["total"], suffix=False), (detail or "-") + mark])
    lines.append(table([f"memory per {unit}", "GiB", "breakdown (GiB)"], mem_rows))
    lines.append(
        f"  usable {gib(r.usable_bytes_per_device, suffix=False)} GiB per {unit}; host memory for offload "
        f"{gib(r.host_memory_bytes_per_node, suffix=False)} of {gib(r.host_memory_limit_bytes_per_node, suffix=False)} GiB per node"
    )
    lines.append("")
    hours = f"{r.device_hours_per_step:,.2f} {unit}-hours per step"
    if r.devices_per_card > 1:
        hours += f" ({r.card_hours_per_step:,.2f} card-hours)"
    lines.append(f"  {hours}; {r.tokens_per_s_per_device:,.1f} tokens/s per {unit}")
    lines.append(f"  {r.layouts_evaluated} layouts evaluated")
    lines.extend(f"  note: {n}" for n in r.notes)
    return "\n".join(lines)


@dataclass(frozen=True)
class ProxyComparison:
    original: CostResult
    proxies: list[CostResult]

    def to_json(self) -> dict[str, Any]:
        o = self.original
        return {
            "original": o.to_json(),
            "proxies": [
                {
                    **p.to_json(),
                    "card_reduction": o.num_devices / p.num_devices,
                    "card_saving_fraction": 1 - p.num_devices / o.num_devices,
                    "hours_reduction": o.device_hours_per_step / p.device_hours_per_step,
                }
                for p in self.proxies
            ],
        }


def compare_proxies(model: str, accel: Accelerator, job: Job, experts: list[int], *, max_devices: int = 4096,
                    memory_margin: float = DEFAULT_MEMORY_MARGIN) -> ProxyComparison:  # fmt: skip
    """Minimum devices and best layouts for the original and for proxies keeping each K."""
    original = min_devices(load_model(model), accel, job, max_devices=max_devices, memory_margin=memory_margin)
    proxies = [min_devices(load_model(model, experts=k), accel, job, max_devices=max_devices, memory_margin=memory_margin) for k in experts]
    return ProxyComparison(original, proxies)


def render_comparison(c: ProxyComparison) -> str:
    o = c.original
    unit = o.device_unit
    rows = []
    for r in [o, *c.proxies]:
        peak = r.memory_per_device_bytes[r.peak_phase]["total"]
        rows.append(
            [
                "original" if r is o else f"K={r.experts}",
                r.num_devices,
                r.train_layout.describe(),
                r.rollout_layout.describe(),
                f"{gib(peak, suffix=False)} ({r.peak_phase})",
                f"{r.step_time_s:,.0f}",
                f"{r.device_hours_per_step:,.2f}",
                "-" if r is o else f"{o.num_devices / r.num_devices:.1f}x ({1 - r.num_devices / o.num_devices:.1%})",
                "-" if r is o else f"{o.device_hours_per_step / r.device_hours_per_step:.2f}x",
            ]
        )
    job = o.job
    title = (
        f"{o.model} {job.algorithm.upper()} on {o.accelerator}: {job.prompts_per_step} prompts x {job.samples_per_prompt}, "
        f"response mean {job.response_tokens.mean:g} (max {job.response_tokens.max}), {job.precision}, recompute {job.recompute}"
    )
    out = [
        table(
            ["model", f"min {unit}s", "train layout", "rollout layout", "peak GiB/" + unit, "step s", f"{unit}-h/step", f"fewer {unit}s", "fewer hours"],
            rows,
            title=title,
        )
    ]
    out.append("")
    out.append("Phase times (s) at the minimum device count:")
    phases = list(o.phase_times_s)
    out.append(
        table(
            ["model", *phases],
            [["original" if r is o else f"K={r.experts}", *(f"{r.phase_times_s[p]:,.1f}" for p in phases)] for r in [o, *c.proxies]],
        )
    )
    notes = c.proxies[0].notes if c.proxies else []
    out.extend(f"note: {n}" for n in notes)
    return "\n".join(out)


def catalog_listing() -> dict[str, Any]:
    from planner.arch.routing import routing_shape
    from planner.families import family_of_shape

    models = []
    for mid, m in catalog_models().items():
        arch = load_model(mid)
        counts = count_parameters(arch)
        shape = routing_shape(arch)
        models.append(
            {
                "id": mid,
                "name": m.name,
                "hf_repo": m.hf_repo,
                "model_type": arch.model_type,
                "experts": arch.moe.num_experts,
                "top_k": arch.moe.top_k,
                "moe_layers": arch.num_moe_layers,
                "routing_shape": shape.key(),
                "routing": shape.describe(),
                "calibration_family": family_of_shape(shape),
                "total_params": counts.total,
                "active_params": counts.active,
                "published_total": parse_count(m.published["total_params"]),
                "published_active": parse_count(m.published["active_params"]),
                "published_active_counts": m.published.get("active_counts", "embeddings"),
                # our count the way the publisher counts active parameters (with or without embeddings)
                "active_params_as_published": counts.active_counted(m.published.get("active_counts", "embeddings")),
                "source": m.published["source"],
                "config_source": m.config_source,
            }
        )
    accels = []
    for aid, a in catalog_accelerators().items():
        accels.append(
            {
                "id": aid,
                "name": a.name,
                "family": a.family,
                "device_unit": a.device_unit,
                "devices_per_card": a.devices_per_card,
                "devices_per_node": a.devices_per_node,
                "hbm_bytes": a.hbm_bytes,
                "usable_bytes": a.usable_bytes,
                "hbm_bytes_per_s": a.hbm_bytes_per_s,
                "peak_bf16_flops": a.peak_bf16_flops,
                "peak_fp8_flops": a.peak_fp8_flops,
                "intra_node_bytes_per_s": a.intra_node_bytes_per_s,
                "inter_node_bytes_per_s": a.inter_node_bytes_per_s,
                "sources": dict(a.sources),
            }
        )
    return {"models": models, "accelerators": accels}


_CONVENTION_WORDS = {"no_input_embedding": "without the input embedding", "non_embedding": "without embeddings and output head"}


def _convention_note(m: dict[str, Any]) -> str:
    convention = m["published_active_counts"]
    if convention == "embeddings":
        return ""
    return f" ({_CONVENTION_WORDS[convention]}: ours {count(m['active_params_as_published'])})"


def render_catalog(listing: dict[str, Any]) -> str:
    rows = [
        [
            m["id"],
            m["model_type"],
            m["experts"],
            m["top_k"],
            count(m["total_params"]),
            count(m["active_params"]),
            f"{count(m['published_total'])} / {count(m['published_active'])}" + _convention_note(m),
            m["routing_shape"],
            m["calibration_family"] or "-",
        ]
        for m in listing["models"]
    ]
    out = [table(["model", "model type", "experts", "top-k", "total", "active", "published total / active", "routing shape", "calibration family"],
                 rows, title="Models (planner inspect MODEL for the breakdown; sources in models/catalog.yaml)")]
    if any(m["published_active_counts"] != "embeddings" for m in listing["models"]):
        out.append("active: every parameter a token touches, embeddings and output head included; where a publisher counts "
                   "otherwise, its convention and our count under it follow the published figure")  # fmt: skip
    out.append("")
    rows = [
        [
            a["id"],
            a["family"],
            f"{a['device_unit']}" + (f" ({a['devices_per_card']}/card)" if a["devices_per_card"] > 1 else ""),
            f"{a['hbm_bytes'] / GIB:.1f}",
            f"{a['usable_bytes'] / GIB:.2f}",
            f"{a['hbm_bytes_per_s'] / 1e12:.2f}",
            f"{a['peak_bf16_flops'] / 1e12:.1f}",
            "-" if a["peak_fp8_flops"] is None else f"{a['peak_fp8_flops'] / 1e12:.0f}",
            f"{a['intra_node_bytes_per_s'] / 1e9:.0f} / {a['inter_node_bytes_per_s'] / 1e9:.0f}",
            a["devices_per_node"],
        ]
        for a in listing["accelerators"]
    ]
    out.append(
        table(
            ["accelerator", "family", "device", "HBM GiB", "usable GiB", "TB/s", "bf16 TFLOPS", "fp8 TFLOPS", "intra/inter GB/s", "per node"],
            rows,
            title="Accelerators (per device as the framework counts it; sources in models/accelerators.yaml)",
        )
    )
    return "\n".join(out)


_STAT_COLUMNS = (
    ("frequency_dropped", "freq dropped"),
    ("saliency_dropped", "saliency dropped"),
    ("dispersion", "dispersion"),
    ("silhouette", "silhouette"),
    ("reconstruction_error", "recon error"),
    ("routing_agreement", "routing agree"),
    ("load_cv_after", "load CV after"),
    ("load_cv_settled", "load CV settled"),  # the correction bias settled again (planner stats --settle-bias)
)


def render_stats(stats: dict[str, Any]) -> str:
    """Per-plan statistics as a table: layer means (min..max) and the end-to-end KL."""
    ck = stats["checkpoint"]
    cal = stats.get("calibration")
    head = (
        f"{ck['path']}: {ck['model_type']}, {ck['num_experts']} experts, top-{ck['top_k']}, {len(ck['moe_layers'])} MoE layers; "
        + (f"calibration {cal['tokens']} tokens ({cal['source']}, {cal['tokenizer']})" if cal else "weights only")
    )
    present = [(k, label) for k, label in _STAT_COLUMNS if any(k in p["summary"] for p in stats["plans"].values())]
    rows = []
    for key, p in stats["plans"].items():
        summary = p["summary"]
        cells = [key]
        for name, _ in present:
            v = summary.get(name)
            cells.append("-" if v is None else f"{v['mean']:.3f} ({v['min']:.2f}..{v['max']:.2f})")
        if "kl_original_proxy" in summary:
            cells.append(f"{summary['kl_original_proxy']:.3g}")
        rows.append(cells)
    headers = ["plan", *(label for _, label in present)]
    if any("kl_original_proxy" in p["summary"] for p in stats["plans"].values()):
        headers.append("KL(orig||proxy)")
    return "\n".join([head, table(headers, rows), f"features: {stats['feature_spec']}"])
