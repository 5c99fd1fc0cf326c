"""`python -m engine_proc generate` (its main(), in this process): the streamed completion is
transformers' greedy text, the closing line counts the prompt and output tokens, bad values exit
2 naming the field."""

from __future__ import annotations

import re

import pytest

from engine_proc.__main__ import main
from tests.engine_fixtures import greedy_reference
from tests.tiny_models import hf_reference_model, tiny_model_dir

STATS = re.compile(
    r"^\[prompt (\d+) tokens \| TTFT [\d.]+ ms \| (\d+) tokens, decode [\d.]+ tok/s \| "
    r"finish: (\w+)\]$"
)


def _generate(capsys, *args: str):
    capsys.readouterr()
    rc = main(["generate", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def model():
    from transformers import AutoTokenizer

    path = tiny_model_dir("llama")
    return path, AutoTokenizer.from_pretrained(str(path)), hf_reference_model(path)


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_prints_transformers_greedy_completion_then_its_counts(model, chat, capsys) -> None:
    path, tokenizer, hf = model
    prompt = "Name a colour."
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(prompt).input_ids
    expected = greedy_reference(hf)(ids, 8)
    rc, out, err = _generate(capsys, "--model", str(path), "--prompt", prompt, "--max-tokens",
                             "8", *(["--chat"] if chat else []))  # fmt: skip
    assert rc == 0, err
    completion, stats = out.rstrip("\n").rsplit("\n", 1)
    assert completion == tokenizer.decode(expected)
    m = STATS.match(stats)
    assert m, stats
    finish = "stop" if expected[-1] == 2 else "length"
    assert (int(m[1]), int(m[2]), m[3]) == (len(ids), len(expected), finish)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-tokens", "0"], "max_tokens must be >= 1, got 0"),
        (["--temperature", "-1"], "temperature must be a number >= 0 (0 = greedy), got -1.0"),
        (["--model", "/nonexistent/model.gguf"], "model='/nonexistent/model.gguf' does not exist"),
    ],
)
def test_bad_values_exit_2_naming_the_field(model, args, needle, capsys) -> None:
    rc, out, err = _generate(capsys, "--model", str(model[0]), "--prompt", "hi", *args)
    assert rc == 2, err
    assert f"error: {needle}" in err
    assert out == ""
