"""The calibration grid: original and proxy runs of every fault recipe, as Optuna trials.

families x originals x K x plans make the proxies. Every family has several independently trained
originals (model seeds: initialisation and data order), so that validation can hold out a whole
original. Plans span quality within each K: the clustering methods, saliency and frequency ranking,
random draws, and deliberately bad plans (the least-used experts, one tight cluster). K runs from
top_k to E/2. Every (recipe, phase, original) is one Optuna study on RDB storage (SQLite by default)
whose grid points are that original's models; a GridSampler hands each trial a distinct point, so several worker processes
or machines share the work and nothing is computed twice. A run that is interrupted resumes: a
worker that dies stops beating its heartbeat, its trial is failed after the grace period and
re-queued; the next `calibrate run` picks up whatever is missing.

Studies are named by the grid's key (the settings measurements depend on: not the recipe list nor
the dynamic budget), the recipe and its measurement version, and the original, so adding a recipe,
re-measuring one after a change to it, or running a dynamic recipe on more originals leaves the
results already measured in place. The originals' phase is keyed without `proxy_build`: a grid that
builds the same plans' proxies another way (their correction bias settled) measures them against the
sliced grid's originals, measured once.

Phase 1 measures the originals: the critical knob per margin seed (at least 4; their SD is the
noise floor of that original and recipe), bisected to a stated resolution in log2 units, and for
dynamic recipes a curve run at the critical knob plus a fixed offset with replicas (same prompts,
other sampling seeds). Phase 2 measures every proxy the same way at its original's knob. Dynamic
recipes are budgeted: they run on the first `dynamic_originals` originals from `first_original`
(model seeds first_original .. originals-1: a later grid adds originals to a family measured
before). A (recipe, K) where the fault cannot occur (router collapse at K <= top_k) is not measured.
Negative controls (`controls`: mis-sliced routers, built from the clustered plan) are measured like
any proxy. Results live in the trials' user attributes and, with `results`, in one JSON-lines file
per study, each point with the fingerprint of the model it was measured on: a fresh storage (another
checkout, another machine) takes a file's points for the same models instead of measuring them.
`planner.fidelity.calibrate.export` joins them into the dataset.

The models are trained on this CPU, and a CPU's kernels round differently from another's (PyTorch
and its BLAS pick AVX-512 or AVX2 code at run time), so a file's points carry over only to machines
of the same kind. With `numerics: portable` the models, their statistics and the proxies are made in a
child process pinned to one code path that every x86-64 CPU with AVX2 runs the same way (PyTorch's
AVX2 kernels, MKL's AVX2 conditional-numerical-reproducibility branch, oneDNN and OpenBLAS held to
AVX2, one thread), so the same seed makes the same bytes on any such machine and a grid stopped on
one machine resumes on another. The measurements themselves run natively: their noise is the label's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from planner.errors import SpecError
from planner.files import read_json, read_yaml, write_text_atomic
from planner.rl.margin import DEFAULT_PROBE_STEPS

__all__ = ["Grid", "PRODUCTION", "job_settings", "job_shares", "unit_id", "split_unit", "prepare", "run_phase", "run_workers", "collect", "study_name", "grid_storage", "grid_units", "results_file", "read_results",
           "import_results", "mis_slice"]

log = logging.getLogger(__name__)
# a worker beats every HEARTBEAT_S; a trial whose worker went silent for GRACE_S fails and is re-queued
HEARTBEAT_S = int(os.environ.get("PLANNER_GRID_HEARTBEAT_S", 30))
GRACE_S = int(os.environ.get("PLANNER_GRID_GRACE_S", 120))
MAX_FAILURES = 3  # a grid point that raised this often is reported, not retried again
PHASES = ("originals", "proxies")
# what the models and proxies under a workdir depend on
_MODEL_FIELDS = ("families", "originals", "kept_fractions", "methods", "random_draws", "calib_tokens", "dense_steps", "moe_steps",
                 "controls", "first_original", "numerics", "balancing", "proxy_build")  # fmt: skip
_ADDED_LATER = ("controls", "first_original", "jobs", "numerics", "balancing", "proxy_build")  # settings with a default that leaves earlier grids' keys as they were
# one code path for making models that every x86-64 CPU with AVX2 runs the same way (`numerics: portable`)
PORTABLE_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2", "OPENBLAS_CORETYPE": "Haswell",
                "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # fmt: skip
NUMERICS = ("native", "portable")
PRODUCTION = "1/1/1"  # the harness's own job (RLConfig's prompts, group and new tokens), which every label is measured against


@dataclass(frozen=True, kw_only=True)
class Grid:
    families: tuple[str, ...] = ("qwen3_moe", "deepseek_v3", "mixtral")
    originals: int = 3  # independently trained originals per family (model seeds 0 .. originals-1)
    recipes: tuple[str, ...] = ("fp16-overflow", "rollout-mismatch", "router-collapse")
    dynamic_originals: int = 3  # dynamic recipes run on this many originals per family (their compute budget)
    kept_fractions: tuple[float, ...] = (0.125, 0.25, 0.375, 0.5)  # K/E; K is raised to the smallest legal K >= top_k
    methods: tuple[str, ...] = ("agglomerative", "kmeans", "router", "saliency", "frequency", "least-used", "one-cluster")
    random_draws: int = 3
    margin_seeds: tuple[int, ...] = (0, 1, 2, 3)
    curve_seed: int = 0
    replica_gen_seeds: tuple[int, ...] = (1000, 1001)
    margin_steps: int = DEFAULT_PROBE_STEPS
    curve_steps: int = 24
    resolution_static: float = 0.05  # bisection resolution, log2 units (a quarter of the smallest seed SD seen: 0.26)
    resolution_dynamic: float = 0.15  # (router collapse: seed SD 0.6-1.1)
    knob_offset: float = 0.25  # curve runs sit this far above the original's critical knob
    calib_tokens: int = 2048
    dense_steps: int = 300
    moe_steps: int = 300
    controls: tuple[str, ...] = ()  # negative controls per K (planner.plan.CONTROL_METHODS), built from the agglomerative plan
    first_original: int = 0  # model seeds first_original .. originals-1: more originals for a family measured before
    # reproduction jobs every model is also measured at: divisors of the harness's prompts per step,
    # group size and new tokens ("4/1/1": a quarter of the prompts); the first is the production job
    jobs: tuple[str, ...] = (PRODUCTION,)
    # how the models are made: "native" (this CPU's fastest kernels; another kind of CPU makes other
    # models from the same seeds) or "portable" (PORTABLE_ENV: the same bytes on any AVX2 machine).
    # Not in the key: the points of one grid carry the fingerprint of the models they were measured on
    numerics: str = "native"
    # how the originals' MoE stage is trained (planner.rl.models.ModelRecipe): "none" (the routers learn from the
    # language-model loss alone: the grids measured so far) or "published" (each shape's published load balancing)
    balancing: str = "none"
    # how the proxies are built (planner.plan.PROXY_BUILDS): "sliced" (every tensor of a kept expert
    # as the original has it) or "settled" (the kept experts' correction bias settled again after
    # pruning: `planner build --settle-bias`). A calibration family of its own; the originals and
    # their measurements are the sliced grid's (the originals' phase is keyed without it)
    proxy_build: str = "sliced"

    def seeds(self) -> range:
        """The model seeds of the grid's originals."""
        return range(self.first_original, self.originals)

    def original(self, family: str, seed: int) -> str:
        """An original's name, FAMILY-sSEED, and -bal where it trains with its shape's published balancing
        (another model from the same seed: its rows must not meet the unbalanced original's)."""
        from planner.families import trained_name

        return trained_name(f"{family}-s{seed}", self.balancing)

    def family_name(self, family: str) -> str:
        """The calibration family the grid's rows of `family` join: -bal where its originals train with the
        shape's published balancing, -settled where its proxies' correction bias is settled again."""
        from planner.families import built_name, trained_name

        return built_name(trained_name(family, self.balancing), self.proxy_build)

    def __post_init__(self) -> None:
        from planner.plan import SELECTION_METHODS
        from planner.families import family_configs
        from planner.rl.recipes import RECIPES

        for name, known in (("families", family_configs()), ("recipes", RECIPES), ("methods", SELECTION_METHODS)):
            bad = [v for v in getattr(self, name) if v not in known]
            if bad or not getattr(self, name):
                raise SpecError(f"grid: {name} {bad or '[]'} not among {', '.join(known)}")
        if "random" in self.methods:
            raise SpecError("grid: random plans come from random_draws, not methods")
        from planner.plan import CONTROL_METHODS

        if any(c not in CONTROL_METHODS for c in self.controls) or (self.controls and "agglomerative" not in self.methods):
            raise SpecError(f"grid: controls {list(self.controls)}: each one of {', '.join(CONTROL_METHODS)}, and built from the "
                            "agglomerative plan, which methods must then hold")  # fmt: skip
        if not self.jobs or self.jobs[0] != PRODUCTION or len(set(self.jobs)) != len(self.jobs):
            raise SpecError(f"grid: jobs {list(self.jobs)}: distinct, the production job {PRODUCTION} first (every label is against it)")
        for job in self.jobs:
            job_settings(job)
        if self.numerics not in NUMERICS:
            raise SpecError(f"grid: numerics {self.numerics!r}: one of {', '.join(NUMERICS)}")
        from planner.families import BALANCINGS

        if self.balancing not in BALANCINGS:
            raise SpecError(f"grid: balancing {self.balancing!r}: one of {', '.join(BALANCINGS)}")
        from planner.plan import PROXY_BUILDS

        if self.proxy_build not in PROXY_BUILDS:
            raise SpecError(f"grid: proxy_build {self.proxy_build!r}: one of {', '.join(PROXY_BUILDS)}")
        if not 0 <= self.first_original < self.originals:
            raise SpecError(f"grid: first_original {self.first_original} must lie in [0, originals={self.originals})")
        positive = ("originals", "margin_steps", "curve_steps", "calib_tokens")
        if any(getattr(self, n) < 1 for n in positive) or self.random_draws < 0 or self.dynamic_originals < 0:
            raise SpecError(f"grid: {', '.join(positive)} must be >= 1, random_draws and dynamic_originals >= 0")
        if len(self.margin_seeds) < 2 or len(set(self.margin_seeds)) != len(self.margin_seeds):
            raise SpecError(f"grid: margin_seeds {list(self.margin_seeds)}: at least 2 distinct seeds (4 or more for the labels)")
        if not (self.resolution_static > 0 and self.resolution_dynamic > 0) or not all(0 < f < 1 for f in self.kept_fractions):
            raise SpecError("grid: resolutions must be > 0 and kept_fractions inside (0, 1)")

    @classmethod
    def load(cls, path: str | Path | None) -> "Grid":
        if path is None:
            return cls()
        return cls.from_mapping(read_yaml(path, "grid") or {}, str(path))

    @classmethod
    def from_mapping(cls, data: Any, source: str) -> "Grid":
        """A grid from its YAML's mapping (each setting cast to its field's type); SOURCE names it in errors."""
        if not isinstance(data, dict):
            raise SpecError(f"{source}: a grid file is a mapping of setting -> value")
        kinds = {f.name: f for f in fields(cls)}
        unknown = [k for k in data if k not in kinds]
        if unknown:
            raise SpecError(f"{source}: unknown key(s) {unknown}; allowed: {', '.join(kinds)}")
        values = {}
        for key, value in data.items():
            default = kinds[key].default
            try:
                if isinstance(default, tuple):
                    items = value if isinstance(value, list) else [value]
                    values[key] = tuple(type(default[0])(v) for v in items) if default else tuple(str(v) for v in items)
                else:
                    values[key] = type(default)(value)
            except (TypeError, ValueError):
                raise SpecError(f"{source}: {key}: {value!r} is not a valid {type(default).__name__}") from None
        return cls(**values)

    def only(self, recipes: list[str] | str) -> "Grid":
        """The same grid measuring only `recipes` (some of its own, in its order): the studies and
        results are the same, since the recipe list is not part of the grid's key. A string is the
        comma-separated list `--recipes` takes."""
        if isinstance(recipes, str):
            recipes = [r.strip() for r in recipes.split(",") if r.strip()]
        unknown = [r for r in recipes if r not in self.recipes]
        if unknown or not recipes:
            raise SpecError(f"--recipes {','.join(recipes) or '(none)'}: the grid measures {', '.join(self.recipes)}; "
                            f"{'not ' + ', '.join(unknown) if unknown else 'name at least one'}")  # fmt: skip
        from dataclasses import replace

        return replace(self, recipes=tuple(r for r in self.recipes if r in recipes))

    def to_yaml(self) -> str:
        return yaml.safe_dump({k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}, sort_keys=False)

    def key(self, phase: str = "proxies") -> str:
        """The settings every measurement of the phase depends on (the recipe list and the dynamic
        budget only select studies; how the proxies are built is not the originals'). A setting
        added after the first grid enters the key only when it is not at its default, so the grids
        measured before it keep their studies."""
        settings = {k: v for k, v in asdict(self).items() if k not in ("recipes", "dynamic_originals", "numerics")}
        if phase == "originals":
            settings["proxy_build"] = Grid.__dataclass_fields__["proxy_build"].default
        for name in _ADDED_LATER:
            if name in settings and settings[name] == Grid.__dataclass_fields__[name].default:
                del settings[name]
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]

    def model_settings(self) -> dict[str, Any]:
        """What the models and proxies under a workdir depend on (the workdir's stamp)."""
        at_default = {k for k in _ADDED_LATER if getattr(self, k) == Grid.__dataclass_fields__[k].default}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k in _MODEL_FIELDS and k not in at_default}

    def experts(self, family: str) -> list[int]:
        """The K of a family: each kept fraction of E, raised to the smallest K the routing allows
        (K >= top_k, whole groups), below E."""
        from planner.errors import ConfigError
        from planner.families import family_architecture

        arch = family_architecture(family)
        e, legal = arch.original_num_experts, []
        for k in range(1, e):
            try:
                arch.with_experts(k)
                legal.append(k)
            except ConfigError:
                pass
        chosen = {min((k for k in legal if k >= f * e), default=legal[-1]) for f in self.kept_fractions}
        return sorted(chosen)

    def iters(self, recipe_name: str) -> int:
        """Bisection steps for the recipe's bracket to reach the grid's resolution (log2 units)."""
        from planner.fidelity.labels import knob_scale
        from planner.rl.recipes import recipe

        r = recipe(recipe_name)
        target = self.resolution_static if r.kind == "static" else self.resolution_dynamic
        return max(1, math.ceil(math.log2((r.hi - r.lo) * knob_scale(recipe_name) / target)) - 1)

    def resolution(self, recipe_name: str) -> float:
        """The bisection's resolution in knob units: half the final bracket."""
        from planner.rl.recipes import recipe

        r = recipe(recipe_name)
        return (r.hi - r.lo) / 2 ** (self.iters(recipe_name) + 1)

    def measured_on(self, recipe_name: str, seed: int) -> bool:
        """Does the recipe run on the family's original of this model seed (the dynamic budget)?"""
        from planner.rl.recipes import recipe

        return recipe(recipe_name).kind == "static" or seed < self.first_original + self.dynamic_originals


