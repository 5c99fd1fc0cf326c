"""model_info() says the KV element type and the lower tiers' sizes (issue 14), and the wire's
ModelInfo carries them."""

from __future__ import annotations

from engine_proc.attention.kv_quant import kv_int8_bytes_per_token
from ipc import protocol as P
from tests.engine_fixtures import tiny_engine


def test_model_info_reports_the_tiers(tmp_path):
    engine = tiny_engine(kv_host_memory=1 << 20, kv_disk_dir=str(tmp_path / "kv"),
                         kv_disk_bytes=8 << 20)
    info = engine.model_info()
    assert info["kv_cache_dtype"] == "auto"
    assert info["kv_host_bytes"] == 1 << 20 and info["kv_disk_bytes"] == 8 << 20
    m = P.ModelInfo(**info)
    assert (m.kv_cache_dtype, m.kv_host_bytes, m.kv_disk_bytes) == ("auto", 1 << 20, 8 << 20)


def test_model_info_without_tiers_and_with_int8():
    plain = tiny_engine().model_info()
    assert (plain["kv_cache_dtype"], plain["kv_host_bytes"], plain["kv_disk_bytes"]) == (
        "auto", 0, 0)
    engine = tiny_engine(kv_cache_dtype="int8")
    info = engine.model_info()
    mc = engine.model_config
    assert info["kv_cache_dtype"] == "int8" and info["kv_host_bytes"] == 0
    assert info["kv_bytes_per_token"] == kv_int8_bytes_per_token(
        mc.num_layers, mc.num_kv_heads, mc.head_dim)
    # the status bar's formula: 2·L·H_kv·(D·1 + 2)
    assert info["kv_bytes_per_token"] == 2 * mc.num_layers * mc.num_kv_heads * (mc.head_dim + 2)


def test_model_info_with_fp8():
    engine = tiny_engine(kv_cache_dtype="fp8")
    info = engine.model_info()
    mc = engine.model_config
    assert info["kv_cache_dtype"] == "fp8"
    # the status bar's formula: 2·L·H_kv·D·1 (the per-layer scales are not per token)
    assert info["kv_bytes_per_token"] == 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim
    assert P.ModelInfo(**info).kv_cache_dtype == "fp8"
