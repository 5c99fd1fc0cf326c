"""speculative_config: vLLM's JSON shape, and errors that name the key and allowed values."""

from __future__ import annotations

import pytest

from engine_proc.config import EngineConfig, SpeculativeConfig
from engine_proc.sampling_params import SamplingParams


def test_parses_vllm_json_and_dicts() -> None:
    text = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
            '"prompt_lookup_min": 2}')  # fmt: skip
    assert EngineConfig(speculative_config=text).speculative_config == SpeculativeConfig(
        "ngram", 3, 5, 2
    )
    assert EngineConfig(speculative_config={"method": "ngram"}).speculative_config == (
        SpeculativeConfig()
    )
    assert EngineConfig().speculative_config is None
    draft = EngineConfig(speculative_config={"model": "/m", "num_speculative_tokens": 2})
    assert draft.speculative_config == SpeculativeConfig(
        "draft_model", 2, model="/m"
    )  # vLLM's shape: the method follows from the model


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle"}, "method must be one of ('ngram', 'draft_model')"),
        ({"method": "ngram", "model": "/m"}, "method 'draft_model' needs a 'model'"),
        ({"method": "draft_model"}, "method 'draft_model' needs a 'model'"),
        ({"model": 3}, "model must be a path"),
        ({"method": "ngram", "lookahead": 1}, "unknown key 'lookahead'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "prompt_lookup_min": 5}, "prompt_lookup_min (5) must be <="),
        ({"num_speculative_tokens": 2}, "or a draft 'model' is required"),
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_errors_name_the_key(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(speculative_config=value)


def test_per_request_opt_out_is_a_bool() -> None:
    assert SamplingParams().speculative is True
    with pytest.raises(ValueError, match="speculative must be"):
        SamplingParams(speculative=1)  # type: ignore[arg-type]


def test_serve_flag_reaches_the_engine() -> None:
    import argparse

    from engine_proc.server.cli import add_arguments, build_engine
    from tests.tiny_models import tiny_model_dir

    path = tiny_model_dir(
        "llama", num_heads=4, num_kv_heads=2, num_layers=2, max_position_embeddings=1024
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flag = '{"method": "ngram", "num_speculative_tokens": 3}'
    engine = build_engine(parser.parse_args(["--model", str(path), "--speculative-config", flag]))
    assert engine.config.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    assert engine.scheduler.propose is not None
    plain = build_engine(parser.parse_args(["--model", str(path)]))
    assert plain.config.speculative_config is None and plain.scheduler.propose is None
