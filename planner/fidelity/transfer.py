"""Scale transfer: does a label measured on a 64-wide, 3-layer model hold for a wider, deeper one?

The calibration families are small. The method's claim (a proxy reproduces the original's fault at
full scale) is the transfer of their labels to the real width and depth, so it is measured, not
assumed: for a routing shape, the same plan rule (a clustered plan at one K/E) is measured with the
grid's labels at several widths and depths (`benchmarks/scale_transfer.py`, points in
calibration/transfer.json). Per (recipe, shape) the signed shift is fitted as

    shift = a + b log2(hidden / 64) + c log2(layers / 3) [+ d log2(steps / 300)]   (weighted least squares)
              [+ (e + f log2(hidden / 64)) log2(K/E / 0.25)]

and b and c are reported with their 90% intervals. Where points of more than one plan rule exist,
each rule has its own label at the calibration scale (e) and its own width slope (b + f per doubling
of K/E; a rule at one width has none and borrows b), measured up to its own widest point; depth and
training length share one slope. A term enters only where the exact points identify it, so one
rule's points fit the first line alone. Every scale is trained for the grid's 300 dense and 300 MoE
steps unless a point says otherwise; where points at other training lengths exist, d
separates training length from width (models of every width trained for the same steps are not
equally far into training), and b is the width's effect at the grid's length. A point's error is its
margin seeds' standard error and, beyond it, the spread between independently trained originals at
one scale (a model seed moves a label by as much as the grid's originals differ), so each point is
weighted by 1/(se^2 + tau^2) with tau^2 the between-original variance left after the fit, estimated
from the points themselves by the Paule-Mandel equation (the generalised Q statistic equal to its
degrees of freedom) as a random-effects meta-regression does; the slopes' covariance is never scaled
below that model's (Knapp-Hartung, floored at 1). Weighting by 1/se^2 alone would let the points
with small margin-seed errors steer the slopes although their originals are no more typical.

The estimator asks `widening` where a target's label lies and how much its interval must widen.
Where a width or depth slope's interval excludes zero and the fitted trend predicts each point off
the calibration scale, fitted without it, better than the calibration scale's label does
(`_holdout`), a plan at a K/E measured at two widths or more is predicted along its rule's trend to
the target, or to the measured edge where the target lies beyond it; a plan at another K/E stays at
its label, its interval taking the nearest measured rule's change; otherwise it stays at the
calibration scale's label and the interval takes the fitted change. The interval widens by the
fitted change's own interval within the measured widths and depths and, beyond them, by the distance
times the slopes at the far ends of their intervals; the output says how far beyond the data the
target lies. The target is taken at the grid's training length. A (recipe, shape) without points
says "transfer not measured beyond hidden 64"; one with too few points for a slope says where they
lie; either borrows the interval's widening (not the label's move) from the nearest measured shape
(`nearest_fit`) and says so, since a scale with no measured trend is not one where the label is
known to hold. A censored point (some margin seed found no crossing inside the knob's bracket) is a bound on its
shift, not a value: the benchmark records which way it points (`bound`: "lower" where the original
faults already at the bracket's floor or the proxy never faults inside it, "upper" the other way
round), and the fit takes it as such, a Tobit term P(shift beyond the bound) in the likelihood
beside the exact points' normal terms, with tau^2 from the exact points alone. With no bounds this is
the weighted least squares above. Censored points without a recorded direction are left out.

Fitting needs statsmodels; what the estimator stores (slopes, covariance, measured ranges) is
JSON and is applied with numpy alone.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from planner.families import BUILT, TRAINED

__all__ = ["TRANSFER_SCHEMA", "load_points", "fit_transfer", "fit_key", "fit_build", "widening", "nearest_fit", "default_transfer_path", "between_variance",
           "AXES", "BASE_HIDDEN", "BASE_LAYERS", "BASE_STEPS", "BASE_KEPT", "BOUNDS", "censored_bound", "slope",
           "slopes_text", "balanced_text"]

TRANSFER_SCHEMA = "planner.transfer/1"
BASE_HIDDEN, BASE_LAYERS, BASE_STEPS = 64, 3, 300  # the calibration families' scale and training length
# the fit's directions: name, the point's field, its base, and the words for it
AXES = (("log2_hidden", "hidden", BASE_HIDDEN, "width"), ("log2_layers", "layers", BASE_LAYERS, "depth"),
        ("log2_steps", "steps", BASE_STEPS, "training length"))  # fmt: skip
LEVEL = 0.90
BOUNDS = {"lower": 1.0, "upper": -1.0}  # a censored point's true shift lies above (lower bound) or below its value
BASE_KEPT = 0.25  # the plan rule the transfer was first measured with: a clustered plan keeping a quarter of the experts
# the plan rule's own terms beside the axes: its label at the calibration scale, and how its width slope differs from
# BASE_KEPT's (per doubling of K/E); depth and training length share one slope across rules
RULE = ("log2_kept", "log2_hidden:kept")
TERMS = ("intercept", *(name for name, *_ in AXES), *RULE)


def default_transfer_path() -> Path:
    from importlib import resources

    return Path(str(resources.files("planner._calibration"))) / "transfer.json"


def load_points(path: str | Path | None = None) -> list[dict]:
    """The measured points (empty where the file does not exist yet)."""
    from planner.files import read_records

    return read_records(path if path is not None else default_transfer_path(), "scale-transfer file", TRANSFER_SCHEMA, "points")


def _usable(points: Iterable[dict]) -> list[dict]:
    """Points with a finite shift: exact ones, and censored ones whose bound's direction is recorded."""
    return [p for p in points if p.get("shift_log2") is not None and math.isfinite(p["shift_log2"])
            and (not p.get("censored") or p.get("bound") in BOUNDS)]  # fmt: skip


