"""Run transformers' own model over a checkpoint, one decoder layer in memory at a time.

The model is built on the meta device; embeddings, final norm and head are loaded up front; each
decoder layer is loaded from the checkpoint just before its forward (a forward pre-hook) and sent
back to meta just after (a forward hook), so peak memory is about one layer plus activations. On-disk
names map to the in-memory modules through the family data (per-expert tensors stacked into
transformers 5's fused gate_up_proj / down_proj). Held in float32 by default, or in the checkpoint's
own dtype (`dtype`); a tensor stored as its parameter holds it (same dtype and size) is a private
mapping of the file's pages, no copy, and the others (fused experts, casts) are read into a reused
block of memory.
Every on-disk tensor read is recorded (`read`), so a caller can tell which ones the model never used.

Hooks on each MoE block see the block's input and output and can replace the output; `route` and
`expert_outputs` evaluate a loaded block's router and experts on any tokens: what the statistics need.
"""

from __future__ import annotations

import inspect
import mmap
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

from planner.checkpoint.reader import Checkpoint
from planner.errors import CheckpointError
from planner.hf import require_torch

__all__ = ["LayerwiseModel", "MoECall", "NATIVE_DTYPES"]

NATIVE_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}  # safetensors dtypes torch holds as they are


@dataclass
class MoECall:
    """One MoE block's routing of some tokens: router logits, top-k ids and their weights."""

    logits: Any
    topk_ids: Any
    topk_weights: Any


def _numel(info) -> int:
    n = 1
    for d in info.shape:
        n *= d
    return n