def job_settings(job: str) -> dict[str, int]:
    """The RLConfig settings of a grid job "P/G/L": the harness's prompts per step, group size and new
    tokens divided by P, G and L (each a whole divisor; a group keeps at least 2 samples)."""
    from planner.rl.grpo import RLConfig

    base = {name: RLConfig.__dataclass_fields__[name].default for name in ("prompts", "group", "new_tokens")}
    try:
        divisors = [int(v) for v in str(job).split("/")]
    except ValueError:
        divisors = []
    if len(divisors) != 3 or any(d < 1 for d in divisors):
        raise SpecError(f"grid: job {job!r}: three whole divisors P/G/L of the prompts ({base['prompts']}), group ({base['group']}) and new "
                        f"tokens ({base['new_tokens']}), e.g. 4/1/1")  # fmt: skip
    out = {name: value // d for (name, value), d in zip(base.items(), divisors)}
    if any(value % d for value, d in zip(base.values(), divisors)) or out["group"] < 2:
        raise SpecError(f"grid: job {job!r}: {base} must divide by it and keep a group of 2 or more")
    return out


def job_shares(job: str) -> dict[str, float]:
    """The dataset's job columns of a grid job: its share of the production prompts, group and length."""
    from planner.fidelity.dataset import job_columns

    return job_columns(*(1 / int(d) for d in job.split("/")))


def unit_id(base: str, model: str, recipe_name: str, job: str = PRODUCTION) -> str:
    """ORIGINAL/MODEL/RECIPE, and @P-G-L for a job other than the production one."""
    return f"{base}/{model}/{recipe_name}" + ("" if job == PRODUCTION else "@" + job.replace("/", "-"))


def split_unit(unit: str) -> tuple[str, str, str, str]:
    """(original, model, recipe, job) of a unit id."""
    base, model, rest = unit.split("/")
    recipe_name, _, job = rest.partition("@")
    return base, model, recipe_name, job.replace("-", "/") if job else PRODUCTION


def study_name(grid: Grid, recipe_name: str, phase: str, original: str) -> str:
    from planner.rl.recipes import recipe

    return f"calibration-{grid.key(phase)}-{recipe_name}-v{recipe(recipe_name).version}-{original}-{phase}"


@contextmanager
def _folder_lock(root: Path, *, blocking: bool):
    """An exclusive lock on ROOT/.lock (made with ROOT); yields whether it is held (never False when
    blocking)."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _prepare_original(grid: Grid, family: str, seed: int, root: Path) -> dict[str, dict]:
    """One original of `family` under ROOT, its statistics, every proxy of the grid and the controls
    (each made only where missing); their model records by id."""
    from planner.checkpoint import Checkpoint, build
    from planner.rl.models import ModelRecipe, make_model
    from planner.stats.compute import compute_stats, plan_from_stats
    from planner.stats.store import STATISTICS_VERSION, load_stats, plan_key, plan_statistics, save_stats

    experts = grid.experts(family)
    settle = grid.proxy_build == "settled"
    records: dict[str, dict] = {}
    base = grid.original(family, seed)
    original = root / "original"
    if not (original / "config.json").is_file():
        make_model(family, original, ModelRecipe(dense_steps=grid.dense_steps, moe_steps=grid.moe_steps, seed=seed, balancing=grid.balancing))
    ckpt = Checkpoint(original)
    top_k = ckpt.arch.moe.top_k
    records[f"{base}/original"] = {"family": family, "original": base, "seed": seed, "model": "original", "path": str(original),
                                   "experts": ckpt.arch.original_num_experts, "top_k": top_k, "method": "original",
                                   "statistics": {}}  # fmt: skip
    stats_path = root / "stats.json"
    old = read_json(stats_path, "stats file") if stats_path.is_file() else None
    unsettled = settle and old is not None and any("settled_bias" not in plan for plan in old["plans"].values())
    if old is None or old.get("statistics_version", 1) != STATISTICS_VERSION or unsettled:
        stats = compute_stats(ckpt, experts=experts, methods=tuple(grid.methods), calib_tokens=grid.calib_tokens, seq_len=64, settle_bias=settle)
        for draw in range(grid.random_draws):
            extra = compute_stats(ckpt, experts=experts, methods=("random",), calib_tokens=grid.calib_tokens,
                                  seq_len=64, seed=draw, settle_bias=settle)  # fmt: skip
            for key, plan in extra["plans"].items():
                stats["plans"][f"{key}-{draw}"] = {**plan, "seed": draw}
        if old is not None:  # statistics of another version: the proxies built (and measured) must stay the same
            moved = [key for key, plan in old["plans"].items() if stats["plans"].get(key, {}).get("kept") != plan["kept"]]
            if moved:
                raise SpecError(f"{stats_path}: recomputing the statistics (version {old.get('statistics_version', 1)} -> "
                                f"{STATISTICS_VERSION}) keeps other experts for {moved[:3]}; the proxies measured there "
                                "belong to the old choice: pass another --workdir")  # fmt: skip
        save_stats(stats, stats_path, force=True)
    stats = load_stats(stats_path, fingerprint=ckpt.fingerprint())
    for key, plan in stats["plans"].items():
        k, method = int(key.split("/")[0][2:]), key.split("/", 1)[1]
        model = f"K{k}-{method}"
        path = root / model
        if not (path / "expert_map.json").is_file():
            kind = method.rsplit("-", 1)[0] if method.startswith("random-") else method
            stored = {**stats, "seed": int(plan.get("seed", 0)), "plans": {plan_key(k, kind): plan}}
            p = plan_from_stats(stored, k, kind, model=str(original), seed=int(plan.get("seed", 0)), settle_bias=settle)
            build(ckpt, p, path, verify="never", force=True)
        records[f"{base}/{model}"] = {"family": family, "original": base, "seed": seed, "model": model, "path": str(path),
                                      "experts": k, "top_k": top_k, "method": method, "statistics": plan_statistics(stats, key)}  # fmt: skip
    for control in grid.controls:
        for k in experts:
            source, model = records[f"{base}/K{k}-agglomerative"], f"K{k}-{control}"
            path = root / model
            if not (path / "expert_map.json").is_file():
                mis_slice(Path(source["path"]), path)
            # the statistics are the clustered plan's, as a reader of the plan would see them: the
            # control is wrong where no statistic looks
            records[f"{base}/{model}"] = {**source, "model": model, "path": str(path), "method": control}
    return records


def _prepare_portable(grid: Grid, family: str, seed: int, root: Path) -> dict[str, dict]:
    """_prepare_original in a child process pinned to PORTABLE_ENV (the kernels are chosen when the
    libraries load, so this process cannot switch); its records come back as JSON."""
    import torch

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.warning("numerics: portable needs an x86-64 CPU with AVX2 (this one: %s): the models made here differ from other "
                    "machines', whose points will be measured again", torch.backends.cpu.get_cpu_capability())  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "planner.fidelity.grid", "--prepare", family, str(seed), str(root)],
                          input=grid.to_yaml(), capture_output=True, text=True, env={**os.environ, **PORTABLE_ENV})  # fmt: skip
    if proc.returncode:
        raise SpecError(f"making {grid.original(family, seed)} under {root} (numerics: portable) failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def prepare(grid: Grid, workdir: Path, progress=None) -> dict[str, dict]:
    """Make the originals and every proxy (idempotent); return model records by id (ORIGINAL/MODEL,
    ORIGINAL = FAMILY-sSEED)."""
    workdir.mkdir(parents=True, exist_ok=True)
    settings = grid.model_settings()
    stamp = workdir / "grid.json"
    if stamp.is_file():
        if json.loads(stamp.read_text()) != settings:
            raise SpecError(f"{workdir} holds models made for other grid settings ({stamp}); pass another --workdir")
    else:  # atomic: another run sharing this work directory may be reading it now
        write_text_atomic(stamp, json.dumps(settings, indent=1))
    # one original at a time per process, under a lock in its folder: a second run sharing the work
    # directory prepares another original meanwhile, and waits only for those the first one holds
    bases = [grid.original(family, seed) for family in grid.families for seed in grid.seeds()]
    by_base: dict[str, dict[str, dict]] = {}
    pending = [(family, seed) for family in grid.families for seed in grid.seeds()]
    for blocking in (False, True):
        waiting = []
        for family, seed in pending:
            base = grid.original(family, seed)
            with _folder_lock(workdir / "models" / base, blocking=blocking) as held:
                if not held:
                    waiting.append((family, seed))
                    continue
                root = workdir / "models" / base
                by_base[base] = _prepare_original(grid, family, seed, root) if grid.numerics == "native" else _prepare_portable(grid, family, seed, root)
            if progress:
                progress(base)
        pending = waiting
    records = {key: record for base in bases for key, record in by_base[base].items()}
    write_text_atomic(workdir / "models.json", json.dumps(records, indent=1))
    return records


def mis_slice(proxy: Path, out: Path) -> None:
    """A negative control: the proxy at `proxy` with every MoE layer's router rows (and router and
    correction biases) rotated by one expert, so that the router's choice for expert i runs expert
    i+1. Written to OUT.tmp and renamed; the expert map records the rotation."""
    import torch
    from safetensors.torch import load_file, save_file

    from planner.checkpoint import Checkpoint

    ckpt = Checkpoint(proxy)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(proxy, tmp)
    rotated = []
    for shard in sorted(tmp.glob("*.safetensors")):
        tensors = load_file(shard)
        for layer in ckpt.moe_layers.values():
            for info, dim in ((layer.router, 0), (layer.router_bias, 0), (layer.correction_bias, layer.correction_dim)):
                if info is not None and info.name in tensors:
                    tensors[info.name] = torch.roll(tensors[info.name], shifts=-1, dims=dim).contiguous()
                    rotated.append(info.name)
        save_file(tensors, shard, metadata={"format": "pt"})
    if not rotated:
        raise SpecError(f"{proxy}: no router tensor found to mis-slice")
    expert_map = json.loads((tmp / "expert_map.json").read_text())
    expert_map["control"] = {"kind": "mis-sliced", "rule": "router rows rotated by one expert: row i <- row i+1 (mod K)", "tensors": rotated}
    (tmp / "expert_map.json").write_text(json.dumps(expert_map, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)


def grid_storage(url: str):
    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    kwargs = {"heartbeat_interval": HEARTBEAT_S, "grace_period": GRACE_S,
              "heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_FAILURES)}  # fmt: skip
    from planner.rdb import rdb_storage

    return rdb_storage(url, **kwargs)


def _study(storage: str, grid: Grid, recipe_name: str, phase: str, original: str, units: list[str]):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=study_name(grid, recipe_name, phase, original),
        storage=grid_storage(storage),
        sampler=optuna.samplers.GridSampler({"unit": units}),
        load_if_exists=True,
    )
    if not study.user_attrs:
        for key, value in (("recipe", recipe_name), ("phase", phase), ("original", original)):
            study.set_user_attr(key, value)
    return study


def grid_units(grid: Grid, records: dict[str, dict], recipe_name: str, phase: str) -> dict[str, list[str]]:
    """The unit (unit_id) of every model the phase measures under the recipe at every job of the grid
    (not where the fault cannot occur, nor beyond the dynamic budget), by original: one study each."""
    from planner.fidelity.labels import applicable

    out: dict[str, list[str]] = {}
    for r in sorted(records.values(), key=lambda r: (r["seed"], r["original"], r["model"])):  # seed first: a budget cut short keeps whole seeds
        if (r["model"] == "original") == (phase == "originals") and grid.measured_on(recipe_name, r["seed"]) \
                and applicable(recipe_name, r["experts"], r["top_k"]):  # fmt: skip
            out.setdefault(r["original"], []).extend(unit_id(r["original"], r["model"], recipe_name, job) for job in grid.jobs)
    return out


def _measure(grid: Grid, record: dict, recipe_name: str, original: dict | None, job: str = PRODUCTION) -> dict[str, Any]:
    """Margin (per seed) and, for dynamic recipes, curve runs of one model under one recipe at one job.
    A proxy's curve runs at its original's knob (at the production job); an original's at its own
    critical knob plus the offset, with replicas at the production job only."""
    from planner.rl.grpo import GRPO, Models
    from planner.rl.margin import critical_knob
    from planner.rl.recipes import recipe

    from planner.checkpoint import Checkpoint

    r = recipe(recipe_name)
    models = Models(record["path"])
    settings = {} if job == PRODUCTION else job_settings(job)
    margin = critical_knob(models, r, list(grid.margin_seeds), iters=grid.iters(recipe_name), steps=grid.margin_steps, settings=settings)
    # the model measured: a results file's point stands for this model only (trained weights differ
    # between CPUs' float kernels)
    out: dict[str, Any] = {"margin": {**margin.to_json(), "resolution": grid.resolution(recipe_name)},
                           "fingerprint": Checkpoint(record["path"]).fingerprint()}  # fmt: skip
    if r.kind == "dynamic":
        knob = original["knob"] if original else margin.mean + grid.knob_offset
        out["knob"] = knob
        runs = {"curve": GRPO(models, r.config(knob, seed=grid.curve_seed, steps=grid.curve_steps, **settings)).run()}
        if original is None and job == PRODUCTION:
            for i, gen_seed in enumerate(grid.replica_gen_seeds):
                runs[f"replica{i}"] = GRPO(models, r.config(knob, seed=grid.curve_seed, steps=grid.curve_steps, gen_seed=gen_seed)).run()
        for name, rows in runs.items():
            out[name] = [{k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()} for row in rows]
            out[f"{name}_onset"] = r.onset(rows)
    return out


def results_file(results: Path, study) -> Path:
    """The JSON-lines record of a study's completed grid points under `results` (one file per study:
    data that travels with the repository, so a grid resumes in a fresh checkout or elsewhere)."""
    return Path(results) / f"{study.study_name}.jsonl"


def _append_result(path: Path, unit: str, result: dict) -> None:
    """One completed point, appended under an exclusive lock (workers share the file)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"unit": unit, "result": result}, separators=(",", ":")) + "\n"
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read_results(path: Path) -> dict[str, list[dict]]:
    """A results file's points by unit, every record of a unit in the order written (one per model
    it was measured on: a point measured again on other weights is appended); a torn line, from a
    worker killed mid-write, is skipped."""
    out: dict[str, list[dict]] = {}
    if not path.is_file():
        return out
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d: not a JSON line (a torn write?); skipped", path, number)
            continue
        out.setdefault(record["unit"], []).append(record["result"])
    return out


