"""The KV cache views: the block map, the prefix tree (and its layout off the GUI thread) and the
tiers strip."""
