"""The cached blocks of one or many vLLM-format publishers (sources: a server, each data-parallel
rank of one, a fleet of replicas) as one forest of prefixes; no Qt.

A node per block hash, with its parent's hash and its tokens (as the first source to store it
described it), the media holding it and the sources holding it. vLLM does not deduplicate its
events: one hash can be stored twice by one publisher (two KV cache groups of a hybrid model,
a block recomputed while its twin still lives), and the second removal, not the first, frees
it. So every source keeps a reference count per (hash, medium); a node lives while some count
is positive. A node whose parent is gone stays, the root of its own subtree.

`longest_prefix` is the routing score a KV-aware router (llm-d's indexer, Dynamo's) computes:
how many leading blocks of a prompt a source holds, found by walking from the roots and matching
the prompt's tokens block by block, so it needs no knowledge of the publisher's hash function.

Nodes are immutable and replaced when their holders change, so `snapshot()` is a shallow copy
of one dict that another thread may lay out while this one goes on applying batches. A big tree
is mostly objects the garbage collector need not scan (reference counts keyed by (hash, medium)
tuples, index entries as tuples, the few distinct media and source sets shared): a full
collection over 100,000 blocks is a pause every thread, the GUI's included, waits out. The
interface the prefix-tree layout reads (`nodes` with parent_hash, token_ids, num_tokens,
block_id, media; `children()`) is ipc.kv_events.PrefixTree's.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from ipc.vllm_events.events import Batch, BlockHash, Cleared, Removed, Stored
from ipc.vllm_events.media import medium_name

SourceId = str  # the publisher's endpoint, as the subscriber names it
Refs = dict[tuple[BlockHash, str], int]  # (hash, medium) -> references one source holds


@dataclass(slots=True, frozen=True)
class FleetNode:
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    media: frozenset[str]
    sources: frozenset[SourceId]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_id(self) -> int:
        return -1  # events in vLLM's format name no pool block


@dataclass(slots=True)
class FleetSnapshot:
    """The nodes at one version, for a layout on another thread."""

    nodes: dict[BlockHash, FleetNode]
    version: int

    def children(self) -> dict[BlockHash | None, list[BlockHash]]:
        return _children(self.nodes)


class FleetTree:
    def __init__(self) -> None:
        self.nodes: dict[BlockHash, FleetNode] = {}
        self.version = 0  # +1 per apply or clear that changed something
        self._refs: dict[SourceId, Refs] = {}
        # source -> the block size of its latest BlockStored: a router's score is blocks x this
        self.block_sizes: dict[SourceId, int] = {}
        self._media: list[str] = []  # every medium seen, in order of appearance
        self._sets: dict[frozenset[str], frozenset[str]] = {}  # one object per distinct set
        # (parent hash, a block's tokens) -> the hashes stored there: longest_prefix's steps
        self._index: dict[tuple[BlockHash | None, tuple[int, ...]], tuple[BlockHash, ...]] = {}

    # ------------------------------------------------------------------ changes

    def apply(self, source: SourceId, batch: Batch) -> None:
        refs = self._refs.setdefault(source, {})
        changed = False
        for event in batch.events:
            if isinstance(event, Stored):
                self.block_sizes[source] = event.block_size
                changed = self._stored(refs, event) or changed
            elif isinstance(event, Removed):
                changed = self._removed(refs, event) or changed
            elif isinstance(event, Cleared):
                changed = self.clear(source) or changed
                refs = self._refs.setdefault(source, {})
        if changed:
            self.version += 1

    def clear(self, source: SourceId) -> bool:
        """Forget everything `source` holds (AllBlocksCleared, or a restarted publisher)."""
        refs = self._refs.pop(source, None)
        if not refs:
            return False
        for h in {h for h, _ in refs}:
            self._refresh(h)
        self.version += 1
        return True

    def _stored(self, refs: Refs, event: Stored) -> bool:
        medium, bs, tokens = self._medium(event.medium), event.block_size, event.token_ids
        parent, changed = event.parent_block_hash, False
        for i, h in enumerate(event.block_hashes):
            n = refs.get((h, medium), 0)
            refs[(h, medium)] = n + 1
            if n == 0:  # a new holder: the node's media or sources change
                self._refresh(h, parent, tokens[i * bs : (i + 1) * bs])
                changed = True
            parent = h
        return changed

    def _removed(self, refs: Refs, event: Removed) -> bool:
        medium, changed = self._medium(event.medium), False
        for h in event.block_hashes:
            n = refs.get((h, medium))
            if not n:
                continue  # stored before we subscribed (the replay did not reach back)
            if n > 1:
                refs[(h, medium)] = n - 1  # vLLM stored it twice: the last removal frees it
                continue
            del refs[(h, medium)]
            self._refresh(h)
            changed = True
        return changed

    def _refresh(self, h: BlockHash, parent: BlockHash | None = None,
                 tokens: tuple[int, ...] = ()) -> None:  # fmt: skip
        """Rebuild node `h` from the reference counts: created, changed or dropped."""
        media: set[str] = set()
        sources: set[SourceId] = set()
        for source, refs in self._refs.items():
            for m in self._media:
                if (h, m) in refs:
                    media.add(m)
                    sources.add(source)
        node = self.nodes.get(h)
        if not sources:
            if node is not None:
                del self.nodes[h]
                self._unindex(node)
            return
        if node is None:
            node = FleetNode(h, parent, tokens, self._shared(media), self._shared(sources))
            key = (parent, tokens)
            self._index[key] = self._index.get(key, ()) + (h,)
        else:  # the first description stays: the same hash is the same prefix
            node = FleetNode(h, node.parent_hash, node.token_ids, self._shared(media),
                             self._shared(sources))  # fmt: skip
        self.nodes[h] = node

    def _shared(self, items: set[str]) -> frozenset[str]:
        s = frozenset(items)
        return self._sets.setdefault(s, s)

    def _medium(self, medium: str | None) -> str:
        m = medium_name(medium)
        if m not in self._media:
            self._media.append(m)
        return m

    def _unindex(self, node: FleetNode) -> None:
        key = (node.parent_hash, node.token_ids)
        rest = tuple(x for x in self._index.get(key, ()) if x != node.block_hash)
        if rest:
            self._index[key] = rest
        else:
            self._index.pop(key, None)

    # ------------------------------------------------------------------ questions

    def sources(self) -> dict[SourceId, int]:
        """Every source seen -> how many blocks it holds now. O(its blocks)."""
        return {s: len({h for h, _ in refs}) for s, refs in self._refs.items()}

    def sources_holding(self, h: BlockHash) -> frozenset[SourceId]:
        node = self.nodes.get(h)
        return node.sources if node is not None else frozenset()

    def references(self, source: SourceId, h: BlockHash) -> dict[str, int]:
        """medium -> how many times `source` stored `h` there and has not yet removed it."""
        refs = self._refs.get(source, {})
        return {m: refs[(h, m)] for m in self._media if (h, m) in refs}

    def longest_prefix(self, source: SourceId, token_ids: Iterable[int], block_size: int,
                       media: Collection[str] | None = None) -> int:  # fmt: skip
        """How many leading full blocks of a prompt `source` holds (in `media`, any when None):
        from the roots (blocks without a parent), each next block must continue the last
        matched one with the prompt's next `block_size` tokens. Several hashes can match one
        step (vLLM's extra keys: a LoRA, a cache salt, images): all are followed."""
        tokens = tuple(token_ids)
        frontier: set[BlockHash | None] = {None}
        matched = 0
        for start in range(0, len(tokens) - block_size + 1, block_size):
            chunk = tokens[start : start + block_size]
            frontier = {h for p in frontier for h in self._index.get((p, chunk), ())
                        if self._holds(source, h, media)}  # fmt: skip
            if not frontier:
                break
            matched += 1
        return matched

    def _holds(self, source: SourceId, h: BlockHash, media: Collection[str] | None) -> bool:
        refs = self._refs.get(source, {})
        return any((h, m) in refs for m in (self._media if media is None else media))

    def edges(self) -> dict[BlockHash, BlockHash | None]:
        """block hash -> parent hash, the whole forest (what tests compare)."""
        return {h: n.parent_hash for h, n in self.nodes.items()}

    def media(self) -> dict[BlockHash, frozenset[str]]:
        return {h: n.media for h, n in self.nodes.items()}

    def children(self) -> dict[BlockHash | None, list[BlockHash]]:
        """parent hash -> children; key None holds the roots (first blocks, and blocks whose
        parent is no longer held by anyone). O(nodes)."""
        return _children(self.nodes)

    def snapshot(self) -> FleetSnapshot:
        return FleetSnapshot(dict(self.nodes), self.version)


def _children(nodes: dict[BlockHash, FleetNode]) -> dict[BlockHash | None, list[BlockHash]]:
    out: dict[BlockHash | None, list[BlockHash]] = {}
    for h, n in nodes.items():
        key = n.parent_hash if n.parent_hash in nodes else None
        out.setdefault(key, []).append(h)
    return out