def import_results(study, units: list[str], path: Path, fingerprint_of=None) -> tuple[int, list[str]]:
    """Complete trials in `study` for the points `path` holds that the study has not completed (the
    GridSampler then never hands them out). A point measured on another model than the local one
    (its fingerprint differs: the models were made on another CPU) is not taken: it is measured
    again here. Returns (points added, units skipped as measured on another model)."""
    import optuna

    done = {t.params.get("unit") for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))}
    added, other = 0, []
    distribution = optuna.distributions.CategoricalDistribution(units)
    for unit, results in read_results(path).items():
        if unit in done or unit not in units:
            continue
        here = fingerprint_of(unit) if fingerprint_of is not None else None
        result = next((r for r in results if here is None or not r.get("fingerprint") or r["fingerprint"] == here), None)
        if result is None:
            other.append(unit)
            continue
        study.add_trial(optuna.trial.create_trial(params={"unit": unit}, distributions={"unit": distribution}, value=0.0,
                                                  user_attrs={"result": json.dumps(result), "imported_from": path.name},
                                                  system_attrs={"grid_id": units.index(unit), "search_space": {"unit": units}}))  # fmt: skip
        added += 1
    return added, other


def _work(study, units: list[str], measure, results: Path | None = None) -> bool:
    """One worker's loop over one study until every unit is complete (True) or the only ones left
    are running in other workers (False: come back later; a dead worker's trial goes stale)."""
    import optuna

    state = optuna.trial.TrialState

    def others(unit: str, number: int, states: tuple) -> list:
        return [t for t in study.get_trials(deepcopy=False, states=states) if t.params.get("unit") == unit and t.number != number]

    def objective(trial: optuna.Trial) -> float:
        try:
            unit = trial.suggest_categorical("unit", units)
        except ValueError as exc:  # the study was made with another set of grid points
            trial.set_user_attr("error", f"{type(exc).__name__}: {exc}")
            raise
        # two workers can land on one point (a re-queued retry, a race at the end): the lower
        # trial number keeps it, the other is pruned unrun; checked again before recording
        taken = [t.number for t in others(unit, trial.number, (state.COMPLETE, state.RUNNING))
                 if t.state == state.COMPLETE or t.number < trial.number]  # fmt: skip
        if taken:
            raise optuna.TrialPruned(f"{unit} is taken by trial {taken[0]}")
        try:
            result = measure(unit)
        except Exception as exc:
            trial.set_user_attr("error", f"{type(exc).__name__}: {exc}")
            raise
        if others(unit, trial.number, (state.COMPLETE,)):
            raise optuna.TrialPruned(f"{unit} was completed by another trial meanwhile")
        trial.set_user_attr("result", json.dumps(result))
        if results is not None:
            _append_result(results_file(results, study), unit, result)
        return 0.0

    rng = random.Random(os.getpid())
    while True:
        trials = study.get_trials(deepcopy=False)
        by_state = {s: [t.params.get("unit") for t in trials if t.state == s] for s in state}
        missing = sorted(set(units) - set(by_state[state.COMPLETE]) - set(by_state[state.RUNNING]))
        failures = {u: by_state[state.FAIL].count(u) for u in missing}
        gave_up = [u for u in missing if failures[u] >= MAX_FAILURES]
        todo = [u for u in missing if u not in gave_up]
        if not todo and not by_state[state.WAITING]:
            if by_state[state.RUNNING]:  # others hold the last points
                optuna.storages.fail_stale_trials(study)
                return False
            if gave_up:
                errors = {t.params.get("unit"): t.user_attrs.get("error", "?") for t in trials if t.state == state.FAIL}
                raise SpecError(f"{len(gave_up)} grid point(s) failed {MAX_FAILURES} times, e.g. {gave_up[0]}: {errors.get(gave_up[0])}")
            return True
        # a point that failed or was pruned counts as visited to the GridSampler: queue it again
        visited = set(by_state[state.FAIL]) | set(by_state[state.PRUNED])
        if not by_state[state.WAITING] and todo and set(todo) <= visited:
            study.enqueue_trial({"unit": rng.choice(todo)})
        try:
            study.optimize(objective, n_trials=1, catch=(Exception,))
        except optuna.exceptions.StorageInternalError:  # a concurrent write lost a SQLite lock: retry
            time.sleep(rng.uniform(0.1, 1.0))
            continue
        last = study.get_trials(deepcopy=False)[-1]
        if last.state == state.FAIL and "unit" not in last.params:  # no grid point could even be drawn: retrying cannot help
            raise SpecError(f"study {study.study_name}: {last.user_attrs.get('error', 'a trial failed before drawing a grid point')}; "
                            "its grid points differ from this grid's (another grid under the same settings?): use another --storage")  # fmt: skip


