"""A conversation as a tree of messages: editing a user turn or regenerating a reply adds a
sibling instead of overwriting, so every branch stays reachable.

`Conversation.nodes` holds every message of every branch in creation order, each pointing at
its parent; `chosen` records which child each message (and "" for the roots) continues with.
`messages` is the branch on screen, root to leaf. No Qt and no I/O here (see store.py).
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
ROOT = ""  # the key in `chosen` for the first message of each branch


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def check_attachment(a: object, where: str) -> None:
    """An attached file: {"name": str, "text": str, "tokens": int | None}."""
    if not isinstance(a, dict):
        raise ValueError(f"{where} must be an object {{name, text, tokens}}, got {a!r}")
    if not isinstance(a.get("name"), str) or not a["name"]:
        raise ValueError(f"{where}.name must be a non-empty string, got {a.get('name')!r}")
    if not isinstance(a.get("text"), str):
        raise ValueError(f"{where}.text must be a string, got {type(a.get('text')).__name__}")
    tokens = a.get("tokens")
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool)):
        raise ValueError(f"{where}.tokens must be an integer or null, got {tokens!r}")


def fence_for(text: str) -> str:
    """A backtick fence longer than any run of backticks inside `text`, so it cannot close early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def attachment_block(name: str, text: str) -> str:
    """How an attached file is written into the turn the model reads (the window counts its
    tokens on exactly this text)."""
    fence = fence_for(text)
    return f"File: {name}\n{fence}\n{text if text.endswith(chr(10)) else text + chr(10)}{fence}"


@dataclass(slots=True)
class Message:
    role: str  # user | assistant (the system prompt lives on the conversation)
    content: str
    # assistant replies only: TTFT, tok/s, prompt / cached / generated tokens, finish reason
    stats: dict = field(default_factory=dict)
    interrupted: bool = False  # the engine died or the user pressed Stop mid-reply
    id: str = field(default_factory=new_id)
    parent: str | None = None  # set by Conversation when the message joins the tree
    attachments: list[dict] = field(default_factory=list)  # user turns: attached text files
    created: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.attachments and self.role != "user":
            raise ValueError(f"only user messages carry attachments, not {self.role!r}")
        for i, a in enumerate(self.attachments):
            check_attachment(a, f"attachments[{i}]")

    def prompt_text(self) -> str:
        """What the model reads: the typed text, then each attached file in a fenced block."""
        parts = [self.content] if self.content else []
        parts += [attachment_block(a["name"], a["text"]) for a in self.attachments]
        return "\n\n".join(parts)


def _key(parent: str | None) -> str:
    return ROOT if parent is None else parent


