"""TokenCounter against a fake `send`, the engine link's routing of Tokenized replies (no sockets:
the worker's dispatch is driven with hand-made messages), the window feed's split between the
counter and the chat, and the demo link's tokenize."""

from __future__ import annotations

from PySide6.QtCore import QObject

from ipc import protocol as P
from ui.chat.attachments import estimate_tokens
from ui.chat.token_counter import TokenCounter
from ui.engine.demo import DemoLink
from ui.engine.link import EngineLink
from ui.window.feed import TelemetryFeed


class FakeEngine:
    """A `send` that records requests; `answer` replies as the engine would (one id per word)."""

    def __init__(self, reachable: bool = True) -> None:
        self.reachable = reachable
        self.sent: dict[str, str] = {}

    def __call__(self, rid: str, text: str) -> bool:
        if self.reachable:
            self.sent[rid] = text
        return self.reachable

    def answer(self, rid: str, max_model_len: int = 2048) -> P.Tokenized:
        text = self.sent[rid]
        return P.Tokenized(request_id=rid, token_ids=list(range(len(text.split()))), text=text,
                           max_model_len=max_model_len)


def _collect(counter: TokenCounter) -> list[tuple]:
    got: list[tuple] = []
    counter.counted.connect(lambda key, n, est: got.append((key, n, est)))
    return got


def test_exact_counts_come_from_the_replies(qtbot):
    engine = FakeEngine()
    counter = TokenCounter(engine)
    got = _collect(counter)
    counter.count("a", "one two three")
    counter.count(("bar", 1), "four five")
    assert got == [] and counter.pending() == 2
    rid_a, rid_b = engine.sent
    chat = P.Delta(request_id="chat-1", index=0, token_ids=[1], text="x", token_times=[0.0],
                   time=0.0)
    rest = counter.take_replies([engine.answer(rid_b, 4096), chat, engine.answer(rid_a)])
    assert rest == [chat]  # the chat's messages pass through untouched
    assert got == [(("bar", 1), 2, False), ("a", 3, False)]
    assert counter.max_model_len == 2048 and counter.pending() == 0
    assert counter.take_replies([engine.answer(rid_a)]) == []  # a late duplicate: swallowed


def test_estimates_without_an_engine(qtbot):
    text = "x" * 41
    for send in (None, FakeEngine(reachable=False)):
        counter = TokenCounter(send)
        got = _collect(counter)
        counter.count("k", text)
        assert got == [("k", estimate_tokens(text), True)] == [("k", 11, True)]


def test_an_error_or_silence_falls_back_to_the_estimate(qtbot):
    engine = FakeEngine()
    counter = TokenCounter(engine, timeout_ms=50)
    got = _collect(counter)
    counter.count("err", "a b c d e f g h")
    (rid,) = engine.sent
    counter.take_replies([P.Error(code=P.ERR_INVALID_REQUEST, message="bad", request_id=rid)])
    assert got == [("err", estimate_tokens("a b c d e f g h"), True)]
    counter.count("silent", "abcdefgh")
    qtbot.waitUntil(lambda: len(got) == 2, timeout=2000)
    assert got[1] == ("silent", 2, True)


def test_newer_counts_supersede_and_forgotten_keys_stay_quiet(qtbot):
    engine = FakeEngine()
    counter = TokenCounter(engine)
    got = _collect(counter)
    counter.count("typed", "a b")
    counter.count("typed", "a b c d")  # the user typed on
    counter.count("gone", "x y z")
    counter.forget("gone")
    old, new, gone = engine.sent
    counter.take_replies([engine.answer(new), engine.answer(old), engine.answer(gone)])
    assert got == [("typed", 4, False)]


def test_two_counters_keep_their_own_replies(qtbot):
    e1, e2 = FakeEngine(), FakeEngine()
    c1, c2 = TokenCounter(e1), TokenCounter(e2)
    got1, got2 = _collect(c1), _collect(c2)
    c1.count("k", "a")
    c2.count("k", "a b")
    replies = [e1.answer(next(iter(e1.sent))), e2.answer(next(iter(e2.sent)))]
    assert c1.take_replies(replies) == replies[1:]
    assert got1 == [("k", 1, False)] and got2 == []


def test_the_link_routes_tokenized_to_replies(qtbot):
    link = EngineLink("tcp://127.0.0.1:9")
    got: list = []
    link.replies.connect(got.extend)
    link._token_ids = {"count-1", "count-2"}
    ok = P.Tokenized(request_id="count-1", token_ids=[5, 6], text="hi", max_model_len=512)
    err = P.Error(code=P.ERR_INVALID_REQUEST, message="bad", request_id="count-2")
    stranger = P.Tokenized(request_id="someone-else", token_ids=[], text="", max_model_len=512)
    link._dispatch([ok, err, stranger], gen=None)  # type: ignore[arg-type]
    assert got == [ok, err] and link._token_ids == set()


def test_the_link_queues_a_tokenize(qtbot):
    link = EngineLink("tcp://127.0.0.1:9")
    assert link.tokenize("count-9", "some text") is True
    assert link._cmds.get_nowait() == ("tokenize", "count-9", "some text")


class _Window(QObject):
    """What TelemetryFeed.on_replies reads of the window."""

    def __init__(self, counter: TokenCounter) -> None:
        super().__init__()
        self.token_counter = counter
        self.chat_got: list = []
        self.chat = self
        self.perf = {"replies": []}

    def on_replies(self, msgs: list) -> None:
        self.chat_got.append(msgs)


def test_the_feed_gives_tokenized_to_the_counter_and_the_rest_to_the_chat(qtbot):
    engine = FakeEngine()
    counter = TokenCounter(engine)
    got = _collect(counter)
    w = _Window(counter)
    feed = TelemetryFeed(w, refresh_hz=10.0)  # type: ignore[arg-type]
    counter.count("k", "a b c")
    (rid,) = engine.sent
    finish = P.Finish(request_id="chat-1", index=0, reason="stop",
                      usage=P.Usage(prompt_tokens=1, cached_tokens=0, completion_tokens=1))
    feed.on_replies([engine.answer(rid)])
    assert got == [("k", 3, False)] and w.chat_got == []  # nothing for the chat: not called
    feed.on_replies([finish])
    assert w.chat_got == [[finish]]


def test_the_demo_link_has_no_tokenizer(qtbot):
    demo = DemoLink()
    counter = TokenCounter(demo.tokenize)
    got = _collect(counter)
    counter.count("k", "12345678")
    assert got == [("k", 2, True)]
