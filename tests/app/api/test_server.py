"""The OpenAI-compatible API against a real `serve` process, driven by the official SDK.

References are independent of the HTTP path: the in-process engine on the same checkpoint (greedy
tokens), transformers' forward pass (logprobs), and sequential runs (concurrency)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from engine_proc import SamplingParams
from tests.app.api.helpers import API_KEY, MODEL

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Tell me about paged attention."}]
AUTH = {"authorization": f"Bearer {API_KEY}"}


def ref_generate(reference, prompt, **params):
    [out] = reference.generate([prompt], SamplingParams(**params))
    return out


def test_models_lists_the_served_model_with_its_context(sdk, reference) -> None:
    models = sdk.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == reference.max_model_len


def test_greedy_chat_equals_the_in_process_engine(sdk, reference) -> None:
    got = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    want = ref_generate(reference, CHAT, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == want.num_prompt_tokens
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == want.num_prompt_tokens + len(want.token_ids)


def test_greedy_completions_equal_the_in_process_engine_for_text_and_token_prompts(
    sdk, reference
) -> None:
    ids = reference.tokenize_text("The cache holds")
    texts = ["Once upon a time", "The scheduler"]
    got = sdk.completions.create(model=MODEL, prompt=texts, max_tokens=9, temperature=0)
    for choice, prompt in zip(got.choices, texts, strict=True):
        assert choice.text == ref_generate(reference, prompt, max_tokens=9, temperature=0).text
    assert [c.index for c in got.choices] == [0, 1]
    got = sdk.completions.create(model=MODEL, prompt=ids, max_tokens=9, temperature=0)
    assert got.choices[0].text == ref_generate(reference, ids, max_tokens=9, temperature=0).text


def test_streaming_chat_reassembles_the_non_streamed_reply(sdk, reference) -> None:
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL,
            messages=CHAT, max_tokens=12, temperature=0,
            stream=True,
        )
    )  # fmt: skip
    want = ref_generate(reference, CHAT, max_tokens=12, temperature=0)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_n3_streaming_indexes_and_seeded_sampling_is_reproducible(sdk) -> None:
    def run() -> dict[int, str]:
        stream = sdk.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=10,
            temperature=1.0,
            seed=1234,
            n=3,
            stream=True,
        )
        texts: dict[int, list[str]] = {}
        roles: dict[int, int] = {}
        finishes: dict[int, str] = {}
        for chunk in stream:
            for c in chunk.choices:
                if c.delta.role == "assistant":
                    assert c.index not in texts, "role chunk first, once per choice"
                    roles[c.index] = roles.get(c.index, 0) + 1
                assert c.index in roles, "content before the role chunk"
                texts.setdefault(c.index, []).append(c.delta.content or "")
                if c.finish_reason is not None:
                    finishes[c.index] = c.finish_reason
        assert sorted(roles) == [0, 1, 2] and set(roles.values()) == {1}
        assert sorted(finishes) == [0, 1, 2]
        return {i: "".join(t) for i, t in texts.items()}

    first, second = run(), run()
    assert first == second
    assert len(set(first.values())) > 1, "three seeded samples should not all be equal"


def test_stop_strings_end_the_reply_before_the_stop(sdk, reference) -> None:
    full = ref_generate(reference, CHAT, max_tokens=24, temperature=0, ignore_eos=True).text
    stop = full[6:9]
    assert stop and stop.strip(), full
    got = sdk.chat.completions.create(
        model=MODEL,
        messages=CHAT, max_tokens=24, temperature=0, stop=[stop, "never-seen-stop"],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].message.content == full[: full.index(stop)]


def test_include_usage_reports_cached_tokens_of_a_repeated_system_prompt(sdk) -> None:
    system = "You are a careful assistant who explains memory paging. " * 12

    def usage(question: str):
        chunks = list(
            sdk.chat.completions.create(
                model=MODEL,
                messages=[{"role": "system", "content": system},
                          {"role": "user", "content": question}],
                max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True},
            )
        )  # fmt: skip
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert all(c.usage is None for c in chunks[:-1])
        return chunks[-1].usage

    first = usage("What is a block?")
    second = usage("What is a page?")
    assert second.prompt_tokens_details.cached_tokens > 0
    assert second.prompt_tokens_details.cached_tokens % 16 == 0  # whole blocks
    assert second.prompt_tokens_details.cached_tokens <= second.prompt_tokens
    assert first.completion_tokens == 4


def test_logprobs_equal_log_softmax_of_transformers_logits(sdk, reference, tiny_dir) -> None:
    import torch

    from tests.tiny_models import hf_reference_model

    got = sdk.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    entries = got.choices[0].logprobs.content
    prompt_ids = reference.tokenize_chat(CHAT)
    model = hf_reference_model(tiny_dir)
    ids = list(prompt_ids)
    with torch.no_grad():
        for entry in entries:
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            logp = torch.log_softmax(logits, dim=-1)
            chosen = int(logp.argmax())
            assert entry.logprob == pytest.approx(float(logp[chosen]), abs=1e-4)
            assert entry.token == reference.tokenizer.decode([chosen])
            top = torch.topk(logp, 5)
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
                top.values.tolist(), abs=1e-4
            )
            ids.append(chosen)
    assert len(entries) == got.usage.completion_tokens


def test_completions_logprobs_shape(sdk) -> None:
    got = sdk.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2
    )
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(t) <= 2 and all(v <= 0 for v in t.values()) for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == got.choices[0].text


def test_penalties_and_logit_bias_equal_the_in_process_engine(sdk, reference) -> None:
    prompt = "Repeat after me: la la la"
    plain = ref_generate(reference, prompt, max_tokens=16, temperature=0)
    # A bias on the first greedy token makes it repeat until the penalties outweigh the bias.
    first = plain.token_ids[0]
    params = dict(max_tokens=16, temperature=0, frequency_penalty=1.5, presence_penalty=0.5)
    got = sdk.completions.create(
        model=MODEL, prompt=prompt, logit_bias={str(first): 10.0}, **params,
        extra_body={"repetition_penalty": 1.3},
    )  # fmt: skip
    want = ref_generate(
        reference, prompt, logit_bias={first: 10.0}, repetition_penalty=1.3, **params
    )
    assert got.choices[0].text == want.text
    assert want.token_ids != plain.token_ids, "the penalties should change this greedy reply"
    assert want.token_ids.count(first) > 1, "the bias should make the first token repeat"


def test_64_concurrent_streams_give_the_outputs_of_sequential_runs(async_sdk, sdk) -> None:
    prompts = [f"Story number {i}: once upon a time" for i in range(64)]
    lengths = [4 + i % 9 for i in range(64)]
    sequential = [
        sdk.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0).choices[0].text
        for p, n in zip(prompts[:16], lengths[:16], strict=True)
    ]

    async def one(prompt: str, n: int) -> str:
        stream = await async_sdk.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of() -> list[str]:
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths, strict=True)))

    concurrent = asyncio.run(all_of())
    assert concurrent[:16] == sequential
    # The other 48 against sequential runs too (after the concurrent burst, one at a time).
    rest = [
        sdk.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0).choices[0].text
        for p, n in zip(prompts[16:], lengths[16:], strict=True)
    ]
    assert concurrent[16:] == rest


def test_tokenize_and_detokenize(server, reference) -> None:
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, headers=AUTH)
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == reference.tokenize_text("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == reference.max_model_len
    r = httpx.post(server.url + "/tokenize", json={"messages": CHAT}, headers=AUTH)
    assert r.json()["tokens"] == reference.tokenize_chat(CHAT)
    r = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}, headers=AUTH)
    assert r.json() == {"prompt": reference.tokenizer.decode(body["tokens"])}


def test_health_version_and_metrics_need_no_key(server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert "version" in httpx.get(server.url + "/version").json()
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401


# ------------------------------------------------------------------ bad requests

LONG = "word " * 700  # > 512 tokens: over this model's context


def _bad_cases(model: str) -> list[tuple[str, str, dict, object, int, str | None]]:
    """(name, path, headers, body, status, param) — body: dict (JSON), bytes (raw) or None."""
    chat = {"messages": CHAT, "max_tokens": 2}
    j = {"content-type": "application/json", **AUTH}
    return [
        ("not JSON", "/v1/chat/completions", j, b"{not json", 400, None),
        ("JSON array", "/v1/chat/completions", j, [1, 2], 400, None),
        ("wrong content type", "/v1/chat/completions", {**AUTH, "content-type": "text/plain"},
         b"{}", 415, None),
        ("no key", "/v1/chat/completions", {"content-type": "application/json"}, chat, 401, None),
        ("wrong key", "/v1/chat/completions",
         {"content-type": "application/json", "authorization": "Bearer nope"}, chat, 401, None),
        ("foreign Host", "/v1/chat/completions", {**j, "host": "evil.example:8000"}, chat, 403,
         None),
        ("unknown model", "/v1/chat/completions", j, {**chat, "model": "gpt-9"}, 404, "model"),
        ("unknown route", "/v1/engines", j, chat, 404, None),
        ("wrong method", "/v1/chat/completions", None, None, 405, None),
        ("messages missing", "/v1/chat/completions", j, {"max_tokens": 2}, 400, "messages"),
        ("messages empty", "/v1/chat/completions", j, {"messages": []}, 400, "messages"),
        ("bad role", "/v1/chat/completions", j,
         {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        ("content a number", "/v1/chat/completions", j,
         {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        ("image part", "/v1/chat/completions", j,
         {"messages": [{"role": "user", "content": [
             {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
         400, "messages[0].content"),
        ("temperature a string", "/v1/chat/completions", j, {**chat, "temperature": "hot"}, 400,
         "temperature"),
        ("temperature too high", "/v1/chat/completions", j, {**chat, "temperature": 3}, 400,
         "temperature"),
        ("top_p zero", "/v1/chat/completions", j, {**chat, "top_p": 0}, 400, "top_p"),
        ("max_tokens zero", "/v1/chat/completions", j, {**chat, "max_tokens": 0}, 400,
         "max_tokens"),
        ("max_tokens float", "/v1/chat/completions", j, {**chat, "max_tokens": 2.5}, 400,
         "max_tokens"),
        ("n too large", "/v1/chat/completions", j, {**chat, "n": 1000}, 400, "n"),
        ("top_logprobs without logprobs", "/v1/chat/completions", j,
         {**chat, "top_logprobs": 3}, 400, "top_logprobs"),
        ("top_logprobs over 20", "/v1/chat/completions", j,
         {**chat, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ("stream_options without stream", "/v1/chat/completions", j,
         {**chat, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("tool without a name", "/v1/chat/completions", j,
         {**chat, "tools": [{"type": "function", "function": {}}]}, 400,
         "tools[0].function.name"),
        ("json schema", "/v1/chat/completions", j,
         {**chat, "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
         "response_format.json_schema.schema"),
        ("typo field", "/v1/chat/completions", j, {**chat, "temprature": 0}, 400, "temprature"),
        ("logit_bias bad key", "/v1/chat/completions", j, {**chat, "logit_bias": {"x": 1}}, 400,
         "logit_bias"),
        ("logit_bias out of range", "/v1/chat/completions", j,
         {**chat, "logit_bias": {"5": 200}}, 400, "logit_bias"),
        ("logit_bias id beyond vocab", "/v1/chat/completions", j,
         {**chat, "logit_bias": {"99999999": 1}}, 400, None),
        ("negative seed", "/v1/chat/completions", j, {**chat, "seed": -1}, 400, "seed"),
        ("stop not strings", "/v1/chat/completions", j, {**chat, "stop": [1]}, 400, "stop"),
        ("presence_penalty out of range", "/v1/chat/completions", j,
         {**chat, "presence_penalty": 5}, 400, "presence_penalty"),
        ("prompt too long", "/v1/chat/completions", j,
         {"messages": [{"role": "user", "content": LONG}]}, 400, None),
        ("prompt missing", "/v1/completions", j, {"max_tokens": 2}, 400, "prompt"),
        ("prompt a number", "/v1/completions", j, {"prompt": 3}, 400, "prompt"),
        ("echo", "/v1/completions", j, {"prompt": "x", "echo": True}, 400, "echo"),
        ("token id out of vocab", "/v1/completions", j, {"prompt": [10**9]}, 400, None),
        ("oversize body", "/v1/completions", j, {"prompt": "x" * (1 << 21)}, 413, None),
        ("tokenize both", "/tokenize", j, {"prompt": "a", "messages": CHAT}, 400, "prompt"),
        ("detokenize bad ids", "/detokenize", j, {"tokens": ["a"]}, 400, "tokens"),
    ]  # fmt: skip


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, sdk) -> None:
    running = sdk.completions.create(
        model=MODEL, prompt="Keep going", max_tokens=64, temperature=0, stream=True
    )
    first = next(iter(running))
    cases = _bad_cases("x")
    assert len(cases) >= 25
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for name, path, headers, body, status, param in cases:
            if body is None:
                r = http.get(path, headers=AUTH)
            elif isinstance(body, bytes):
                r = http.post(path, content=body, headers=headers)
            else:
                r = http.post(path, content=json.dumps(body), headers=headers)
            assert r.status_code == status, (name, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, name
            assert isinstance(err["message"], str) and err["message"], name
            if param is not None:
                assert err["param"] == param, (name, err)
            if name == "prompt too long":
                assert err["code"] == "context_length_exceeded"
                assert "512" in err["message"], err["message"]
            # Served between every bad request.
            ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                           headers=AUTH)  # fmt: skip
            assert ok.status_code == 200, (name, ok.text)
    rest = [c.choices[0].text for c in running if c.choices]
    assert first.choices and len("".join(rest)) > 0


def test_a_refused_streaming_request_gets_its_status_before_the_stream(server) -> None:
    body = {"messages": [{"role": "user", "content": LONG}], "stream": True}
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


# ------------------------------------------------------------------ metrics and disconnects


def _metrics(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine")
            )
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def _wait_metrics(server, check, timeout: float = 30.0) -> dict[str, float]:
    import time

    deadline = time.monotonic() + timeout
    m = _metrics(server)
    while not check(m) and time.monotonic() < deadline:
        time.sleep(0.1)
        m = _metrics(server)
    return m


def _idle(m: dict[str, float]) -> bool:
    return (
        m.get("kvscope:num_requests_running") == 0
        and m.get("kvscope:num_requests_waiting") == 0
        and m.get("kvscope:kv_cache_usage_perc") == 0
    )


def test_metrics_count_a_known_workload_exactly(server, sdk, reference) -> None:
    before = _wait_metrics(server, _idle)
    prompts = ["alpha beta gamma delta " * 8, "one two three four five six"]
    sent = sum(len(reference.tokenize_text(p)) for p in prompts)
    generated = 0
    for p in prompts:
        for _ in range(2):  # the repeat hits the prefix cache
            out = sdk.completions.create(
                model=MODEL, prompt=p, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
            )
            generated += out.usage.completion_tokens
    after = _wait_metrics(
        server,
        lambda m: (
            _idle(m)
            and m["kvscope:generation_tokens_total"] - before["kvscope:generation_tokens_total"]
            >= generated
        ),
    )

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("kvscope:prompt_tokens_total") == 2 * sent
    assert grew("kvscope:generation_tokens_total") == generated == 20
    assert grew("kvscope:prefix_cache_hits_total") > 0
    assert grew("kvscope:request_success_total{finished_reason=length}") == 4
    for h in ("e2e_request_latency_seconds", "time_to_first_token_seconds",
              "request_queue_time_seconds", "request_generation_tokens",
              "request_prompt_tokens"):  # fmt: skip
        assert grew(f"kvscope:{h}_count") == 4, h
        assert after[f"kvscope:{h}_bucket{{le=+Inf}}"] == after[f"kvscope:{h}_count"], h
    assert grew("kvscope:inter_token_latency_seconds_count") == 4 * 4
    assert grew("kvscope:request_generation_tokens_sum") == 20
    assert after["kvscope:cache_config_info{" + ",".join(
        f"{k}={v}" for k, v in sorted({
            "block_size": "16", "cache_dtype": "float32", "device": "cpu",
            "enable_prefix_caching": "True", "kv_bytes_per_token": str(2 * 2 * 2 * 16 * 4),
            "num_gpu_blocks": "256"}.items())) + "}"] == 1  # fmt: skip


def test_non_loopback_host_without_a_long_key_refuses_to_start() -> None:
    import subprocess
    import sys

    from tests.app.api.helpers import REPO

    for extra in ([], ["--api-key", "short"]):
        r = subprocess.run(
            [sys.executable, "-m", "app", "serve", "--host", "0.0.0.0", "--port", "0", *extra],
            cwd=REPO, capture_output=True, text=True, timeout=60,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert r.returncode == 2, r.stderr
        assert "--api-key" in r.stderr or "16 characters" in r.stderr


def test_cors_is_off_by_default(server) -> None:
    r = httpx.options(server.url + "/v1/models", headers={
        "origin": "http://evil.example", "access-control-request-method": "GET"})  # fmt: skip
    assert "access-control-allow-origin" not in r.headers


def test_async_sdk_streaming_chat(async_sdk, reference) -> None:
    async def run() -> str:
        stream = await async_sdk.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=8, temperature=0, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    assert asyncio.run(run()) == ref_generate(reference, CHAT, max_tokens=8, temperature=0).text


def test_greedy_logprob_of_chosen_token_is_the_max(sdk) -> None:
    got = sdk.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0, logprobs=3)
    for lp, top in zip(got.choices[0].logprobs.token_logprobs,
                       got.choices[0].logprobs.top_logprobs, strict=True):  # fmt: skip
        assert math.isclose(lp, max(top.values()), abs_tol=1e-6)


# Every series vLLM's example Grafana dashboard (examples/online_serving/prometheus_grafana)
# queries, without its `vllm:` prefix; each query filters on the model_name label.
VLLM_DASHBOARD_SERIES = (
    "e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum",
    "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total",
    "time_per_output_token_seconds_bucket", "time_per_output_token_seconds_sum",
    "time_per_output_token_seconds_count", "num_requests_running", "num_requests_waiting",
    "time_to_first_token_seconds_bucket", "time_to_first_token_seconds_sum",
    "time_to_first_token_seconds_count", "gpu_cache_usage_perc", "request_prompt_tokens_bucket",
    "request_generation_tokens_bucket", "request_success_total", "request_queue_time_seconds_sum",
    "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum",
    "request_max_num_generation_tokens_sum",
)  # fmt: skip


def test_vllm_grafana_dashboard_series_exist_with_the_kvscope_prefix(server, sdk) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    sdk.completions.create(model=MODEL, prompt="warm", max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    series = {
        s.name: s.labels for family in text_string_to_metric_families(text) for s in family.samples
    }
    for name in VLLM_DASHBOARD_SERIES:
        assert "kvscope:" + name in series, name
        assert series["kvscope:" + name].get("model_name") == MODEL, name
