"""Bad input gets a ValueError naming the field and what is allowed, and the engine keeps
serving everyone else."""

import pytest

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.loading.loader import SUPPORTED_ARCHITECTURES
from tests.engine_fixtures import tiny_engine


@pytest.fixture
def engine():
    return tiny_engine(num_kv_blocks=64, block_size=4)  # context limit 256 tokens


@pytest.mark.parametrize(
    ("kwargs", "field", "allowed"),
    [
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -1}, "top_k", ">= 0"),
        ({"n": 0}, "n", ">= 1"),
        ({"seed": -3}, "seed", "[0, 2**63)"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"presence_penalty": "1"}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -2.01}, "frequency_penalty", "[-2, 2]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty", "[-2, 2]"),
        ({"frequency_penalty": True}, "frequency_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "> 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty", "finite"),
        ({"repetition_penalty": None}, "repetition_penalty", "> 0"),
        ({"logit_bias": [1, 2]}, "logit_bias", "dict"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias", "integers >= 0"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias", "integers >= 0"),
        ({"logit_bias": {"-3": 1.0}}, "logit_bias", "integers >= 0"),
        ({"logit_bias": {1.5: 1.0}}, "logit_bias", "integers >= 0"),
        ({"logit_bias": {5: 100.5}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {5: "1"}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {5: 1.0, "5": 2.0}}, "logit_bias", "twice"),
        ({"logprobs": -1}, "logprobs", "[0, 20]"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"logprobs": 2.0}, "logprobs", "[0, 20]"),
        ({"logprobs": True}, "logprobs", "[0, 20]"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field, allowed):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert field in str(err.value) and allowed in str(err.value)


def test_logit_bias_takes_json_string_keys_and_the_engine_checks_the_vocabulary(engine):
    params = SamplingParams(logit_bias={"17": 3, 4: -100.0}, logprobs=0)
    assert params.logit_bias == {17: 3.0, 4: -100.0}
    with pytest.raises(ValueError) as err:
        engine.add_request("bad", [1, 2], SamplingParams(logit_bias={5: 1.0, 128: 2.0}))
    assert "logit_bias" in str(err.value) and "[0, 128)" in str(err.value)
    assert not engine.is_active("bad")
    engine.add_request("ok", [1, 2], SamplingParams(logit_bias={127: 1.0}, max_tokens=1))


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        ("", "prompt must not be empty"),
        ([], "prompt"),
        ([1] * 300, "shorter than the context limit of 256"),
        ([5, 128], "[0, 128)"),
        ([-1], "[0, 128)"),
        (12, "prompt must be"),
    ],
)
def test_bad_prompts_are_refused_and_others_keep_running(engine, prompt, needle):
    engine.add_request("good", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError) as err:
        engine.add_request("bad", prompt, SamplingParams())
    assert needle in str(err.value)
    assert not engine.is_active("bad")
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [(o.request_id, len(o.token_ids)) for o in finals] == [("good", 4)]
    assert engine.kv.pool.num_free == engine.num_blocks


def test_request_ids_and_limits(engine):
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [3, 4], SamplingParams())
    with pytest.raises(ValueError, match="not an active request"):
        engine.abort_request("nobody")
    for field in ("max_num_seqs", "max_num_batched_tokens"):
        with pytest.raises(ValueError, match=f"{field} must be an integer >= 1"):
            engine.set_limits(**{field: 0})
    with pytest.raises(ValueError, match="long_prefill_chunk must be an integer >= 0"):
        engine.set_limits(long_prefill_chunk=-1)
    assert engine.live_config()["max_num_seqs"] == 64  # nothing changed
    # a chunk of one's own, then back to the engine's rule (None: 512 beside others)
    assert engine.live_config()["long_prefill_chunk_default"] is True
    config = engine.set_limits(long_prefill_chunk=64)
    assert (config["long_prefill_chunk"], config["long_prefill_chunk_default"]) == (64, False)
    assert engine.scheduler.limits.long_prefill_chunk == 64
    with pytest.raises(ValueError, match="long_prefill_chunk or default_prefill_chunk, not both"):
        engine.set_limits(long_prefill_chunk=32, default_prefill_chunk=True)
    config = engine.set_limits(default_prefill_chunk=True)
    assert (config["long_prefill_chunk"], config["long_prefill_chunk_default"]) == (512, True)
    assert engine.scheduler.limits.long_prefill_chunk is None
    engine.add_request("long", [5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    (out,) = engine.generate([[7, 8, 9]], SamplingParams(max_tokens=2))  # shares steps
    assert out.finished and engine.is_active("long")
    assert engine.abort_request("long")[0].finish_reason == "abort"
    assert engine.kv.pool.num_free == engine.num_blocks


def test_chat_messages_are_checked(engine):
    with pytest.raises(ValueError, match=r"messages\[0\]\.role must be one of"):
        engine.tokenize([{"role": "wizard", "content": "hi"}])


def test_unknown_model_path_and_architecture(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLMEngine(EngineConfig(model=str(tmp_path / "missing")))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError) as err:
        LLMEngine(EngineConfig(model=str(tmp_path)))
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


def test_bad_engine_config_names_the_field():
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="int3")
    with pytest.raises(ValueError, match="block_size must be an integer in"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="magic")


def test_a_failing_forward_pass_fails_its_batch_only_and_leaks_nothing(engine):
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    (expected,) = tiny_engine(num_kv_blocks=64, block_size=4).generate([prompt], params)
    execute = engine.runner.execute

    def broken(batch):
        engine.runner.execute = execute  # fail once
        raise RuntimeError("simulated kernel fault")

    engine.runner.execute = broken
    engine.add_request("doomed", prompt, params)
    (out,) = engine.step()
    assert out.finish_reason == "error" and "simulated kernel fault" in out.error
    assert engine.kv.pool.num_free == engine.num_blocks
    # Blocks indexed for the failed step never got their K/V: nothing may hit them.
    assert engine.kv.pool.hash_to_block == {}
    (again,) = engine.generate([prompt], params)
    assert again.token_ids == expected.token_ids