def censored_bound(original: tuple[list[float], list[bool]], proxy: tuple[list[float], list[bool]], lo: float, hi: float) -> str | None:
    """Which way a censored point's shift (proxy knob - original knob) points, from each side's
    per-seed (critical knob, censored) and the recipe's bracket [lo, hi]: a censored seed sits at the
    end where it stopped, and its true knob lies beyond that end. An original at lo or a proxy at hi
    makes the true shift larger ("lower": the value is a lower bound), an original at hi or a proxy
    at lo smaller ("upper"); both directions at once, or nothing censored, give None."""
    ways = set()
    for (values, censored), sign in ((original, -1.0), (proxy, 1.0)):
        for v, c in zip(values, censored):
            if c:  # the side's knob is overstated at lo and understated at hi
                at_lo = abs(v - lo) <= abs(v - hi)
                ways.add("lower" if at_lo == (sign < 0) else "upper")
    return ways.pop() if len(ways) == 1 else None


def fit_key(recipe: str, shape: str, balancing: str = "none", build: str = "sliced") -> str:
    """The name of a fit: "recipe|shape", "|published" for points on originals trained with the
    shape's published load balancing, "|settled" for points whose proxies' correction bias was
    settled again (each fitted apart)."""
    return f"{recipe}|{shape}" + ("" if balancing == "none" else f"|{balancing}") + ("" if build == "sliced" else f"|{build}")


def _made(point: dict) -> tuple[str, str]:
    """How the point's originals were trained (planner.rl.models.ModelRecipe.balancing) and its proxy
    built (planner.plan.PROXY_BUILDS): points of originals trained with their published load
    balancing, or of settled proxies, are fitted apart (`fit_key`), and the estimator reads the fit
    of originals trained, and proxies built, as a calibration family's were (`fit_build`)."""
    return point.get("balancing") or "none", point.get("proxy_build") or "sliced"


