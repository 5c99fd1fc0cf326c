"""KV tiers below the pool: evicted prefix blocks written down to host memory and to disk
(entries with checksummed headers that outlive the process) and loaded back instead of
recomputed."""
