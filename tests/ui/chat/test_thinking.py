"""A reply's thinking block in the window: split from the answer, open while the model thinks,
closed once when the answer starts, its tokens and time on the toggle; replies without thinking
unchanged."""

from __future__ import annotations

import pytest

from app.conversations import ConversationStore
from app.settings import SamplingDefaults
from ipc import protocol as P
from ui.chat.panel import ChatPanel
from ui.chat.thinking import split_thinking


@pytest.mark.parametrize(("text", "inside", "want"), [
    ("plain answer", False, (None, "plain answer", False)),
    ("<think>\nhmm", False, ("\nhmm", "", True)),
    ("<think>\nhmm\n</think>\n\nYes.", False, ("hmm", "Yes.", False)),
    ("<think>a</thi", False, ("a", "", True)),  # a marker that has not fully arrived is hidden
    ("<thi", False, ("", "", True)),
    ("why</think>Because.", True, ("why", "Because.", False)),
    ("a <think> in the middle", False, (None, "a <think> in the middle", False)),
    ("<think>x</think>y<think>z</think>", False, ("x", "y<think>z</think>", False)),
])  # fmt: skip
def test_split(text: str, inside: bool, want: tuple) -> None:
    s = split_thinking(text, inside)
    assert (s.reasoning, s.answer, s.thinking) == want


def _delta(rid: str, text: str, n: int = 1) -> P.Delta:
    return P.Delta(request_id=rid, index=0, token_ids=[1] * n, text=text,
                   token_times=[0.0] * n, time=0.0)  # fmt: skip


def _rendered(qtbot, view) -> None:
    """A streaming reply renders on a timer (coalesced): wait for it."""
    qtbot.waitUntil(lambda: not view.render_pending, timeout=2000)


def _panel(qtbot, tmp_path) -> ChatPanel:
    p = ChatPanel(ConversationStore(tmp_path), SamplingDefaults(temperature=0.0, max_tokens=9))
    qtbot.addWidget(p)
    p.set_engine_ready(True)
    p.show()
    return p


def test_thinking_block_opens_while_thinking_and_closes_when_the_answer_starts(qtbot, tmp_path):
    p = _panel(qtbot, tmp_path)
    p.input.setPlainText("Is 7 prime?")
    rid = p.send_current()
    thinking = [("<think>\n", 1), ("Divisors of 7", 3), (": only 1 and 7.", 5)]
    p.on_replies([_delta(rid, t, n) for t, n in thinking])
    reply = p.current.messages[-1]
    view = p._view_for(reply)
    _rendered(qtbot, view)
    assert not view.think_toggle.isHidden() and view.think_toggle.isChecked()
    assert not view.think_text.isHidden()
    assert view.think_text.text() == "\nDivisors of 7: only 1 and 7."
    assert view.think_toggle.text() == "Thinking… 9 tokens"
    assert "<think>" not in view.text.text()
    p.on_replies([_delta(rid, "\n</think>\n\n", 2), _delta(rid, "Yes, 7 is prime.", 4)])
    _rendered(qtbot, view)
    assert not view.think_toggle.isChecked() and view.think_text.isHidden()
    assert view.text.text().startswith("Yes, 7 is prime.") and "think" not in view.text.text()
    assert reply.stats["thinking_tokens"] == 1 + 3 + 5 + 2  # every delta up to the marker's
    p.on_replies([P.Finish(request_id=rid, index=0, reason="stop", ttft=0.1, tpot=0.05, e2e=1.0,
                           usage=P.Usage(prompt_tokens=9, cached_tokens=0,
                                         completion_tokens=15))])  # fmt: skip
    assert reply.stats["thinking_tokens"] == 11 and reply.stats["completion_tokens"] == 15
    assert view.think_toggle.text().startswith("Thought for ")
    assert view.think_toggle.text().endswith(" s · 11 tokens")
    view.think_toggle.click()  # the user opens it again
    assert not view.think_text.isHidden()
    assert reply.content.startswith("<think>")  # the transcript keeps the model's text


def test_reply_without_thinking_has_no_block(qtbot, tmp_path):
    p = _panel(qtbot, tmp_path)
    p.input.setPlainText("hi")
    rid = p.send_current()
    p.on_replies([_delta(rid, "Hello there.")])
    view = p._view_for(p.current.messages[-1])
    _rendered(qtbot, view)
    assert view.think_toggle.isHidden() and "thinking_tokens" not in view.msg.stats


def test_a_prompt_that_opens_the_block(qtbot, tmp_path):
    p = _panel(qtbot, tmp_path)
    p.reasoning_open = True  # ModelInfo.reasoning_parser "think_open"
    p.input.setPlainText("hi")
    rid = p.send_current()
    p.on_replies([_delta(rid, "pondering", 2)])
    view = p._view_for(p.current.messages[-1])
    _rendered(qtbot, view)
    assert view.think_toggle.isChecked() and view.think_text.text() == "pondering"
    p.on_replies([_delta(rid, "</think>Hi!", 2)])
    _rendered(qtbot, view)
    assert view.text.text().startswith("Hi!") and not view.think_toggle.isChecked()
