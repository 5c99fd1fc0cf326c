"""Where each cached block of a prefix tree is drawn (numpy only, no Qt: the engine link's worker
thread computes it, the panel only draws it).

The picture is an icicle of prefixes: x is the token position, so a block is `block_size` tokens
wide and a linear run of blocks (a prompt nobody shares) is one straight band, however long. Each
leaf of the tree gets a row (top to bottom in depth-first order) and every block spans the rows
of all the leaves below it, so a shared system prompt is one tall trunk band with a branch band
per conversation beside it, each as tall as the number of conversations that share it.
Blocks evicted from the pool but still held by a lower KV tier stay in the tree, marked by the
highest tier holding them (`tier`: where a request would load them from).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ipc.kv_events import HOST, POOL, PrefixTree

IN_POOL, HOST_ONLY, DISK_ONLY = 0, 1, 2  # TreeLayout.tier: the highest medium holding a block
# Most cells of the band image (int32 owners, then as many RGBA words to draw): ~64 MB. A tree
# with more rows x depth is drawn with every `row_step`-th sub-row only: a band thinner than
# that (one conversation among thousands) may not show until the tree shrinks.
MAX_CELLS = 8_000_000


@dataclass(slots=True)
class TreeLayout:
    """Per block (arrays of equal length): where its band is; and the image of bands."""

    x0: np.ndarray  # float64: first token position of the block
    row: np.ndarray  # float64: first row of its band (its own row)
    row_end: np.ndarray  # float64: last row of its band (its subtree's last row)
    block_id: np.ndarray  # int64: pool block, -1 when unknown
    hashes: list[bytes]  # block hash per block
    tokens: list[list[int]]
    block_size: int
    # owner[(2 * row + k) // row_step, depth] = index of the block drawn there, -1 = nothing
    # (row_step 1 but for huge trees); each band
    # leaves its last half-row empty, so sibling bands of one colour stay apart
    owner: np.ndarray = field(default_factory=lambda: np.full((0, 0), -1, np.int32))
    num_rows: int = 0
    num_roots: int = 0
    tier: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))  # IN_POOL, ...
    media: list[frozenset[str]] = field(default_factory=list)  # every medium holding it
    parent: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # index, -1: root
    row_step: int = 1  # sub-rows per image row (MAX_CELLS)

    def count(self, tier: int) -> int:
        return int(np.count_nonzero(self.tier == tier))

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    def block_at(self, x: float, y: float) -> int | None:
        """Index of the block drawn at token position x, row coordinate y (rows are 1 apart,
        row r covering [r - 0.5, r + 0.5))."""
        if self.num_blocks == 0 or x < 0:
            return None
        r, c = int(np.floor(2 * (y + 0.5))) // self.row_step, int(x // self.block_size)
        if not (0 <= r < self.owner.shape[0] and 0 <= c < self.owner.shape[1]):
            return None
        i = int(self.owner[r, c])
        return None if i < 0 else i


def layout_tree(tree: PrefixTree, tier_of: Callable[[frozenset[str]], int] | None = None,
                max_cells: int = MAX_CELLS) -> TreeLayout:  # fmt: skip
    """`tree`: a PrefixTree, or anything with its `nodes` and `children()` (a fleet tree of
    vLLM-format events); `tier_of`: IN_POOL, HOST_ONLY or DISK_ONLY from a block's media
    (default: KVScope's pool, host and disk)."""
    tier_of = tier_of or _tier_of
    nodes = tree.nodes
    children = tree.children()
    block_size = next((n.num_tokens for n in nodes.values()), 16) or 16
    depth_of: list[int] = []
    rows: list[int] = []
    hashes: list[bytes] = []
    kids_of: list[list[int]] = []  # indexes of each block's children, in layout order
    parents: list[int] = []
    next_row = 0
    roots = sorted(children.get(None, []), key=lambda h: _first_token_key(nodes[h]))
    # Iterative depth-first walk; the first child continues its parent's row, every later
    # child opens the next free row, below the whole subtree before it.
    stack: list[tuple[bytes, int, int, int]] = []  # (hash, depth, row or -1, parent index)
    for h in reversed(roots):
        stack.append((h, _root_depth(nodes[h]), -1, -1))
    while stack:
        h, depth, row, parent = stack.pop()
        if row < 0:
            row = next_row
            next_row += 1
        i = len(hashes)
        hashes.append(h)
        depth_of.append(depth)
        rows.append(row)
        kids_of.append([])
        parents.append(parent)
        if parent >= 0:
            kids_of[parent].append(i)
        kids = sorted(children.get(h, []), key=lambda k: _first_token_key(nodes[k]))
        for j, k in reversed(list(enumerate(kids))):
            stack.append((k, depth + 1, row if j == 0 else -1, i))
    row_end = list(rows)
    for i in range(len(hashes) - 1, -1, -1):  # children come after their parent: reverse = post
        for k in kids_of[i]:
            row_end[i] = max(row_end[i], row_end[k])
    cols = max(depth_of, default=0) + 1
    rows2 = 2 * max(1, next_row)
    step = max(1, -(-rows2 * cols // max_cells))
    owner = np.full((-(-rows2 // step), cols), -1, np.int32)
    for i in range(len(hashes)):  # the sampled sub-rows j * step inside the band
        owner[-(-2 * rows[i] // step) : 2 * row_end[i] // step + 1, depth_of[i]] = i
    return TreeLayout(
        x0=np.asarray(depth_of, dtype=np.float64) * block_size,
        row=np.asarray(rows, dtype=np.float64),
        row_end=np.asarray(row_end, dtype=np.float64),
        block_id=np.asarray([nodes[h].block_id for h in hashes], dtype=np.int64),
        hashes=hashes,
        tokens=[nodes[h].token_ids for h in hashes],
        block_size=block_size,
        owner=owner,
        num_rows=next_row,
        num_roots=len(roots),
        tier=np.asarray([tier_of(nodes[h].media) for h in hashes], dtype=np.uint8),
        media=[frozenset(nodes[h].media) for h in hashes],
        parent=np.asarray(parents, dtype=np.int64),
        row_step=step,
    )


def _tier_of(media: frozenset[str] | set[str]) -> int:
    return IN_POOL if POOL in media else HOST_ONLY if HOST in media else DISK_ONLY


def _first_token_key(node) -> tuple[int, ...]:
    return tuple(node.token_ids[:4])


def _root_depth(node) -> int:
    """A root whose parent is gone (evicted before it) still starts after that parent's tokens:
    unknown how far, so one block in, which sets it apart from real first blocks."""
    return 0 if node.parent_hash is None else 1


class TreeTracker:
    """The worker thread's side of the panel: the tree rebuilt from event batches, when to ask
    the engine for a replay (a lost batch, at most every `replay_every` s) and when to lay the
    tree out again (changed, wanted, at most every `layout_every` s)."""

    def __init__(self, replay_every: float = 2.0, layout_every: float = 0.5) -> None:
        self.tree = PrefixTree()
        self.wanted = False  # set from the GUI thread while the panel is visible
        self.replay_every = replay_every
        self.layout_every = layout_every
        self._last_replay = -1e9
        self._last_layout = -1e9
        self._laid_out_version = -1
        self._layout_gap = layout_every
        self.events_seen = False

    def on_batch(self, batch) -> None:
        self.events_seen = True
        self.tree.apply(batch)

    def needs_replay(self, published_seq: int, now: float) -> bool:
        """After a telemetry snapshot: True when the tree missed a batch and no replay was
        asked for in the last `replay_every` s (the caller sends control replay_kv_events)."""
        if not published_seq and not self.events_seen:
            return False  # an engine that publishes no KV events
        if self.tree.in_sync(published_seq) or now - self._last_replay < self.replay_every:
            return False
        self._last_replay = now
        return True

    def maybe_layout(self, now: float) -> TreeLayout | None:
        if not self.wanted or self.tree.version == self._laid_out_version:
            return None
        if now - self._last_layout < self._layout_gap:
            return None
        self._last_layout = now
        self._laid_out_version = self.tree.version
        t0 = time.perf_counter()
        layout = layout_tree(self.tree)
        # a big tree takes a while (~0.1 s for 20,000 blocks): keep this thread's share of
        # the GIL, which the GUI thread shares, under ~1/5
        self._layout_gap = max(self.layout_every, 4 * (time.perf_counter() - t0))
        return layout
