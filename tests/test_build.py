"""The proxy builder on real checkpoints saved by transformers: round trips, rules, bad inputs."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("torch")

from checkpoints import add_mtp_layer, corrupt_header_length, family_config, save_tiny  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402

from planner.checkpoint import EXPERT_MAP_NAME, Checkpoint, build  # noqa: E402
from planner.errors import CheckpointError, PlanError, SpecError  # noqa: E402
from planner.plan import Plan, load_plan  # noqa: E402

FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss",
            "llama4_text", "ernie4_5_moe", "phimoe", "qwen3_next", "nemotron_h"]  # fmt: skip


def even_plan(ckpt: Checkpoint, k: int, **kw) -> Plan:
    """Keep the last k experts of every MoE layer (the first k/n_group of every group when grouped)."""
    arch = ckpt.arch
    e, g = arch.original_num_experts, arch.moe.n_group
    per, kg = e // g, k // g
    ids = [grp * per + per - kg + j for grp in range(g) for j in range(kg)]
    layers = [i for i, layer in ckpt.moe_layers.items() if kw.get("mtp") == "prune" or not layer.mtp]
    return Plan(model=arch.name, experts=k, original_experts=e, layers={i: ids for i in layers}, **kw)


def keys(path) -> set[str]:
    out = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, "np") as fh:
            out |= set(fh.keys())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "single"])
def test_round_trip(tmp_path, family, sharded):
    source = save_tiny(tmp_path / "src", family_config(family), sharded=sharded)
    ckpt = Checkpoint(source)
    e = ckpt.arch.original_num_experts
    # the build compares the proxy with the original on 2 x 24 random tokens (seed 0): the same tokens through
    # transformers' own models, each held whole, give the KL to check its figure against
    ids = torch.randint(0, ckpt.arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        original_logits = transformers.AutoModelForCausalLM.from_pretrained(source, local_files_only=True).eval()(ids).logits.double()
    for k in sorted({e, *ckpt.arch.legal_expert_counts()[:2]}):
        out = tmp_path / f"k{k}"
        report = build(ckpt, even_plan(ckpt, k), out, verify="always")
        v = report.verification
        assert v["load"].startswith("every tensor feeds a parameter, none missing (layer by layer") and v["forward"] == "finite"
        # transformers' own loader agrees: nothing missing, unexpected (MTP layers aside) or resized
        model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, local_files_only=True)
        layer_of = (re.search(r"layers\.(\d+)\.", n) for n in info["unexpected_keys"])
        unexpected = [m for m in layer_of if not m or int(m.group(1)) < ckpt.arch.num_layers]
        assert not info["missing_keys"] and not unexpected and not info["mismatched_keys"], info
        if k == e:
            assert v["logits"] == "bit-identical to the original" and report.bytes_skipped == 0
        else:
            assert report.bytes_skipped > 0
            # KL(original || proxy) of the next-token distributions, mean over the 48 positions, from torch's kl_div
            with torch.no_grad():
                proxy_logits = model.eval()(ids).logits.double()
            kl = float(torch.nn.functional.kl_div(torch.log_softmax(proxy_logits, -1), torch.log_softmax(original_logits, -1),
                                                  log_target=True, reduction="none").sum(-1).mean())  # fmt: skip
            assert kl > 0  # half the experts gone: the proxy predicts otherwise
            assert v["kl_original_proxy"] == pytest.approx(kl, rel=1e-5), (v["kl_original_proxy"], kl)  # equal here: the same modules
        config = json.loads((out / "config.json").read_text())
        original = json.loads((source / "config.json").read_text())
        changed = {key for key in config if config[key] != original.get(key)}
        assert changed <= {ckpt.arch.moe.experts_key, "num_local_experts", "num_experts"} and (changed or k == e)
        assert (out / "tokenizer_config.json").is_file() and (out / "generation_config.json").is_file()
        emap = json.loads((out / EXPERT_MAP_NAME).read_text())
        assert emap["experts"] == k and emap["source"]["fingerprint"] == ckpt.fingerprint()
        assert all(len(layer["kept"]) == k for layer in emap["layers"].values())
        assert (out / "model.safetensors.index.json").is_file() == sharded
        assert not (tmp_path / f"k{k}.tmp").exists()


def test_the_check_refuses_a_tensor_that_feeds_no_parameter(tmp_path):
    """The layer-by-layer check reads every tensor into transformers' model: one that no parameter
    takes (a stray key a converter left behind) fails the build's check, as transformers' own loader
    would report it unexpected."""
    from safetensors.torch import load_file, save_file

    from planner.checkpoint.verify import verify_proxy

    source = save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False)
    ckpt = Checkpoint(source)
    plan = even_plan(ckpt, ckpt.arch.legal_expert_counts()[0])
    build(ckpt, plan, tmp_path / "proxy", verify="never")
    shard = tmp_path / "proxy" / "model.safetensors"
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.stray.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) feed no parameter.*self_attn.stray.weight"):
        verify_proxy(source, tmp_path / "proxy", plan, num_layers=ckpt.arch.num_layers)


def test_kept_experts_are_copied_bit_for_bit_and_renumbered(tmp_path):
    source = save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=True)
    ckpt = Checkpoint(source)
    plan = Plan(model="q", experts=4, original_experts=8, layers={i: [7, 1, 4, 2] for i in ckpt.moe_layers})
    build(ckpt, plan, tmp_path / "out", verify="never")
    proxy = Checkpoint(tmp_path / "out")
    for layer in ckpt.moe_layers:
        old, new = ckpt.moe_layers[layer], proxy.moe_layers[layer]
        for new_id, orig in enumerate([1, 2, 4, 7]):
            for suffix, info in new.experts[new_id].items():
                assert proxy.read_bytes(info) == ckpt.read_bytes(old.experts[orig][suffix])
        router_old, router_new = ckpt.read_float32(old.router), proxy.read_float32(new.router)
        assert (router_new == router_old[[1, 2, 4, 7]]).all()


def test_correction_bias_stays_fp32_and_is_sliced(tmp_path):
    source = save_tiny(tmp_path / "src", family_config("deepseek_v3"), sharded=False, dtype=__import__("torch").bfloat16)
    ckpt = Checkpoint(source)
    plan = even_plan(ckpt, 4)
    build(ckpt, plan, tmp_path / "out", verify="never")
    proxy = Checkpoint(tmp_path / "out")
    for i, layer in proxy.moe_layers.items():
        assert layer.correction_bias.dtype == "F32" and layer.correction_bias.shape == (4,)
        assert layer.router.dtype == "F32"
        full = ckpt.read_float32(ckpt.moe_layers[i].correction_bias)
        assert (proxy.read_float32(layer.correction_bias) == full[list(plan.layers[i])]).all()


def test_mtp_dropped_or_pruned(tmp_path):
    source = save_tiny(tmp_path / "src", family_config("deepseek_v3"), sharded=False)
    add_mtp_layer(source)
    ckpt = Checkpoint(source)
    n = ckpt.arch.num_layers
    assert ckpt.moe_layers[n].mtp
    build(ckpt, even_plan(ckpt, 4), tmp_path / "drop", verify="always")
    assert not any(k.startswith(f"model.layers.{n}.") for k in keys(tmp_path / "drop"))
    assert json.loads((tmp_path / "drop" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert json.loads((tmp_path / "drop" / EXPERT_MAP_NAME).read_text())["mtp"] == {"layers": [n], "choice": "drop"}
    plan = even_plan(ckpt, 4, mtp="prune")
    report = build(ckpt, plan, tmp_path / "prune", verify="always")
    assert report.verification["load"].startswith("every tensor feeds a parameter")
    proxy = Checkpoint(tmp_path / "prune")
    assert proxy.moe_layers[n].num_experts == 4 and proxy.moe_layers[n].router.shape[0] == 4
    assert f"model.layers.{n}.eh_proj.weight" in keys(tmp_path / "prune")


# ---- rules: each violation names the rule and writes nothing --------------------------------------

@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    path = tmp_path_factory.mktemp("grouped")
    config = family_config("deepseek_v3", n_group=2, topk_group=1, num_experts_per_tok=3)
    return Checkpoint(save_tiny(path / "src", config, sharded=False))


def _violation(ckpt, tmp_path, plan, message):
    with pytest.raises((PlanError, SpecError)) as err:
        build(ckpt, plan, tmp_path / "out", verify="never")
    assert message in str(err.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_rule_top_k_at_most_k(grouped, tmp_path):
    plan = Plan(model="g", experts=2, original_experts=8, layers={i: [0, 4] for i in grouped.moe_layers})
    _violation(grouped, tmp_path, plan, "rule top_k <= K: top_k=3 > K=2")


def test_rule_k_multiple_of_groups(grouped, tmp_path):
    plan = Plan(model="g", experts=5, original_experts=8, layers={i: [0, 1, 2, 4, 5] for i in grouped.moe_layers})
    _violation(grouped, tmp_path, plan, "rule K % n_group == 0: K=5, n_group=2")


def test_rule_topk_group_reach(grouped, tmp_path):
    plan = Plan(model="g", experts=4, original_experts=8, layers={i: [0, 1, 4, 5] for i in grouped.moe_layers})
    _violation(grouped, tmp_path, plan, "rule topk_group*K/n_group >= top_k: 1*2=2 < top_k=3")


def test_rule_two_per_group(tmp_path):
    ckpt = Checkpoint(save_tiny(tmp_path / "src", family_config("deepseek_v3", n_group=4, topk_group=4), sharded=False))
    plan = Plan(model="g", experts=4, original_experts=8, layers={i: [0, 2, 4, 6] for i in ckpt.moe_layers})
    _violation(ckpt, tmp_path, plan, "rule K/n_group >= 2")


def test_rule_equal_per_group(grouped, tmp_path):
    plan = Plan(model="g", experts=6, original_experts=8, layers={i: [0, 1, 2, 3, 4, 5] for i in grouped.moe_layers})
    _violation(grouped, tmp_path, plan, "rule equal experts per routing group: layer 1 keeps [4, 2]")


def test_rule_one_k_per_layer(tmp_path):
    ckpt = Checkpoint(save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False))
    layers = {i: [0, 1, 2, 3] for i in ckpt.moe_layers}
    layers[max(layers)] = [0, 1, 2]
    plan = Plan(model="q", experts=4, original_experts=8, layers=layers)
    _violation(ckpt, tmp_path, plan, "rule one K for every MoE layer: layer 4 keeps 3 distinct experts, K=4")


def test_rule_every_moe_layer_listed(tmp_path):
    ckpt = Checkpoint(save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False))
    plan = Plan(model="q", experts=4, original_experts=8, layers={0: [0, 1, 2, 3]})
    _violation(ckpt, tmp_path, plan, "rule one kept set per MoE layer")


def test_rule_k_divisible_by_declared_ep(tmp_path):
    ckpt = Checkpoint(save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False))
    plan = Plan(model="q", experts=6, original_experts=8, layers={i: list(range(6)) for i in ckpt.moe_layers}, target_ep=(4,))
    _violation(ckpt, tmp_path, plan, "rule K % EP == 0 for the declared layout: K=6, EP=4")


def test_rule_ids_in_range(tmp_path):
    ckpt = Checkpoint(save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False))
    plan = Plan(model="q", experts=4, original_experts=8, layers={i: [0, 1, 2, 9] for i in ckpt.moe_layers})
    _violation(ckpt, tmp_path, plan, "rule expert ids in 0..E-1")


def test_plan_for_another_checkpoint_is_refused(tmp_path):
    ckpt = Checkpoint(save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False))
    plan = even_plan(ckpt, 4, checkpoint_fingerprint="0" * 64)
    _violation(ckpt, tmp_path, plan, "the plan was made for checkpoint 000000000000")


def test_existing_output_needs_force_and_only_builds_are_replaced(tmp_path):
    ckpt = Checkpoint(save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(SpecError, match="exists; pass --force"):
        build(ckpt, even_plan(ckpt, 4), tmp_path / "out", verify="never")
    with pytest.raises(SpecError, match="is not a planner build"):
        build(ckpt, even_plan(ckpt, 4), tmp_path / "out", force=True, verify="never")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    build(ckpt, even_plan(ckpt, 4), tmp_path / "proxy", verify="never")
    build(ckpt, even_plan(ckpt, 2), tmp_path / "proxy", force=True, verify="never")
    assert Checkpoint(tmp_path / "proxy").arch.moe.num_experts == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "proxy", "src"]  # no .tmp or .old left


def test_output_overlapping_the_source_is_refused(tmp_path):
    ckpt = Checkpoint(save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False))
    for target in (tmp_path, tmp_path / "src", tmp_path / "src" / "inner"):
        with pytest.raises(SpecError, match="overlaps the source checkpoint"):
            build(ckpt, even_plan(ckpt, 4), target, force=True, verify="never")
    assert (tmp_path / "src" / "model.safetensors").is_file()


def test_a_foreign_tmp_directory_is_not_deleted(tmp_path):
    ckpt = Checkpoint(save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False))
    (tmp_path / "out.tmp").mkdir()
    (tmp_path / "out.tmp" / "notes.txt").write_text("mine")
    with pytest.raises(SpecError, match="is not an unfinished planner build"):
        build(ckpt, even_plan(ckpt, 4), tmp_path / "out", verify="never")
    assert (tmp_path / "out.tmp" / "notes.txt").is_file()


def test_a_second_build_into_the_same_directory_is_refused_while_the_first_runs(tmp_path):
    """The running build holds a lock on OUT.tmp's marker; a second one is refused and deletes
    nothing; once the lock is gone (the first died), the leftovers are cleared and the build runs."""
    import fcntl
    import os

    from planner.checkpoint.build import TMP_MARKER

    ckpt = Checkpoint(save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False))
    (tmp_path / "out.tmp").mkdir()
    marker = tmp_path / "out.tmp" / TMP_MARKER
    marker.write_text("planner build in progress\n")
    (tmp_path / "out.tmp" / "model.safetensors").write_bytes(b"half")
    fd = os.open(marker, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what the first build holds
    with pytest.raises(SpecError, match="another planner build is writing"):
        build(ckpt, even_plan(ckpt, 4), tmp_path / "out", verify="never")
    assert (tmp_path / "out.tmp" / "model.safetensors").read_bytes() == b"half"
    os.close(fd)  # the first build died
    build(ckpt, even_plan(ckpt, 4), tmp_path / "out", verify="never")
    assert Checkpoint(tmp_path / "out").arch.moe.num_experts == 4 and not (tmp_path / "out.tmp").exists()


@pytest.mark.slow
def test_sigterm_during_build_leaves_nothing_behind(tmp_path):
    """SIGTERM (Slurm, Kubernetes) is handled as Ctrl-C is: OUT.tmp is removed, exit 128 + 15."""
    import signal
    import subprocess
    import sys
    import time

    source = save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "planner.cli", "build", str(source), str(out), "--experts", "4", "--method", "kmeans",
                             "--verify", "always"], stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.time() + 120
    while not (out.with_name("out.tmp")).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "the build finished before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "interrupted (SIGTERM)" in err, err
    assert not out.exists() and not out.with_name("out.tmp").exists()


def test_side_files_carry_over_but_never_other_weights(tmp_path):
    source = save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False)
    (source / "pytorch_model.bin").write_bytes(b"stale pickled weights")
    (source / "pytorch_model.bin.index.json").write_text("{}")
    (tmp_path / "elsewhere.jinja").write_text("{{ messages }}")
    (source / "chat_template.jinja").symlink_to(tmp_path / "elsewhere.jinja")
    build(Checkpoint(source), even_plan(Checkpoint(source), 4), tmp_path / "out", verify="never")
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"tokenizer_config.json", "generation_config.json", "chat_template.jinja"} <= names
    assert not (tmp_path / "out" / "chat_template.jinja").is_symlink()
    assert not names & {"pytorch_model.bin", "pytorch_model.bin.index.json"}


def test_hub_cache_layout_with_symlinked_shards_is_read(tmp_path):
    source = save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=True)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in source.glob("*.safetensors"):
        target = blobs / shard.name
        shard.rename(target)
        shard.symlink_to(target)
    assert Checkpoint(source).arch.moe.num_experts == 8


def test_plan_round_trips_through_yaml(tmp_path):
    plan = Plan(model="q", experts=4, original_experts=8, layers={0: [5, 1, 2, 3]}, method="saliency",
                labels={0: [0, 1, 2, 3, 3, 0, 1, 2]}, seed=3)  # fmt: skip
    path = tmp_path / "plan.yaml"
    path.write_text(plan.to_yaml())
    assert load_plan(path) == plan and plan.layers[0] == (1, 2, 3, 5)


# ---- bad checkpoints: a clear error and no OUT_DIR ------------------------------------------------

@pytest.fixture
def sharded_source(tmp_path):
    return save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=True)


def _bad(source, tmp_path, message):
    with pytest.raises((CheckpointError, SpecError)) as err:
        build(Checkpoint(source), Plan(model="q", experts=4, original_experts=8, layers={}), tmp_path / "out")
    assert message in str(err.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_truncated_header(sharded_source, tmp_path):
    shard = sorted(sharded_source.glob("*.safetensors"))[0]
    corrupt_header_length(shard, shard.stat().st_size * 2)
    _bad(sharded_source, tmp_path, "truncated header")


def test_header_data_length_mismatch(sharded_source, tmp_path):
    shard = sorted(sharded_source.glob("*.safetensors"))[1]
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [header[name]["shape"][0] + 1] + header[name]["shape"][1:]
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    shard.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])
    _bad(sharded_source, tmp_path, "header/data length mismatch")


def test_truncated_data(sharded_source, tmp_path):
    shard = sorted(sharded_source.glob("*.safetensors"))[2]
    shard.write_bytes(shard.read_bytes()[:-100])
    _bad(sharded_source, tmp_path, "truncated file?")


def test_missing_shard(sharded_source, tmp_path):
    sorted(sharded_source.glob("*.safetensors"))[-1].unlink()
    _bad(sharded_source, tmp_path, "is missing")


def test_weight_map_escaping_the_directory(sharded_source, tmp_path):
    index = sharded_source / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    name = next(iter(doc["weight_map"]))
    doc["weight_map"][name] = "../elsewhere.safetensors"
    index.write_text(json.dumps(doc))
    _bad(sharded_source, tmp_path, "escapes the checkpoint directory")


def test_a_single_file_beside_an_index_is_read_as_transformers_loads_it(sharded_source, tmp_path):
    """A folder with model.safetensors and a sharded index (other weights) beside it: transformers'
    from_pretrained loads the single file, and so does the reader."""
    single = save_tiny(tmp_path / "other", family_config("qwen3_moe"), sharded=False, seed=1) / "model.safetensors"
    (sharded_source / "model.safetensors").write_bytes(single.read_bytes())
    ckpt = Checkpoint(sharded_source)
    assert set(ckpt.shards) == {"model.safetensors"}
    name = "model.layers.0.mlp.gate.weight"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(sharded_source).state_dict()[name]
    with safe_open(single, "pt") as fh:
        assert torch.equal(loaded, fh.get_tensor(name))


def test_shape_disagreeing_with_config(sharded_source, tmp_path):
    config = json.loads((sharded_source / "config.json").read_text())
    config["moe_intermediate_size"] = 40
    (sharded_source / "config.json").write_text(json.dumps(config))
    _bad(sharded_source, tmp_path, "gate_proj.weight has shape [24, 48], config.json implies [40, 48]")


def test_expert_count_disagreeing_with_config(sharded_source, tmp_path):
    config = json.loads((sharded_source / "config.json").read_text())
    config["num_local_experts"] = 16
    (sharded_source / "config.json").write_text(json.dumps(config))
    _bad(sharded_source, tmp_path, "router has 8 rows, config.json says 16 experts")


def test_pickled_weights_are_never_loaded(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(family_config("qwen3_moe")))
    (source / "pytorch_model.bin").write_bytes(b"\x80\x04not for unpickling")
    with pytest.raises(CheckpointError, match="pickled weights are never loaded"):
        Checkpoint(source)


def test_fp8_experts_keep_their_block_scales(tmp_path):
    """DeepSeek-V3's published layout: FP8 expert weights with a weight_scale_inv per 128x128 block."""
    import torch
    from safetensors.torch import load_file, save_file

    from planner.stats.compute import compute_stats

    source = save_tiny(tmp_path / "src", family_config("deepseek_v3"), sharded=False)
    tensors = load_file(source / "model.safetensors")
    for name in [n for n in tensors if ".experts." in n]:
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.rand(1, 1) + 0.5
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    ckpt = Checkpoint(source)
    plan = even_plan(ckpt, 4)
    build(ckpt, plan, tmp_path / "out", verify="never")
    proxy = Checkpoint(tmp_path / "out")
    for i, layer in proxy.moe_layers.items():
        for new_id, orig in enumerate(plan.layers[i]):
            for suffix in ("gate_proj.weight", "gate_proj.weight_scale_inv"):
                assert proxy.read_bytes(layer.experts[new_id][suffix]) == ckpt.read_bytes(ckpt.moe_layers[i].experts[orig][suffix])
        assert layer.experts[0]["down_proj.weight"].dtype == "F8_E4M3"
    stats = compute_stats(ckpt, experts=[4], weights_only=True)
    assert np.isfinite(stats["layers"]["1"]["distance"]).all()
    with pytest.raises(SpecError, match="quantised weights"):
        compute_stats(ckpt, experts=[4])


