"""engine_proc/catalog/estimate.py against the engine's own pool: an LLMEngine built on a tiny
model with kv_cache_memory = the estimate's KV bytes has the estimate's bytes per token, page
bytes and block count, and torch allocated exactly the estimate's KV bytes for its pool; the
hybrid layout's saving is the window bound of core/kv_groups.py, recomputed here by hand."""

from __future__ import annotations

import math

import pytest

from engine_proc import EngineConfig
from engine_proc.catalog.estimate import FITS, TIGHT, UNKNOWN, WONT_FIT, estimate, fit_label
from engine_proc.catalog.inspect import inspect
from engine_proc.catalog.stores import Found
from engine_proc.engine.llm_engine import LLMEngine
from tests.tiny_models import tiny_model_dir

WINDOW = 32


def _entry(arch: str, **params):
    d = tiny_model_dir(arch, **params)
    e = inspect(Found(arch, d, "folder", "safetensors"))
    assert e.supported, e.reason
    return d, e


@pytest.mark.parametrize(("arch", "params", "kv_dtype", "dtype"), [
    ("llama", {}, "auto", "float32"),
    ("llama", {}, "int8", "float32"),
    ("qwen2", {}, "fp16", "bfloat16"),
    ("gemma3", {"sliding_window": WINDOW, "num_layers": 4}, "auto", "float32"),
])  # fmt: skip
def test_estimate_is_the_engines_pool_sizing(arch, params, kv_dtype, dtype):
    d, e = _entry(arch, **params)
    est = estimate(e.config, e.params, 100, kv_dtype, dtype, available=1 << 40)
    engine = LLMEngine(EngineConfig(model=str(d), kv_cache_memory=est.kv_bytes,
                                    kv_cache_dtype=kv_dtype, dtype=dtype))  # fmt: skip
    assert engine.kv_bytes_per_token == est.kv_bytes_per_token
    assert engine.block_bytes == est.block_bytes
    assert engine.num_blocks == est.kv_blocks
    assert engine.kv_layout.is_hybrid == est.hybrid == (arch == "gemma3")
    # the bytes torch allocated for the pool (and int8's scales): what the estimate counts
    runner = engine.runner
    pool = runner.kv_cache.nbytes + (runner.kv_scales.nbytes if runner.kv_scales is not None else 0)
    assert pool == est.kv_bytes
    assert est.weights_bytes == e.params * {"float32": 4, "bfloat16": 2}[dtype]
    assert est.total_bytes == est.weights_bytes + est.kv_bytes


def test_hybrid_saving_is_the_window_bound():
    _, e = _entry("gemma3", sliding_window=WINDOW, num_layers=4)
    c = e.config
    assert c.layer_types.count("sliding_attention") == 2  # tiny_model_dir: alternating
    context, block = 100, 16
    hybrid = estimate(c, e.params, context, available=1 << 40)
    flat = estimate(c, e.params, context, hybrid_kv=False, available=1 << 40)
    per_layer_token = 2 * c.num_kv_heads * c.head_dim * 4
    # every layer keeps every block: ceil(100/16) = 7 pages of 4 layers
    assert flat.kv_bytes == 7 * block * 4 * per_layer_token
    # 2 full layers keep 7 pages; each of the 2 sliding layers (one group of 2) at most
    # ceil(32/16) + 1 = 3: 10 pages of 2 layers
    assert hybrid.kv_bytes == (7 + 3) * block * 2 * per_layer_token
    assert hybrid.kv_bytes_per_token == flat.kv_bytes_per_token == 4 * per_layer_token
    assert estimate(c, e.params, 100, "fp8", available=1 << 40).note  # the engine refuses


def test_context_is_capped_at_the_models_and_bad_input_is_named():
    _, e = _entry("llama")
    est = estimate(e.config, e.params, 10**6, available=1 << 40)
    assert est.context == e.config.max_position_embeddings
    assert est.kv_blocks == math.ceil(est.context / 16)
    for kw, field in (({"kv_cache_dtype": "q4"}, "kv_cache_dtype"), ({"dtype": "int8"}, "dtype"),
                      ({"context": 0}, "context")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            estimate(e.config, e.params, **kw)


def test_fit_labels():
    assert fit_label(80, 100) == FITS
    assert fit_label(81, 100) == TIGHT
    assert fit_label(100, 100) == TIGHT
    assert fit_label(101, 100) == WONT_FIT
    assert fit_label(1, 0) == UNKNOWN