def fit_build(fits: dict[str, dict[str, Any]], recipe: str, shape: str, balancing: str = "none", build: str = "sliced") -> str:
    """The proxy build whose trend a family of `build` proxies reads: its own where one is fitted
    along every direction (width, depth, training) the sliced proxies' is, else the sliced proxies'
    (the output then says so)."""
    own, sliced = fits.get(fit_key(recipe, shape, balancing, build)), fits.get(fit_key(recipe, shape, balancing))

    def directions(entry: dict | None) -> set[str]:  # the scale axes it has a slope along (plan rules aside)
        return {name for name, *_ in AXES if (entry or {}).get("interval", {}).get(name) is not None}

    return build if own is not None and own.get("fitted") and directions(own) >= directions(sliced) else "sliced"


def _fittable(at: list[dict]) -> list[dict]:
    """The exact points, and the bounds at the scale (and plan rule) of the exact points along every
    axis they do not vary along: a bound alone on an axis would pull that slope without limit."""
    exact = [p for p in at if not p.get("censored")]
    if not exact:
        return []
    fields = [(field, base) for _, field, base, _ in AXES] + [("kept_fraction", BASE_KEPT)]  # the plan rule, too
    flat = [(field, base, exact[0].get(field) or base) for field, base in fields if len({p.get(field) or base for p in exact}) == 1]
    bounds = [p for p in at if p.get("censored") and all((p.get(field) or base) == value for field, base, value in flat)]
    return exact + bounds


def fit_transfer(points: list[dict], tau2: Callable[[np.ndarray, np.ndarray, np.ndarray], float] | None = None,
                 holdout: bool = True) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per "recipe|shape": the fitted slopes in log2 width, depth and training length with their
    intervals, the covariance of (a, b, c, d), the scales measured, and the fit's held-out test
    (`_holdout`). A slope whose direction has a single measured value is not fitted (it stays 0
    with no interval, and `widening` treats any distance along it as unmeasured). `tau2(y, x,
    variance)` estimates the between-original variance (Paule-Mandel, `between_variance`, unless
    another is given); `holdout=False` skips the held-out test (one refit per point), which only
    `widening` reads."""
    tau2 = tau2 or between_variance
    out: dict[str, dict[str, Any]] = {}
    usable = _usable(points)
    for recipe, shape, made in sorted({(p["recipe"], p["shape"], _made(p)) for p in usable}):
        at = _fittable([p for p in usable if (p["recipe"], p["shape"], _made(p)) == (recipe, shape, made)])
        if not at:  # bounds alone: nothing measured to fit them to
            continue
        rule = lambda p: round(float(p.get("kept_fraction") or BASE_KEPT), 4)  # noqa: E731
        widths = {k: {p.get("hidden") for p in at if rule(p) == k and not p.get("censored")} for k in {rule(p) for p in at}}
        entry: dict[str, Any] = {"recipe": recipe, "shape": shape, "points": len(at), "originals": len({p["original"] for p in at}),
                                 "kept_fraction": sorted(widths), "trend_rules": sorted(k for k, w in widths.items() if len(w) > 1),
                                 "rule_hidden": {f"{k:g}": sorted(int(h or BASE_HIDDEN) for h in w) for k, w in sorted(widths.items())},
                                 **{field: sorted({int(p.get(field) or base) for p in at}) for _, field, base, _ in AXES}, **_fit(at, tau2)}  # fmt: skip
        if entry["fitted"] and holdout:
            entry["holdout"] = _holdout(at, tau2)
        if made != ("none", "sliced"):  # read beside the grid originals' fit, not instead of it: its points as measured
            entry["measured"] = [{"hidden": int(p.get("hidden") or BASE_HIDDEN), "layers": int(p.get("layers") or BASE_LAYERS),
                                  "kept_fraction": rule(p), "shift": round(float(p["shift_log2"]), 3), "se": round(float(p["shift_se"]), 3),
                                  "bound": p.get("bound") if p.get("censored") else None}
                                 for p in sorted(at, key=lambda p: (rule(p), p.get("hidden") or 0, p.get("layers") or 0, p["original"]))]  # fmt: skip
        out[fit_key(recipe, shape, *made)] = entry | {"balancing": made[0], "build": made[1]}
    return out


def balanced_text(fits: dict[str, dict[str, Any]], recipe: str, shape: str) -> str:
    """The points measured on originals trained with the shape's published load balancing (the grid's
    were trained without), as measured, and their fitted width slope where they have one; empty
    where there are none."""
    entry = fits.get(fit_key(recipe, shape, "published"))
    if not entry or not entry.get("measured"):
        return ""
    rules = sorted({m["kept_fraction"] for m in entry["measured"]})
    parts = []
    for k in rules:
        at = [m for m in entry["measured"] if m["kept_fraction"] == k]
        shown = ", ".join(f"{'>=' if m['bound'] == 'lower' else '<=' if m['bound'] == 'upper' else ''}{m['shift']:+.2f} at hidden {m['hidden']}"
                          + (f" / {m['layers']} layers" if m["layers"] != BASE_LAYERS else "") for m in at)  # fmt: skip
        parts.append(f"K/E {k:g}: {shown}")
    slope_said = f"; width slope {', '.join(slopes_text(entry, 2, skip=('depth', 'training length')))}" if entry.get("fitted") else ""
    return (f"on originals trained {TRAINED['published']}, which start near balanced, the shift measures "
            f"{'; '.join(parts)} ({plural(entry['points'], 'point')}{slope_said})")  # fmt: skip


def _columns(at: list[dict]) -> dict[str, np.ndarray]:
    """Every term's column for the points: the intercept, log2 of each axis over its base, and the plan
    rule's log2(K/E / BASE_KEPT) alone and times log2 width."""
    axis = {name: np.log2(np.array([p.get(field) or base for p in at], dtype=float) / base) for name, field, base, _ in AXES}
    kept = np.log2(np.array([p.get("kept_fraction") or BASE_KEPT for p in at], dtype=float) / BASE_KEPT)
    return {"intercept": np.ones(len(at)), **axis, "log2_kept": kept, "log2_hidden:kept": axis["log2_hidden"] * kept}


