"""Search over titles and every branch's messages, checked against brute-force recounts."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from app.conversations import Conversation, Message
from app.conversations.search import SearchHit, search
from app.conversations.store import to_json


def test_titles_come_first_then_messages_on_every_branch():
    a = Conversation(title="Paging notes", system_prompt="")
    q = a.append(Message("user", "How does PAGED\n  kv caching work?"))
    hidden = a.add_sibling(q, Message("user", "forget paged kv"))
    a.switch_branch(hidden, -1)
    b = Conversation(title="Other", messages=[Message("assistant", "paged KV, again")])
    hits = search([a, b], "  paged   kv ")
    assert [(h.conv_id, h.message_id, h.role) for h in hits] == [
        (a.id, q.id, "user"),
        (a.id, hidden.id, "user"),  # not on the branch on screen, still found
        (b.id, b.messages[0].id, "assistant"),
    ]
    assert hits[0] == SearchHit(a.id, q.id, "user", "How does PAGED   kv caching work?", 9, 10)
    title_hit = search([b, a], "PAGING")[0]
    assert title_hit == SearchHit(a.id, None, "", "Paging notes", 0, 6)


def test_long_text_is_cut_around_the_match():
    text = "x" * 100 + " needle " + "y" * 100
    conv = Conversation(messages=[Message("user", text)])
    (hit,) = search([conv], "NEEDLE")
    assert hit.snippet.startswith("…x") and hit.snippet.endswith("y…")
    assert 55 <= len(hit.snippet) <= 65
    assert hit.snippet[hit.start : hit.start + hit.length] == "needle"


def test_an_empty_query_finds_nothing_and_the_limit_holds():
    conv = Conversation(title="a a a", messages=[Message("user", "a " * 10)])
    assert search([conv], "") == [] and search([conv], " \n ") == []
    hits = search([conv], "a", limit=5)
    assert len(hits) == 5 and [h.message_id for h in hits[:3]] == [None] * 3


WORDS = ["kiwi", "Mango", "lime", "PLUM"]  # none occurs in the JSON's keys or ids
GAPS = [" ", "  ", "\n", "\t "]


@st.composite
def texts(draw) -> str:
    n = draw(st.integers(0, 12))
    words = [draw(st.sampled_from(WORDS)) for _ in range(n)]
    words = [w.upper() if draw(st.booleans()) else w for w in words]
    return "".join(w + draw(st.sampled_from(GAPS)) for w in words)


@st.composite
def conversations(draw) -> Conversation:
    conv = Conversation(title=draw(texts()), system_prompt="")
    for _ in range(draw(st.integers(0, 6))):
        path = conv.messages
        if path and draw(st.booleans()):  # sometimes branch off an earlier turn
            of = path[draw(st.integers(0, len(path) - 1))]
            conv.add_sibling(of, Message(of.role, draw(texts())))
        else:
            conv.append(Message("user" if len(path) % 2 == 0 else "assistant", draw(texts())))
    return conv


def normalised(text: str) -> str:
    return " ".join(text.split()).lower()


@settings(max_examples=80, deadline=None)
@given(convs=st.lists(conversations(), max_size=4), first=st.sampled_from(WORDS),
       second=st.sampled_from(WORDS), two=st.booleans())  # fmt: skip
def test_every_occurrence_is_found_once(convs, first, second, two):
    query = f"{first}\n {second}" if two else first
    hits = search(convs, query, limit=10**6)
    if not two:  # recount in the saved files themselves
        saved = "".join(json.dumps(to_json(c)) for c in convs)
        assert len(hits) == len(re.findall(first, saved, re.IGNORECASE))
    wanted = normalised(query)
    expected = [(c.id, None) for c in convs for _ in range(normalised(c.title).count(wanted))]
    expected += [(c.id, m.id) for c in convs for m in c.nodes.values()
                 for _ in range(normalised(m.content).count(wanted))]  # fmt: skip
    assert [(h.conv_id, h.message_id) for h in hits] == expected
    for h in hits:
        assert normalised(h.snippet[h.start : h.start + h.length]) == wanted