def run_phase(storage: str, grid: Grid, workdir: Path, phase: str, results: Path | None = None) -> None:
    """Work through the phase's studies (one per recipe and original) until none has a point left
    (one worker). A study whose last points run in other workers is left for later, not waited on.
    With `results`, every point this worker completes is also appended to its study's results file."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    records = json.loads((workdir / "models.json").read_text())
    pending = []
    for recipe_name in grid.recipes:
        originals = collect(storage, grid, "originals", recipes=(recipe_name,)) if phase == "proxies" else {}
        needed = [u for units in grid_units(grid, records, recipe_name, "originals").values() for u in units]
        missing = [u for u in needed if u not in originals] if phase == "proxies" else []
        if missing:
            raise SpecError(f"the originals phase is not complete ({len(missing)} missing, e.g. {missing[0]}); run it first")

        def measure(unit: str, recipe_name=recipe_name, originals=originals) -> dict:
            base, model, _, job = split_unit(unit)
            return _measure(grid, records[f"{base}/{model}"], recipe_name, originals.get(unit_id(base, "original", recipe_name)), job)

        for base, units in grid_units(grid, records, recipe_name, phase).items():
            pending.append((_study(storage, grid, recipe_name, phase, base, units), units, measure, results))
    while pending:
        pending = [p for p in pending if not _work(*p)]
        if pending:
            time.sleep(min(HEARTBEAT_S, 5))


def run_workers(storage: str, grid: Grid, grid_path: str | None, workdir: Path, phase: str, workers: int,
                results: Path | None = None) -> int:  # fmt: skip
    """Run `workers` processes on the phase (each a `python -m planner.fidelity.grid` worker);
    returns how many points were taken from `results` files instead of being measured.

    The studies (and the storage's tables) are made here first: workers creating a SQLite schema at
    the same moment race each other. Points a results file holds are completed in the storage
    before any worker starts. Workers start a second apart."""
    from planner.checkpoint import Checkpoint

    records = json.loads((workdir / "models.json").read_text())
    imported, other = 0, []

    def fingerprint_of(unit: str) -> str:
        base, model, _, _ = split_unit(unit)
        return Checkpoint(records[f"{base}/{model}"]["path"]).fingerprint()

    for recipe_name in grid.recipes:
        for base, units in grid_units(grid, records, recipe_name, phase).items():
            study = _study(storage, grid, recipe_name, phase, base, units)
            if results is not None:
                added, skipped = import_results(study, units, results_file(results, study), fingerprint_of)
                imported, other = imported + added, other + skipped
    if other:
        log.warning("%d point(s) of the results files were measured on other models than the ones here (made on another CPU?), "
                    "e.g. %s: measured again", len(other), other[0])  # fmt: skip
    cmd = [sys.executable, "-m", "planner.fidelity.grid", storage, str(workdir), phase, grid_path or "-", str(results or "-"), ",".join(grid.recipes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for i in range(workers):
        if i:
            time.sleep(1.0)
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SpecError(f"calibration workers exited with {codes}; rerun the same command to resume")
    return imported


def collect(storage: str, grid: Grid, phase: str, recipes: tuple[str, ...] | None = None) -> dict[str, dict]:
    """Completed results of a phase by unit id (ORIGINAL/MODEL/RECIPE), from the studies of every
    original of the grid (those beyond the dynamic budget have none)."""
    import optuna

    out = {}
    studies = [(r, grid.original(family, seed)) for r in recipes or grid.recipes for family in grid.families for seed in grid.seeds()
               if grid.measured_on(r, seed)]  # fmt: skip
    for recipe_name, base in studies:
        try:
            study = optuna.load_study(study_name=study_name(grid, recipe_name, phase, base), storage=grid_storage(storage))
        except KeyError:
            continue
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            if "result" in trial.user_attrs:
                out.setdefault(trial.params["unit"], json.loads(trial.user_attrs["result"]))
    return out


if __name__ == "__main__":  # a worker: python -m planner.fidelity.grid STORAGE WORKDIR PHASE GRID|- RESULTS|- [RECIPES]
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if sys.argv[1] == "--prepare":  # one original, portably (_prepare_portable): the grid's YAML on stdin, the records out
        print(json.dumps(_prepare_original(Grid.from_mapping(yaml.safe_load(sys.stdin.read()), "stdin"), sys.argv[2], int(sys.argv[3]),
                                           Path(sys.argv[4]))))  # fmt: skip
        sys.exit(0)
    url, directory, which = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    given = sys.argv[4:7]
    grid_arg, results_arg, recipes_arg = given + ["-", "-", ""][len(given) :]
    try:
        grid = Grid.load(None if grid_arg == "-" else grid_arg)
        if recipes_arg:  # the recipes this run measures (a subset of the grid's; the studies are the same)
            grid = grid.only(recipes_arg)
        run_phase(url, grid, directory, which, None if results_arg == "-" else Path(results_arg))
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
