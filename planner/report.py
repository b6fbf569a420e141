"""`planner report`: a capacity-planning report, in Markdown and HTML with PNG figures.

For one model, accelerator, RL job and budget: the original and its proxies at every candidate K
(each at its own minimum device count, best layouts), memory per device by component, step time
by RL phase, devices and accelerator-hours against K, the Pareto front of cost against predicted
fidelity from `planner suggest`'s search, its best plan, and the inputs and versions used. Written
to a temporary directory and renamed when complete.
"""

from __future__ import annotations

import json
import platform
import shutil
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

from planner.cost.evaluate import CostResult
from planner.errors import SpecError
from planner.files import refuse_existing

__all__ = ["Report", "build_report", "write_report", "FIGURE_SIZE_PX"]

FIGURE_SIZE_PX = (960, 540)
_DPI = 120
COLOURS = {"weights": "#4C72B0", "grads": "#55A868", "optimizer": "#C44E52", "activations": "#8172B2", "kv_cache": "#CCB974",
           "workspace": "#64B5CD", "training_states_kept": "#8C8C8C", "total": "#4C72B0"}  # fmt: skip


@dataclass
class Report:
    request: Any  # planner.search.suggest.Request
    costs: dict[str, CostResult]  # "original", "K=..." at their minimum device counts
    suggestion: Any  # planner.search.suggest.Suggestion
    skipped: dict[str, str]  # K that fit nowhere within the search bound, and why


def _label(k: int, e: int) -> str:
    return "original" if k == e else f"K={k}"


def build_report(request, *, progress: Callable[[str], None] = lambda s: None) -> Report:
    from planner.search.suggest import Suggester, suggest

    progress("costing the original and every K at its minimum device count")
    space = Suggester(request)
    costs, skipped = {}, {}
    e = space.arch.original_num_experts
    for k in sorted(space.experts, reverse=True):
        m = space.minimum(k)
        if m is not None:
            costs[_label(k, e)] = m
        else:
            skipped[_label(k, e)] = f"fits on no count up to {request.max_devices} {space.accel.device_unit}s"
    progress(f"searching proxies within {request.budget} ({request.trials} trials)")
    return Report(request, costs, suggest(request, suggester=space), skipped)


# ---- figures --------------------------------------------------------------------------------------

def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(FIGURE_SIZE_PX[0] / _DPI, FIGURE_SIZE_PX[1] / _DPI), dpi=_DPI)
    return plt, fig, ax


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)  # no bbox cropping: every figure is FIGURE_SIZE_PX
    plt.close(fig)