@dataclass(slots=True, init=False)
class Conversation:
    id: str
    title: str
    system_prompt: str
    draft: str  # text typed in the input box and not yet sent
    model: str  # the model of the engine its last message was sent to ("" = unknown)
    created: float
    updated: float
    sampling: dict  # this conversation's sampling settings; {} = the app's defaults
    preset: str  # the name of the system-prompt preset picked for it ("" = none)
    nodes: dict[str, Message]  # every message of every branch, in creation order
    chosen: dict[str, str]  # parent id (ROOT for the roots) -> the child the branch goes on with

    def __init__(
        self,
        *,
        id: str | None = None,
        title: str = "New chat",
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        messages: list[Message] | None = None,
        draft: str = "",
        model: str = "",
        created: float | None = None,
        updated: float | None = None,
        sampling: dict | None = None,
        preset: str = "",
        nodes: dict[str, Message] | None = None,
        chosen: dict[str, str] | None = None,
    ) -> None:
        if messages is not None and (nodes or chosen):
            raise ValueError("give either messages (one branch) or nodes and chosen, not both")
        now = time.time()
        self.id = id if id is not None else new_id()
        self.title, self.system_prompt, self.draft, self.model = title, system_prompt, draft, model
        self.created = created if created is not None else now
        self.updated = updated if updated is not None else now
        self.sampling = dict(sampling or {})
        self.preset = preset
        self.nodes = dict(nodes or {})
        self.chosen = dict(chosen or {})
        for m in messages or []:  # the pre-tree constructor: a list becomes one chain
            self.append(m)
        self._check()

    # --- reading ------------------------------------------------------------------------------

    def children(self) -> dict[str, list[Message]]:
        """Parent key -> children in creation order (one pass; trees stay small)."""
        kids: dict[str, list[Message]] = {}
        for m in self.nodes.values():
            kids.setdefault(_key(m.parent), []).append(m)
        return kids

    @property
    def messages(self) -> tuple[Message, ...]:
        """The branch on screen, root to leaf. A tuple, so code that still tries to append to it
        fails loudly instead of changing a copy."""
        kids, path, key = self.children(), [], ROOT
        while kids.get(key):
            pick = self.chosen.get(key)
            nxt = next((m for m in kids[key] if m.id == pick), kids[key][-1])  # else the newest
            path.append(nxt)
            key = nxt.id
        return tuple(path)

    def siblings(self, msg: Message) -> list[Message]:
        """`msg` and the other messages with its parent, in creation order."""
        self._node(msg.id)
        return [m for m in self.nodes.values() if m.parent == msg.parent]

    def branch_position(self, msg: Message) -> tuple[int, int]:
        """(1-based index among its siblings, number of siblings): the "2 / 3" beside a turn."""
        sibs = self.siblings(msg)
        return [m.id for m in sibs].index(msg.id) + 1, len(sibs)

    def fork_source(self, msg: Message) -> Message | None:
        """The sibling an edit or a regeneration was made from (the one created just before it);
        None for a first child."""
        index, _ = self.branch_position(msg)
        return self.siblings(msg)[index - 2] if index > 1 else None

    def to_prompt(self) -> list[dict]:
        """Chat messages for the engine: system prompt first, then the branch's turns (empty
        replies left out, attached files inlined)."""
        out: list[dict] = []
        if self.system_prompt.strip():
            out.append({"role": "system", "content": self.system_prompt})
        for m in self.messages:
            if m.role == "user":
                out.append({"role": "user", "content": m.prompt_text()})
            elif m.content:
                out.append({"role": m.role, "content": m.content})
        return out

    def auto_title(self) -> str:
        """A title from the first user turn, for conversations still called 'New chat'."""
        for m in self.messages:
            if m.role == "user" and m.content.strip():
                first = " ".join(m.content.split())
                return first[:40] + ("…" if len(first) > 40 else "")
        return self.title

    # --- changing -----------------------------------------------------------------------------

    def append(self, msg: Message) -> Message:
        """Continue the branch on screen with `msg`."""
        path = self.messages
        return self._attach(msg, path[-1].id if path else None)

    def add_sibling(self, of: Message, msg: Message) -> Message:
        """A new version of `of` (an edited user turn, a regenerated reply): same parent, shown
        now, and the branch on screen ends at it."""
        return self._attach(msg, self._node(of.id).parent)

    def switch_branch(self, msg: Message, step: int) -> Message:
        """Show the sibling `step` places from `msg` (-1: previous, +1: next); below it the
        branch follows that subtree's own choices. Returns the sibling now shown."""
        sibs = self.siblings(msg)
        index = [m.id for m in sibs].index(msg.id)
        if not 0 <= index + step < len(sibs):
            raise ValueError(f"step must be in {-index}..{len(sibs) - 1 - index} for branch "
                             f"{index + 1} of {len(sibs)}, got {step}")  # fmt: skip
        target = sibs[index + step]
        self.select(target.id)
        return target

    def select(self, msg_id: str) -> None:
        """Make the branch on screen pass through `msg_id` (a search hit on another branch)."""
        node = self._node(msg_id)
        while True:
            self.chosen[_key(node.parent)] = node.id
            if node.parent is None:
                break
            node = self.nodes[node.parent]
        self._check()

    def remove_leaf(self, msg: Message) -> None:
        """Undo an append or add_sibling (the save before sending failed)."""
        node = self._node(msg.id)
        if any(m.parent == node.id for m in self.nodes.values()):
            raise ValueError(f"message {node.id!r} has replies; only a leaf can be removed")
        source = self.fork_source(node)
        del self.nodes[node.id]
        key = _key(node.parent)
        if self.chosen.get(key) == node.id:
            if source is None:  # a first child: fall back to the newest sibling, if any
                del self.chosen[key]
            else:
                self.chosen[key] = source.id
        self._check()

    # --- internals ----------------------------------------------------------------------------

    def _node(self, msg_id: str) -> Message:
        try:
            return self.nodes[msg_id]
        except KeyError:
            raise ValueError(f"message {msg_id!r} is not in conversation {self.id!r}") from None

    def _attach(self, msg: Message, parent: str | None) -> Message:
        if msg.id in self.nodes:
            raise ValueError(f"message {msg.id!r} is already in conversation {self.id!r}")
        msg.parent = parent
        self.nodes[msg.id] = msg
        self.select(msg.id)
        return msg

    def _check(self) -> None:
        """The tree's invariants; store.py validates files with real errors before this runs."""
        for key, m in self.nodes.items():
            assert key == m.id, f"nodes[{key!r}] holds message {m.id!r}"
            assert m.parent is None or m.parent in self.nodes, f"{m.id}: no parent {m.parent!r}"
        for key, child in self.chosen.items():
            assert key == ROOT or key in self.nodes, f"chosen[{key!r}]: no such message"
            assert child in self.nodes and _key(self.nodes[child].parent) == key, (
                f"chosen[{key!r}] = {child!r} is not a child of it"
            )
