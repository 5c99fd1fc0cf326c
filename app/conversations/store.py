"""Conversations on disk: one `<id>.json` per conversation.

No Qt here: the GUI resolves the directory (QStandardPaths, `--data-dir`, `KVSCOPE_DATA_DIR`)
and hands it in. Writes are atomic so a crash never leaves half a file, and a file that does
not parse, or that a newer KVScope wrote, is set aside instead of blocking start-up.

Format 2 stores the message tree (`nodes` in creation order, each naming its parent, and
`chosen`); format 1 files (a linear `messages` list, no ids) still open, as one chain.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from app.conversations.atomic import set_aside, write_json_atomic
from app.conversations.model import (
    DEFAULT_SYSTEM_PROMPT,
    ROLES,
    ROOT,
    Conversation,
    Message,
    check_attachment,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
NODE_FIELDS = ("id", "parent", "role", "content", "stats", "interrupted", "attachments", "created")


def to_json(conv: Conversation) -> dict:
    return {
        "version": FORMAT_VERSION,
        "id": conv.id,
        "title": conv.title,
        "system_prompt": conv.system_prompt,
        "draft": conv.draft,
        "model": conv.model,
        "created": conv.created,
        "updated": conv.updated,
        "sampling": dict(conv.sampling),
        "preset": conv.preset,
        "nodes": [{f: getattr(m, f) for f in NODE_FIELDS} for m in conv.nodes.values()],
        "chosen": dict(conv.chosen),
    }


def from_json(d: Any) -> Conversation:
    """A conversation from a parsed file; ValueError naming the field for anything malformed."""
    if not isinstance(d, dict) or not isinstance(d.get("id"), str):
        raise ValueError("conversation JSON must be an object with a string 'id'")
    version = d.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"version must be a positive integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise ValueError(f"version {version} was written by a newer KVScope; this one reads "
                         f"versions 1 to {FORMAT_VERSION}")  # fmt: skip
    created = _number(d, "created", time.time())
    head = {
        "id": d["id"],
        "title": _str(d, "title", "New chat"),
        "system_prompt": _str(d, "system_prompt", DEFAULT_SYSTEM_PROMPT),
        "draft": _str(d, "draft", ""),
        "model": _str(d, "model", ""),
        "created": created,
        "updated": _number(d, "updated", created),
    }
    if version == 1:
        return Conversation(**head, messages=_v1_messages(d.get("messages", []), created))
    nodes = _v2_nodes(d.get("nodes", []))
    return Conversation(
        **head,
        sampling=_typed(d, "sampling", dict, {}),
        preset=_str(d, "preset", ""),
        nodes=nodes,
        chosen=_chosen(d.get("chosen", {}), nodes),
    )


def _v1_messages(raw: Any, created: float) -> list[Message]:
    """Format 1: a plain list; ids are made up from the position so two loads compare equal."""
    if not isinstance(raw, list):
        raise ValueError(f"messages must be a list, got {type(raw).__name__}")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object, got {type(m).__name__}")
        out.append(_message(m, where, id=f"v1-{i}", parent=None, attachments=[], created=created))
    return out


def _v2_nodes(raw: Any) -> dict[str, Message]:
    if not isinstance(raw, list):
        raise ValueError(f"nodes must be a list, got {type(raw).__name__}")
    nodes: dict[str, Message] = {}
    ids = {n.get("id") for n in raw if isinstance(n, dict)}
    for i, n in enumerate(raw):
        where = f"nodes[{i}]"
        if not isinstance(n, dict):
            raise ValueError(f"{where} must be an object, got {type(n).__name__}")
        mid, parent = n.get("id"), n.get("parent")
        if not isinstance(mid, str) or not mid:
            raise ValueError(f"{where}.id must be a non-empty string, got {mid!r}")
        if mid in nodes:
            raise ValueError(f"{where}.id {mid!r} is used by an earlier message")
        if parent is not None and (not isinstance(parent, str) or parent not in ids):
            raise ValueError(f"{where}.parent {parent!r} is not a message in this conversation")
        if parent is not None and parent not in nodes:  # also rules out cycles
            raise ValueError(f"{where}.parent {parent!r} comes after it (parents come first)")
        attachments = _typed(n, "attachments", list, [], where)
        for j, a in enumerate(attachments):
            check_attachment(a, f"{where}.attachments[{j}]")
        created = _number(n, "created", time.time(), where)
        nodes[mid] = _message(n, where, id=mid, parent=parent, attachments=attachments,
                              created=created)  # fmt: skip
    return nodes


def _message(m: dict, where: str, **tree: Any) -> Message:
    role = m.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role {role!r} must be one of {', '.join(ROLES)}")
    if tree["attachments"] and role != "user":
        raise ValueError(f"{where}.attachments: only user messages carry attachments")
    return Message(
        role=role,
        content=_str(m, "content", "", where),
        stats=dict(_typed(m, "stats", dict, {}, where)),
        interrupted=_typed(m, "interrupted", bool, False, where),
        **tree,
    )


def _chosen(raw: Any, nodes: dict[str, Message]) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise ValueError(f"chosen must be an object, got {type(raw).__name__}")
    for key, child in raw.items():
        if key != ROOT and key not in nodes:
            raise ValueError(f"chosen[{key!r}]: {key!r} is not a message in this conversation")
        parent = None if key == ROOT else key
        if not isinstance(child, str) or child not in nodes or nodes[child].parent != parent:
            raise ValueError(f"chosen[{key!r}] {child!r} is not a reply to {key or 'the root'!r}")
    return dict(raw)


def _typed(d: dict, key: str, kind: type, default: Any, where: str = "") -> Any:
    value = d.get(key, default)
    if not isinstance(value, kind):
        name = f"{where}.{key}" if where else key
        raise ValueError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _str(d: dict, key: str, default: str, where: str = "") -> str:
    return _typed(d, key, str, default, where)


def _number(d: dict, key: str, default: float, where: str = "") -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        name = f"{where}.{key}" if where else key
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


class ConversationStore:
    """One `<id>.json` per conversation under `directory`."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.unreadable: list[Path] = []  # set aside by load_all (renamed to *.json.bad)

    def path_for(self, conv_id: str) -> Path:
        if not conv_id or not all(c.isalnum() or c in "-_" for c in conv_id):
            raise ValueError(f"conversation id must be alphanumeric (with - or _), got {conv_id!r}")
        return self.directory / f"{conv_id}.json"

    def save(self, conv: Conversation) -> None:
        """Write atomically: on any error (disk full) the previous file stays as it was and the
        OSError reaches the caller."""
        conv.updated = time.time()
        write_json_atomic(self.path_for(conv.id), to_json(conv))

    def delete(self, conv_id: str) -> None:
        self.path_for(conv_id).unlink(missing_ok=True)

    def load_all(self) -> list[Conversation]:
        """Every readable conversation, most recently updated first."""
        convs: list[Conversation] = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                with open(path, encoding="utf-8") as f:
                    convs.append(from_json(json.load(f)))
            except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
                # keep the bad file for the user to inspect, out of the way of the next load
                log.warning("skipping unreadable conversation %s: %s", path, exc)
                set_aside(path)
        self.unreadable = sorted(self.directory.glob("*.json.bad"))
        convs.sort(key=lambda c: c.updated, reverse=True)
        return convs