class LayerwiseModel:
    """`device`: where layers are materialised; `experts`: transformers' experts implementation
    ("eager" for an fp16 backward on CPU); `transform(tensor)`, when set, is applied to every matrix
    of a decoder layer as it is loaded (the probe's rounded rollout weights). `auto_load = False`
    stops the hooks, for callers that load and release layers themselves (a backward pass, which
    needs a layer again after its forward)."""

    def __init__(self, ckpt: Checkpoint, *, device: str = "cpu", experts: str | None = None, dtype: Any = None):
        torch, transformers = require_torch("running a checkpoint layer by layer")
        self.torch = torch
        self.dtype = dtype or torch.float32
        self.read: set[str] = set()
        self._slab = None  # the reused block one decoder layer at a time lives in
        self._slab_user: int | None = None
        self.ckpt = ckpt
        self.names = ckpt.names
        self.device = device
        self.transform: Callable | None = None
        self.auto_load = True
        config = transformers.AutoConfig.from_pretrained(ckpt.path, local_files_only=True)
        self.config = config.get_text_config() if ckpt.text_wrapper else config
        kwargs = {"experts_implementation": experts} if experts else {}
        with torch.device("meta"):
            self.model = transformers.AutoModelForCausalLM.from_config(self.config, dtype=self.dtype, **kwargs)
        self.model.eval()
        self.decoder = self.model.model
        self.mem_moe = self.names["memory"]["moe"]
        self._load_outside_layers()
        self.moe_hook: Callable | None = None
        for i, layer in enumerate(self.decoder.layers):
            layer.register_forward_pre_hook(self._loader(i))
            layer.register_forward_hook(self._releaser(i))
            if i in ckpt.moe_layers:
                block = getattr(layer, self.mem_moe)
                block.register_forward_hook(self._block_hook(i))

    # ---- weights ------------------------------------------------------------------------------
    def _disk_name(self, mem_key: str) -> str:
        prefix = self.ckpt.layer_prefix  # e.g. "model.layers", "language_model.model.layers", "backbone.layers"
        root = self.names.get("root", "model")
        outer = prefix[: -len(f"{root}.layers")]
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", mem_key)
        if not m:
            return outer + (root + mem_key[len("model") :] if mem_key.startswith("model.") else mem_key)
        layer, rest = m.group(1), m.group(2)
        memory = self.names["memory"]
        block = f"{self.mem_moe}."
        if rest.startswith(block):
            inner = rest[len(block) :]
            disk_block = f"{prefix}.{layer}.{self.names['moe']}"
            if inner == memory["router"]:
                return f"{disk_block}.{self.names['router'][0]}"
            if "correction_bias" in memory and inner == memory["correction_bias"]:
                return f"{disk_block}.{self.names['correction_bias'][0]}"
            return f"{disk_block}.{inner}"
        return f"{prefix}.{layer}.{rest}"

    def _fill(self, mem_key: str, target) -> None:
        """Copy the on-disk value of `mem_key` into `target` (an allocated parameter or buffer),
        one expert at a time for per-expert checkpoints held fused in memory."""
        torch = self.torch
        disk = self._disk_name(mem_key)
        info = self.ckpt.tensors.get(disk)
        if info is not None:
            self._read_into(info, target)
            self._transform(target)
            return
        per_expert = self.names.get("per_expert")
        fused = {name: role for role, name in self.names["memory"].get("experts", {"gate_up": "gate_up_proj", "down": "down_proj"}).items()}
        m = re.match(r"^model\.layers\.(\d+)\..*\.experts\.(\w+)$", mem_key)
        if not (per_expert and m and m.group(2) in fused):
            raise CheckpointError(f"{self.ckpt.path}: no tensor on disk for {mem_key} (looked for {disk})")
        experts = self.ckpt.moe_layers[int(m.group(1))].experts
        role = fused[m.group(2)]
        for e in sorted(experts):  # transformers 5 holds per-expert checkpoints fused: (E, 2I, h) or (E, I, h), (E, h, I)
            if role == "gate_up":
                gate, up = experts[e][per_expert["gate"]], experts[e][per_expert["up"]]
                self._read_into(gate, target[e, : gate.shape[0]])
                self._read_into(up, target[e, gate.shape[0] :])
            else:
                self._read_into(experts[e][per_expert[role]], target[e])
        self._transform(target)

    def _read_into(self, info, target) -> None:
        """The tensor `info` from disk into `target`: straight from the file into its memory when the
        dtypes match on the CPU (no copy, no float32 detour), else decoded and cast."""
        torch = self.torch
        if _numel(info) != target.numel():
            raise CheckpointError(f"{self.ckpt.path}: {info.name} holds {list(info.shape)}, the model expects {list(target.shape)}")
        self.read.add(info.name)
        if self._native(info) is target.dtype and target.device.type == "cpu" and target.is_contiguous():
            buf = target.view(-1).view(torch.uint8).numpy()
            with open(info.path, "rb") as fh:
                fh.seek(info.begin)
                got = fh.readinto(memoryview(buf))
            if got != info.nbytes:
                raise CheckpointError(f"{info.path}: ended {info.nbytes - got} bytes early reading {info.name}")
            return
        target.copy_(torch.from_numpy(self.ckpt.read_float32(info)).reshape(target.shape))

    def _transform(self, target) -> None:
        if self.transform is not None and target.dim() > 1:
            target.copy_(self.transform(target))

    def _materialize(self, module, prefix: str, *, slab: bool = False) -> None:
        torch = self.torch
        persistent = set(module.state_dict().keys())
        if slab:
            self._in_slab(module)
        else:
            module.to_empty(device=self.device)
        with torch.no_grad():
            for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
                if name not in persistent:
                    raise CheckpointError(f"{prefix}{name} is a non-persistent buffer; cannot rebuild it layer by layer")
                mapped = self._mapped(prefix + name, tensor)
                if mapped is None:
                    self._fill(prefix + name, tensor)
                else:
                    self._place(module, name, mapped)

    def _mapped(self, mem_key: str, target):
        """The on-disk tensor for `mem_key` as a view of the file (a private mapping of its pages:
        no copy, no fresh memory, unmapped when the tensor goes), where it can stand for `target` as
        it is: same dtype and size, on the CPU, aligned, not transformed. Else None."""
        torch = self.torch
        info = self.ckpt.tensors.get(self._disk_name(mem_key))
        if info is None or self.transform is not None or target.device.type != "cpu" or info.nbytes == 0:
            return None
        if self._native(info) is not target.dtype or _numel(info) != target.numel() or info.begin % target.element_size():
            return None
        start = info.begin - info.begin % mmap.ALLOCATIONGRANULARITY
        with open(info.path, "rb") as fh:
            pages = mmap.mmap(fh.fileno(), info.begin + info.nbytes - start, offset=start, access=mmap.ACCESS_COPY)
        self.read.add(info.name)
        return torch.frombuffer(pages, dtype=torch.uint8, count=info.nbytes, offset=info.begin - start).view(target.dtype).view(target.shape)

    def _native(self, info):
        """The torch dtype a tensor's bytes are as stored (None: one torch does not hold as is)."""
        return getattr(self.torch, NATIVE_DTYPES[info.dtype]) if info.dtype in NATIVE_DTYPES else None

    def _place(self, module, name: str, tensor) -> None:
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        if leaf in sub._parameters:
            sub._parameters[leaf] = self.torch.nn.Parameter(tensor, requires_grad=sub._parameters[leaf].requires_grad)
        else:
            sub._buffers[leaf] = tensor

    def _load_outside_layers(self) -> None:
        torch = self.torch
        layers = self.decoder.layers
        self.decoder.layers = torch.nn.ModuleList()  # detach while loading the rest
        try:
            rotary = getattr(self.decoder, "rotary_emb", None)
            if rotary is not None:  # non-persistent buffers: rebuild on the CPU from the config
                self.decoder.rotary_emb = None
            for name, module in (("model.", self.decoder), ("lm_head.", self.model.lm_head)):
                if name == "lm_head." and self.config.tie_word_embeddings:
                    continue
                self._materialize(module, name)
            if rotary is not None:
                self.decoder.rotary_emb = type(rotary)(config=self.config).to(self.device)
        finally:
            self.decoder.layers = layers
        if self.config.tie_word_embeddings:
            self.model.lm_head.weight = self.model.get_input_embeddings().weight

    def _in_slab(self, module) -> None:
        """Place `module`'s parameters and buffers in one reused block of memory: a decoder layer
        loaded into fresh memory pays a page fault per 4 KiB on first touch (reading from the page
        cache runs at a fifth of the speed), while the block, sized for the largest layer, is
        touched once. Parameters then mapped from the file (_mapped) leave their part untouched."""
        torch = self.torch
        entries = list(module.named_parameters()) + list(module.named_buffers())
        offsets, total = [], 0
        for _, t in entries:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // 64) * 64  # 64-byte aligned
        if self._slab is None or self._slab.numel() < total:
            self._slab = None
            self._slab = torch.empty(total, dtype=torch.uint8, device=self.device)
        for (name, t), off in zip(entries, offsets):
            self._place(module, name, self._slab[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape))

    def load_layer(self, i: int):
        """Decoder layer i in memory: in the reused block unless another layer holds it (then in
        memory of its own)."""
        return self._load(i, self.decoder.layers[i], f"model.layers.{i}.")

    def load_block(self, i: int):
        """Only the MoE block of decoder layer i in memory (router and experts: what evaluating
        experts on stored activations needs)."""
        return self._load(i, getattr(self.decoder.layers[i], self.mem_moe), f"model.layers.{i}.{self.mem_moe}.")

    def _load(self, i: int, module, prefix: str):
        slab = self._slab_user is None
        self._materialize(module, prefix, slab=slab)
        if slab:
            self._slab_user = i
        return module

    def release_layer(self, i: int) -> None:
        self.decoder.layers[i].to("meta")
        if self._slab_user == i:
            self._slab_user = None

    def _loader(self, i: int):
        def hook(module, args):
            if self.auto_load:
                self.load_layer(i)

        return hook

    def _releaser(self, i: int):
        def hook(module, args, output):
            if self.auto_load:
                self.release_layer(i)

        return hook

    # ---- MoE block hooks ------------------------------------------------------------------
    def _block_hook(self, i: int):
        def hook(module, args, output):
            if self.moe_hook is None:
                return None
            return self.moe_hook(i, module, args[0], output)

        return hook

    @contextmanager
    def moe(self, fn: Callable):
        """Within the block, `fn(layer, block, input, output)` runs after every MoE block forward;
        a non-None return value replaces the block's output."""
        self.moe_hook = fn
        try:
            yield
        finally:
            self.moe_hook = None

    def forward(self, ids) -> "object":
        with self.torch.no_grad():
            return self.model(input_ids=ids, use_cache=False).logits

    @property
    def final_norm(self):
        """The decoder's norm after its last layer (Nemotron-H names it norm_f)."""
        norm = getattr(self.decoder, "norm", None)
        return norm if norm is not None else self.decoder.norm_f

    def hidden(self, ids) -> "object":
        """The decoder's output (after the final norm), without the head: a pass that needs the
        next-token distributions only at some positions applies the head there."""
        with self.torch.no_grad():
            return self.decoder(input_ids=ids, use_cache=False).last_hidden_state

    # ---- routing and experts of a loaded block -------------------------------------------------
    def router(self, block):
        return getattr(block, self.names["memory"]["router"].split(".")[0])

    def route(self, block, x, router=None) -> MoECall:
        """Router logits and top-k routing of `block` on tokens `x` (tokens x hidden), by its own
        router or by `router` (one of the same class)."""
        torch = self.torch
        router = router or self.router(block)
        with torch.no_grad():
            out = router(x)
        if len(out) == 3:  # (logits, weights, ids)
            logits, weights, ids = out
        else:  # llama4: (scores, sigmoid of the top-k logits and zero elsewhere; logits)
            scores, logits = out
            weights, ids = torch.topk(scores, block.top_k, dim=-1)
        return MoECall(logits=logits, topk_ids=ids, topk_weights=weights)

    def expert_output(self, block, e: int, x):
        """Expert e's output on tokens x (unweighted), through transformers' expert module."""
        torch = self.torch
        experts = block.experts
        with torch.no_grad():
            if len(inspect.signature(experts.forward).parameters) == 1:  # llama4: experts over a routed block
                gate, up = (x @ experts.gate_up_proj[e]).chunk(2, dim=-1)
                return (experts.act_fn(gate) * up) @ experts.down_proj[e]
            ids = torch.full((x.shape[0], 1), e, dtype=torch.long)
            ones = torch.ones((x.shape[0], 1), dtype=x.dtype)
            return experts(x, ids, ones)

    def weights_inputs(self, block) -> bool:
        """Does the block scale each expert's input by its routing weight (llama4) rather than its
        output? Then an expert's contribution is not linear in its weight."""
        return len(inspect.signature(block.experts.forward).parameters) == 1

    def expert_outputs(self, block, experts, x, weights=None):
        """Row n's contribution of expert experts[n] on x[n] at routing weight weights[n] as the block
        applies it (None: unweighted output), every row in one call of transformers' expert module."""
        torch = self.torch
        if self.weights_inputs(block):  # llama4: one expert at a time, the weight scales its input
            x = x if weights is None else x * weights[:, None].to(x.dtype)
            out = torch.empty_like(x)
            for e in torch.unique(experts).tolist():
                rows = torch.nonzero(experts == e).flatten()
                out[rows] = self.expert_output(block, e, x[rows])
            return out
        w = torch.ones((x.shape[0], 1), dtype=x.dtype) if weights is None else weights[:, None].to(x.dtype)
        with torch.no_grad():
            return block.experts(x, experts[:, None].long(), w)
