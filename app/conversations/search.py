"""Search every conversation's title and every message on every branch, for the sidebar's
search box. A hit names the message, so the GUI can `select` it even on a hidden branch."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from app.conversations.model import Conversation

SNIPPET_CHARS = 60


@dataclass(slots=True, frozen=True)
class SearchHit:
    conv_id: str
    message_id: str | None  # None: the match is in the conversation's title
    role: str  # the message's role; "" for a title hit
    snippet: str  # about SNIPPET_CHARS of context, "…" where cut, whitespace shown as spaces
    start: int  # where the match starts in `snippet`
    length: int  # its length there (whitespace in the text may be longer than in the query)


def search(convs: Iterable[Conversation], query: str, limit: int = 200) -> list[SearchHit]:
    """Case-insensitive; whitespace in the query matches any run of whitespace. Title hits come
    first, then message hits, each in the order the conversations are given (messages in
    creation order). An empty query finds nothing."""
    words = query.split()
    if not words or limit <= 0:
        return []
    pattern = re.compile(r"\s+".join(map(re.escape, words)), re.IGNORECASE)
    convs = list(convs)
    hits: list[SearchHit] = []
    for hit in _title_hits(convs, pattern):
        hits.append(hit)
        if len(hits) >= limit:
            return hits
    for hit in _message_hits(convs, pattern):
        hits.append(hit)
        if len(hits) >= limit:
            break
    return hits


def _title_hits(convs: list[Conversation], pattern: re.Pattern) -> Iterator[SearchHit]:
    for conv in convs:
        for match in pattern.finditer(conv.title):
            yield _hit(conv.id, None, "", conv.title, match)


def _message_hits(convs: list[Conversation], pattern: re.Pattern) -> Iterator[SearchHit]:
    for conv in convs:
        for msg in conv.nodes.values():
            for match in pattern.finditer(msg.content):
                yield _hit(conv.id, msg.id, msg.role, msg.content, match)


def _hit(conv_id: str, msg_id: str | None, role: str, text: str, match: re.Match) -> SearchHit:
    start, end = match.span()
    side = max(0, (SNIPPET_CHARS - (end - start)) // 2)
    left, right = max(0, start - side), min(len(text), end + side)
    # one space per whitespace character keeps offsets; newlines would break a one-line list
    body = re.sub(r"\s", " ", text[left:right])
    prefix = "…" if left else ""
    snippet = prefix + body + ("…" if right < len(text) else "")
    return SearchHit(conv_id, msg_id, role, snippet, len(prefix) + start - left, end - start)
