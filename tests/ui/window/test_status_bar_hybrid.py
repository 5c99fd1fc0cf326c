"""The status bar's KV figures for a hybrid KV cache (issue 31): the per-group formula, the pool's
bytes and a long chat's footprint, checked against a real engine on a tiny Gemma-3-shaped model
(its pool tensor, the blocks its request tables hold) and against the config's own arithmetic;
the same engine's telemetry and /metrics carry the blocks per attention type."""

from __future__ import annotations

import re
from types import SimpleNamespace

import msgspec
from PySide6.QtWidgets import QStatusBar

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.engine.telemetry import group_block_counts
from ipc import protocol as P
from tests.tiny_models import tiny_model_dir
from ui.units import human_bytes
from ui.window.status_bar import StatusBarView, hybrid_chat_bytes, hybrid_kv_formula, kv_formula

SLIDING, FULL = "sliding_attention", "full_attention"
WINDOW, BLOCK, CONTEXT = 20, 8, 200


def _engine() -> LLMEngine:
    path = tiny_model_dir("gemma3", num_layers=4, sliding_window=WINDOW, num_kv_heads=2,
                          layer_types=(SLIDING, SLIDING, FULL, SLIDING))  # fmt: skip
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=BLOCK,
                                  num_kv_blocks=120, max_model_len=CONTEXT,
                                  long_prefill_chunk=32))  # fmt: skip


def _model_info(engine: LLMEngine) -> P.ModelInfo:
    info = {k: v for k, v in engine.model_info().items() if k in P.ModelInfo.__struct_fields__}
    info["kv_groups"] = [P.KVGroup(**g) for g in info["kv_groups"]]
    return P.ModelInfo(**info)


def _bytes(text: str) -> list[int]:
    """The 'full + sliding B' figures of a formula."""
    found = re.search(r"= ([\d,]+) \+ ([\d,]+) B\b", text)
    assert found is not None, text
    return [int(n.replace(",", "")) for n in found.groups()]


def test_the_formula_splits_full_and_sliding_layers_as_the_engine_holds_them(qtbot):
    engine = _engine()
    m = _model_info(engine)
    cfg = engine.model_config
    per_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # float32 K and V
    text = hybrid_kv_formula(m)
    assert text.startswith("KV/token 2·L_full·H_kv·D·b + 2·L_sliding·H_kv·D·b = "
                           "2·1·2·16·4 + 2·3·2·16·4 = ")  # fmt: skip
    assert _bytes(text)[:2] == [1 * per_layer, 3 * per_layer]
    assert text.endswith(f"B (sliding: last {WINDOW:,} tokens)")
    # a model with one group keeps the plain formula
    assert hybrid_kv_formula(msgspec.structs.replace(m, kv_groups=[])) == ""
    assert kv_formula(m).endswith(f"{4 * per_layer:,} B")

    # the pool the engine allocated: pages of one group's layers (here 1), not of all 4
    assert m.kv_pool_bytes == engine.runner.kv_cache.nbytes
    assert m.kv_pool_bytes == engine.num_blocks * BLOCK * per_layer

    # a chat at the longest context: what its tables hold in the engine, against the bar's figure
    prompt = list(range(10, 10 + CONTEXT - 2))
    engine.add_request("long", prompt, SamplingParams(max_tokens=2, temperature=0,
                                                      ignore_eos=True))  # fmt: skip
    while engine.requests["long"][0].num_computed_tokens < len(prompt):
        engine.step()
    seq = engine.requests["long"][0]
    held_blocks = sum(1 for t in (seq.block_table, *seq.group_tables) for b in t if b >= 0)
    held = held_blocks * BLOCK * per_layer
    said, contiguous = hybrid_chat_bytes(m, CONTEXT)
    # the engine holds no more than the bar says (it may be a block short of the straddle)
    assert held <= said and said - held <= 3 * BLOCK * per_layer
    assert contiguous == CONTEXT * 4 * per_layer
    bar = QStatusBar()
    qtbot.addWidget(bar)
    view = StatusBarView(bar)
    view.show_engine(m)
    assert text in view.kv_label.text()
    assert view.kv_label.toolTip().startswith(
        f"hybrid KV cache: a {CONTEXT}-token chat holds {human_bytes(said)}, not "
        f"{human_bytes(contiguous)} contiguous")

    counts = group_block_counts(engine.all_sequences(), engine.kv.windows)
    assert counts == {"kv_blocks_full_attention": len(seq.block_table),
                      "kv_blocks_sliding_window": held_blocks - len(seq.block_table)}
    assert counts["kv_blocks_sliding_window"] <= 3 * (-(-WINDOW // BLOCK) + 1)
    snapshot = engine.snapshot()
    assert snapshot.counters["kv_blocks_full_attention"] == counts["kv_blocks_full_attention"]
    engine.abort_request("long")
    assert engine.kv.pool.num_free == engine.num_blocks


def test_metrics_export_the_blocks_by_attention_type():
    from app.api.metrics import render

    engine = _engine()
    engine.add_request("r", list(range(10, 90)), SamplingParams(max_tokens=4, temperature=0,
                                                                ignore_eos=True))  # fmt: skip
    engine.step()
    snap = engine.snapshot()

    # what the API's collector reads of the engine's latest telemetry
    telemetry = SimpleNamespace(counters=dict(snap.counters), histograms={}, finished_reasons={},
                                config=SimpleNamespace(enable_prefix_caching=True))
    source = SimpleNamespace(telemetry=telemetry, model_info=_model_info(engine))
    text = render(source, "tiny").decode()
    full = re.search(r'kvscope:kv_group_blocks\{.*attention="full_attention".*\} ([\d.]+)', text)
    sliding = re.search(r'kvscope:kv_group_blocks\{.*attention="sliding_window".*\} ([\d.]+)',
                        text)  # fmt: skip
    assert full and sliding, text
    seq = engine.requests["r"][0]
    assert float(full[1]) == sum(1 for b in seq.block_table if b >= 0)
    assert float(sliding[1]) == sum(1 for t in seq.group_tables for b in t if b >= 0)
