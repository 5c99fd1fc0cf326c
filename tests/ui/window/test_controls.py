"""The engine controls panel without an engine: the prefill chunk's "auto" box against the
configs telemetry brings, stale ones included."""

from __future__ import annotations

from ui.window.controls import ControlsPanel

CONFIG = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "enable_prefix_caching": True}


def test_auto_waits_for_the_engine_and_gives_way_to_the_slider(qtbot):
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.setEnabled(True)
    sent: list[tuple[str, dict]] = []
    panel.control.connect(lambda op, fields: sent.append((op, fields)))
    panel.show_config(CONFIG | {"long_prefill_chunk": 512, "long_prefill_chunk_default": True})
    assert panel.auto_chunk.isChecked()
    panel.set_limit("long_prefill_chunk", 64)  # a number of one's own
    assert not panel.auto_chunk.isChecked()
    qtbot.waitUntil(lambda: sent == [("set_limits", {"long_prefill_chunk": 64})], timeout=5000)
    panel.show_config(CONFIG | {"long_prefill_chunk": 64})
    assert panel.values["long_prefill_chunk"].text() == "64"
    panel.auto_chunk.click()
    assert sent[-1] == ("set_limits", {"default_prefill_chunk": True})
    # a telemetry frame from before the engine took it: the box and the slider wait
    panel.show_config(CONFIG | {"long_prefill_chunk": 64})
    assert panel.auto_chunk.isChecked() and panel.values["long_prefill_chunk"].text() == "64"
    panel.show_config(CONFIG | {"long_prefill_chunk": 512, "long_prefill_chunk_default": True})
    assert panel.auto_chunk.isChecked() and panel.values["long_prefill_chunk"].text() == "512"
    # refused: the next config says what runs
    panel.auto_chunk.click()  # off: the slider's number becomes one's own
    qtbot.waitUntil(lambda: sent[-1] == ("set_limits", {"long_prefill_chunk": 512}), timeout=5000)
    panel.auto_chunk.click()
    panel.show_result("refused", error=True)
    panel.show_config(CONFIG | {"long_prefill_chunk": 512})
    assert not panel.auto_chunk.isChecked()
