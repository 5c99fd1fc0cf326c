"""The hybrid KV layout (vLLM v1's hybrid KV cache manager, in small): layers grouped by attention
type, each group with its own block table per request, all groups drawing pages from one pool.

A page (block id) holds `group_size` layers' K/V for block_size tokens, so any block serves any
group: group 0 is the full-attention layers, groups 1.. the sliding-window layers, each group
`group_size` layers (the last padded). Layer i reads and writes slot `layer_slot[i]` of the pages
in its group's table. A sliding group releases the blocks that fell out of its window: a request
of L tokens holds ceil(L / B) blocks in the full group and at most ceil(W / B) + 1 in each
sliding group.

A model whose every layer slides (Mistral, Phi-3 with a window) is one sliding group of every
layer: its one block table releases blocks as the others' sliding groups do. A model without
sliding layers (Llama) keeps one full group of every layer."""

from __future__ import annotations

import math
from dataclasses import dataclass

SLIDING_ATTENTION = "sliding_attention"  # engine_proc.models.config.LAYER_TYPES


@dataclass(frozen=True, slots=True)
class KVLayout:
    group_size: int  # layers per page
    windows: tuple[int | None, ...]  # per group: None = full attention
    layer_group: tuple[int, ...]  # per layer
    layer_slot: tuple[int, ...]  # per layer: its slot in a page

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_hybrid(self) -> bool:
        """Groups of different layers: each layer reads a slot of its group's pages."""
        return self.num_groups > 1

    @property
    def has_sliding_groups(self) -> bool:
        """Some block table releases the blocks that left its window."""
        return any(w is not None for w in self.windows)

    def layers_of(self, group: int) -> list[int]:
        return [i for i, g in enumerate(self.layer_group) if g == group]


def plan_layout(layer_types: tuple[str, ...], num_layers: int, window: int | None) -> KVLayout:
    """Groups for these layer types: one of every layer unless there are full and sliding ones
    (a sliding one when every layer slides); then pages of as many layers as there are full
    ones, the sliding layers split in groups of that size."""
    sliding = [i for i, t in enumerate(layer_types) if t == SLIDING_ATTENTION]
    full = [i for i in range(num_layers) if i not in set(sliding)]
    if not sliding or window is None:
        return KVLayout(num_layers, (None,), (0,) * num_layers, tuple(range(num_layers)))
    if not full:
        return KVLayout(num_layers, (window,), (0,) * num_layers, tuple(range(num_layers)))
    size = len(full)
    groups = [full] + [sliding[i : i + size] for i in range(0, len(sliding), size)]
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    for g, layers in enumerate(groups):
        for slot, layer in enumerate(layers):
            layer_group[layer], layer_slot[layer] = g, slot
    windows = (None,) + (window,) * (len(groups) - 1)
    return KVLayout(size, windows, tuple(layer_group), tuple(layer_slot))


def first_needed_block(num_computed: int, window: int, block_size: int) -> int:
    """The first block a sliding layer still reads once `num_computed` tokens are computed: the
    next query (position num_computed) sees positions from num_computed - window + 1 on."""
    return max(0, num_computed - window + 1) // block_size


def max_sliding_blocks(window: int, block_size: int) -> int:
    """Blocks a sliding group holds for a decoding request: its window may straddle one more."""
    return math.ceil(window / block_size) + 1
