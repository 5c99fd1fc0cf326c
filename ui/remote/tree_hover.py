"""What hovering a block of a remote server's prefix tree says: its token range and hash, the
media holding it (the publishers' own names), the sources holding it (a fleet: which replica
or data-parallel rank would hit it), and its tokens as text when the server detokenizes, as ids
until then or otherwise."""

from __future__ import annotations

from collections.abc import Callable

from ipc.vllm_events.events import BlockHash
from ui.kv.prefix_tree_layout import TreeLayout

MAX_TEXT = 120  # characters of a block's text in the hover
MAX_IDS = 16


def hash_text(h: BlockHash) -> str:
    """A hash as hex: 64 bits of an int (vLLM's default), the first 8 bytes of a digest."""
    if isinstance(h, bytes):
        return h[:8].hex()
    return f"{h & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def describe_block(lay: TreeLayout, i: int, holders: Callable[[BlockHash], frozenset[str]],
                   text_of: Callable[[tuple[int, ...]], str | None]) -> str:  # fmt: skip
    start = int(lay.x0[i])
    tokens = tuple(lay.tokens[i])
    lines = [f"tokens {start}–{start + len(tokens) - 1} · hash {hash_text(lay.hashes[i])}",
             "lives in: " + ", ".join(sorted(lay.media[i]))]
    held = sorted(holders(lay.hashes[i]))
    if held:
        lines.append(f"held by {len(held)}: " + ", ".join(held[:4]) + (" …" if len(held) > 4
                                                                      else ""))
    text = text_of(tokens)
    if text is not None:
        shown = text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…"
        lines.append("text: " + repr(shown))
    ids = ", ".join(map(str, tokens[:MAX_IDS])) + (", …" if len(tokens) > MAX_IDS else "")
    lines.append(f"token ids: [{ids}]")
    return "\n".join(lines)