def _fit(at: list[dict], tau2: Callable[[np.ndarray, np.ndarray, np.ndarray], float]) -> dict[str, Any]:
    """The weighted meta-regression of one (recipe, shape)'s points (`_fittable`'s) on the terms the
    exact points identify (a term enters where it adds to the rank: an axis measured at one value, or
    one plan rule, has none); censored points enter as bounds (`_tobit`)."""
    import statsmodels.api as sm

    column = _columns(at)
    side = np.array([BOUNDS[p["bound"]] if p.get("censored") else 0.0 for p in at])
    exact = side == 0
    names: list[str] = []
    for name in TERMS:
        if exact.any() and np.linalg.matrix_rank(np.column_stack([column[n][exact] for n in (*names, name)])) > len(names):
            names.append(name)
    x = np.column_stack([column[name] for name in names])
    n_exact, bounds = int(exact.sum()), len(at) - int(exact.sum())
    if n_exact <= x.shape[1]:
        also = f" (and {plural(bounds, 'bound')})" if bounds else ""
        return {"fitted": False, "reason": f"{plural(n_exact, 'point')}{also} for {plural(x.shape[1], 'coefficient')}: a slope needs "
                                           "more points than coefficients, at two widths or depths at least"}  # fmt: skip
    y = np.array([p["shift_log2"] for p in at])
    variance = np.array([max(float(p.get("shift_se") or 0.0), 0.05) ** 2 for p in at])
    between = tau2(y[exact], x[exact], variance[exact])
    fit = sm.WLS(y[exact], x[exact], weights=1.0 / (variance[exact] + between)).fit()
    params, info = np.asarray(fit.params), np.linalg.inv(fit.normalized_cov_params)
    if bounds:
        params, info = _tobit(y, x, variance + between, side, params)
    # Knapp-Hartung from the exact points' residuals, never narrower than the random-effects model
    residual = y[exact] - x[exact] @ params
    dof = float(n_exact - x.shape[1])
    scale = max(float(np.sum(residual**2 / (variance[exact] + between))) / dof, 1.0)
    cov_fit, t = np.linalg.inv(info) * scale, _t(dof)
    coef = {n: float(v) for n, v in zip(names, params)}
    half = t * np.sqrt(np.diag(cov_fit))
    interval = {n: [float(v - h), float(v + h)] for n, v, h in zip(names, params, half)}
    cov = np.zeros((len(TERMS), len(TERMS)))
    index = [TERMS.index(n) for n in names]
    cov[np.ix_(index, index)] = cov_fit
    return {"fitted": True, "coef": {n: coef.get(n, 0.0) for n in TERMS}, "interval": {n: interval.get(n) for n in TERMS},
            "cov": cov.tolist(), "dof": dof, "t": t, "tau": math.sqrt(between), "bounds": bounds,
            "residual_sd": float(np.sqrt(np.sum(residual**2 / variance[exact]) / dof))}  # fmt: skip


