"""Engines over tiny random Llama models built in-process with transformers, for tests that
exercise scheduling and caching rather than a real vocabulary."""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.models.config import ModelConfig

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM


class CharTokenizer:
    """Token id i decodes to one printable character; enough for detokenization paths."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x41 + i % 58) for i in ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [(ord(c) - 0x41) % self.vocab_size for c in text]}


@functools.cache
def tiny_hf_model(
    vocab_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2, layers: int = 2, seed: int = 0
) -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    # Larger logits than the default init make greedy choices clear-cut, so comparisons of
    # different schedules are not decided by float rounding in near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def _tiny_parts(**kwargs: int) -> dict:
    """The tiny model's config values and weights. Engine processes the suite spawns build the
    same model again and again; the first one in a session saves it in the suite's cache dir
    (tests/conftest.py sets KVSCOPE_CACHE_DIR, inherited by every child), and the others load
    those very tensors without importing transformers (about a second of CPU per engine)."""
    cache_root = os.environ.get("KVSCOPE_CACHE_DIR")
    path = None
    if cache_root:
        path = Path(cache_root) / "tiny-models" / f"llama-{sorted(kwargs.items())}.pt"
        if path.exists():
            return torch.load(path, weights_only=True)
    hf = tiny_hf_model(**kwargs)
    c = hf.config
    parts = {
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_layers": c.num_hidden_layers,
        "num_heads": c.num_attention_heads, "num_kv_heads": c.num_key_value_heads,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_parameters["rope_theta"],
        "max_position_embeddings": c.max_position_embeddings,
        "weights": {k: v.detach().clone() for k, v in hf.state_dict().items()},
    }  # fmt: skip
    if path is not None:  # written whole, then renamed: a reader never sees half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        torch.save(parts, tmp)
        os.replace(tmp, path)
    return parts


def tiny_checkpoint(**kwargs: int) -> SimpleNamespace:
    parts = _tiny_parts(**kwargs)
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=parts["vocab_size"],
        hidden_size=parts["hidden_size"],
        intermediate_size=parts["intermediate_size"],
        num_layers=parts["num_layers"],
        num_heads=parts["num_heads"],
        num_kv_heads=parts["num_kv_heads"],
        head_dim=parts["hidden_size"] // parts["num_heads"],
        rms_norm_eps=parts["rms_norm_eps"],
        rope_theta=parts["rope_theta"],
        max_position_embeddings=parts["max_position_embeddings"],
        tie_word_embeddings=False,
        attention_bias=False,
        eos_token_ids=(),
    )
    return SimpleNamespace(
        config=config,
        weights=parts["weights"],
        tokenizer=CharTokenizer(parts["vocab_size"]),
        model_id=f"tiny-{sorted(kwargs.items())}",
        display_name="tiny random llama",
    )


def tiny_engine(model_kwargs: dict | None = None, **config: object) -> LLMEngine:
    config.setdefault("num_kv_blocks", 256)
    return LLMEngine(EngineConfig(**config), checkpoint=tiny_checkpoint(**(model_kwargs or {})))


def greedy_reference(model) -> Callable[[list[int], int], list[int]]:
    """transformers' greedy generate() of a model, as a function of prompt ids."""

    def run(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
        return out[0, len(prompt_ids) :].tolist()

    return run


def sampled_reference(model) -> Callable[[list[int], SamplingParams, int], list[int]]:
    """One sequence, one token at a time: transformers' logits of the whole sequence, each
    draw made by the sampler at (seed, output position), the contract
    engine_proc/executor/sampler.py documents (the sampler itself is checked against brute force in
    tests/engine_proc/executor/test_sampler.py). What a request must produce however the engine
    batches, chunks or preempts it; greedy params give transformers' greedy tokens. Stops at EOS (id
    2) unless ignore_eos."""
    from engine_proc.executor.sampler import sample

    def run(prompt_ids: list[int], params: SamplingParams, seed: int) -> list[int]:
        out: list[int] = []
        with torch.no_grad():  # the whole sequence each step: no cache to get wrong
            while len(out) < params.max_tokens:
                ids = torch.tensor([prompt_ids + out])
                logits = model(ids, logits_to_keep=1).logits[:, -1].float()
                out.append(sample(logits, [params], [seed], [len(out)])[0])
                if out[-1] == 2 and not params.ignore_eos:
                    break
        return out

    return run
