"""Incremental detokenization with the default model's byte-level tokenizer, where one character
often spans several tokens: no delta ever holds half a character (U+FFFD), the deltas add up to
the tokenizer's own decoding of all the tokens, and stop strings never show; then the same
through the engine with the default model replying in Japanese."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_proc import SamplingParams
from engine_proc.detokenizer import IncrementalDetokenizer
from tests.tiny_models import tiny_tokenizer_dir

REPLACEMENT = "\ufffd"
# Two-, three- and four-byte UTF-8, combining marks, a skin-tone modifier and a ZWJ sequence.
PIECES = ["a", " ", "the", ",", "é", "ß", "ö", "中", "文", "日本語", "한국어", "🦀", "👍🏽", "👩‍💻",
          "e\u0301", "Ωμέγα", "\n"]  # fmt: skip
texts = st.lists(st.sampled_from(PIECES), min_size=1, max_size=12).map("".join)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir()))
    assert not tok.clean_up_tokenization_spaces  # decoding is concatenation of bytes
    return tok


def _stream(tokenizer, ids: list[int], stop: list[str]) -> tuple[list[str], bool]:
    """Feed `ids` one token at a time, as the engine does; the deltas (the last one final) and
    whether a stop string was hit."""
    det = IncrementalDetokenizer(tokenizer, tokenizer("Say:").input_ids, stop)
    deltas = []
    for token in ids:
        if det.add_tokens([token]):
            deltas.append(det.take_delta(final=True))
            return deltas, True
        deltas.append(det.take_delta(final=False))
    deltas.append(det.take_delta(final=True))
    return deltas, False


def test_a_character_split_over_tokens_waits_for_its_last_byte(tokenizer) -> None:
    ids = tokenizer("🦀", add_special_tokens=False).input_ids
    assert len(ids) > 1 and all(REPLACEMENT in tokenizer.decode([i]) for i in ids)
    deltas, _ = _stream(tokenizer, ids, [])
    assert deltas[:-2] == [""] * (len(ids) - 1) and "".join(deltas) == "🦀"


@settings(max_examples=150, deadline=None)
@given(text=texts)
def test_deltas_are_whole_characters_and_add_up_to_the_decoded_text(tokenizer, text) -> None:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    reference = tokenizer.decode(ids)  # independent: the tokenizer on all tokens at once
    assert reference == text
    deltas, _ = _stream(tokenizer, ids, [])
    assert not any(REPLACEMENT in d for d in deltas), deltas
    assert "".join(deltas) == reference


@settings(max_examples=150, deadline=None)
@given(text=texts, data=st.data())
def test_stop_strings_never_show_and_cut_at_the_first_occurrence(tokenizer, text, data) -> None:
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 4))]  # occurs in the text
    other = data.draw(st.sampled_from(["zzz", "🦀🦀", "the end"]))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    deltas, hit = _stream(tokenizer, ids, [other, stop])
    expected = text[: min(i for s in (other, stop) if (i := text.find(s)) >= 0)]
    assert hit
    assert "".join(deltas) == expected
    assert not any(REPLACEMENT in d for d in deltas)


@pytest.mark.slow
def test_engine_replies_in_japanese_without_half_characters(default_engine_factory) -> None:
    engine = default_engine_factory()
    chat = [{"role": "user", "content": "Write 'thank you' in Japanese and in Chinese."}]
    engine.add_request("jp", chat, SamplingParams(max_tokens=16, temperature=0))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.text_delta)
            final = out
    pieces = [engine.tokenizer.decode([t]) for t in final.token_ids]
    assert sum(REPLACEMENT in p for p in pieces) >= 4, "the reply should split characters"
    assert not any(REPLACEMENT in d for d in deltas), deltas
    assert "".join(deltas) == final.text == engine.tokenizer.decode(final.token_ids)
    assert "" in deltas[:-1]  # some steps had only part of a character to show
