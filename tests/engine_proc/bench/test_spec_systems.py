"""The workers' side of the spec workloads (app/bench/spec_workloads.py): kvscope-spec's engine
config, requests that end at EOS, the chat prompts as token ids, and llamacpp-lookup
(engine_proc/bench/llamacpp_lookup.py; its runs need llama-cpp-python, an optional peer, and
skip without it, like tests/engine_proc/bench/test_llamacpp.py)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from engine_proc.bench.common import parse_workload
from engine_proc.bench.kvscope import engine_config_for
from engine_proc.bench.llamacpp_lookup import concurrent, run_llamacpp_lookup
from engine_proc.bench.spec_prompts import DOCUMENT, PROMPTS, chat_prompt_ids
from engine_proc.config import SpeculativeConfig

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed (optional)")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}


def _workload(n: int, spec: dict | None = None) -> dict:
    reqs = [{"id": f"quote-{i}", "prompt": [5, 6, 7, 5, 6], "max_tokens": 8,
             "ignore_eos": False, "arrival_s": 0.0} for i in range(n)]
    return {"requests": reqs, "meta": {} if spec is None else {"speculative_config": spec}}


def _args() -> SimpleNamespace:
    return SimpleNamespace(model=None, dtype="float32", threads=1, device="cpu", kv_blocks=None)


def test_kvscope_spec_takes_the_workloads_speculative_config() -> None:
    config = engine_config_for("kvscope-spec", _workload(1, NGRAM), _args())
    assert config.speculative_config == SpeculativeConfig(**NGRAM)
    assert engine_config_for("kvscope", _workload(1, NGRAM), _args()).speculative_config is None
    with pytest.raises(ValueError, match="meta.speculative_config"):
        engine_config_for("kvscope-spec", _workload(1), _args())
    # A draft model goes to the engine as given (the engine loads it, or says why not).
    draft = {"model": "/nowhere/draft.gguf", "num_speculative_tokens": 4}
    config = engine_config_for("kvscope-spec", _workload(1, draft), _args())
    assert config.speculative_config == SpeculativeConfig("draft_model", 4,
                                                          model="/nowhere/draft.gguf")


def test_requests_may_end_at_eos() -> None:
    [r] = parse_workload(_workload(1))
    assert r.ignore_eos is False
    w = _workload(1)
    del w["requests"][0]["ignore_eos"]
    assert parse_workload(w)[0].ignore_eos is True  # every other workload: EOS ignored
    w["requests"][0]["ignore_eos"] = "no"
    with pytest.raises(ValueError, match="ignore_eos"):
        parse_workload(w)


def test_chat_prompt_ids_are_the_texts_under_the_chat_template() -> None:
    from transformers import AutoTokenizer

    from tests.tiny_models import tiny_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir()))
    ids = chat_prompt_ids(tok)
    assert set(ids) == set(PROMPTS)
    text = tok.decode(ids["quote"])
    assert DOCUMENT in text and "<|im_start|>user" in text
    assert text.rstrip().endswith("<|im_start|>assistant")  # the reply is the model's


def test_lookup_serves_one_sequence_at_a_time() -> None:
    one = _workload(1)["requests"]
    after = {"id": "b", "prompt": [1], "max_tokens": 2, "after": {"request": "quote-0",
                                                                  "tokens": -1}}
    assert not concurrent(parse_workload({"requests": [*one, after]}))
    assert concurrent(parse_workload(_workload(2)))
    after["after"]["tokens"] = 3  # starts while quote-0 still decodes
    assert concurrent(parse_workload({"requests": [*one, after]}))
    result = run_llamacpp_lookup(_workload(16), SimpleNamespace(model=None, threads=1))
    assert set(result) == {"skipped"}
    assert ("one sequence at a time" in result["skipped"]
            or "llama-cpp-python is not installed" in result["skipped"])


@needs_llama_cpp
@pytest.mark.slow
@pytest.mark.parametrize("flash_attn", ["auto", "off"])
def test_lookup_decoding_gives_the_plain_greedy_tokens(flash_attn: str) -> None:
    """llama.cpp's prompt lookup on the tiny GGUF: the same tokens as the batched runner
    without speculation (both greedy), ending at EOS or max_tokens."""
    from engine_proc.bench.llamacpp import run_llamacpp
    from tests.tiny_models import tiny_gguf_file

    path = str(tiny_gguf_file("llama"))
    prompt = [(37 * i) % 5000 + 100 for i in range(12)] * 3  # repeats: lookup finds drafts
    reqs = [{"id": "quote-0", "prompt": prompt, "max_tokens": 24, "ignore_eos": False,
             "arrival_s": 0.0},
            {"id": "edit-code-0", "prompt": prompt[5:], "max_tokens": 24, "ignore_eos": False,
             "after": {"request": "quote-0", "tokens": -1}}]
    workload = {"requests": reqs, "meta": {"lookup": {"max_ngram_size": 4,
                                                      "num_pred_tokens": 4}}}
    lookup = run_llamacpp_lookup(workload, SimpleNamespace(model=path, threads=1,
                                                           llamacpp_flash_attn=flash_attn))
    plain = run_llamacpp(workload, SimpleNamespace(model=path, threads=1, llamacpp_kv="split",
                                                   llamacpp_flash_attn=flash_attn))
    for a, b in zip(lookup["requests"], plain["requests"], strict=True):
        assert a["token_ids"] == b["token_ids"] and 1 <= len(a["token_ids"]) <= 24
    assert lookup["llamacpp"]["lookup"] == {"max_ngram_size": 4, "num_pred_tokens": 4}
    assert lookup["llamacpp"]["flash_attn"] is (flash_attn != "off")
