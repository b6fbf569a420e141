"""`planner preflight request.yaml`: check a reproduction request before it is filed.

A request (schema planner.request/1):

    model: qwen3-30b-a3b            # catalog name or a config.json path; or give checkpoint alone
    checkpoint: /data/qwen3-30b     # optional: the original checkpoint the proxy is built from
    plan: plan.yaml                 # planner suggest / planner plan output (relative to the request)
    budget: 8npu                    # as `planner suggest --budget`
    hardware: ascend-910b2          # default: the plan's deployment, else ascend-910b2
    job: job.yaml                   # or an inline mapping; default: the plan's deployment job
    stats: stats.json               # optional: `planner stats` of the checkpoint
    min_fidelity: 0.8
    memory_margin: 0.1              # keep this share of usable memory free
    steps: 20                       # steps of the reproduction (hours budgets)
    fault:
      type: grad-overflow
      settings:                     # the failing run's settings, all optional
        precision: fp16
        max_prompt_tokens: 256
        max_response_tokens: 3072
        top_k: 8
        scoring: softmax
        router_dtype: fp32
        balance_coef: 0.001
        routing_replay: true
      metrics: runs/failing/        # optional: the failing run's metrics in any format `planner detect`
                                    # reads (metrics.csv, TensorBoard, verl / MindSpeed-RL logs, wandb
                                    # export); its fault signature is checked against type, and fills
                                    # type when the request leaves it out

Every check says PASS, WARN or FAIL with its reason and numbers; the exit code is 0 when nothing
fails, 1 otherwise (2 when the request file itself cannot be read).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from planner.cost.evaluate import DEFAULT_MEMORY_MARGIN
from planner.errors import PlannerError, SpecError
from planner.files import read_yaml
from planner.stats.store import plan_key, plan_statistics, stale_note

__all__ = ["Check", "REQUEST_KEYS", "preflight", "render_preflight"]

REQUEST_SCHEMA = "planner.request/1"
REQUEST_KEYS = ("schema", "model", "checkpoint", "plan", "budget", "hardware", "job", "stats", "min_fidelity", "memory_margin", "steps", "fault")
FAULT_KEYS = ("type", "settings", "metrics")
SETTING_KEYS = ("precision", "max_prompt_tokens", "max_response_tokens", "top_k", "scoring", "router_dtype", "balance_coef",
                "routing_replay", "n_group", "topk_group")  # fmt: skip


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS | WARN | FAIL | SKIP (not checked: a check it needs failed)
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"check": self.name, "status": self.status, "reason": self.reason}


class _Context:
    """What the checks share, loaded lazily; a failure to load becomes that check's FAIL."""

    def __init__(self, data: dict, base: Path):
        self.data, self.base = data, base
        fault = data.get("fault")
        settings = fault.get("settings") if isinstance(fault, dict) else None
        self.settings = settings if isinstance(settings, dict) else {}

    def path(self, key: str) -> Path:
        p = Path(str(self.data[key])).expanduser()
        return p if p.is_absolute() else self.base / p

    def ref(self, key: str) -> str:
        """A catalog id or a path: a path relative to the request's folder when one exists there."""
        text = str(self.data[key])
        local = self.path(key)
        return str(local) if not Path(text).expanduser().is_absolute() and local.exists() else text

    def __getattr__(self, name: str):
        loader = getattr(type(self), f"_load_{name}", None)
        if loader is None:
            raise AttributeError(name)
        value = loader(self)
        setattr(self, name, value)
        return value

    def _load_signature(self):
        from planner.runs.signature import signature

        return signature(_metrics_path(self))

    def _load_plan(self):
        from planner.plan import load_plan

        return load_plan(self.path("plan"))

    def _load_deployment(self) -> dict:
        return dict(self.plan.deployment or {})

    def _load_config(self) -> tuple[str, dict]:
        from planner.catalog import load_model_config

        if self.data.get("model"):
            return load_model_config(self.ref("model"))
        return load_model_config(str(self.path("checkpoint")))

    def _load_arch(self):
        from planner.arch import Architecture

        name, config = self.config
        return Architecture.from_config(config, name=name)

    def _load_checkpoint(self):
        from planner.checkpoint import Checkpoint

        return Checkpoint(self.path("checkpoint")) if self.data.get("checkpoint") else None

    def _load_accel(self):
        from planner.catalog import load_accelerator

        if self.data.get("hardware"):
            return load_accelerator(self.ref("hardware"))
        return load_accelerator(str(self.deployment.get("hardware") or "ascend-910b2"))

    def _load_job(self):
        from planner.specs import Job, load_job

        job = self.data.get("job")
        if isinstance(job, dict):
            base = Job.from_dict(job, where="request.job")
        elif job:
            base = load_job(self.path("job"))
        elif self.deployment.get("job"):
            base = Job.from_dict(self.deployment["job"], where=f"{self.data['plan']}: deployment.job")
        else:
            base = Job()
        return base

    def _load_production(self):
        """The production job the plan's reproduction job was shrunk from: the plan's record of it, else
        the plan's job (a plan made before jobs shrank), else the request's own."""
        from planner.specs import Job

        dep = self.deployment
        where = f"{self.data['plan']}: deployment"
        if dep.get("production_job"):
            return Job.from_dict(dep["production_job"], where=f"{where}.production_job")
        return Job.from_dict(dep["job"], where=f"{where}.job") if dep.get("job") else self.job

    def _load_stats(self):
        from planner.stats.store import load_stats

        return load_stats(self.path("stats")) if self.data.get("stats") else None

    def _load_cost(self):
        """The proxy at the plan's deployment (its card count and layouts when it names them)."""
        from planner.cost.evaluate import evaluate, min_devices
        from planner.plan import deployment_cards
        from planner.specs import RolloutLayout, TrainLayout

        dep, plan = self.deployment, self.plan
        arch = self.arch.with_experts(plan.experts)  # K = E: the original itself
        job = self.job
        if dep.get("train_layout") and dep.get("rollout_layout"):
            job = dataclasses.replace(job, train_layout=TrainLayout.from_dict(dep["train_layout"]),
                                      rollout_layout=RolloutLayout.from_dict(dep["rollout_layout"]))  # fmt: skip
        margin = float(self.data.get("memory_margin", DEFAULT_MEMORY_MARGIN))  # kept free in the training phases, as `suggest` does
        if dep.get("num_cards") is not None:
            return evaluate(arch, self.accel, job, deployment_cards(dep), memory_margin=margin)
        return min_devices(arch, self.accel, job, memory_margin=margin)


