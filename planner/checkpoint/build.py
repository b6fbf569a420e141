"""Write the proxy checkpoint a plan describes: streamed, sliced, renumbered, verified, atomic.

Every rule is checked before a byte is written. Each source shard becomes at most one output shard
holding its kept tensors: whole tensors and kept expert rows are copied as byte ranges (kernel-side
where the platform allows), so memory stays bounded by one copy chunk and writing never reads a
dropped expert (choosing the plan from statistics reads them all, once; verification loads the
original to compare logits). The result goes to OUT_DIR.tmp and is renamed to OUT_DIR only once it
is complete and has passed verification; an existing OUT_DIR is replaced only with force, and only
when it is an earlier planner build.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from planner import __version__
from planner.arch import config_with_experts
from planner.checkpoint.reader import INDEX_NAME, SINGLE_NAME, Checkpoint, MoELayer
from planner.checkpoint.safetensors import DTYPE_BYTES, NUMPY_DTYPES, OutTensor, Segment, TensorInfo, write_shard
from planner.errors import CheckpointError, PlanError, SpecError
from planner.files import refuse_existing, write_text_atomic
from planner.plan import Plan

__all__ = ["BuildReport", "build", "EXPERT_MAP_NAME"]

log = logging.getLogger(__name__)
EXPERT_MAP_NAME = "expert_map.json"
TMP_MARKER = ".planner-build-in-progress"
_SKIP_FILES = {INDEX_NAME, SINGLE_NAME, "config.json", EXPERT_MAP_NAME}
# weights in other formats are never carried over (a proxy holds only its own safetensors)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".npz")


@dataclass
class BuildReport:
    out_dir: Path
    experts: int
    original_experts: int
    tensors_written: int
    bytes_written: int
    bytes_skipped: int  # dropped experts, not copied (the builder never reads them)
    seconds: float
    warnings: list[str] = field(default_factory=list)
    verification: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "out_dir": str(self.out_dir),
            "experts": self.experts,
            "original_experts": self.original_experts,
            "tensors_written": self.tensors_written,
            "bytes_written": self.bytes_written,
            "bytes_skipped": self.bytes_skipped,
            "seconds": round(self.seconds, 3),
            "warnings": self.warnings,
            "verification": self.verification,
        }


def _slice(info: TensorInfo, dim: int, keep: tuple[int, ...], name: str | None = None) -> OutTensor:
    """The tensor restricted to indices `keep` along `dim`, as byte ranges of the source."""
    shape = info.shape
    if not keep or max(keep) >= shape[dim]:
        raise CheckpointError(f"{info.name}: cannot keep ids up to {max(keep, default=-1)} of dim {dim} in {list(shape)}")
    outer = math.prod(shape[:dim])
    inner = math.prod(shape[dim + 1 :]) * DTYPE_BYTES[info.dtype]
    if inner != int(inner):
        raise CheckpointError(f"{info.name}: cannot slice {info.dtype} along dim {dim}: rows are not whole bytes")
    inner = int(inner)
    segments: list[Segment] = []
    for o in range(outer):
        base = info.begin + o * shape[dim] * inner
        for k in keep:
            start = base + k * inner
            if segments and segments[-1].offset + segments[-1].length == start:
                last = segments.pop()
                segments.append(Segment(info.path, last.offset, last.length + inner))
            else:
                segments.append(Segment(info.path, start, inner))
    new_shape = shape[:dim] + (len(keep),) + shape[dim + 1 :]
    return OutTensor(name or info.name, info.dtype, new_shape, tuple(segments))


def _whole(info: TensorInfo, name: str | None = None) -> OutTensor:
    return OutTensor(name or info.name, info.dtype, info.shape, (Segment(info.path, info.begin, info.nbytes),))


def _settled(sliced: OutTensor, values: tuple[float, ...]) -> OutTensor:
    """The sliced correction bias with the plan's own values (settled after pruning) in its place:
    the same name, shape and dtype."""
    if math.prod(sliced.shape) != len(values) or sliced.dtype not in ("F32", "F64", "F16", "BF16"):
        raise CheckpointError(f"{sliced.name}: {len(values)} settled values cannot replace a {sliced.dtype} tensor of shape "
                              f"{list(sliced.shape)}")  # fmt: skip
    f32 = np.asarray(values, dtype=np.float32)
    if sliced.dtype == "BF16":  # round to nearest even on the upper 16 bits
        bits = f32.view(np.uint32)
        raw = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()
    else:
        raw = f32.astype(np.dtype(NUMPY_DTYPES[sliced.dtype]).newbyteorder("<")).tobytes()
    return OutTensor(sliced.name, sliced.dtype, sliced.shape, data=raw)


def _layer_of(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix + "."):
        return None
    head = name[len(prefix) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _plan_tensors(ckpt: Checkpoint, plan: Plan) -> tuple[dict[str, list[OutTensor]], int]:
    """Output tensors per source shard, and the source bytes left unread."""
    moe_by_name: dict[str, tuple[MoELayer, str]] = {}
    for layer in ckpt.moe_layers.values():
        for ex in layer.experts.values():
            for suffix, t in ex.items():
                moe_by_name[t.name] = (layer, "expert")
        for t in layer.fused.values():
            moe_by_name[t.name] = (layer, "fused")
        for kind in ("router", "router_bias", "correction_bias"):
            t = getattr(layer, kind)
            if t is not None:
                moe_by_name[t.name] = (layer, kind)
    mtp_start = ckpt.arch.num_layers
    out: dict[str, list[OutTensor]] = {}
    skipped = 0
    for shard_name, shard in ckpt.shards.items():
        tensors = []
        for info in sorted(shard.tensors.values(), key=lambda t: t.begin):
            layer_idx = _layer_of(info.name, ckpt.layer_prefix)
            if layer_idx is not None and layer_idx >= mtp_start and plan.mtp == "drop":
                skipped += info.nbytes
                continue
            hit = moe_by_name.get(info.name)
            if hit is None:
                tensors.append(_whole(info))
                continue
            layer, kind = hit
            keep = plan.layers[layer.index]
            if kind == "expert":
                rest = info.name[len(layer.prefix) + len(".experts.") :]
                eid, suffix = rest.split(".", 1)
                if int(eid) in keep:
                    tensors.append(_whole(info, f"{layer.prefix}.experts.{keep.index(int(eid))}.{suffix}"))
                else:
                    skipped += info.nbytes
            elif kind == "correction_bias":
                tensors.append(_slice(info, layer.correction_dim, keep))
                if plan.correction_bias and layer.index in plan.correction_bias:
                    tensors[-1] = _settled(tensors[-1], plan.correction_bias[layer.index])
                skipped += info.nbytes - tensors[-1].nbytes
            else:  # router rows, router bias, fused expert tensors: experts on dim 0
                tensors.append(_slice(info, 0, keep))
                skipped += info.nbytes - tensors[-1].nbytes
        out[shard_name] = tensors
    return out, skipped


def _new_config(ckpt: Checkpoint, plan: Plan) -> dict:
    config = config_with_experts(ckpt.config, plan.experts)
    if plan.mtp == "drop" and any(layer.mtp for layer in ckpt.moe_layers.values()):
        target = config["text_config"] if ckpt.text_wrapper else config
        target["num_nextn_predict_layers"] = 0
    return config


def _expert_map(ckpt: Checkpoint, plan: Plan, report_warnings: list[str]) -> dict:
    return {
        "schema": "planner.expert_map/1",
        "planner_version": __version__,
        "source": {"path": str(ckpt.path), "fingerprint": ckpt.fingerprint()},
        "model": plan.model,
        "original_experts": plan.original_experts,
        "experts": plan.experts,
        "method": plan.method,
        "feature_spec": plan.feature_spec,
        "seed": plan.seed,
        "rule": "kept experts are real (unmerged) original experts renumbered 0..K-1 in ascending original id; "
        "router rows, router biases and correction biases sliced alike"
        + ("; except the correction biases of the layers under correction_bias_settled, settled again after pruning" if plan.correction_bias else ""),
        **({"correction_bias_settled": {
            "layers": sorted(plan.correction_bias),
            "how": "auxiliary-loss-free balancing run on the original's router logits of the calibration text until the kept "
                   "experts' biases stop drifting (planner stats --settle-bias); the plan holds the values",
        }} if plan.correction_bias else {}),  # fmt: skip
        "mtp": {
            "layers": [i for i, layer in ckpt.moe_layers.items() if layer.mtp],
            "choice": plan.mtp if any(layer.mtp for layer in ckpt.moe_layers.values()) else "none (no MTP layer in the checkpoint)",
        },
        "layers": {
            str(i): {
                "kept": list(ids),
                "new_id_of": {str(orig): new for new, orig in enumerate(ids)},
                "labels": list(plan.labels[i]) if plan.labels and i in plan.labels else None,
            }
            for i, ids in sorted(plan.layers.items())
        },
        "plan_sha256": hashlib.sha256(plan.to_yaml().encode()).hexdigest(),
        "warnings": report_warnings,
    }


def _write_atomic_json(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def _side_files(src: Path) -> list[Path]:
    """Tokenizer, generation config, chat template and other small files to carry over: regular
    files (or links to them), never weights in any format nor their indexes."""
    out = []
    for item in sorted(src.iterdir()):
        name = item.name
        if name in _SKIP_FILES or name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json"):
            continue
        if name.startswith("consolidated.") or not item.is_file():  # is_file follows links to files
            continue
        out.append(item)
    return out


def _lock(marker: Path) -> int | None:
    """An exclusive lock on a build's marker file, held by the building process until it ends
    (the OS releases it when the process dies); None when another process holds it."""
    fd = os.open(marker, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _prepare_output(out_dir: Path, src: Path, force: bool) -> tuple[Path, int]:
    """Check OUT_DIR can be (re)placed and make OUT_DIR.tmp, marked as ours and locked: a second
    build into the same OUT_DIR is refused while the first runs, and clears its leftovers if it died."""
    if out_dir == src or src.is_relative_to(out_dir) or out_dir.is_relative_to(src):
        raise SpecError(f"{out_dir} overlaps the source checkpoint {src}; choose a directory outside it")
    if refuse_existing(out_dir, force).exists():
        if not (out_dir / EXPERT_MAP_NAME).is_file():
            raise SpecError(f"{out_dir} exists and is not a planner build (no {EXPERT_MAP_NAME}); not replacing it, even with --force")
    blocking = next((p for p in out_dir.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise SpecError(f"{out_dir}: {blocking} is a file, not a folder; choose an output directory elsewhere")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    busy = SpecError(f"another planner build is writing {out_dir} now ({tmp} is locked); wait for it, or build into another directory")
    if tmp.exists():
        marker = tmp / TMP_MARKER
        if not marker.is_file():
            raise SpecError(f"{tmp} exists and is not an unfinished planner build; move it away first")
        fd = _lock(marker)
        if fd is None:
            raise busy
        os.close(fd)
        shutil.rmtree(tmp)  # a build that died before finishing
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.mkdir()
        (tmp / TMP_MARKER).write_text("planner build in progress\n")
        fd = _lock(tmp / TMP_MARKER)
    except FileExistsError:  # another build made it a moment ago
        raise busy from None
    except BaseException:  # Ctrl-C or SIGTERM before the build's own cleanup is armed: nothing stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if fd is None:
        raise busy
    return tmp, fd


def _swap_in(tmp: Path, out_dir: Path) -> None:
    """Replace OUT_DIR by the finished build; on failure the previous OUT_DIR is restored."""
    (tmp / TMP_MARKER).unlink()
    if not out_dir.exists():
        tmp.rename(out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    old.rmdir()
    out_dir.rename(old)
    try:
        tmp.rename(out_dir)
    except OSError:
        old.rename(out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _import_model_code(model_type: str) -> None:
    """torch, transformers and the family's causal-LM class (its modeling module), imported ahead
    of the check, which reports anything missing itself."""
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    except Exception:  # best effort
        pass


def build(
    ckpt: Checkpoint,
    plan: Plan,
    out_dir: str | Path,
    *,
    force: bool = False,
    verify: str = "auto",
    progress: Callable[[int, int], None] | None = None,
) -> BuildReport:
    """Build the proxy into `out_dir`. `verify`: auto (run the proxy layer by layer in transformers,
    and the original too for a keep-all plan, whose logits must be bit-identical), always (the
    original too for every plan: the KL between them), never (structural checks run in every case)."""
    start = time.perf_counter()
    out_dir = Path(out_dir).expanduser().resolve()
    if plan.deferred:
        raise PlanError(f"the plan keeps K={plan.experts} by {plan.method} but names no experts yet; choose them first "
                        "(planner build --plan resolves such a plan against the checkpoint)")  # fmt: skip
    warnings = plan.check(ckpt.arch, list(ckpt.moe_layers))
    if plan.checkpoint_fingerprint and plan.checkpoint_fingerprint != ckpt.fingerprint():
        raise PlanError(
            f"the plan was made for checkpoint {plan.checkpoint_fingerprint[:12]}..., this one is "
            f"{ckpt.fingerprint()[:12]}...; make the plan again from this checkpoint"
        )
    tmp, lock = _prepare_output(out_dir, ckpt.path.resolve(), force)
    try:  # from here on an interrupt (even while the import thread starts) removes OUT_DIR.tmp
        importing = threading.Thread(target=_import_model_code, args=(ckpt.arch.model_type,), daemon=True)
        if verify != "never":  # the check's imports (seconds) overlap the writing instead of following it
            importing.start()
        per_shard, skipped = _plan_tensors(ckpt, plan)
        non_empty = [(name, ts) for name, ts in per_shard.items() if ts]
        total = sum(t.nbytes for _, ts in non_empty for t in ts)
        written = 0
        weight_map: dict[str, str] = {}
        for i, (_, tensors) in enumerate(non_empty):
            name = SINGLE_NAME if len(non_empty) == 1 else f"model-{i + 1:05d}-of-{len(non_empty):05d}.safetensors"
            written += write_shard(tmp / name, tensors, {"format": "pt"})
            weight_map.update({t.name: name for t in tensors})
            if progress:
                progress(written, total)
        if len(non_empty) > 1:
            _write_atomic_json(tmp / INDEX_NAME, {"metadata": {"total_size": written}, "weight_map": weight_map})
        _write_atomic_json(tmp / "config.json", _new_config(ckpt, plan))
        for item in _side_files(ckpt.path):
            shutil.copyfile(item, tmp / item.name)  # follows links: the proxy holds real files

        proxy = Checkpoint(tmp)  # structural verification: headers, index, shapes and counts vs config
        if proxy.arch.moe.num_experts != plan.experts or any(l.num_experts != plan.experts for l in proxy.moe_layers.values()):
            raise CheckpointError(f"{tmp}: the written checkpoint does not hold {plan.experts} experts per MoE layer")
        verification = {"structure": "ok"}
        if verify == "never":
            verification["load"] = "skipped (verify=never)"
        else:  # layer by layer in the checkpoint's dtype: bounded memory at any size
            importing.join()  # no import races the one under way
            from planner.checkpoint.verify import verify_proxy

            # auto: where it proves the copy exact (a keep-all plan with its biases as they were)
            compare = verify == "always" or (plan.experts == plan.original_experts and not plan.correction_bias)
            verification.update(verify_proxy(ckpt.path, tmp, plan, num_layers=ckpt.arch.num_layers, compare=compare))
        emap = _expert_map(ckpt, plan, warnings)
        emap["verification"] = verification
        _write_atomic_json(tmp / EXPERT_MAP_NAME, emap)
        _swap_in(tmp, out_dir)
    except BaseException:  # an error, Ctrl-C or SIGTERM (the CLI turns it into KeyboardInterrupt): nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
    return BuildReport(
        out_dir=out_dir,
        experts=plan.experts,
        original_experts=plan.original_experts,
        tensors_written=len(weight_map),
        bytes_written=written,
        bytes_skipped=skipped,
        seconds=time.perf_counter() - start,
        warnings=warnings,
        verification=verification,
    )
