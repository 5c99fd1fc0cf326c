"""Chat panel logic with protocol messages played by hand (no engine): what it submits, how
replies land, Regenerate, Stop, refusals, engine loss, the Enter key."""

from __future__ import annotations

from PySide6.QtCore import Qt

from app.conversations import ConversationStore
from app.settings import SamplingDefaults
from ipc import protocol as P
from ui.chat.message_view import format_stats
from ui.chat.panel import ChatPanel


def _panel(qtbot, tmp_path) -> tuple[ChatPanel, list, list]:
    p = ChatPanel(ConversationStore(tmp_path), SamplingDefaults(temperature=0.0, max_tokens=9))
    qtbot.addWidget(p)
    submitted, aborted = [], []
    p.submit.connect(lambda rid, msgs, s: submitted.append((rid, msgs, s)))
    p.abort.connect(aborted.append)
    p.set_engine_ready(True)
    return p, submitted, aborted


def _delta(rid: str, text: str) -> P.Delta:
    return P.Delta(request_id=rid, index=0, token_ids=[1], text=text, token_times=[0.0], time=0.0)


def _finish(rid: str, reason: str = "stop", n: int = 2) -> P.Finish:
    return P.Finish(request_id=rid, index=0, reason=reason, ttft=0.25, tpot=0.05, e2e=0.3,
                    usage=P.Usage(prompt_tokens=30, cached_tokens=16, completion_tokens=n))


def test_send_stream_finish_regenerate(qtbot, tmp_path):
    p, submitted, _ = _panel(qtbot, tmp_path)
    p.system_edit.setPlainText("Be brief.")
    p.input.setPlainText("What is a block?")
    rid = p.send_current()
    assert submitted[-1] == (rid, [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is a block?"}],
                             {"temperature": 0.0, "top_p": 0.95, "top_k": 0, "max_tokens": 9})
    assert p.input.toPlainText() == "" and p.busy() and not p.send_btn.isEnabled()
    assert p.current.title == "What is a block?"  # auto-titled from the first turn
    p.on_replies([_delta(rid, "A fixed"), _delta(rid, " slab.")])
    reply = p.current.messages[-1]
    view = p._view_for(reply)
    qtbot.waitUntil(lambda: not view.render_pending, timeout=2000)  # streaming renders coalesce
    assert reply.content == "A fixed slab." and view.text.text().startswith("A fixed slab.")
    p.on_replies([_finish(rid)])
    assert not p.busy() and reply.stats["completion_tokens"] == 2
    line = p._view_for(reply).stats.text()
    assert line == "TTFT 250 ms · 20.0 tok/s · prompt 30 / cached 16 / generated 2 · stop"
    assert line == format_stats(reply.stats)
    # Regenerate: same history, the old reply replaced
    rid2 = p.regenerate()
    assert rid2 != rid and submitted[-1][1] == submitted[-2][1]
    assert [m.role for m in p.current.messages] == ["user", "assistant"]
    assert p.current.messages[-1].content == ""
    # a late delta of the old request changes nothing
    p.on_replies([_delta(rid, "zzz")])
    assert p.current.messages[-1].content == ""


def test_stop_refusal_and_engine_loss(qtbot, tmp_path):
    p, submitted, aborted = _panel(qtbot, tmp_path)
    p.input.setPlainText("one")
    rid = p.send_current()
    p.on_replies([_delta(rid, "par")])
    qtbot.mouseClick(p.stop_btn, Qt.MouseButton.LeftButton)
    assert aborted == [rid]
    p.on_replies([_finish(rid, "abort", 1)])
    reply = p.current.messages[-1]
    assert reply.interrupted and reply.content == "par" and "stopped" in \
        p._view_for(reply).stats.text()
    # the engine refuses a request
    p.input.setPlainText("two")
    rid = p.send_current()
    p.on_replies([P.Error(code=P.ERR_INVALID_REQUEST, message="prompt too long",
                          request_id=rid)])
    assert p.current.messages[-1].interrupted and not p.busy()
    assert "prompt too long" in p._view_for(p.current.messages[-1]).stats.text()
    # the engine dies mid-reply: text kept, marked, saved
    p.input.setPlainText("three")
    rid = p.send_current()
    p.on_replies([_delta(rid, "half")])
    p.interrupt_all("interrupted: engine stopped")
    saved = {c.id: c for c in p.store.load_all()}[p.current.id]
    assert saved.messages[-1].content == "half" and saved.messages[-1].interrupted
    assert saved.messages[-2].content == "three"
    assert not p.busy()


def test_enter_sends_and_shift_enter_does_not(qtbot, tmp_path):
    p, submitted, _ = _panel(qtbot, tmp_path)
    p.input.setFocus()
    qtbot.keyClicks(p.input, "hello")
    qtbot.keyClick(p.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    assert not submitted and "\n" in p.input.toPlainText()
    qtbot.keyClicks(p.input, "world")
    qtbot.keyClick(p.input, Qt.Key.Key_Return)
    assert submitted and submitted[-1][1][-1]["content"] == "hello\nworld"
    # not ready: nothing is sent and the text stays
    p.on_replies([_finish(submitted[-1][0])])
    p.set_engine_ready(False)
    p.input.setPlainText("later")
    assert p.send_current() is None and p.input.toPlainText() == "later"
