"""Decode steps replayed from CUDA graphs.

A decode step of a small model on a GPU is launch-bound: ~10 kernels per layer, each a few
microseconds of CPU work, against well under a millisecond of GPU time for the whole step. A
CUDA graph records the step's kernels once and replays them with one launch. Graphs freeze
addresses and shapes, so (as in vLLM and nano-vllm) there is one graph per bucketed batch size,
all reading the same static input buffers; a batch is padded up to the next bucket.

Padding rows are inert: slot -1 (their K/V is written nowhere), sequence length 0 and a block
table of -1 (the attention kernel reads no key for them). Only backends whose launches depend on
device tensors alone (``graph_safe``) can be captured: the Triton kernels find each program's
sequence on the device; the torch reference plans from host lists and is never captured.

``EagerReplayGraph`` stands in for ``torch.cuda.CUDAGraph`` on CPU so the bucketing, padding and
static-buffer logic is tested without a GPU: its replay re-runs the captured closure, which reads
nothing but the static buffers, exactly what a real replay reads.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from engine_proc.attention.base import AttentionBackend, AttentionMetadata
from engine_proc.executor.step_input import StepInput
from engine_proc.models.llama import LlamaModel

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (which is always included)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class CudaGraph:
    """One ``torch.cuda.CUDAGraph``; all graphs of a runner share one memory pool."""

    def __init__(self, pool: object) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        # Warm up on a side stream first: compiles the Triton kernels and settles the allocator,
        # neither of which may happen during capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class EagerReplayGraph:
    """CPU stand-in for tests: replay re-runs the closure into the captured output tensor."""

    def __init__(self, pool: object = None) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        self.out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        assert self.fn is not None and self.out is not None, "replay before capture"
        with torch.inference_mode():  # the captured output is an inference tensor
            self.out.copy_(self.fn())


class DecodeGraphRunner:
    """Captures one graph per bucket and runs decode-only steps through them."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        make_graph: Callable[[object], Graph] | None = None,
    ) -> None:
        if not getattr(backend, "graph_safe", False):
            raise ValueError(
                f"attention backend {backend.name!r} cannot be captured in a CUDA graph "
                "(it plans from host data); use attention_backend='triton'"
            )
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        device = model.device
        if make_graph is None:
            if device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA device, the model is on {device}")
            pool = torch.cuda.graph_pool_handle()
            self._make_graph: Callable[[], Graph] = lambda: CudaGraph(pool)
        else:
            self._make_graph = lambda: make_graph(None)
        n = self.batch_sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        # One query token per sequence, always: the offsets never change.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.full(
            (n, max_blocks_per_seq), -1, dtype=torch.int32, device=device
        )
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}

    def capture(self) -> float:
        """Record every bucket, largest first (smaller graphs then reuse its pool); seconds."""
        started = time.monotonic()
        for size in reversed(self.batch_sizes):
            graph = self._make_graph()
            out = graph.capture(self._forward_fn(size))
            self.graphs[size] = (graph, out)
        seconds = time.monotonic() - started
        logger.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s", self.batch_sizes, seconds
        )
        return seconds

    def _forward_fn(self, size: int) -> Callable[[], torch.Tensor]:
        # Everything the closure touches is a static buffer (or weights / the KV pool), so a
        # replay sees whatever run() copied into those buffers.
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.max_blocks_per_seq * self.kv_caches[0][0].shape[1],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[0] * size,  # only its length (num_seqs) is read by graph-safe backends
        )
        input_ids, positions = self.input_ids[:size], self.positions[:size]

        def forward() -> torch.Tensor:
            return self.model.forward(input_ids, positions, self.kv_caches, meta, self.backend)

        return forward

    def can_run(self, step: StepInput) -> bool:
        meta = step.meta
        num_seqs = meta.num_seqs
        return (
            bool(self.graphs)
            and meta.max_query_len == 1
            and step.input_ids.shape[0] == num_seqs
            and num_seqs <= self.batch_sizes[-1]
            and meta.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def run(self, step: StepInput) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of a decode-only step, from the bucket's graph (a
        view of the graph's output: valid until the next replay)."""
        assert self.can_run(step), "not a decode-only step that fits the captured graphs"
        meta = step.meta
        n = meta.num_seqs
        size = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        self.input_ids[:n].copy_(step.input_ids)
        self.positions[:n].copy_(step.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        # The kernel reads a row only up to its sequence length, so stale entries past `width`
        # are never used; clearing them keeps a table from ever naming another request's blocks.
        self.block_tables[:size].fill_(-1)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if size > n:  # padding rows: write nothing, read nothing
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
