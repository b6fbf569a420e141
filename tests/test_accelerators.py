"""Contract checks run against every accelerator profile, and user-defined profiles."""

from __future__ import annotations

import pytest
import yaml

from planner.catalog import catalog_accelerators, load_accelerator
from planner.errors import ConfigError

GIB = 1024**3
REQUIRED_SOURCES = ("hbm_gib", "reserved_gib", "hbm_tb_per_s", "intra_node_gb_per_s", "inter_node_gb_per_s", "host_memory_gib_per_node")


@pytest.mark.parametrize("accel_id", sorted(catalog_accelerators()))
def test_profile_is_complete_and_sourced(accel_id):
    a = catalog_accelerators()[accel_id]
    assert 0 < a.reserved_bytes < 0.1 * a.hbm_bytes
    assert a.peak_bf16_flops > 1e14 and a.hbm_bytes_per_s > 1e12
    assert a.intra_node_bytes_per_s > a.inter_node_bytes_per_s > 0
    assert a.devices_per_node % a.devices_per_card == 0
    for key in REQUIRED_SOURCES:
        assert a.sources.get(key), f"{accel_id}: no source for {key}"
    bw = a.a2a_bytes_per_s([8, 16, 64, 4096])
    assert (bw > 0).all()


def test_design_reference_figures():
    b2 = load_accelerator("ascend-910b2")
    assert b2.peak_bf16_flops == pytest.approx(24 * 8192 * 1.8e9)  # 353.9 TFLOPS
    assert b2.hbm_bytes == 64 * GIB and b2.devices_per_node == 8
    a3 = load_accelerator("atlas-a3")
    assert a3.devices_per_card == 2 and a3.hbm_bytes == 64 * GIB
    assert 752e12 <= 2 * a3.peak_bf16_flops <= 800e12
    assert a3.a2a_bytes_per_s(8) == pytest.approx(146e9) and a3.a2a_bytes_per_s(128) == pytest.approx(57e9)
    assert load_accelerator("h20").peak_bf16_flops == 148e12


def test_user_profile_from_cube_cores(tmp_path):
    path = tmp_path / "my910b.yaml"
    path.write_text(yaml.safe_dump({
        "name": "Ascend 910B3 (our cluster)", "family": "ascend", "hbm_gib": 64, "reserved_gib": 3.0,
        "hbm_tb_per_s": 1.6, "intra_node_gb_per_s": 392, "inter_node_gb_per_s": 25, "devices_per_node": 8,
        "peak_from_cube": {"cube_cores": 20, "cube_freq_ghz": 1.8},
    }))
    a = load_accelerator(str(path))
    assert a.peak_bf16_flops == pytest.approx(20 * 8192 * 1.8e9)
    assert a.family == "ascend" and a.id == "my910b"


def test_user_profile_errors_name_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "family": "ascend", "hbm_gb": 64}))
    with pytest.raises(ConfigError) as err:
        load_accelerator(str(path))
    assert "unknown key(s) 'hbm_gb'" in str(err.value) and "hbm_gib" in str(err.value)


def _write_profile(tmp_path, **changes):
    """A user profile that is complete but for `changes`."""
    profile = {"name": "x", "family": "nvidia", "hbm_gib": 80, "reserved_gib": 0.5, "hbm_tb_per_s": 3.35,
               "intra_node_gb_per_s": 300, "inter_node_gb_per_s": 25, "devices_per_node": 8, "peak_bf16_tflops": 300}
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump({**profile, **changes}))
    return path


@pytest.mark.parametrize("key, value, message", [
    ("hbm_tb_per_s", 0, "hbm_tb_per_s must be a finite positive number, got 0"),
    ("devices_per_node", 3.5, "devices_per_node must be a whole number, got 3.5"),
])
def test_user_profile_rejects_impossible_values(tmp_path, key, value, message):
    with pytest.raises(ConfigError) as err:
        load_accelerator(str(_write_profile(tmp_path, **{key: value})))
    assert message in str(err.value)
