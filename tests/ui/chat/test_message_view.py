"""A message in the transcript: user text stays literal, every message copies its own text, links
open outside the app, a streamed reply re-renders a bounded number of times (coalesced) and shows
exactly its final text once finished, wrapped labels keep fitting their text on resize, and the
wheel over a reply scrolls the transcript."""

from __future__ import annotations

from PySide6.QtCore import QObject, QPoint, Qt, QUrl, Slot
from PySide6.QtGui import QDesktopServices, QGuiApplication, QTextTable
from PySide6.QtTest import QTest

from app.conversations import ConversationStore, Message
from app.settings import SamplingDefaults
from ipc import protocol as P
from tests.ui.chat.qtdoc import block, formats_of_line
from ui.chat.answer_view import AnswerView
from ui.chat.message_view import MessageView
from ui.chat.panel import ChatPanel

STREAMED = """Here is the plan:

1. read the **config**
2. call `load()`

```python
def load(path):
    return open(path).read()
```

| step | cost |
|------|-----:|
| read | 3 ms |

Done, see [docs](https://example.org).
"""


def _panel(qtbot, tmp_path) -> ChatPanel:
    p = ChatPanel(ConversationStore(tmp_path), SamplingDefaults(temperature=0.0, max_tokens=9))
    qtbot.addWidget(p)
    p.set_engine_ready(True)
    p.resize(800, 600)
    p.show()
    return p


def _delta(rid: str, text: str) -> P.Delta:
    return P.Delta(request_id=rid, index=0, token_ids=[1], text=text, token_times=[0.0], time=0.0)


def _finish(rid: str) -> P.Finish:
    return P.Finish(request_id=rid, index=0, reason="stop", ttft=0.1, tpot=0.01, e2e=1.0,
                    usage=P.Usage(prompt_tokens=5, cached_tokens=0, completion_tokens=100))