def _tobit(y: np.ndarray, x: np.ndarray, s2: np.ndarray, side: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maximum likelihood of the coefficients with known variances s2 where some points are bounds
    (side +1: the true value is at least y; -1: at most y; 0: y itself), and its information matrix.
    Exact points add log N(y; x b, s2); a bound adds log P(beyond y), the normal's tail. The
    log-likelihood is concave in b, so Newton's method from the exact points' fit converges (halving
    a step that would lower it)."""
    from scipy.stats import norm

    s = np.sqrt(s2)

    def terms(b: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        mean = x @ b
        z = side * (mean - y) / s  # how far the mean lies on the bound's side, in SDs: the tail's log P is log Phi(z)
        mills = np.exp(norm.logpdf(z) - norm.logcdf(z))
        ll = np.where(side == 0, norm.logpdf(y, mean, s), norm.logcdf(z))
        slope = np.where(side == 0, (y - mean) / s2, side * mills / s)  # d log-likelihood / d mean
        curve = np.where(side == 0, 1.0 / s2, mills * (mills + z) / s2)  # - d2 log-likelihood / d mean2
        return float(ll.sum()), x.T @ slope, (x * curve[:, None]).T @ x

    b = np.asarray(start, dtype=float)
    ll, grad, info = terms(b)
    for _ in range(100):
        step = np.linalg.solve(info, grad)
        while True:
            new = terms(b + step)
            if new[0] >= ll - 1e-12 or np.max(np.abs(step)) < 1e-12:
                break
            step = step / 2
        b = b + step
        ll, grad, info = new
        if np.max(np.abs(step)) < 1e-10:
            break
    return b, info


def _holdout(at: list[dict], tau2: Callable[[np.ndarray, np.ndarray, np.ndarray], float]) -> dict[str, Any] | None:
    """Each point off the calibration scale predicted by the fit of the others: at the calibration
    scale's label for its plan rule (what a prediction that ignores the trend says) and moved along the
    fitted slopes to the point's scale. Mean absolute errors of both; None where no point is off the
    calibration scale or no fit without one has slopes."""
    base, moved = [], []
    for i, p in enumerate(at):
        v = {name: float(c[0]) for name, c in _columns([p]).items()}
        if not any(v[name] for name, *_ in AXES) or p.get("censored"):  # a bound is no value to predict; it stays in the others' fits
            continue
        fit = _fit(_fittable(at[:i] + at[i + 1 :]), tau2)
        if not fit["fitted"] or any(v[name] and fit["interval"][name] is None for name in TERMS):
            continue
        label = sum(fit["coef"][name] * v[name] for name in ("intercept", "log2_kept"))
        base.append(abs(p["shift_log2"] - label))
        moved.append(abs(p["shift_log2"] - sum(fit["coef"][name] * v[name] for name in TERMS)))
    if not base:
        return None
    return {"points": len(base), "mae_base": float(np.mean(base)), "mae_moved": float(np.mean(moved))}


def between_variance(y: np.ndarray, x: np.ndarray, variance: np.ndarray) -> float:
    """The between-original variance tau^2 of a meta-regression of y on x with known within-point
    variances (Paule-Mandel): the tau^2 at which the weighted residual sum of squares equals its
    degrees of freedom, 0 where the points scatter no more than their own errors say."""
    from scipy.optimize import brentq

    dof = len(y) - x.shape[1]

    def excess(tau2: float) -> float:
        w = 1.0 / (variance + tau2)
        beta = np.linalg.lstsq(x * np.sqrt(w)[:, None], y * np.sqrt(w), rcond=None)[0]
        return float(np.sum(w * (y - x @ beta) ** 2)) - dof

    if dof <= 0 or excess(0.0) <= 0:
        return 0.0
    top = float(np.var(y)) + float(variance.max()) + 1.0
    while excess(top) > 0:  # Q falls towards 0 as tau^2 grows, so a bracket exists
        top *= 4
    return float(brentq(excess, 0.0, top, xtol=1e-10))


def widening(fits: dict[str, dict[str, Any]], recipe: str, shape: str, hidden: int | None, layers: int | None,
             kept_fraction: float | None = None, balancing: str = "none", build: str = "sliced") -> dict[str, Any]:  # fmt: skip
    """Where a prediction at (hidden, layers) for (recipe, shape) and a plan keeping `kept_fraction`
    of the experts lies along the measured trend (`shift`), how much its shift interval must widen
    (log2 units), and the words for it: the trend of originals trained as `balancing` says (those of
    a calibration family trained with the published balancing read the points fitted apart)."""
    entry = fits.get(fit_key(recipe, shape, balancing, build))
    target = f"hidden {hidden}, {layers} layers" if hidden else "the target"
    on = ("" if balancing == "none" else f" on originals trained {TRAINED[balancing]}") + ("" if build == "sliced" else f" {BUILT[build]}")
    if entry is None or not entry.get("fitted"):
        if entry is None:
            said = f"transfer not measured beyond hidden {BASE_HIDDEN}{on}"
        else:  # points too few for a slope: where they lie, and why no slope
            said = (f"transfer{on} not fitted (points at hidden {', '.join(map(str, entry['hidden']))} and "
                    f"{', '.join(map(str, entry['layers']))} layers; {entry['reason']})")  # fmt: skip
        out = {"halfwidth": None, "measured": False, "text": f"{said}: {target} is outside the calibrated scale"}
        other = nearest_fit(fits, recipe, shape, balancing, build) if hidden and layers else None
        if other is None:
            return out
        # no trend of its own: the label stays at hidden 64's, and the interval takes the change the nearest measured
        # shape's trend allows at the target (its fitted change and, beyond its data, its slopes' far ends)
        there = widening(fits, recipe, other, hidden, layers, kept_fraction, balancing, build)
        if there["halfwidth"] is None:
            return out
        half = there["halfwidth"] + abs(there.get("shift") or 0.0)
        return out | {"halfwidth": half, "borrowed": other,
                      "text": out["text"] + f"; interval widened by {half:.2f} log2, as the transfer of the nearest measured shape ({other}) "
                                            f"widens it there (assumed, not measured, for this shape)"}  # fmt: skip
    if hidden is None or layers is None:
        return {"halfwidth": None, "measured": True, "text": "target scale unknown"}
    # the target is taken at the grid's training length: its own (trillions of tokens) is on no scale the grid measures
    distance = {"log2_hidden": math.log2(hidden / BASE_HIDDEN), "log2_layers": math.log2(layers / BASE_LAYERS), "log2_steps": 0.0}
    rules = entry.get("kept_fraction") or [BASE_KEPT]
    kappa = _kappa(rules, kept_fraction)
    # a rule's own widths bound its width trend (the fit's terms for it are measured there); depth and training are shared
    own = (entry.get("rule_hidden") or {}).get(f"{round(BASE_KEPT * 2**kappa, 4):g}") or entry["hidden"]
    inside, far = {}, {}
    for name, field, base, _ in AXES:
        d, measured = distance[name], (own if field == "hidden" else entry.get(field)) or [base]
        top = math.log2(max(measured) / base)
        if entry["interval"].get(name) is None and d != 0:
            return {"halfwidth": None, "measured": False, "text": f"transfer in {field} not measured ({target})"}
        inside[name] = min(d, top)  # the fitted change up to the measured scale ...
        if d > top:  # ... and beyond it the slope (at the target's plan rule) at the far end of its interval
            far[name] = (d - top) * max(abs(end) for end in slope(entry, name, kappa)[1])
    names = list(entry["coef"])  # as the covariance is ordered
    v = sum(inside[name] * _rule_vector(names, name, kappa) for name, *_ in AXES)  # each axis's change at the target's rule
    cov = np.array(entry["cov"])
    change = float(np.dot([entry["coef"][n] for n in names], v))
    half = float(entry["t"] * math.sqrt(max(v @ cov @ v, 0.0)))
    spread = half + sum(far.values())
    beyond = f", beyond the measured hidden {max(own)} / {max(entry['layers'])} layers" if far else ""
    # a slope whose interval excludes zero: the calibration scale's label is measured not to hold at another scale
    at_rule = {what: slope(entry, name, kappa) for name, _, _, what in AXES}
    moves = [what for what, sl in at_rule.items() if sl is not None and (sl[1][0] > 0 or sl[1][1] < 0)]
    # where width or depth moves the label and the fitted trend predicts held-out points better than the calibration
    # scale's label does, the prediction follows the trend to the target (or the measured edge) instead of staying put
    # the trend is measured for the plan rules (K/E) in the points: a plan keeping another share of the experts may move otherwise
    # (a rule measured at one width has its own label but borrows the others' width slope: it is not followed)
    held, measured_rules = entry.get("holdout"), entry.get("trend_rules", rules)
    same_rule = kept_fraction is not None and any(math.isclose(kept_fraction, k, abs_tol=1e-3) for k in measured_rules)
    trend = bool({"width", "depth"} & set(moves)) and held is not None and held["mae_moved"] < held["mae_base"]
    follows = trend and same_rule
    shift = change if follows else 0.0
    halfwidth = spread if follows else abs(change) + spread
    slopes = [f"slope {text}" for text in slopes_text(entry, 2, BASE_KEPT * 2**kappa if len(rules) > 1 else None, skip=("depth",))]
    said = "; ".join(slopes) if entry["interval"].get("log2_hidden") else "; ".join(["one width", *slopes])
    moving = f"; the label moves with {' and '.join(moves)} on this shape" if moves else ""
    lengths = entry.get("steps") or [BASE_STEPS]
    trained = f" and {lengths[0]}-{lengths[-1]} training steps" if len(lengths) > 1 else ""
    if "training length" in moves:  # a real model's pretraining is on no scale the grid measures: say what the P assumes
        moving += f", so P holds for an original trained as long as the grid's ({BASE_STEPS} steps), not beyond"
    read = ""
    if trend and not same_rule and kept_fraction is not None:
        read = (f"; the trend is measured for plans keeping {' or '.join(f'{k:g}' for k in measured_rules)} of the experts, not "
                f"{kept_fraction:g}: the label stays at hidden {BASE_HIDDEN}'s")
    if follows:
        edge = f"hidden {round(BASE_HIDDEN * 2 ** inside['log2_hidden'])}, {round(BASE_LAYERS * 2 ** inside['log2_layers'])} layers"
        read = (f"; the label follows the fitted trend by {shift:+.2f} log2 to {edge} (held out over {plural(held['points'], 'point')}: "
                f"MAE {held['mae_moved']:.2f} along the trend against {held['mae_base']:.2f} at hidden {BASE_HIDDEN}'s label)")  # fmt: skip
    balanced = balanced_text(fits, recipe, shape) if balancing == "none" else ""  # the balanced points beside the trend it follows
    return {"halfwidth": halfwidth, "shift": shift, "measured": True, "change": change, "moves_with": moves,
            "text": (f"transfer{on} measured at hidden {', '.join(map(str, entry['hidden']))} and {', '.join(map(str, entry['layers']))} "
                     f"layers{trained} ({said}{moving}); {target}{beyond}{read}: interval widened by {halfwidth:.2f} log2"
                     + (f"; {balanced}" if balanced else ""))}  # fmt: skip


def nearest_fit(fits: dict[str, dict[str, Any]], recipe: str, shape: str, balancing: str = "none", build: str = "sliced") -> str | None:
    """The measured routing shape nearest `shape` (a fitted trend of `recipe` on originals trained as
    `balancing` says, proxies built as `build` says): the same scoring function first, then the most
    routing traits in common (top-k of E, renormalisation, groups, correction bias, shared experts,
    ...); a tie takes the shape listed first. None where no other shape's trend of the recipe is
    fitted."""
    parts = shape.split("/")
    scoring = parts[0].split("_")[0]

    def nearness(other: str) -> tuple[int, int]:
        theirs = other.split("/")
        return int(theirs[0].split("_")[0] == scoring), len(set(parts[1:]) & set(theirs[1:]))

    shapes = [e["shape"] for e in fits.values() if e.get("fitted") and e["recipe"] == recipe and e["shape"] != shape
              and (e.get("balancing", "none"), e.get("build", "sliced")) == (balancing, build)]
    return max(shapes, key=nearness) if shapes else None


def _kappa(rules: list[float], kept_fraction: float | None) -> float:
    """A plan rule as log2(K/E / BASE_KEPT), held within the measured rules (BASE_KEPT's where none is given)."""
    measured = [math.log2(k / BASE_KEPT) for k in rules]
    k = math.log2(kept_fraction / BASE_KEPT) if kept_fraction else 0.0
    return min(max(k, min(measured)), max(measured))


def _rule_vector(names: list[str], name: str, kappa: float) -> np.ndarray:
    """The coefficients' combination that is an axis's slope for the plan rule kappa: the axis's own
    and, for width, kappa times the rule's width term."""
    return np.array([1.0 if n == name else kappa if (name, n) == ("log2_hidden", "log2_hidden:kept") else 0.0 for n in names])


def slope(entry: dict[str, Any], name: str, kappa: float = 0.0) -> tuple[float, tuple[float, float]] | None:
    """An axis's fitted slope (log2 per doubling) for the plan rule log2(K/E / BASE_KEPT) = kappa, with
    its 90% interval; None where the axis was not fitted."""
    if entry["interval"].get(name) is None:
        return None
    names = list(entry["coef"])
    g = _rule_vector(names, name, kappa)
    value = float(g @ np.array([entry["coef"][n] for n in names]))
    half = float(entry["t"] * math.sqrt(max(g @ np.array(entry["cov"]) @ g, 0.0)))
    return value, (value - half, value + half)


def slopes_text(entry: dict[str, Any], digits: int = 3, kept: float | None = None, skip: tuple[str, ...] = ()) -> list[str]:
    """Each fitted slope with its 90% interval: the width slope once per plan rule measured along
    width, or for the rule `kept` alone; the axes named in `skip` ("depth", ...) left out."""
    every = entry.get("trend_rules") or [BASE_KEPT]
    rules = every if kept is None else [kept]
    out = []
    for name, _, _, what in AXES:
        for k in rules if name == "log2_hidden" else [BASE_KEPT]:
            if what not in skip and (sl := slope(entry, name, math.log2(k / BASE_KEPT))) is not None:
                rule = f" at K/E {k:g}" if name == "log2_hidden" and (len(every) > 1 or kept not in (None, *every)) else ""
                out.append(f"{sl[0]:+.{digits}f} [{sl[1][0]:+.{digits}f}, {sl[1][1]:+.{digits}f}] log2 per doubling of {what}{rule}")
    return out


def _t(dof: float) -> float:
    from scipy.stats import t

    return float(t.ppf((1 + LEVEL) / 2, max(dof, 1.0)))


def plural(n: int, noun: str) -> str:
    """'1 point', '3 points'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
