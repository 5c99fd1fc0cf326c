"""A reply's stats line gives the share of its drafts the engine confirmed (speculative decoding,
issue 35): from the Finish's Usage, as it crosses the wire; nothing from engines that did not
speculate for it or that predate the fields."""

from __future__ import annotations

import msgspec

from ipc import protocol as P
from tests.ui.chat.test_panel import _delta, _panel


def _finish(rid: str, **usage) -> P.Finish:
    msg = P.Finish(request_id=rid, index=0, reason="length", ttft=0.25, tpot=0.05, e2e=0.3,
                   usage=P.Usage(prompt_tokens=30, cached_tokens=16, completion_tokens=2,
                                 **usage))  # fmt: skip
    return P.decode_engine(P.encode(msg))  # as the client receives it


def test_stats_line_shows_the_accepted_fraction(qtbot, tmp_path) -> None:
    p, _, _ = _panel(qtbot, tmp_path)
    p.input.setPlainText("quote it back")
    rid = p.send_current()
    p.on_replies([_delta(rid, "quoted")])
    p.on_replies([_finish(rid, draft_tokens=40, accepted_draft_tokens=31)])
    reply = p.current.messages[-1]
    line = p._view_for(reply).stats.text()
    assert line == ("TTFT 250 ms · 20.0 tok/s · prompt 30 / cached 16 / generated 2 · "
                    "drafts 31/40 accepted (78%) · length")


def test_no_drafts_part_without_speculation(qtbot, tmp_path) -> None:
    p, _, _ = _panel(qtbot, tmp_path)
    p.input.setPlainText("hello")
    rid = p.send_current()
    p.on_replies([_finish(rid)])
    assert "drafts" not in p._view_for(p.current.messages[-1]).stats.text()
    # the wire leaves the zero counts out, so an older peer's Usage decodes as it did; and a
    # Finish from an older engine (no such fields) decodes with zeros
    wire = msgspec.msgpack.decode(P.encode(_finish("r")))
    assert set(wire["usage"]) == {"prompt_tokens", "cached_tokens", "completion_tokens"}
    old = {"kind": "finish", "request_id": "r", "index": 0, "reason": "stop",
           "usage": {"prompt_tokens": 1, "cached_tokens": 0, "completion_tokens": 1}}
    u = P.decode_engine(msgspec.msgpack.encode(old)).usage
    assert (u.draft_tokens, u.accepted_draft_tokens) == (0, 0)