def test_router_bias_with_the_wrong_expert_count(tmp_path):
    from safetensors.torch import load_file, save_file

    source = save_tiny(tmp_path / "src", family_config("gpt_oss"), sharded=False)
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.0.mlp.router.bias"] = tensors["model.layers.0.mlp.router.bias"][:4].clone()
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="router bias model.layers.0.mlp.router.bias has shape \\[4\\]; config.json says 8"):
        Checkpoint(source)


@pytest.mark.parametrize("mutate,message", [
    (lambda h, k: h[k].update(data_offsets=["0", "8"]), "must be integers"),
    (lambda h, k: h[k].update(data_offsets=[0.0, float(h[k]["data_offsets"][1])]), "must be integers"),
    (lambda h, k: h.update(__metadata__=["not", "a", "dict"]), "__metadata__ must map strings to strings"),
])  # fmt: skip
def test_malformed_headers_are_clear_errors(tmp_path, mutate, message):
    source = save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False)
    path = source / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    mutate(header, next(k for k in header if k != "__metadata__"))
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])
    with pytest.raises(CheckpointError, match=message):
        Checkpoint(source)


def test_bytes_belonging_to_no_tensor_are_refused(tmp_path):
    source = save_tiny(tmp_path / "src", family_config("qwen3_moe"), sharded=False)
    path = source / "model.safetensors"
    path.write_bytes(path.read_bytes() + b"\0" * 64)
    with pytest.raises(CheckpointError, match="trailing bytes"):
        Checkpoint(source)
