"""The Experts tab (issue 31): which experts a routed-experts model's traffic wakes. A tiny
Qwen3-MoE engine's telemetry, through the wire, into the view: the tokens per [layer, expert] it
draws for a reply equal a recount from transformers' own router logits over the same tokens; the
window drops what is older than its seconds; the tab shows for MoE models only."""

from __future__ import annotations

import numpy as np
import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.server.wire import telemetry_from_snapshot
from ipc import protocol as P
from tests.tiny_models import hf_reference_model, tiny_moe_model_dir
from ui.charts.experts import ExpertRoutingView, routing_caption
from ui.telemetry import Frame

PROMPT = torch.randint(3, 49152, (30,), generator=torch.Generator().manual_seed(3)).tolist()
MOE = dict(num_experts=6, num_experts_per_tok=2, num_layers=3, mlp_only_layers=(1,))


def _frame(engine: LLMEngine, seq: int) -> Frame:
    wire = P.decode_pub(P.encode(telemetry_from_snapshot(engine.snapshot(), seq, False, 0)))
    return Frame.from_wire(wire)


def test_the_view_draws_what_transformers_router_chooses(qtbot):
    path = tiny_moe_model_dir("qwen3_moe", **MOE)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64,
                                    decode_weights="dense"))  # fmt: skip
    view = ExpertRoutingView(window_s=1e9)
    qtbot.addWidget(view)
    view.add(_frame(engine, 1))
    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0,
                                                      ignore_eos=True))  # fmt: skip
    view.add(_frame(engine, 2))
    assert view.has_experts
    drawn = view.window_counts()

    # transformers' router over every token the engine ran: the prompt and each generated
    # token but the last (which was sampled, not fed back)
    tokens = PROMPT + out.token_ids[:-1]
    ref = hf_reference_model(path)
    with torch.no_grad():
        res = ref(torch.tensor([tokens]), output_router_logits=True)
    expected = np.zeros((3, 6), dtype=np.int64)
    moe_layers = [0, 2]  # layer 1 is dense (mlp_only_layers)
    assert len(res.router_logits) == len(moe_layers)
    for layer, logits in zip(moe_layers, res.router_logits, strict=True):
        top = torch.topk(logits.reshape(len(tokens), 6), 2, dim=-1).indices
        expected[layer] = np.bincount(top.reshape(-1).numpy(), minlength=6)
    assert np.array_equal(drawn, expected)
    assert drawn[1].sum() == 0 and drawn.sum() == len(tokens) * 2 * 2

    view.redraw()
    assert np.array_equal(view.image.image, expected.astype(np.float32))
    assert view.caption.text() == routing_caption(expected, 1e9)
    assert f"{expected.sum():,}" in view.caption.text()


def _synthetic(t: float, counts: list[list[int]] | None) -> Frame:
    return Frame.from_wire({"time": t, "blocks": {"state": []}, "requests": [], "counters": {},
                            "config": {}, "expert_counts": counts or []})  # fmt: skip


def test_the_window_forgets_older_traffic_and_restarts_with_the_engine(qtbot):
    view = ExpertRoutingView(window_s=10.0)
    qtbot.addWidget(view)
    view.add(_synthetic(0.0, [[0, 0], [0, 0]]))
    view.add(_synthetic(5.0, [[4, 0], [1, 3]]))
    view.add(_synthetic(12.0, [[4, 6], [1, 9]]))
    # at 12 s the window starts at 2 s: the baseline is the 0 s sample (the last at or before it)
    assert view.window_counts().tolist() == [[4, 6], [1, 9]]
    view.add(_synthetic(16.0, [[5, 6], [2, 9]]))
    assert view.window_counts().tolist() == [[1, 6], [1, 6]]  # since the 5 s sample
    view.add(_synthetic(1.0, [[1, 0], [0, 1]]))  # a restarted engine: a new clock
    assert view.window_counts().tolist() == [[0, 0], [0, 0]]
    view.add(_synthetic(2.0, None))  # a model without experts
    assert not view.has_experts and view.window_counts() is None
    view.redraw()
    assert view.caption.text() == "no routed experts in this model"


def test_the_experts_tab_shows_for_moe_models_only(qtbot, tmp_path):
    from app.conversations import ConversationStore
    from app.settings import open_settings
    from ui.window.main_window import EngineSource, MainWindow

    d = tmp_path / "data"
    w = MainWindow(open_settings(d), ConversationStore(d / "conversations"),
                   EngineSource(connect="tcp://127.0.0.1:9"), data_dir=d)  # fmt: skip
    qtbot.addWidget(w)
    tab = w.kv_tabs.indexOf(w.expert_view)
    assert not w.kv_tabs.isTabVisible(tab)
    w.feed._take_frames([_synthetic(1.0, [[1, 2]]), _synthetic(2.0, [[3, 2]])])
    assert w.kv_tabs.isTabVisible(tab)
    w.kv_tabs.setCurrentWidget(w.expert_view)
    w.feed.redraw_now()
    for _ in range(3):  # every phase: the map's redraws the tab shown
        w.feed._refresh()
    assert int(np.asarray(w.expert_view.image.image).sum()) == 2
    w.feed._take_frames([_synthetic(3.0, None)])
    assert not w.kv_tabs.isTabVisible(tab)
