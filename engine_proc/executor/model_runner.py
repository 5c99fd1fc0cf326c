"""Flat batch in, logits out: lays the scheduled tokens of all sequences end to end, builds
positions, slot mapping, block tables and query offsets, and runs the forward pass."""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import accumulate

import numpy as np
import torch

from engine_proc.attention.base import AttentionBackend, AttentionMetadata
from engine_proc.attention.kv_quant import layer_caches
from engine_proc.core.kv_groups import KVLayout
from engine_proc.core.request import Sequence
from engine_proc.core.scheduler import ScheduledBatch
from engine_proc.executor.cuda_graphs import DecodeGraphRunner, Graph
from engine_proc.executor.fused_decode import FusedDecodeStep
from engine_proc.executor.fused_lifecycle import FusedDecode
from engine_proc.executor.step_input import StepInput
from engine_proc.models.llama import LlamaModel


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        backend: AttentionBackend,
        kv_scales: torch.Tensor | None = None,  # int8 KV: [num_layers, 2, num_blocks, bs, heads]
        kv_dtype: torch.dtype | None = None,  # int8/fp8 KV: the dtype attention reads it back in
        kv_layer_scales: torch.Tensor | None = None,  # fp8 KV: [num_layers, 2], fixed at start
        decode_step: str = "eager",  # "fused" / "auto": engine_proc/executor/fused_decode.py
        layout: KVLayout | None = None,  # hybrid KV groups; None: one group of every layer
        decode_activations: str = "exact",  # the fused step's arithmetic (EngineConfig's)
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_scales = kv_scales
        read_dtype = kv_dtype or kv_cache.dtype
        slot_caches = layer_caches(kv_cache, kv_scales, kv_layer_scales, read_dtype)
        self.layout = layout
        if layout is None or not layout.is_hybrid:
            self.kv_caches = slot_caches
        else:  # each layer reads its slot of its group's pages
            self.kv_caches = [slot_caches[slot] for slot in layout.layer_slot]
            for layer, group, slot in zip(model.layers, layout.layer_group, layout.layer_slot,
                                          strict=True):  # fmt: skip
                layer.kv_group, layer.kv_slot = group, slot
        self.block_size = kv_cache.shape[3]
        self.backend = backend
        self.device = kv_cache.device
        self.decode_graphs: DecodeGraphRunner | None = None  # set by enable_decode_graphs
        self.num_graph_steps = 0
        quantized = kv_scales is not None or kv_layer_scales is not None
        self.fused = FusedDecode(model, kv_cache, quantized, decode_step, decode_activations)
        self.num_fused_steps = 0  # fused passes (a split step makes one)
        self.num_split_steps = 0  # mixed steps run as a fused pass and an eager one
        self.num_fused_prompt_steps = 0  # prompt chunks run as fused rows
        # Mixed steps (prompt chunks and decodes together) with at least this many one-token
        # rows run those through the fused step and the chunks eagerly, else as one eager pass.
        # 1: always split, so a decode row's arithmetic never depends on a prompt beside it (a
        # verified row's on whether its step holds one: speculation stays exact). Measured on 2
        # Zen 4 cores, exact activations, a 1,500-token prompt's three chunks beside n decodes,
        # one pass / split: 2 threads n = 1 3.21 / 2.96 s, 2: 3.20 / 2.97, 4: 3.27 / 3.15, 8:
        # 2.87 / 2.90; 1 thread n = 1 5.91 / 5.44, 4: 5.78 / 5.84 (on Zen 5, with the kernels
        # of then, one pass had been 10 % faster at 8 decodes on 2 threads).
        self.min_split_rows = 1

    def enable_decode_graphs(
        self,
        max_num_seqs: int,
        max_model_len: int,
        make_graph: Callable[[object], Graph] | None = None,
    ) -> float:
        """Capture decode graphs for batch sizes up to ``max_num_seqs``; seconds spent."""
        graphs = DecodeGraphRunner(
            self.model,
            self.kv_caches,
            self.backend,
            max_num_seqs,
            max_blocks_per_seq=-(-max_model_len // self.block_size),
            make_graph=make_graph,
        )
        seconds = graphs.capture()
        self.decode_graphs = graphs
        return seconds

    def prepare(self, batch: ScheduledBatch) -> StepInput:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling: list[Sequence] = []
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = np.full((len(batch.seqs), max_blocks), -1, dtype=np.int32)
        long_offset = self.model.rotary.long_offset  # LongRoPE's long rows (models/layers.py)
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            end = start + n
            drafts = seq.spec_token_ids  # a speculative row: its last token, then the drafts
            input_ids.extend(seq.token_ids[start:end])
            input_ids.extend(drafts)
            assert len(input_ids) - len(positions) == n, (seq.display_id, n, len(drafts))
            # the rotary table's rows: positions, offset to the long-factor rows for LongRoPE
            # sequences past the original length (the fused step, which reads positions as
            # such, refuses LongRoPE models)
            rows = long_offset if seq.rope_long and long_offset is not None else 0
            positions.extend(range(start + rows, end + rows))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            tables[row, : len(table)] = table
            query_lens.append(n)
            seq_lens.append(end)
            if end == seq.num_tokens + len(drafts):  # the prompt (or the last token) is done:
                # sample (a speculative row: at the last token and every draft, to verify them)
                logits_indices.extend(range(len(input_ids) - 1 - len(drafts), len(input_ids)))
                sampling.append(seq)
        dev = self.device
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start[1:])
        query_start_t = torch.from_numpy(query_start).to(dev)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=dev)

        def metadata(slot_list: list[int], table_array: np.ndarray) -> AttentionMetadata:
            return AttentionMetadata(
                slot_mapping=torch.tensor(slot_list, dtype=torch.int64, device=dev),
                query_start_loc=query_start_t,
                seq_lens=seq_lens_t,
                block_tables=torch.from_numpy(table_array).to(dev),
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
                query_lens_cpu=query_lens,
                seq_lens_cpu=seq_lens,
            )

        meta = metadata(slots, tables)
        if self.layout is not None and self.layout.is_hybrid:
            meta.groups = [metadata(*self._group_inputs(batch, g))
                           for g in range(1, self.layout.num_groups)]  # fmt: skip
        return StepInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            sampling_seqs=sampling,
        )

    def _group_inputs(self, batch: ScheduledBatch, group: int) -> tuple[list[int], np.ndarray]:
        """Slot mapping and block tables of a sliding group (-1 where a block was released:
        attention masks those positions by the window, and no token writes there)."""
        bs = self.block_size
        seq_tables = [s.group_tables[group - 1] for s in batch.seqs]
        tables = np.full((len(seq_tables), max(map(len, seq_tables))), -1, dtype=np.int32)
        slots: list[int] = []
        for row, (seq, n, table) in enumerate(zip(batch.seqs, batch.num_new_tokens, seq_tables,
                                                  strict=True)):  # fmt: skip
            start = seq.num_computed_tokens
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            tables[row, : len(table)] = table
            assert all(table[p // bs] >= 0 for p in range(start, start + n)), (group, start, n)
        return slots, tables

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.device)
            dst = torch.tensor([c[1] for c in copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
            if self.kv_scales is not None:
                self.kv_scales[:, :, dst] = self.kv_scales[:, :, src]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits (float32) and the sequences they belong to: a row per sequence, 1 + k rows
        for one with k drafts (seq.spec_token_ids). Speculative rows are multi-token rows: the
        eager pass, or the fused step's one-token-per-row prompt path, never the decode
        graphs."""
        self.copy_blocks(batch.block_copies)
        fused = self.fused.ready()
        if fused is None or self.decode_graphs is not None:
            return self._run(self.prepare(batch), None)
        if max(batch.num_new_tokens) == 1:  # every row one token: no split to look for
            return self._run(self.prepare(batch), fused)
        one_token, rest = split_single_token_rows(batch)
        spec, rest = split_rows(rest, lambda seq: bool(seq.spec_token_ids))
        # The sequences that decode in this step: as many one-token rows as it would have
        # without drafts. Their rows' arithmetic follows from that count alone, so a verified
        # row computes what its decode step would (speculation stays exact at any batch width:
        # a wide step's fast products, a narrow one's precise ones).
        decoding = len(one_token.seqs) + len(spec.seqs)
        short = sum(rest.num_new_tokens) <= fused.max_prompt_tokens
        if not short and decoding < self.min_split_rows:
            # A long prompt chunk beside few decodes: one eager pass (drafted rows too, as
            # their decode rows would run).
            return self._run(self.prepare(batch), fused)
        precise = fused.is_precise(decoding)
        parts: list[tuple[torch.Tensor, list[Sequence]]] = []
        if spec.seqs:  # verified rows as fused rows, one per token
            parts.append(self._run_prompt_rows(self.prepare(spec), fused, precise))
        if one_token.seqs:
            parts.append(self._run(self.prepare(one_token), fused, precise))
        if short:
            # Short prompt chunks as one-token rows of the fused step, its precise products.
            # Rows are independent (each writes only its own sequence's new slots), so the
            # passes compute what one would.
            if rest.seqs:
                parts.append(self._run_prompt_rows(self.prepare(rest), fused))
        else:
            # A mixed step: the decodes through the fused step, the prompt chunks eagerly.
            parts.append(self._run(self.prepare(rest), None))
            self.num_split_steps += 1
        return merge_in_batch_order(batch, parts)

    def _run_prompt_rows(
        self, step: StepInput, fused: FusedDecodeStep, precise: bool | None = None
    ) -> tuple[torch.Tensor, list[Sequence]]:
        """Prompt chunks through the fused step, a row per token: each row writes its token's
        K/V and attends to its sequence up to itself (every row's write comes before any row's
        attention in a layer), so the rows compute the causal prefill. Precise products and
        head unless under 8-bit activations or ``precise`` says otherwise (verified rows take
        their decode step's)."""
        meta = step.meta
        groups = [meta, *meta.groups]  # the hybrid cache's groups: each its own tables
        query_lens = torch.tensor(meta.query_lens_cpu)
        tables = [g.block_tables.repeat_interleave(query_lens, dim=0) for g in groups]
        seq_lens = (step.positions + 1).to(torch.int32)
        if precise is None:
            precise = not fused.int8_activations
        hidden = fused.forward_rows(
            step.input_ids, step.positions, self.kv_cache, [g.slot_mapping for g in groups],
            tables, seq_lens, precise=precise,
        )  # fmt: skip
        self.num_fused_prompt_steps += 1
        if not step.sampling_seqs:
            return hidden.new_empty((0, 0), dtype=torch.float32), []
        return fused.compute_logits(hidden[step.logits_indices], precise), step.sampling_seqs

    def _run(
        self, step: StepInput, fused: FusedDecodeStep | None, precise: bool | None = None
    ) -> tuple[torch.Tensor, list[Sequence]]:
        """One pass: the decode graphs, the fused step (its arithmetic by its row count unless
        ``precise`` is given) or the eager forward."""
        logits = self.model.compute_logits
        if self.decode_graphs is not None and self.decode_graphs.can_run(step):
            hidden = self.decode_graphs.run(step)
            self.num_graph_steps += 1
        elif fused is not None and fused.can_run(step.meta):
            hidden = fused.forward(step.input_ids, step.positions, self.kv_cache, step.meta,
                                   precise)  # fmt: skip
            # as precise as the step's products
            logits = functools.partial(fused.compute_logits, precise=precise)
            self.num_fused_steps += 1
        else:
            hidden = self.model.forward(
                step.input_ids, step.positions, self.kv_caches, step.meta, self.backend
            )
        if not step.sampling_seqs:
            return hidden.new_empty((0, 0), dtype=torch.float32), []
        return logits(hidden[step.logits_indices]), step.sampling_seqs


def split_single_token_rows(batch: ScheduledBatch) -> tuple[ScheduledBatch, ScheduledBatch]:
    """The rows of ``batch`` that compute one token (decodes, and prompts down to their last
    token), and the others; block copies stay with the whole batch (done before either runs)."""
    return split_rows(batch, lambda seq: False, lambda n: n == 1)


def split_rows(
    batch: ScheduledBatch, take: Callable[[Sequence], bool],
    take_count: Callable[[int], bool] = lambda n: False,
) -> tuple[ScheduledBatch, ScheduledBatch]:  # fmt: skip
    """The rows whose sequence ``take``s or whose token count ``take_count``s, and the rest
    (block copies with neither: they belong to the whole batch)."""
    taken, rest = ScheduledBatch(), ScheduledBatch()
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        part = taken if take(seq) or take_count(n) else rest
        part.seqs.append(seq)
        part.num_new_tokens.append(n)
    return taken, rest


def merge_in_batch_order(
    batch: ScheduledBatch, parts: list[tuple[torch.Tensor, list[Sequence]]]
) -> tuple[torch.Tensor, list[Sequence]]:
    """The parts' logits rows and sequences, in the order the one-pass step would give them."""
    position = {id(seq): i for i, seq in enumerate(batch.seqs)}
    seqs = [seq for _, part_seqs in parts for seq in part_seqs]
    if not seqs:
        return parts[0][0], []
    logits = torch.cat([lg for lg, part_seqs in parts if part_seqs])
    counts = [1 + len(seq.spec_token_ids) for seq in seqs]  # a row, and one per draft
    first_row = [0, *accumulate(counts)]
    assert first_row[-1] == logits.shape[0], (first_row[-1], logits.shape)
    order = sorted(range(len(seqs)), key=lambda i: position[id(seqs[i])])
    rows = [r for i in order for r in range(first_row[i], first_row[i + 1])]
    return logits[rows], [seqs[i] for i in order]
