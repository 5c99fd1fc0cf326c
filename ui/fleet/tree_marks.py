"""The fleet's prefix tree laid out with each block marked by the replicas holding it: the
layout's per-block `media` carries the replicas' labels (the hover lists them, tests read
them), and the colour says how widely a block is held: by every replica, by several, by one."""

from __future__ import annotations

import dataclasses

from ipc.vllm_events.fleet_tree import FleetSnapshot, SourceId
from ui.kv.prefix_tree import CACHED_BAR, DISK_BAR, HOST_BAR
from ui.kv.prefix_tree_layout import DISK_ONLY, HOST_ONLY, IN_POOL, TreeLayout, layout_tree

HOLDERS_LEGEND = {CACHED_BAR: "held by every replica", HOST_BAR: "held by several",
                  DISK_BAR: "held by one"}  # fmt: skip


def layout_by_replica(snapshot: FleetSnapshot, labels: dict[SourceId, str],
                      replicas: int) -> TreeLayout:  # fmt: skip
    """`labels`: source (publisher endpoint) -> the replica's label; `replicas`: how many have
    a publisher (a block all of them hold is 'every')."""
    nodes = {h: dataclasses.replace(n, media=frozenset(labels.get(s, s) for s in n.sources))
             for h, n in snapshot.nodes.items()}  # fmt: skip
    marked = FleetSnapshot(nodes, snapshot.version)

    def tier(holders: frozenset[str]) -> int:
        n = len(holders)
        return IN_POOL if n >= replicas > 1 else HOST_ONLY if n > 1 else DISK_ONLY

    return layout_tree(marked, tier_of=tier)  # type: ignore[arg-type]
