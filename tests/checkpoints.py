"""Tiny real checkpoints for tests: saved by transformers' own classes, sharded or single-file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from test_params import VARIANTS, tiny
from transformers import AutoConfig, AutoModelForCausalLM


def family_config(model_type: str, variant: int = 0, **overrides) -> dict:
    return tiny(model_type, **{**VARIANTS[model_type][variant], **overrides})


def save_tiny(path: Path, config: dict, *, sharded: bool, seed: int = 0, dtype=torch.float32) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=dtype)
    model.save_pretrained(path, max_shard_size="100KB" if sharded else "10GB")
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return path


def add_mtp_layer(path: Path) -> None:
    """Append a DeepSeek-style multi-token-prediction layer to a single-file checkpoint: a copy of the
    last decoder layer numbered num_hidden_layers, plus enorm, hnorm, eh_proj and shared_head, as the
    published DeepSeek-V3 and GLM-4.5 checkpoints hold it; config.json gets num_nextn_predict_layers 1."""
    config = json.loads((path / "config.json").read_text())
    n, h = config["num_hidden_layers"], config["hidden_size"]
    tensors = load_file(path / "model.safetensors")
    last = f"model.layers.{n - 1}."
    for name, value in list(tensors.items()):
        if name.startswith(last):
            tensors[f"model.layers.{n}." + name[len(last) :]] = value.clone()
    tensors[f"model.layers.{n}.enorm.weight"] = torch.ones(h)
    tensors[f"model.layers.{n}.hnorm.weight"] = torch.ones(h)
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.randn(h, 2 * h)
    tensors[f"model.layers.{n}.shared_head.norm.weight"] = torch.ones(h)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))


def corrupt_header_length(path: Path, declared: int) -> None:
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", declared) + raw[8:])