def _read_request(path: Path) -> dict:
    data = read_yaml(path, "request")
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a request is a mapping (see `planner preflight --help`)")
    return data


# ---- the checks, in order -----------------------------------------------------------------------

def check_schema(c: _Context) -> Check:
    d = c.data
    problems = []
    unknown = [k for k in d if k not in REQUEST_KEYS]
    if unknown:
        problems.append(f"unknown key(s) {unknown}; allowed: {', '.join(REQUEST_KEYS)}")
    if d.get("schema", REQUEST_SCHEMA) != REQUEST_SCHEMA:
        problems.append(f"schema {d.get('schema')!r} is not {REQUEST_SCHEMA}")
    missing = [k for k in ("plan", "budget", "fault") if not d.get(k)]
    if not d.get("model") and not d.get("checkpoint"):
        missing.append("model or checkpoint")
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    fault = d.get("fault")
    if fault is not None:
        if not isinstance(fault, dict) or ("type" not in fault and not fault.get("metrics")):
            problems.append(f"fault must be a mapping with a type (e.g. fault: {{type: grad-overflow}}) or the failing run's "
                            f"metrics to read it from, got {fault!r}")
        else:
            problems += _fault_problems(fault)
    for key, lo, hi in (("min_fidelity", 0.0, 1.0), ("memory_margin", 0.0, 0.9)):
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi):
            problems.append(f"{key} must lie in [{lo}, {hi}], got {v!r}")
    steps = d.get("steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        problems.append(f"steps must be a whole number of at least 1, got {steps!r}")
    for key in ("model", "checkpoint", "plan", "budget", "hardware", "stats"):
        if d.get(key) is not None and not isinstance(d[key], (str, int, float)):
            problems.append(f"{key} must be a name or a path, got {d[key]!r}")
    if problems:
        return Check("schema", "FAIL", "; ".join(problems))
    return Check("schema", "PASS", f"{REQUEST_SCHEMA}: every key known, plan, budget and fault given")


_SETTING_TYPES = {"precision": str, "max_prompt_tokens": int, "max_response_tokens": int, "top_k": int, "scoring": str, "router_dtype": str,
                  "balance_coef": (int, float), "routing_replay": bool, "n_group": int, "topk_group": int}  # fmt: skip


def _fault_problems(fault: dict) -> list[str]:
    from planner.search.suggest import FAULTS

    problems = []
    settings = fault.get("settings") or {}
    if not isinstance(settings, dict):
        return [f"fault.settings must be a mapping of the failing run's settings, got {settings!r}"]
    bad = [k for k in fault if k not in FAULT_KEYS] + [k for k in settings if k not in SETTING_KEYS]
    if bad:
        problems.append(f"unknown fault key(s) {bad}; fault: {', '.join(FAULT_KEYS)}; settings: {', '.join(SETTING_KEYS)}")
    if "type" in fault and (not isinstance(fault["type"], str) or fault["type"] not in FAULTS):
        problems.append(f"fault type {fault['type']!r} is not one of {', '.join(sorted(FAULTS))}")
    for key, kind in _SETTING_TYPES.items():
        v = settings.get(key)
        if v is not None and (not isinstance(v, kind) or (kind is not bool and isinstance(v, bool))):
            names = " or ".join(t.__name__ for t in (kind if isinstance(kind, tuple) else (kind,)))
            problems.append(f"fault.settings.{key} must be {names}, got {v!r}")
    if fault.get("metrics") is not None and not isinstance(fault["metrics"], str):
        problems.append(f"fault.metrics is the failing run's directory, got {fault['metrics']!r}")
    return problems


def check_model(c: _Context) -> Check:
    name, config = c.config
    arch = c.arch
    ckpt = c.checkpoint
    if ckpt is None:
        return Check("model", "PASS", f"{name}: {arch.original_num_experts} experts/layer, top-{arch.moe.top_k} (no checkpoint to compare)")
    problems = []
    if c.data.get("model"):
        mine = ckpt.arch
        for field in ("model_type", "num_layers", "hidden_size"):
            if getattr(mine, field, None) != getattr(arch, field, None):
                problems.append(f"{field}: checkpoint {getattr(mine, field, None)} vs model {getattr(arch, field, None)}")
        if mine.original_num_experts != arch.original_num_experts or mine.moe.top_k != arch.moe.top_k:
            problems.append(f"experts/top-k: checkpoint {mine.original_num_experts}/{mine.moe.top_k} vs model {arch.original_num_experts}/{arch.moe.top_k}")
    if problems:
        return Check("model", "FAIL", "checkpoint and model disagree: " + "; ".join(problems))
    return Check("model", "PASS", f"checkpoint {ckpt.path.name} matches {name}; its tensors' shapes match its config")


def check_plan(c: _Context) -> Check:
    plan, arch = c.plan, c.arch
    ckpt = c.checkpoint
    moe_layers = list(ckpt.moe_layers) if ckpt is not None else None
    from planner.catalog import resolve_model_id

    asked, made_for = c.config[0], resolve_model_id(str(plan.model)) if plan.model else None
    if c.data.get("model") and made_for is not None and resolve_model_id(asked) is not None and made_for != resolve_model_id(asked):
        return Check("plan", "FAIL", f"the plan was made for {made_for}, the request names {asked}")
    warnings = plan.check(arch, moe_layers)
    if ckpt is not None and plan.checkpoint_fingerprint and plan.checkpoint_fingerprint != ckpt.fingerprint():
        return Check("plan", "FAIL", f"the plan was made for checkpoint {plan.checkpoint_fingerprint[:12]}, not this one ({ckpt.fingerprint()[:12]})")
    what = "kept experts chosen at build time" if plan.deferred else f"{len(plan.layers)} MoE layers"
    if warnings:
        return Check("plan", "WARN", f"K={plan.experts} of {plan.original_experts} ({what}) passes the rules; " + "; ".join(warnings))
    return Check("plan", "PASS", f"K={plan.experts} of {plan.original_experts} ({what}) passes every pruning rule")


def check_memory(c: _Context) -> Check:
    from planner.units import gib

    r = c.cost
    margin = float(c.data.get("memory_margin", DEFAULT_MEMORY_MARGIN))
    unit = r.device_unit
    if not r.feasible:
        return Check("memory", "FAIL", f"K={r.experts} on {r.num_devices} {unit}s does not fit: " + "; ".join(r.reasons))
    # the rollout engine pre-allocates a fixed share of memory; the margin is kept free in the training phases
    usable = r.usable_bytes_per_device
    train_phase, train_peak = max(((p, m["total"]) for p, m in r.memory_per_device_bytes.items() if p != "rollout"), key=lambda t: t[1])
    limit = usable * (1 - margin)
    text = (f"peak {gib(r.peak_memory_bytes)} per {unit} ({r.peak_phase}); training peak {gib(train_peak)} ({train_phase}) of "
            f"{gib(limit)} allowed ({gib(usable)} usable, {margin:.0%} kept free), on {r.num_devices} {unit}s, layout {r.train_layout.describe()}")  # fmt: skip
    if train_peak > usable * (1 - 1.5 * margin):
        return Check("memory", "WARN", f"{text}: less than half the margin again to spare")
    return Check("memory", "PASS", f"{text}: {gib(limit - train_peak)} to spare")


def check_host_memory(c: _Context) -> Check:
    from planner.units import gib

    r = c.cost
    host = [reason for reason in r.reasons if "host memory" in reason]
    if host:
        return Check("host memory", "FAIL", "; ".join(host))
    if not r.feasible:
        return Check("host memory", "FAIL", "not evaluated: the proxy does not fit in device memory")
    need, limit = r.host_memory_bytes_per_node, r.host_memory_limit_bytes_per_node
    offload = c.job.offload
    what = ", ".join(k for k in ("params", "grads", "optimizer") if getattr(offload, k)) or "nothing"
    if need > limit:
        return Check("host memory", "FAIL", f"offload of {what} needs {gib(need)} host RAM per node > {gib(limit)} available")
    return Check("host memory", "PASS", f"offload of {what}: {gib(need)} of {gib(limit)} host RAM per node")


def check_budget(c: _Context) -> Check:
    from planner.search.budget import parse_budget

    budget = parse_budget(str(c.data["budget"]), c.accel)
    r = c.cost
    unit = r.device_unit
    if not r.feasible:
        return Check("budget", "FAIL", "not evaluated: the proxy does not fit in device memory")
    if budget.max_devices is not None:
        if r.num_devices > budget.max_devices:
            return Check("budget", "FAIL", f"the plan runs on {r.num_devices} {unit}s, the budget is {budget.describe(c.accel)}")
        return Check("budget", "PASS", f"{r.num_devices} of {budget.max_devices} {unit}s")
    steps = int(c.data.get("steps") or ((c.deployment.get("predicted") or {}).get("steps") or 20))  # the plan's own length by default
    hours = r.device_hours_per_step * steps
    if hours > budget.device_hours:
        return Check("budget", "FAIL", f"{steps} steps take {hours:,.1f} {unit}-hours > the budget of {budget.device_hours:g}")
    return Check("budget", "PASS", f"{steps} steps take {hours:,.1f} of {budget.device_hours:g} {unit}-hours")


def check_fidelity(c: _Context) -> Check:
    from planner.fidelity.dataset import plan_row
    from planner.fidelity.estimator import FidelityEstimator, default_estimator_path
    from planner.search.suggest import FAULTS, fault_conflicts

    plan, threshold = c.plan, float(c.data.get("min_fidelity", 0.8))
    recipe = FAULTS[c.data["fault"]["type"]]
    conflicts = fault_conflicts(recipe, c.job.precision)
    if conflicts:
        return Check("fidelity", "FAIL", conflicts[0])
    planned = (plan.deployment or {}).get("fault")
    other = f"; the plan was made for fault {planned!r}" if planned and FAULTS.get(planned) != recipe else ""
    if plan.experts == plan.original_experts:
        return Check("fidelity", "WARN" if other else "PASS", "the plan keeps every expert: the original itself" + other)
    statistics = plan.statistics
    stats = c.stats
    if not statistics and stats:
        statistics = plan_statistics(stats, plan_key(plan.experts, plan.method))
    from planner.fidelity.dataset import job_columns

    row = {**plan_row(c.config[1], plan.experts, statistics, plan.build), **job_columns(**_job_shares(c, c.job))}  # at the request's job
    estimator = FidelityEstimator.load(default_estimator_path())
    f = estimator.predict(row, recipe)
    # a settled plan whose shape has no family of settled proxies: what the sliced proxy's family says, as a warning
    sliced = plan.build == "settled" and estimator.family(row, recipe) is None and estimator.family({**row, "proxy_build": "sliced"}, recipe)
    said = ("the plan settles its correction bias again, and the calibration data of its routing shape holds sliced proxies only: "
            "for the sliced proxy, ") if sliced else ""  # fmt: skip
    if sliced:
        f = estimator.predict({**row, "proxy_build": "sliced"}, recipe)
    knob = f"; knob: {f['knob_translation']['text']}" if f.get("knob_translation") else ""
    if f.get("family"):
        from planner.fidelity.estimator import family_text

        knob += f"; rests on {family_text(f['family'])}"
    if f["status"] == "not-applicable":
        return Check("fidelity", "FAIL", f"not applicable: {f['reason']}")
    if f["status"] != "calibrated":
        measured = ""
        if f.get("measured_by_k"):
            m = f["measured_by_k"]
            measured = f"; measured shift at K/E {m['kept_fraction']:g}: {m['shift_mean']:+.2f} +- {m['shift_sd']:.2f} log2 (noise {m['noise_log2']:.2f})"
        return Check("fidelity", "WARN", f"{said}{f['status']}: {f['reason']}{measured}{knob}{other}")
    low, high = f["interval"]
    text = f"P(fault reproduced) {f['p_reproduced']:.2f} [{low:.2f}, {high:.2f}], threshold {threshold}{knob}{other}"
    if sliced:
        return Check("fidelity", "WARN", said + text)
    if f["p_reproduced"] < threshold:
        return Check("fidelity", "FAIL", text)
    if low < threshold or other:
        return Check("fidelity", "WARN", text + (": the interval reaches below it" if low < threshold else ""))
    return Check("fidelity", "PASS", text)


def _job_shares(c: _Context, job) -> dict[str, float]:
    """A job's shares of the plan's production job, per dimension (prompts, samples, length)."""
    p = c.production
    return {"prompts": job.prompts_per_step / p.prompts_per_step, "samples": job.samples_per_prompt / p.samples_per_prompt,
            "length": job.response_tokens.max / p.response_tokens.max}  # fmt: skip


def check_reproduction(c: _Context) -> Check:
    """The request's job against the production job the plan was made from and what the fidelity data
    support (smaller than they support: FAIL; larger than the plan's reproduction job: WARN), and its
    steps against the plan's predicted onset (ending before its upper end, or running more than twice
    the steps the plan needs: WARN)."""
    from planner.fidelity.dataset import plan_row
    from planner.fidelity.estimator import FidelityEstimator, default_estimator_path
    from planner.search.reproduction import run_steps
    from planner.search.suggest import FAULTS
    from planner.specs import Job

    dep, plan, job = c.deployment, c.plan, c.job
    planned = Job.from_dict(dep["job"], where=f"{c.data['plan']}: deployment.job") if dep.get("job") else c.production
    mine, theirs = _job_shares(c, job), _job_shares(c, planned)
    describe = f"{job.prompts_per_step} x {job.samples_per_prompt}, response <= {job.response_tokens.max}"
    proxy = plan.experts != plan.original_experts
    if proxy:
        translated = bool(((dep.get("predicted") or {}).get("fidelity") or {}).get("job_translation"))  # the plan moved the knob with the job
        support = FidelityEstimator.load(default_estimator_path()).job_support(plan_row(c.config[1], plan.experts, None), FAULTS[c.data["fault"]["type"]],
                                                                               translate=translated)  # fmt: skip
        short = [f"{dim} at {share:g} of the production value ({support[dim]['reason']})" for dim, share in mine.items()
                 if share < 1 - 1e-12 and not (support[dim].get("ok") and share >= support[dim]["min_share"] - 1e-12)]  # fmt: skip
        if short:
            return Check("reproduction", "FAIL", f"the job ({describe}) is smaller than the fidelity data support: " + "; ".join(short))
    warns = []
    if any(mine[d] > theirs[d] + 1e-12 for d in mine):
        warns.append(f"the job ({describe}) is larger than the fault needs: the plan's reproduction job is {planned.prompts_per_step} x "
                     f"{planned.samples_per_prompt}, response <= {planned.response_tokens.max}")  # fmt: skip
    onset = (dep.get("predicted") or {}).get("onset") or {}
    steps, reach = c.data.get("steps"), ""
    if onset.get("original_step") is not None and steps is not None:
        latest = onset["interval"][1]
        need = run_steps(latest)
        if int(steps) < math.ceil(latest):
            warns.append(f"{steps} steps end before the fault's predicted onset is past (step {onset['proxy_step']:.0f}, up to {latest:.0f}): "
                         f"{need} steps reach it with the margin")  # fmt: skip
        elif int(steps) > 2 * need:
            warns.append(f"{steps} steps: more than twice the {need} that reach the fault (predicted onset up to step {latest:.0f})")
        else:
            reach = f"; {steps} steps reach the predicted onset (up to step {latest:.0f})"
    if warns:
        return Check("reproduction", "WARN", "; ".join(warns))
    what = ("the plan's reproduction job" if mine == theirs else "within what the fidelity data support") if proxy else "the original's job"
    return Check("reproduction", "PASS", f"the job ({describe}) is {what}{reach}")


def check_factors(c: _Context) -> Check:
    """The fault-relevant factors of the failing run that the proxy run must keep."""
    s, job, arch, plan = c.settings, c.job, c.arch, c.plan
    moe = arch.moe
    fails, warns, kept = [], [], []
    if "precision" in s:
        (kept if s["precision"] == job.precision else fails).append(f"precision {s['precision']} (job: {job.precision})")
    production = c.production  # a shorter reproduction job is the reproduction check's to judge
    for key, have in (("max_prompt_tokens", production.prompt_tokens.max), ("max_response_tokens", production.response_tokens.max)):
        if key in s:
            (kept if int(s[key]) <= have else fails).append(f"{key} {s[key]} (job: {have})")
    for key, have in (("top_k", moe.top_k), ("scoring", moe.scoring), ("n_group", moe.n_group), ("topk_group", moe.topk_group)):
        if key in s:
            (kept if s[key] == have else fails).append(f"{key} {s[key]} (model: {have})")
    if "router_dtype" in s:
        stored = "fp32" if moe.router_fp32 else job.precision
        if s["router_dtype"] != stored:
            warns.append(f"router dtype {s['router_dtype']} in the failing run, {stored} in the model: set {s['router_dtype']} in the proxy run")
        else:
            kept.append(f"router dtype {s['router_dtype']} (the builder never changes the router's dtype)")
    if plan.experts < 4 * moe.top_k:
        warns.append(f"K/top_k = {plan.experts}/{moe.top_k} < 4: near-dense routing loses the fragility behind mismatch faults")
    if c.data["fault"]["type"] == "router-collapse" and "balance_coef" not in s:
        warns.append("router collapse without the failing run's balance-loss coefficient: the proxy run cannot match it")
    elif "balance_coef" in s:
        kept.append(f"balance-loss coefficient {s['balance_coef']} (set it in the proxy run)")
    if s.get("routing_replay"):
        if plan.deferred or plan.labels is None:
            fails.append("routing replay needs the plan's cluster labels to remap the original's routing masks; the plan has none "
                         "(make it with `planner plan` or `planner suggest --stats`)")  # fmt: skip
        else:
            kept.append("routing replay (masks remap through the plan's cluster labels)")
    if fails:  # the warnings stay in the reason: fixing the FAIL should not hide them
        return Check("fault factors", "FAIL", "not kept: " + "; ".join(fails) + ("; also: " + "; ".join(warns) if warns else "")
                     + ("; kept: " + "; ".join(kept) if kept else ""))  # fmt: skip
    if warns:
        return Check("fault factors", "WARN", "; ".join(warns) + ("; kept: " + "; ".join(kept) if kept else ""))
    return Check("fault factors", "PASS", "kept: " + ("; ".join(kept) if kept else "no settings of the failing run given to compare"))


def check_stats(c: _Context) -> Check:
    stats, ckpt, plan = c.stats, c.checkpoint, c.plan
    if stats is None:
        if plan.statistics:
            return Check("stats", "PASS", "the plan carries its own statistics")
        return Check("stats", "WARN", "no stats file: fidelity has no plan statistics to go on (K/E only: no plan-level P)")
    have = stats["checkpoint"]["fingerprint"]
    if ckpt is not None and have != ckpt.fingerprint():
        return Check("stats", "FAIL", f"the stats are of checkpoint {have[:12]}, not this one ({ckpt.fingerprint()[:12]}): recompute them")
    if plan.checkpoint_fingerprint and plan.checkpoint_fingerprint != have:
        return Check("stats", "FAIL", f"the plan was made from checkpoint {plan.checkpoint_fingerprint[:12]}, the stats from {have[:12]}")
    if stale := stale_note(stats):
        return Check("stats", "WARN", stale)
    if ckpt is not None and c.path("stats").stat().st_mtime < max(p.stat().st_mtime for p in ckpt.path.glob("*.safetensors")):
        return Check("stats", "WARN", "the stats file is older than the checkpoint's weights (same fingerprint, so the weights agree)")
    return Check("stats", "PASS", f"stats of checkpoint {have[:12]}" + (", which is this checkpoint" if ckpt is not None else ""))


def _metrics_path(c: _Context) -> Path | None:
    metrics = (c.data.get("fault") or {}).get("metrics")
    if not metrics:
        return None
    p = Path(str(metrics)).expanduser()
    return p if p.is_absolute() else c.base / p


def _finding(f: dict) -> str:
    values = {e["step"]: e["value"] for e in f["evidence"]}
    value = values.get(f["onset_step"])
    shown = f"{value:.4g}" if isinstance(value, float) else value
    return f"{f['fault']} from step {f['onset_step']} ({f['source_key'] or f['metric']} = {shown}: {f['rule']})"


def _compatible(found: str, stated: str) -> bool:
    """A logged fault that is the stated one (a non-finite step ends an overflow or a blow-up)."""
    return found == stated or (found == "non-finite" and stated in ("fp16-overflow", "grad-blowup"))


def fill_fault_type(c: _Context) -> Check | None:
    """A request that gives the failing run's metrics but no fault type takes the logged one."""
    fault = c.data.get("fault") or {}
    if "type" in fault:
        return None
    from planner.search.suggest import FAULTS

    found = c.signature["fault"]
    if found is None:
        return Check("fault type", "FAIL", f"no fault type given and none found in the failing run ({_metrics_path(c)}); state fault.type")
    name = found["fault"]
    if name == "non-finite":
        name = "fp16-overflow" if c.settings.get("precision") == "fp16" else "grad-blowup"
    if name not in FAULTS:
        return Check("fault type", "FAIL", f"the failing run shows {_finding(found)}: no fault recipe reproduces it "
                                           f"(one of {', '.join(sorted(set(FAULTS.values())))}); state fault.type")  # fmt: skip
    fault["type"] = name
    return Check("fault type", "PASS", f"{name}, read from the failing run: {_finding(found)}")


def check_metrics(c: _Context) -> Check | None:
    p = _metrics_path(c)
    if p is None:
        return None
    from planner.search.suggest import FAULTS

    sig = c.signature
    where = f"{sig['steps']} steps of the failing run ({sig['format']}, {sig['trainer']})"
    stated_type = c.data["fault"].get("type")
    if stated_type is None:  # filled from this log or reported by fill_fault_type
        return Check("failing run metrics", "PASS", f"{where}")
    stated = FAULTS[stated_type]
    found = sig["fault"]
    by = {d["fault"]: d for d in sig["detectors"]}
    own = by.get(stated)
    if found is None:
        if own is not None and not own["logged"]:
            return Check("failing run metrics", "WARN", f"{where}: no fault found, and the log cannot show {stated_type} ({own['rule']})")
        return Check("failing run metrics", "WARN", f"{where}: no detector finds a fault in it; is this the failing run?")
    if _compatible(found["fault"], stated):
        return Check("failing run metrics", "PASS", f"{where}: {_finding(found)}, as stated")
    if own is not None and own["onset_step"] is not None:
        return Check("failing run metrics", "WARN", f"{where}: {_finding(found)} comes first; the stated {stated_type} shows later, "
                                                    f"{_finding(own)}")  # fmt: skip
    if own is not None and not own["logged"]:
        return Check("failing run metrics", "WARN", f"{where}: it shows {_finding(found)}; the stated {stated_type} cannot be "
                                                    f"checked ({own['rule']})")  # fmt: skip
    return Check("failing run metrics", "FAIL", f"{where}: the request states {stated_type}, but the log shows {_finding(found)} and no "
                                                f"{stated}" + (f" ({own['rule']})" if own else ""))  # fmt: skip


CHECKS: list[tuple[str, Callable[[_Context], Check | None], tuple[str, ...]]] = [
    ("fault type", fill_fault_type, ()),
    ("model", check_model, ()),
    ("plan", check_plan, ("model",)),
    ("memory", check_memory, ("plan",)),
    ("host memory", check_host_memory, ("plan",)),
    ("budget", check_budget, ("plan",)),
    ("fidelity", check_fidelity, ("plan", "fault type")),
    ("fault factors", check_factors, ("plan", "fault type")),
    ("reproduction", check_reproduction, ("plan", "fault type")),
    ("stats", check_stats, ("plan",)),
    ("failing run metrics", check_metrics, ()),
]


def preflight(path: str | Path) -> list[Check]:
    path = Path(path)
    data = _read_request(path)
    ctx = _Context(data, path.parent)
    schema = check_schema(ctx)
    results = [schema]
    if schema.status == "FAIL":
        return results
    failed: set[str] = set()
    for name, fn, needs in CHECKS:
        blocked = [n for n in needs if n in failed]
        if blocked:  # not a failure of its own: counted as not checked, and what needs it is not checked either
            results.append(Check(name, "SKIP", f"not checked: {', '.join(blocked)} failed"))
            failed.add(name)
            continue
        try:
            result = fn(ctx)
        except PlannerError as exc:
            result = Check(name, "FAIL", str(exc))
        except (ValueError, TypeError, KeyError, OSError) as exc:  # a malformed file the request points at
            result = Check(name, "FAIL", f"{type(exc).__name__}: {exc}")
        if result is None:
            continue
        results.append(result)
        if result.status == "FAIL":
            failed.add(name)
    return results


def render_preflight(checks: list[Check], path: str) -> str:
    from planner.render import table

    count = {status: sum(c.status == status for c in checks) for status in ("PASS", "WARN", "FAIL", "SKIP")}
    verdict = "FAIL" if count["FAIL"] else ("PASS with warnings" if count["WARN"] else "PASS")
    body = table(["check", "status", "reason"], [[c.name, c.status, c.reason] for c in checks], title=f"pre-flight {path}")
    from planner.search.output import calibration_line

    skipped = f", {count['SKIP']} not checked" if count["SKIP"] else ""
    return f"{body}\n\n{verdict}: {count['FAIL']} failed, {count['WARN']} warned, {count['PASS']} passed{skipped}\n{calibration_line()}"


def preflight_json(checks: list[Check]) -> dict[str, Any]:
    from planner.search.suggest import calibration_files

    return {"ok": not any(c.status == "FAIL" for c in checks), "checks": [c.to_json() for c in checks], "calibration_files": calibration_files()}

