"""The reproduction a plan pays for: the job it runs, the steps until the fault shows, and the
accelerator-hours to the fault, split by mechanism.

A proxy keeps top-k, so its FLOPs per token equal the original's and on fewer devices its step is
longer: what a reproduction saves lies as much in its job and its length as in the model. And it is
paid per fault, not per step. So the job is part of the plan:

- `JobBounds`: how far each job dimension may shrink (`--job-bounds`; by default down to 1/16 of
  the batch, prompts x samples, and 1/4 of the response cap).
- `job_scales`: the candidate jobs, halving each dimension down to its bound. A dimension shrinks
  only where the fidelity data support it (`FidelityEstimator.job_support`): a fault whose critical
  knob was never measured at a smaller job keeps the production value, and the output says why.
- `Onset`: the step at which the original showed the fault (`--fault-step`, from the user's run),
  the proxy's predicted onset (the original's times the proxy/original onset ratio measured on the
  calibration curves, `FidelityEstimator.onset`) and the steps the reproduction runs.
- `split`: accelerator-hours to the fault against the original's, as a product: fewer devices x the
  baseline's own layout x the smaller job x the step time x the steps to the fault.

Everything here is arithmetic on costed points (planner.cost); suggest, report and preflight
print from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from planner.errors import SpecError
from planner.specs import Job, Lengths

__all__ = ["WORKLOAD", "with_workload", "JobBounds", "JobScale", "job_scales", "Onset", "onset", "run_steps", "split", "split_text"]

# a reproduction runs past the predicted onset's upper end by 10%, at least 2 steps
ONSET_MARGIN = (0.1, 2)
# what makes a job's workload (the rest are settings: layouts, recompute, offload, ...)
WORKLOAD = ("algorithm", "prompts_per_step", "samples_per_prompt", "prompt_tokens", "response_tokens", "ppo_epochs", "mini_batches",
            "rollout_oversampling")  # fmt: skip


@dataclass(frozen=True)
class JobBounds:
    """How small the reproduction's job may get, as shares of the production job: the batch
    (prompts x samples per prompt) down to `batch`, the response length cap down to `length`."""

    batch: float = 1 / 16
    length: float = 1 / 4

    def __post_init__(self) -> None:
        for name in ("batch", "length"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise SpecError(f"--job-bounds {name}={value:g}: a share of the production job, in (0, 1]")

    @classmethod
    def parse(cls, text: str | None) -> "JobBounds":
        """'batch=1/16,length=1/4' (either key may be left out: its default stays; 1 holds it)."""
        if not text:
            return cls()
        values: dict[str, float] = {}
        for part in str(text).split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in ("batch", "length"):
                raise SpecError(f"--job-bounds {text!r}: expected batch=SHARE,length=SHARE (e.g. batch=1/16,length=1/4), got {part.strip()!r}")
            try:
                values[key] = float(Fraction(value.strip()))
            except (ValueError, ZeroDivisionError):
                raise SpecError(f"--job-bounds {text!r}: {key}={value.strip()!r} is not a number or a fraction such as 1/16") from None
        return cls(**values)

    def describe(self) -> str:
        return f"batch down to {Fraction(self.batch).limit_denominator(1024)}, response cap down to {Fraction(self.length).limit_denominator(1024)}"


@dataclass(frozen=True, order=True)
class JobScale:
    """A reproduction job as divisors of the production job's prompts per step, samples per prompt
    and response length cap (1/1/1: the production job itself)."""

    prompts: int = 1
    samples: int = 1
    length: int = 1

    @property
    def key(self) -> str:
        return f"{self.prompts}/{self.samples}/{self.length}"

    @classmethod
    def from_key(cls, key: str) -> "JobScale":
        p, s, n = (int(v) for v in key.split("/"))
        return cls(p, s, n)

    @property
    def production(self) -> bool:
        return self == JobScale()

    def apply(self, job: Job) -> Job:
        """The production job shrunk: prompts and samples divided, the response cap divided with the
        mean the length model gives the same responses under the lower cap (truncated there)."""
        if self.production:
            return job
        response = job.response_tokens
        if self.length > 1:
            from planner.cost.lengths import LengthModel

            cap = max(1, response.max // self.length)
            model = LengthModel.from_spec(response)
            mean = float((model.pmf_lengths.clip(max=cap) * model.pmf).sum())
            response = Lengths(mean=min(mean, cap), max=cap, shape=response.shape)
        return replace(job, prompts_per_step=job.prompts_per_step // self.prompts, samples_per_prompt=job.samples_per_prompt // self.samples,
                       response_tokens=response)  # fmt: skip

    def columns(self) -> dict[str, float]:
        """The job's shares of the production job, as the calibration dataset's job columns name them."""
        from planner.fidelity.dataset import job_columns

        return job_columns(1 / self.prompts, 1 / self.samples, 1 / self.length)

    def describe(self, job: Job) -> str:
        j = self.apply(job)
        return f"{j.prompts_per_step} x {j.samples_per_prompt}, response <= {j.response_tokens.max} (mean {j.response_tokens.mean:,.0f})"

    def to_json(self, job: Job) -> dict[str, Any]:
        j = self.apply(job)
        return {"prompts_per_step": j.prompts_per_step, "samples_per_prompt": j.samples_per_prompt, "response_max": j.response_tokens.max,
                "response_mean": j.response_tokens.mean, "divisors": {"prompts": self.prompts, "samples": self.samples, "length": self.length},
                "production": self.production}  # fmt: skip


def with_workload(settings: Job, workload: Job) -> Job:
    """`settings` (layouts, recompute, offload, ...) running `workload`'s prompts, samples and lengths;
    without a fixed layout (a layout fixed for one batch says nothing about another)."""
    return replace(settings, train_layout=None, rollout_layout=None, **{f: getattr(workload, f) for f in WORKLOAD})


def _halvings(limit: float) -> list[int]:
    """Divisors 1, 2, 4, ... whose share 1/d is at least `limit`."""
    out, d = [], 1
    while 1 / d >= limit - 1e-12:
        out.append(d)
        d *= 2
    return out


def job_scales(job: Job, bounds: JobBounds, support: dict[str, dict[str, Any]], joint: list[dict[str, Any]] = ()) -> list[JobScale]:
    """The candidate reproduction jobs: each dimension the fidelity data support halves down to its
    bound (and the measured range), the others stay at the production value; a job must keep at
    least one prompt, two samples per prompt where the advantage is normalised within the group
    (GRPO, DAPO), and as many sequences as it has mini-batches. Where a joint-shrink check failed
    (`joint`: the summed extra shifts did not stand for a job shrunk in several dimensions at once),
    one dimension shrinks at a time."""

    def floor(dim: str, bound: float) -> float:
        s = support.get(dim) or {}
        return max(bound, float(s.get("min_share", 0.0))) if s.get("ok") else 1.0

    min_samples = 2 if job.algorithm in ("grpo", "dapo") else 1
    # the production value (divisor 1) always stays, whatever the job; a smaller one must divide it and keep enough
    prompts = [d for d in _halvings(floor("prompts", bounds.batch)) if d == 1 or job.prompts_per_step % d == 0]
    samples = [d for d in _halvings(floor("samples", bounds.batch))
               if d == 1 or (job.samples_per_prompt // d >= min_samples and job.samples_per_prompt % d == 0)]  # fmt: skip
    lengths = [d for d in _halvings(floor("length", bounds.length)) if d == 1 or job.response_tokens.max // d >= 1]
    out = []
    for p in prompts:
        for s in samples:
            if 1 / (p * s) < bounds.batch - 1e-12:
                continue
            if (p, s) != (1, 1) and (job.prompts_per_step // p) * (job.samples_per_prompt // s) < job.mini_batches:
                continue
            out.extend(JobScale(p, s, n) for n in lengths)
    if any(not level["ok"] for level in joint):
        out = [scale for scale in out if sum(d > 1 for d in (scale.prompts, scale.samples, scale.length)) <= 1]
    return out


def run_steps(onset_high: float) -> int:
    """Steps a reproduction runs to see a fault whose onset is at most `onset_high`: past it by 10%,
    at least 2 steps (a detector compares a step with the ones before it)."""
    share, least = ONSET_MARGIN
    return int(math.ceil(onset_high) + max(least, math.ceil(share * onset_high)))


@dataclass(frozen=True)
class Onset:
    """When the fault shows, on the original (at the production job, as the user saw it) and as
    predicted on the proxy, and how many steps each reproduction runs."""

    original: int | None  # the step the original showed the fault at (--fault-step); None: not given
    proxy: float | None  # predicted onset on the proxy
    interval: tuple[float, float] | None
    steps: int  # steps the proxy's reproduction runs
    original_steps: int  # steps the original's would run to see its fault
    basis: str  # where the figures come from, in words

    def to_json(self) -> dict[str, Any]:
        return {"original_step": self.original, "proxy_step": self.proxy, "interval": list(self.interval) if self.interval else None,
                "steps": self.steps, "original_steps": self.original_steps, "basis": self.basis}  # fmt: skip


def onset(fault_step: int | None, ratio: dict[str, Any] | None, default_steps: int, *, original: bool = False) -> Onset:
    """The onset of one plan. With the original's fault step and a measured onset ratio
    (proxy/original on the calibration curves: median and 10-90% range), the proxy's onset is the
    step times the ratio and the reproduction runs past the range's upper end; with the step but no
    ratio the proxy's onset is taken as the original's, and says so; without the step, both run
    `default_steps` (--steps)."""
    if fault_step is None:
        why = (f"the original's fault step is not given (--fault-step, e.g. from `planner detect` on its log): both reproductions are "
               f"priced at {default_steps} steps (--steps)")  # fmt: skip
        return Onset(None, None, None, default_steps, default_steps, why)
    own = run_steps(fault_step)
    if original:
        return Onset(fault_step, float(fault_step), (float(fault_step), float(fault_step)), own, own, "the original's own fault step")
    if not ratio or not ratio.get("ok"):
        why = (ratio or {}).get("reason", "no onset measured for this fault")
        return Onset(fault_step, float(fault_step), (float(fault_step), float(fault_step)), own, own,
                     f"the proxy's onset is taken as the original's: {why}")  # fmt: skip
    lo, mid, hi = (fault_step * ratio[k] for k in ("low", "median", "high"))
    basis = (f"the original's step {fault_step} x the proxy/original onset ratio {ratio['median']:.2f} [{ratio['low']:.2f}, "
             f"{ratio['high']:.2f}] measured on {ratio['rows']} calibration curves ({ratio['where']}; {ratio.get('job', 'at the production job')})")  # fmt: skip
    return Onset(fault_step, mid, (lo, hi), run_steps(max(hi, 1.0)), own, basis)


def split(hours: float, devices: int, steps: int, base_hours: float, base_devices: int, base_steps: int, *, layout: float = 1.0,
          job: float | None = 1.0, step_s: float | None = None) -> dict[str, Any]:  # fmt: skip
    """The reduction of one plan against the baseline, per step and to the fault, as a product of
    mechanisms: fewer devices x the baseline's own layout against the planner's on its devices
    (1 unless the user named a run with a fixed layout) x the smaller job (the original's step on
    the baseline's devices with the baseline's job over its step with this plan's job; None where
    this job does not fit there) x the step time (the rest: fewer experts, this layout) x the
    steps to the fault (the original's steps over this plan's)."""
    per_step = base_hours / hours
    fewer = base_devices / devices
    step = per_step / (fewer * layout * (job or 1.0))
    steps_factor = base_steps / steps
    return {"accelerator_hours": per_step, "reproduction_hours": per_step * steps_factor,
            "by_mechanism": {"fewer_devices": fewer, "layout": layout, "smaller_job": job, "step_time": step, "steps_to_fault": steps_factor,
                             "step_s": step_s, "baseline_step_s": None if step_s is None else step_s * step,
                             "steps": steps, "baseline_steps": base_steps}}  # fmt: skip


def split_text(r: dict[str, Any], unit: str) -> str | None:
    """'12.0x fewer npu-hours to the fault = 4.00 (fewer npus) x 2.00 (smaller job) x 1.50 (step: 300 s
    against 450 s) x 1.00 (steps to the fault: 25 against 25)': every factor shown, each named by
    what it compares, so the line reads against the table."""
    m = r.get("by_mechanism")
    if not m:
        return None
    parts = [f"{m['fewer_devices']:.2f} (fewer {unit}s)"]
    if m["layout"] != 1.0:
        parts.append(f"{m['layout']:.2f} (the baseline's own layout against the planner's on its {unit}s)")
    if m["smaller_job"] is None:
        parts.append(f"{m['step_time']:.2f} (the smaller job, fewer experts and this layout together: this plan's job does not fit the baseline's {unit}s)")
    else:
        parts.append(f"{m['smaller_job']:.2f} (smaller job)")
        against = "the original's step" + (" with this job" if m["smaller_job"] != 1.0 else "") + (
            " at the planner's layout on its devices" if m["layout"] != 1.0 else " on its devices" if m["smaller_job"] != 1.0 else "")
        parts.append(f"{m['step_time']:.2f} (step: this step {m['step_s']:,.0f} s against {against}, {m['baseline_step_s']:,.0f} s: "
                     "fewer experts, this layout)")  # fmt: skip
    parts.append(f"{m['steps_to_fault']:.2f} (steps to the fault: {m['steps']} against the original's {m['baseline_steps']})")
    return f"{r['reproduction_hours']:.2f}x fewer {unit}-hours to the fault ({r['accelerator_hours']:.2f}x per step) = " + " x ".join(parts)
