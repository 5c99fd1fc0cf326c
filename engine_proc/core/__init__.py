"""The policy of the KV cache and the schedule, with no model code and no torch: the block pool
(mechanism), the KV cache manager (block tables, prefix hashing and matching), the scheduler
(token budget, chunked prefill, preemption), sequences, and the KV cache events they record."""
