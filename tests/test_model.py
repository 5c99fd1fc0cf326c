"""Our forward pass over the paged cache against transformers' own forward, on tiny random
checkpoints of every supported head layout."""

import pytest
import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from tests.tiny_models import hf_reference_model, tiny_model_dir

LAYOUTS = [
    # (architecture, num_heads, num_kv_heads, attention_bias, tie_word_embeddings)
    ("llama", 4, 4, False, False),  # MHA
    ("llama", 4, 2, False, True),  # GQA, tied
    ("llama", 4, 1, False, False),  # MQA
    ("qwen2", 4, 2, True, False),  # GQA with q/k/v biases
    ("qwen2", 4, 1, True, True),  # MQA with biases, tied
]


def all_position_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position, taken from our hidden states while the engine runs the
    prompt through its scheduler (so chunking and the paged cache are on the path)."""
    hidden: list[torch.Tensor] = []
    forward = engine.model.forward

    def recording_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        hidden.append(out)
        return out

    engine.model.forward = recording_forward
    try:
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    finally:
        engine.model.forward = forward
    return engine.model.compute_logits(torch.cat(hidden)[: len(prompt)])


# Every layout at the default block size; block size 1 and one that divides neither the prompt
# nor the chunk on two layouts.
CASES = [(layout, 16) for layout in LAYOUTS] + [
    (layout, bs) for layout in (LAYOUTS[1], LAYOUTS[3]) for bs in (1, 7)
]


@pytest.mark.parametrize(
    ("layout", "block_size"),
    CASES,
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else f"bs{v}",
)
def test_logits_match_transformers_at_every_position(layout, block_size):
    arch, heads, kv_heads, bias, tie = layout
    path = tiny_model_dir(
        arch, num_heads=heads, num_kv_heads=kv_heads, attention_bias=bias, tie_word_embeddings=tie
    )
    engine = LLMEngine(
        EngineConfig(
            model=str(path), block_size=block_size, num_kv_blocks=200, long_prefill_chunk=11
        )
    )
    prompt = torch.randint(3, 49152, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = all_position_logits(engine, prompt)
    with torch.no_grad():
        ref = hf_reference_model(path)(torch.tensor([prompt])).logits[0].float()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)

    ref_ids = (
        hf_reference_model(path)
        .generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :]
        .tolist()
    )
    (out,) = engine.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    assert out.token_ids == ref_ids
    assert engine.kv.pool.num_free == engine.num_blocks


def test_llama3_rope_scaling_matches_transformers():
    path = tiny_model_dir("llama", rope_scaling="llama3", max_position_embeddings=512)
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64))
    prompt = list(range(100, 160))
    with torch.no_grad():
        ref = hf_reference_model(path)(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(all_position_logits(engine, prompt), ref, atol=1e-4, rtol=1e-4)


def test_kv_pool_is_allocated_once_and_decode_allocates_nothing_context_sized():
    path = tiny_model_dir("llama", max_position_embeddings=32768)
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=300))
    kv_ptr = engine.runner.kv_cache.data_ptr()
    engine.add_request("r", list(range(10, 30)), SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()  # prefill
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(5):
            engine.step()
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    # One context-sized K/V buffer for this model would be 4096 * 2 heads * 16 dims * 4 B.
    context_sized = engine.max_model_len * engine.model_config.num_kv_heads * 16 * 4
    assert largest < context_sized / 4, f"a decode step allocated {largest} bytes at once"
    assert engine.runner.kv_cache.data_ptr() == kv_ptr


def test_bfloat16_tracks_float32_through_prefill_and_decode():
    # On CPUs without native bf16 the prefill runs upcast to float32 and single-row decode
    # natively in bf16: both paths must stay close to transformers' float32 forward.
    path = tiny_model_dir("llama", num_heads=4, num_kv_heads=2)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", num_kv_blocks=64))
    prompt = list(range(300, 340))
    ours = all_position_logits(engine, prompt)
    with torch.no_grad():
        ref = hf_reference_model(path)(torch.tensor([prompt])).logits[0].float()
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert float(cos.min()) > 0.995
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    ref_ids = (
        hf_reference_model(path)
        .generate(
            torch.tensor([prompt]),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            pad_token_id=0,
        )[0, len(prompt) :]
        .tolist()
    )
    assert sum(a == b for a, b in zip(out.token_ids, ref_ids, strict=True)) >= 6
