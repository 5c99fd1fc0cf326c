"""app/api/requests.py: what a valid body becomes (the engine's sampling options)."""

from __future__ import annotations

import pytest

from app.api.errors import APIError
from app.api.requests import Limits, parse_chat, parse_completion

LIMITS = Limits(max_model_len=512, max_tokens=512)


def test_chat_fields_map_to_sampling_options() -> None:
    plan = parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
            ],
            "max_tokens": 9, "max_completion_tokens": 7, "top_k": -1, "stop": "END",
            "logit_bias": {"17": -3}, "logprobs": True, "top_logprobs": 4, "seed": 5, "n": 2,
            "user": "someone", "metadata": {"a": "b"}, "store": False,
        },
        LIMITS,
    )  # fmt: skip
    s = plan.sampling
    assert [m.role for m in plan.messages] == ["system", "user"]
    assert plan.messages[1].content == "a\nb"
    assert (s.max_tokens, s.top_k, s.stop, s.logit_bias, s.logprobs, s.seed, s.n) == (
        7, 0, ["END"], {17: -3.0}, 4, 5, 2,
    )  # fmt: skip
    assert plan.logprobs is True


def test_defaults_chat_runs_to_the_context_and_completions_to_16_tokens() -> None:
    assert (
        parse_chat({"messages": [{"role": "user", "content": "x"}]}, LIMITS).sampling.max_tokens
        == 512
    )
    assert parse_completion({"prompt": "x"}, LIMITS).sampling.max_tokens == 16
    assert parse_completion({"prompt": "x"}, LIMITS).sampling.speculative is True
    assert parse_completion({"prompt": "x", "speculative": False},
                            LIMITS).sampling.speculative is False  # fmt: skip
    plan = parse_completion({"prompt": [[1, 2], [3]], "logprobs": 0}, LIMITS)
    assert plan.prompts == [[1, 2], [3]] and plan.sampling.logprobs == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": 513}, "max_tokens"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"prompt": "x", "speculative": "no"}, "speculative"),
    ],
)
def test_bad_values_name_their_field(body, param) -> None:
    with pytest.raises(APIError) as info:
        parse_completion(body, LIMITS)
    assert info.value.status == 400 and info.value.param == param
