"""A briefly trained tiny MoE whose experts differ in clusters, like upcycled production MoEs.

Experts of each layer start as noisy copies of a few distinct MLPs (upcycling), then the model trains
for a few hundred real AdamW steps on Python standard-library docstrings, byte level. Experts of one
cluster stay alike; clusters differ.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from planner.stats.text import default_text


def train_clustered_moe(path: Path, *, experts: int = 16, clusters: int = 4, top_k: int = 2, steps: int = 150,
                        seed: int = 0) -> Path:  # fmt: skip
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=48, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=True, router_aux_loss_coef=0.01, output_router_logits=True, max_position_embeddings=128,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with torch.no_grad():
        for layer in model.model.layers:
            ex = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(ex, name)
                seeds = w[:clusters].clone() * 4.0
                for e in range(experts):
                    w[e] = seeds[e % clusters] + 0.05 * seeds.std() * torch.randn_like(w[e])
    data = np.frombuffer(default_text(60_000).encode(), dtype=np.uint8).astype(np.int64)
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(steps):
        starts = rng.integers(0, data.size - 64, size=16)
        batch = torch.from_numpy(np.stack([data[s : s + 64] for s in starts]))
        out = model(input_ids=batch, labels=batch)  # transformers shifts the labels
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    model.eval()
    model.config.output_router_logits = False
    model.save_pretrained(path)
    (path / "train_loss.txt").write_text(f"{losses[0]:.4f} -> {np.mean(losses[-10:]):.4f}\n")
    return path
