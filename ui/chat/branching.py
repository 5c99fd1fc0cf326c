"""Which earlier request a branch shares its prefix with: the block map shows the KV blocks a
new branch's request reuses from the branch it was forked from."""

from __future__ import annotations

from app.conversations import Conversation, Message


def forked_request(conv: Conversation) -> str:
    """The request id of the branch the current path forked from, "" for none.

    At the nearest turn on the path that was made as a sibling (an edit or a regenerate), take
    the sibling it was made from and follow that branch down to its first reply that ran."""
    for m in reversed(conv.messages):
        source = conv.fork_source(m)
        if source is not None:
            return _first_request(conv, source)
    return ""


def _first_request(conv: Conversation, node: Message | None) -> str:
    while node is not None:
        rid = node.stats.get("request_id") if node.role == "assistant" else None
        if rid:
            return str(rid)
        kids = [k for k in conv.nodes.values() if k.parent == node.id]
        chosen = conv.chosen.get(node.id)
        node = conv.nodes.get(chosen) if chosen in conv.nodes else (kids[-1] if kids else None)
    return ""