def test_user_text_is_literal_and_copy_buttons_copy_the_message(qtbot):
    user = MessageView(Message("user", "**not bold** <b>nor this</b> `x`"))
    reply = MessageView(Message("assistant", "<think>\nsecret musing\n</think>\n\n**Yes.**"))
    for v in (user, reply):
        qtbot.addWidget(v)
    assert not isinstance(user.text, AnswerView)
    assert user.text.textFormat() == Qt.TextFormat.PlainText
    assert user.text.text() == "**not bold** <b>nor this</b> `x`"
    qtbot.mouseClick(user.copy_btn, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == "**not bold** <b>nor this</b> `x`"
    qtbot.mouseClick(reply.copy_btn, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == "**Yes.**"  # the answer, without the thinking
    assert reply.text.toPlainText() == "Yes."


class _Opened(QObject):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    @Slot(QUrl)
    def open(self, url: QUrl) -> None:
        self.urls.append(url.toString())


def test_web_links_open_outside_and_nothing_else_does(qtbot):
    v = MessageView(Message("assistant", "[a](https://example.org/x) [m](mailto:a@b.org)"))
    qtbot.addWidget(v)
    opened = _Opened()
    for scheme in ("https", "mailto", "file", "javascript"):
        QDesktopServices.setUrlHandler(scheme, opened, "open")
    try:
        for url in ("https://example.org/x", "mailto:a@b.org", "file:///etc/passwd",
                    "javascript:alert(1)"):  # fmt: skip
            v.text.anchorClicked.emit(QUrl(url))
    finally:
        for scheme in ("https", "mailto", "file", "javascript"):
            QDesktopServices.unsetUrlHandler(scheme)
    assert opened.urls == ["https://example.org/x", "mailto:a@b.org"]
    assert v.text.source().isEmpty()  # the view itself never navigated


def test_a_streamed_reply_renders_a_bounded_number_of_times_then_exactly(qtbot, tmp_path):
    p = _panel(qtbot, tmp_path)
    p.input.setPlainText("plan?")
    rid = p.send_current()
    reply = p.current.messages[-1]
    view = p._view_for(reply)
    user_view = p._view_for(p.current.messages[-2])
    user_renders, before = user_view.render_count, view.render_count
    chunks = [STREAMED[i:i + 3] for i in range(0, len(STREAMED), 3)]
    half = len(chunks) // 2
    # Deltas that arrive while the event loop is busy (one batch of work, no turn of the loop
    # between them) are drawn once, when the render timer fires: the count of renders follows
    # the turns of the loop, not the deltas, whatever the machine's speed.
    for burst, drawn in ((chunks[:half], 1), (chunks[half:], 2)):
        for c in burst:
            p.on_replies([_delta(rid, c)])
        assert view.render_count == before + drawn - 1 and view.render_pending
        qtbot.waitUntil(lambda: not view.render_pending, timeout=2000)
        assert view.render_count == before + drawn
    renders = view.render_count - before
    assert view.text.toPlainText().endswith("▍")  # still streaming
    assert user_view.render_count == user_renders  # only the streaming message re-renders
    p.on_replies([_finish(rid)])
    assert not view.render_pending and view.render_count == before + renders + 1
    assert view.text.text() == STREAMED == reply.content  # the final text, no cursor
    doc = view.text.document()
    assert "▍" not in doc.toPlainText() and "def load(path):" in doc.toPlainText()
    assert view.text.code_blocks[0].code == "def load(path):\n    return open(path).read()"


def test_partial_markdown_renders_while_it_streams(qtbot):
    v = MessageView(Message("assistant", "```python\ndef f(x):\n    return x"))  # no closing fence
    qtbot.addWidget(v)
    v.refresh(streaming=True)
    qtbot.waitUntil(lambda: not v.render_pending, timeout=2000)
    line = block(v.text.document(), "def f(x):")
    assert len({f.foreground().color().name() for f in formats_of_line(line)}) > 1  # code
    assert v.text.code_blocks[0].code == "def f(x):\n    return x"
    v.msg.content = "| a | b |\n|---|---|\n| 1 |"  # a table whose row is half there
    v.refresh()
    tables = [f for f in v.text.document().rootFrame().childFrames() if isinstance(f, QTextTable)]
    assert len(tables) == 1 and (tables[0].rows(), tables[0].columns()) == (2, 2)
    assert tables[0].cellAt(1, 0).firstCursorPosition().block().text() == "1"


def test_wrapped_text_keeps_fitting_when_the_window_narrows(qtbot, tmp_path):
    p = _panel(qtbot, tmp_path)
    p.input.setPlainText("word " * 60)
    p.send_current()
    user = p._view_for(p.current.messages[-2])
    qtbot.waitUntil(lambda: user.text.height() == user.text.heightForWidth(user.text.width()))
    wide, width = user.text.height(), user.text.width()
    p.resize(420, 600)
    qtbot.waitUntil(lambda: user.text.width() < width)
    qtbot.waitUntil(lambda: user.text.height() == user.text.heightForWidth(user.text.width()))
    assert user.text.height() > wide
    qtbot.waitUntil(lambda: user.height() >= user.text.height())  # the message grew with it


def test_the_wheel_over_a_reply_scrolls_the_transcript(qtbot, tmp_path):
    p = _panel(qtbot, tmp_path)
    for i in range(6):
        p.current.append(Message("user", f"q{i}"))
        p.current.append(Message("assistant", STREAMED))
    p._show_current()
    bar = p.transcript.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 300)
    bar.setValue(bar.maximum() // 2)
    qtbot.wait(20)
    reply = next(v.text for v in p.transcript.views if isinstance(v.text, AnswerView)
                 and not v.text.visibleRegion().isEmpty())  # fmt: skip
    at = reply.visibleRegion().boundingRect().center()
    before = bar.value()
    # through the window, as a real wheel arrives (a sent QWheelEvent would not propagate)
    QTest.wheelEvent(p.windowHandle(), reply.mapTo(p, at), QPoint(0, -120))
    qtbot.waitUntil(lambda: bar.value() > before)


def test_the_old_plain_view_renders_each_change_at_once(qtbot):
    """markdown=False: the plain-text view the benchmark compares against."""
    v = MessageView(Message("assistant", "**a**"), markdown=False)
    qtbot.addWidget(v)
    v.refresh(streaming=True)
    assert not v.render_pending and v.text.text() == "**a** ▍"
    v.refresh()
    assert v.text.text() == "**a**" and not isinstance(v.text, AnswerView)
