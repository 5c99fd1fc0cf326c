"""Decode CUDA graphs: bucketing, inert padding and static buffers, checked on CPU through the
eager stand-in graph and the interpreted Triton kernels (the real torch.cuda.CUDAGraph path runs
on a GPU, marked ``cuda``)."""

from types import SimpleNamespace

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.attention.base import AttentionMetadata
from engine_proc.executor.cuda_graphs import EagerReplayGraph, graph_batch_sizes
from tests.engine_fixtures import greedy_reference, tiny_engine
from tests.needs import interpreted_triton
from tests.tiny_models import hf_reference_model, tiny_model_dir


def test_batch_sizes_are_bucketed_up_to_the_limit():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)


def test_torch_reference_backend_is_never_captured():
    engine = tiny_engine(attention_backend="torch")
    with pytest.raises(ValueError, match="cannot be captured.*triton"):
        engine.runner.enable_decode_graphs(4, 64, make_graph=EagerReplayGraph)


def test_eager_cpu_engine_has_no_graphs():
    engine = tiny_engine(attention_backend="torch")
    assert engine.runner.decode_graphs is None
    assert engine.model_info()["cuda_graph_sizes"] == []


def _triton_engine(**config):
    interpreted_triton()
    return tiny_engine(attention_backend="triton", device="cpu", **config)


def _llama_dir():
    """tests/tiny_models/' Llama: attention far from uniform, so a wrong kernel, padding row or
    stale buffer changes its greedy tokens (tiny_engine's model barely depends on attention)."""
    return tiny_model_dir(
        "llama", num_heads=4, num_kv_heads=2, num_layers=2, max_position_embeddings=1024
    )


def _llama_engine(**config) -> LLMEngine:
    config.setdefault("num_kv_blocks", 64)
    return LLMEngine(EngineConfig(model=str(_llama_dir()), attention_backend="triton", **config))


PROMPTS = [list(range(500, 521)), list(range(4000, 4007)), [3001] * 18, list(range(9000, 9004))]


@pytest.mark.slow
def test_graph_replayed_decode_matches_transformers_greedy():
    interpreted_triton()
    engine = _llama_engine(device="cpu", block_size=16, max_num_seqs=4)
    engine.runner.enable_decode_graphs(4, 256, make_graph=EagerReplayGraph)
    assert sorted(engine.runner.decode_graphs.graphs) == [1, 2, 4]
    # Different lengths and budgets: the decode batch shrinks 4 -> 3 -> 2 -> 1, so buckets 4
    # (padded from 3) and 2 and 1 all replay, with stale rows from the larger batches.
    prompts = PROMPTS
    budgets = [3, 5, 7, 9]
    for prompt, n in zip(prompts, budgets, strict=True):
        engine.add_request(
            f"r{n}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        )
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert engine.runner.num_graph_steps >= 6  # every decode step after the prompts
    reference = greedy_reference(hf_reference_model(_llama_dir()))
    for prompt, n in zip(prompts, budgets, strict=True):
        assert done[f"r{n}"] == reference(prompt, n), n
    assert engine.kv.pool.num_free == engine.num_blocks


def test_padding_rows_write_no_kv_and_real_rows_match_eager():
    engine = _triton_engine(block_size=4, max_num_seqs=4)
    runner = engine.runner
    runner.enable_decode_graphs(4, 64, make_graph=EagerReplayGraph)
    graphs = runner.decode_graphs
    gen = torch.Generator().manual_seed(0)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=gen))
    # Stale buffers from an earlier, larger batch: row 3 points at a real slot of block 9.
    graphs.slot_mapping[3] = 9 * 4 + 1
    graphs.seq_lens[3] = 7
    graphs.block_tables[3, :2] = torch.tensor([9, 10])

    seq_lens = [6, 3, 9]  # 3 sequences -> bucket 4, one padding row
    tables = torch.tensor([[0, 1, -1], [2, -1, -1], [3, 4, 5]], dtype=torch.int32)
    positions = torch.tensor([n - 1 for n in seq_lens])
    slots = torch.tensor([int(tables[i, p // 4]) * 4 + p % 4 for i, p in enumerate(positions)])
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(4, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_lens_cpu=[1, 1, 1],
        seq_lens_cpu=seq_lens,
    )
    step = SimpleNamespace(input_ids=torch.tensor([7, 8, 9]), positions=positions, meta=meta)
    before = runner.kv_cache.clone()
    assert graphs.can_run(step)
    hidden = graphs.run(step).clone()

    changed = (runner.kv_cache != before).flatten(0, 1).any(dim=(3, 4))  # [L*2, blocks, offset]
    written = {(int(b), int(o)) for b, o in changed.any(dim=0).nonzero()}
    assert written == {(int(s) // 4, int(s) % 4) for s in slots}

    runner.kv_cache.copy_(before)
    eager = runner.model.forward(step.input_ids, positions, runner.kv_caches, meta, runner.backend)
    torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)


def test_prefill_and_oversized_steps_stay_eager():
    engine = _triton_engine(block_size=4, max_num_seqs=2)
    engine.runner.enable_decode_graphs(2, 16, make_graph=EagerReplayGraph)
    graphs = engine.runner.decode_graphs

    def step(num_seqs: int, query_len: int, width: int):
        meta = SimpleNamespace(
            num_seqs=num_seqs, max_query_len=query_len, block_tables=torch.zeros(num_seqs, width)
        )
        return SimpleNamespace(input_ids=torch.zeros(num_seqs * query_len), meta=meta)

    assert graphs.can_run(step(2, 1, 4))
    assert not graphs.can_run(step(2, 5, 4))  # a prompt chunk
    assert not graphs.can_run(step(3, 1, 4))  # more sequences than the largest graph
    assert not graphs.can_run(step(1, 1, 5))  # a longer block table than max_model_len allows


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_captures_graphs_and_matches_transformers_greedy():
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = PROMPTS[:3]
    reference = greedy_reference(hf_reference_model(_llama_dir()))  # transformers on the CPU
    expected = [reference(p, 12) for p in prompts]
    graphs = _llama_engine(device="cuda", max_num_seqs=8)
    assert graphs.model_info()["cuda_graph_sizes"] == [1, 2, 4, 8]
    ours = [o.token_ids for o in graphs.generate(prompts, params)]
    assert graphs.runner.num_graph_steps > 0
    assert ours == expected
    eager = _llama_engine(device="cuda", cuda_graphs=False)
    assert eager.runner.decode_graphs is None
    assert [o.token_ids for o in eager.generate(prompts, params)] == expected
