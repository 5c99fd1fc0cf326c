"""Conversations: the chat history the GUI shows, saved as one JSON file per conversation.

No Qt here: the GUI resolves the directory (QStandardPaths, `--data-dir`, `KVSCOPE_DATA_DIR`)
and hands it in. Writes are atomic (temp file + rename) so a crash never leaves half a file,
and a file that does not parse is set aside instead of blocking start-up.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
FORMAT_VERSION = 1


@dataclass(slots=True)
class Message:
    role: str  # user | assistant (the system prompt lives on the conversation)
    content: str
    # assistant replies only: TTFT, tok/s, prompt / cached / generated tokens, finish reason
    stats: dict = field(default_factory=dict)
    interrupted: bool = False  # the engine died or the user pressed Stop mid-reply

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


@dataclass(slots=True)
class Conversation:
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    title: str = "New chat"
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    messages: list[Message] = field(default_factory=list)
    draft: str = ""  # text typed in the input box and not yet sent
    model: str = ""  # the model of the engine its last message was sent to ("" = unknown)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    def to_prompt(self) -> list[dict]:
        """Chat messages for the engine: system prompt first, then every non-empty turn."""
        out: list[dict] = []
        if self.system_prompt.strip():
            out.append({"role": "system", "content": self.system_prompt})
        out.extend(
            {"role": m.role, "content": m.content}
            for m in self.messages
            if m.content or m.role == "user"
        )
        return out

    def to_json(self) -> dict:
        d = asdict(self)
        d["version"] = FORMAT_VERSION
        return d

    @classmethod
    def from_json(cls, d: dict) -> Conversation:
        if not isinstance(d, dict) or not isinstance(d.get("id"), str):
            raise ValueError("conversation JSON must be an object with a string 'id'")
        msgs = [
            Message(
                role=m["role"],
                content=str(m.get("content", "")),
                stats=dict(m.get("stats") or {}),
                interrupted=bool(m.get("interrupted", False)),
            )
            for m in d.get("messages", [])
        ]
        return cls(
            id=d["id"],
            title=str(d.get("title", "New chat")),
            system_prompt=str(d.get("system_prompt", DEFAULT_SYSTEM_PROMPT)),
            messages=msgs,
            draft=str(d.get("draft", "")),
            model=str(d.get("model", "")),
            created=float(d.get("created", time.time())),
            updated=float(d.get("updated", time.time())),
        )

    def auto_title(self) -> str:
        """A title from the first user turn, for conversations still called 'New chat'."""
        for m in self.messages:
            if m.role == "user" and m.content.strip():
                first = " ".join(m.content.split())
                return first[:40] + ("…" if len(first) > 40 else "")
        return self.title


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
        path = self.path_for(conv.id)
        tmp = path.with_suffix(".json.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(conv.to_json(), f, ensure_ascii=False, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def delete(self, conv_id: str) -> None:
        self.path_for(conv_id).unlink(missing_ok=True)

    def load_all(self) -> list[Conversation]:
        """Every readable conversation, most recently updated first."""
        convs: list[Conversation] = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                with open(path, encoding="utf-8") as f:
                    convs.append(Conversation.from_json(json.load(f)))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                # keep the bad file for the user to inspect, out of the way of the next load
                log.warning("skipping unreadable conversation %s: %s", path, exc)
                try:
                    path.rename(path.with_suffix(".json.bad"))
                except OSError:
                    pass
        self.unreadable = sorted(self.directory.glob("*.json.bad"))
        convs.sort(key=lambda c: c.updated, reverse=True)
        return convs