def figure_memory(r: Report, path: Path) -> None:
    """Memory per device at the peak phase, by component, original vs proxies."""
    plt, fig, ax = _figure()
    names = list(r.costs)
    parts = sorted({k for c in r.costs.values() for k in c.memory_per_device_bytes[c.peak_phase] if k != "total"},
                   key=list(COLOURS).index)  # fmt: skip
    bottom = [0.0] * len(names)
    for part in parts:
        values = [r.costs[n].memory_per_device_bytes[r.costs[n].peak_phase].get(part, 0.0) / 2**30 for n in names]
        ax.bar(names, values, bottom=bottom, label=part.replace("_", " "), color=COLOURS.get(part))
        bottom = [b + v for b, v in zip(bottom, values)]
    usable = next(iter(r.costs.values())).usable_bytes_per_device / 2**30
    ax.axhline(usable, color="black", linestyle="--", linewidth=1, label=f"usable ({usable:.1f} GiB)")
    for i, n in enumerate(names):
        ax.text(i, bottom[i], f"{r.costs[n].peak_phase}\n{r.costs[n].num_devices} {r.costs[n].device_unit}s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(f"GiB per {next(iter(r.costs.values())).device_unit} (peak phase)")
    ax.set_title("Memory per device by component, at each model's minimum device count")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    _save(plt, fig, path)


def figure_phases(r: Report, path: Path) -> None:
    """Step time by RL phase."""
    plt, fig, ax = _figure()
    names = list(r.costs)
    phases = [p for p in next(iter(r.costs.values())).phase_times_s if any(c.phase_times_s.get(p, 0) > 0 for c in r.costs.values())]
    bottom = [0.0] * len(names)
    for phase in phases:
        values = [r.costs[n].phase_times_s.get(phase, 0.0) for n in names]
        ax.bar(names, values, bottom=bottom, label=phase.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("seconds per step")
    ax.set_title("Step time by RL phase, at each model's minimum device count")
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def figure_scaling(r: Report, path: Path) -> None:
    """Devices and accelerator-hours per step against K, both as a fraction of the original's on one
    axis from zero (two truncated axes would draw a 1.2x change in hours as large as a 4x change in
    devices); each point carries its absolute value."""
    plt, fig, ax = _figure()
    items = sorted(r.costs.values(), key=lambda c: c.experts)
    ks = [c.experts for c in items]
    unit = items[0].device_unit
    original = items[-1]  # the most experts: the original
    series = [("minimum " + unit + "s", "#4C72B0", "o", [c.num_devices for c in items], original.num_devices, "{:g}"),
              (f"{unit}-hours per step", "#C44E52", "s", [c.device_hours_per_step for c in items], original.device_hours_per_step, "{:.2f}")]
    top = 1.0
    for label, colour, marker, values, base, fmt in series:
        rel = [v / base for v in values]
        top = max(top, *rel)
        ax.plot(ks, rel, marker=marker, color=colour, label=f"{label} (original: {fmt.format(base)})")
        for k, v, y in zip(ks, values, rel):
            ax.annotate(fmt.format(v), (k, y), fontsize=8, color=colour, xytext=(4, 4 if marker == "o" else -11), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_ylim(0, top * 1.12)
    ax.set_xlabel("experts kept per MoE layer (K)")
    ax.set_ylabel(f"fraction of the original (K={original.experts})")
    ax.set_title(f"Devices and {unit}-hours per step against K, relative to the original")
    ax.legend(fontsize=8, loc="lower right")
    _save(plt, fig, path)


def figure_pareto(r: Report, path: Path) -> None:
    """Every evaluated point within the budget, each reproduction job searched: accelerator-hours to
    the fault vs calibrated P(fault reproduced) with its interval, and the front. Points without a calibrated P are not placed on a P axis: with
    none at all, the figure shows cost by K and says why there is no P."""
    plt, fig, ax = _figure()
    s = r.suggestion
    pts = [o for o in s.options if o.fits and o.within_budget and o.fidelity["status"] != "not-applicable"]
    unit = s.accelerator.device_unit
    scored = [o for o in pts if o.p_reproduced is not None and o.fidelity["status"] != "original"]
    if scored:
        jobs = sorted({o.scale for o in scored})
        for i, scale in enumerate(jobs):  # one series per reproduction job searched
            group = [o for o in scored if o.scale == scale]
            p = [o.p_reproduced for o in group]
            err = [[v - o.fidelity["interval"][0] for v, o in zip(p, group)], [o.fidelity["interval"][1] - v for v, o in zip(p, group)]]
            what = "production job" if scale.production else f"job {scale.describe(s.request.job)}"
            ax.errorbar([o.reproduction_hours for o in group], p, yerr=err, fmt="os^vD<>"[i % 7], markersize=3,
                        color="#8C8C8C" if len(jobs) == 1 else None, alpha=0.6, elinewidth=0.8,
                        label=f"evaluated, fits the budget (interval): {what}")  # fmt: skip
        front = sorted((o for o in s.pareto if o.p_reproduced is not None), key=lambda o: o.reproduction_hours)
        ax.plot([o.reproduction_hours for o in front], [o.p_reproduced for o in front], marker="o", color="#C44E52", label="Pareto front")
        for i, o in enumerate(front):
            ax.annotate(f"K={o.experts}, {o.cost.num_devices} {unit}s", (o.reproduction_hours, o.p_reproduced), fontsize=8,
                        xytext=(4, -12 - 11 * (i % 3)), textcoords="offset points")  # fmt: skip
        ax.axhline(s.request.min_fidelity, color="black", linestyle="--", linewidth=1, label=f"threshold {s.request.min_fidelity}")
        ax.set_ylabel("calibrated P(fault reproduced)")
        ax.set_ylim(-0.02, 1.05)
        ax.set_title(f"Cost against calibrated fidelity within {s.request.budget}")
    elif not pts:  # nothing to place: say so, and why, instead of an empty pair of axes
        import textwrap

        why = s.diagnosis[0] if s.diagnosis else "no evaluated point fits in memory within the budget"
        ax.set_axis_off()
        ax.text(0.5, 0.5, "Nothing fits within the budget " + s.budget.describe(s.accelerator) + ":\n" + textwrap.fill(why, 80),
                ha="center", va="center", fontsize=9, transform=ax.transAxes)  # fmt: skip
        ax.set_title(f"No point to draw within {s.request.budget}")
        _save(plt, fig, path)
        return
    else:
        statuses = sorted({o.fidelity["status"] for o in pts if o.fidelity["status"] != "original"})
        ax.scatter([o.reproduction_hours for o in pts], [o.experts for o in pts], s=14, color="#8C8C8C", alpha=0.6, label="evaluated, fits the budget")
        ax.set_yticks(sorted({o.experts for o in pts}))
        ax.set_ylabel("K (experts kept per layer)")
        ax.set_title(f"No calibrated P(fault reproduced) ({', '.join(statuses) or 'no proxy'}): cost by K within {s.request.budget}")
    ax.set_xlabel(f"{unit}-hours to the fault (per step x the steps the reproduction runs)")
    if pts:
        ax.legend(fontsize=8, loc="lower right")
    _save(plt, fig, path)


FIGURES = {"memory.png": figure_memory, "phases.png": figure_phases, "scaling.png": figure_scaling, "pareto.png": figure_pareto}


# ---- text -----------------------------------------------------------------------------------------

def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("planner", "numpy", "optuna", "matplotlib"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = None
    return out


def _markdown(r: Report) -> str:
    from planner.search.output import render_suggestion
    from planner.search.suggest import calibration_files
    from planner.units import gib

    req = r.request
    s = r.suggestion
    unit = s.accelerator.device_unit
    original = r.costs.get("original")
    lines = [f"# {req.model} on {s.accelerator.name}: proxy capacity plan", ""]
    lines.append(f"RL job: {req.job.algorithm.upper()} {req.job.prompts_per_step} prompts x {req.job.samples_per_prompt}, responses "
                 f"{req.job.response_tokens.mean:g} tokens on average ({req.job.response_tokens.max} at most), {req.job.precision}, "
                 f"recompute {req.job.recompute}. Budget {s.budget.describe(s.accelerator)}; fault {req.fault} (recipe {s.recipe}); "
                 f"fidelity threshold {req.min_fidelity}.")  # fmt: skip
    lines += ["", "## Original and proxies at their minimum device counts", "",
              f"Each at the fewest devices it fits on (keeping {req.memory_margin:.0%} of usable memory free, full recompute, offload "
              "all), with its best layouts there; proxies keep K experts per MoE layer. Reductions compare like with like, each at its "
              "minimum count; the search below measures against "
              + (s.baseline.named + "." if s.baseline is not None and s.baseline.named else "the original's cheapest configuration."), ""]
    lines.append(f"| model | {unit}s | train layout | rollout layout | peak GiB/{unit} (phase) | step s | {unit}-h/step | fewer {unit}s | fewer hours |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for name, c in r.costs.items():
        fewer = "-" if not original or c is original else f"{original.num_devices / c.num_devices:.1f}x"
        hours = "-" if not original or c is original else f"{original.device_hours_per_step / c.device_hours_per_step:.2f}x"
        lines.append(f"| {name} | {c.num_devices} | {c.train_layout.describe()} | {c.rollout_layout.describe()} | "
                     f"{gib(c.peak_memory_bytes, suffix=False)} ({c.peak_phase}) | {c.step_time_s:,.0f} | {c.device_hours_per_step:,.2f} | "
                     f"{fewer} | {hours} |")  # fmt: skip
    for name, why in r.skipped.items():
        lines.append(f"| {name} | does not fit: {why} | | | | | | | |")
    lines += ["", "![memory](figures/memory.png)", "", "![phases](figures/phases.png)", "", "![scaling](figures/scaling.png)", ""]
    lines += ["## The cheapest proxy within the budget", ""]
    if s.best is None:
        lines += [f"No proxy clears every constraint within {s.budget.describe(s.accelerator)}: "
                  + (s.diagnosis[0] if s.diagnosis else "nothing fits") + ". The search's account follows.", ""]  # fmt: skip
    lines += ["```", render_suggestion(s), "```", "", "![pareto](figures/pareto.png)", ""]
    lines += ["## Inputs and versions", "", "```"]
    lines.append(json.dumps({"model": req.model, "hardware": req.hardware, "budget": req.budget, "fault": req.fault, "job": req.job.to_dict(),
                             "min_fidelity": req.min_fidelity, "trials": req.trials, "seed": req.seed, "steps": req.steps,
                             "fault_step": req.fault_step, "job_bounds": {"batch": req.job_bounds.batch, "length": req.job_bounds.length},
                             "translate_knob": req.translate_knob, "calibration_files": calibration_files(), "versions": _versions()}, indent=1))  # fmt: skip
    lines += ["```", ""]
    rows_of: dict[str, list[str]] = {}  # each note with the rows of the cost table it describes
    for name, c in r.costs.items():
        for n in c.notes:
            rows_of.setdefault(n, []).append(f"{name} ({c.num_devices} {c.device_unit}s)")
    if rows_of:
        lines += ["## Notes", ""] + [f"- {'; '.join(rows)}: {n}" for n, rows in rows_of.items()] + [""]
    return "\n".join(lines)


def _html(markdown: str, title: str) -> str:
    """A self-contained HTML rendering of the report's Markdown (tables, code, figures, headings)."""
    import html

    out, in_code, in_table = [], False, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            out.append("</pre>" if in_code else "<pre>")
            in_code = not in_code
            continue
        if in_code:
            out.append(html.escape(line))
            continue
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if all(set(c) <= {"-"} for c in cells):
                continue
            if not in_table:
                out.append("<table>")
                in_table = True
                out.append("<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cells) + "</tr>")
            else:
                out.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
            continue
        if in_table:
            out.append("</table>")
            in_table = False
        if line.startswith("!["):
            alt, src = line[2:].split("](")
            out.append(f'<p><img alt="{html.escape(alt)}" src="{html.escape(src.rstrip(")"))}" width="{FIGURE_SIZE_PX[0]}"></p>')
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{html.escape(line[level:].strip())}</h{level}>")
        elif line.startswith("- "):
            out.append(f"<li>{html.escape(line[2:])}</li>")
        elif line.strip():
            out.append(f"<p>{html.escape(line)}</p>")
    if in_table:
        out.append("</table>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:90%}pre{background:#f6f6f6;padding:8px;overflow-x:auto}")  # fmt: skip
    return f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{style}</style></head><body>\n" + "\n".join(out) + "\n</body></html>\n"


def write_report(r: Report, out_dir: str | Path, *, force: bool = False) -> Path:
    from planner.search.output import suggestion_json

    out = check_report_dir(out_dir, force)
    if not r.costs:
        raise SpecError("neither the original nor any proxy fits within the search bound: " + "; ".join(r.skipped.values()))
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():  # a run killed before it could clean up (an interrupted one removes its own)
        _replaceable(tmp, partial=True)
        shutil.rmtree(tmp)
    try:
        (tmp / "figures").mkdir(parents=True)
        for name, draw in FIGURES.items():
            draw(r, tmp / "figures" / name)
        markdown = _markdown(r)
        (tmp / "report.md").write_text(markdown)
        (tmp / "report.html").write_text(_html(markdown, f"{r.request.model} proxy capacity plan"))
        data = {"costs": {k: c.to_json() for k, c in r.costs.items()}, "skipped": r.skipped, "suggestion": suggestion_json(r.suggestion)}
        (tmp / "report.json").write_text(json.dumps(data, indent=1, default=lambda v: v.item() if hasattr(v, "item") else str(v)))
    except BaseException:  # Ctrl-C, SIGTERM, a full disk: nothing half-written is kept
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    return out


REPORT_FILES = {"figures", "report.md", "report.html", "report.json"}


def _replaceable(path: Path, partial: bool = False) -> None:
    """Only a report directory (or an empty one) is ever deleted to make room for a new report; with
    `partial`, also a report's unfinished one (nothing but a report's own files)."""
    if not path.is_dir():
        if path.exists():
            raise SpecError(f"{path} exists and is not a directory")
        return
    names = {p.name for p in path.iterdir()}
    if names and not (path / "report.md").is_file() and not (partial and names <= REPORT_FILES):
        raise SpecError(f"{path} is not a report directory (no report.md); refusing to replace it")


def check_report_dir(out_dir: str | Path, force: bool) -> Path:
    """The report's directory, before any work: a fresh name in an existing folder, or with --force
    an earlier report (never `.`, `..` or a directory that is not a report)."""
    out = Path(out_dir)
    if out.resolve() == Path.cwd().resolve() or out.name in ("", ".", ".."):
        raise SpecError(f"-o {out_dir}: name a report directory of its own, not the current or a parent folder")
    if not out.resolve().parent.is_dir():
        raise SpecError(f"-o {out_dir}: folder {out.resolve().parent} does not exist")
    refuse_existing(out, force)
    if out.exists():
        _replaceable(out)
    return out
