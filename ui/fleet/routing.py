"""What a KV-aware router would do with a prompt (llm-d's precise prefix-cache scorer, Dynamo's
KV router): score each replica by the longest prefix of the prompt's blocks it holds, in tokens,
and send the prompt to the highest. The prompt is tokenized by each replica (their tokenizers
may differ), and blocks are matched by tokens, so no hash function is needed."""

from __future__ import annotations

from dataclasses import dataclass

from ipc.vllm_events.fleet_tree import FleetTree, SourceId


@dataclass(slots=True, frozen=True)
class Score:
    tokens: int | None  # the cached prefix in tokens; None: cannot be scored (see `why`)
    blocks: int = 0
    block_size: int | None = None
    why: str = ""


def score(tree: FleetTree, source: SourceId | None, token_ids: list[int] | None,
          block_size: int | None, why_not: str = "") -> Score:  # fmt: skip
    """One replica's score, or why it has none."""
    if token_ids is None:
        return Score(None, why=why_not or "the prompt is not tokenized")
    if source is None:
        return Score(None, why="no KV events endpoint given")
    if not block_size:
        return Score(None, why="no block stored yet: block size unknown")
    blocks = tree.longest_prefix(source, token_ids, block_size)
    return Score(blocks * block_size, blocks, block_size)


def choose(scores: list[Score]) -> int | None:
    """The replica the router picks: the longest cached prefix, the first on a tie; None when
    no replica holds any of it (a router then falls back to its load scorers)."""
    best, pick = 0, None
    for i, s in enumerate(scores):
        if s.tokens is not None and s.tokens > best:
            best, pick = s.tokens, i
    return pick
