"""Reasoning on a real `serve` process: a tiny random model under a Qwen3 / DeepSeek-R1 style
template whose generation prompt opens `<think>` (thinking on) or writes an empty block (off,
`chat_template_kwargs: {"enable_thinking": false}`).

The independent reference is the raw greedy completion of the same rendered prompt
(/tokenize, /v1/completions), split at `</think>` by the test itself: with thinking on the
reply up to the marker is reasoning and the rest content; with it off all of it is content.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.app.api.helpers import API_KEY, MODEL, NUM_BLOCKS, ServeProc

pytestmark = pytest.mark.slow

AUTH = {"authorization": f"Bearer {API_KEY}"}
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
CHAT = [{"role": "user", "content": "Is 17 prime?"}]
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def thinking_server(tiny_dir):
    from tests.tiny_models import with_chat_template

    model = with_chat_template(tiny_dir, THINKING_TEMPLATE, "thinking")
    proc = ServeProc([
        "--port", "0", "--model", str(model), "--dtype", "float32", "--decode-weights", "dense",
        "--api-key", API_KEY, "--served-model-name", MODEL,
        "--engine-args", f"--num-threads 1 --num-kv-blocks {NUM_BLOCKS}",
    ])  # fmt: skip
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def rendered(server, kwargs: dict | None) -> tuple[list[int], str]:
    body = {"messages": CHAT, **({"chat_template_kwargs": kwargs} if kwargs else {})}
    ids = post(server, "/tokenize", body)["tokens"]
    return ids, post(server, "/detokenize", {"tokens": ids})["prompt"]


def expected(server, kwargs: dict | None, max_tokens: int) -> tuple[str | None, str]:
    ids, _ = rendered(server, kwargs)
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    raw = post(server, "/v1/completions", body)["choices"][0]["text"]
    if kwargs == OFF:
        return None, raw
    reasoning, _, content = raw.partition("</think>")
    return reasoning, content


def test_the_template_flag_reaches_the_prompt(thinking_server) -> None:
    _, on = rendered(thinking_server, None)
    _, off = rendered(thinking_server, OFF)
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("kwargs", [None, OFF], ids=["thinking-on", "thinking-off"])
def test_reasoning_and_content_split_exactly_streamed_or_not(thinking_server, kwargs) -> None:
    reasoning, content = expected(thinking_server, kwargs, 24)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 24, "temperature": 0,
            **({"chat_template_kwargs": kwargs} if kwargs else {})}  # fmt: skip
    got = post(thinking_server, "/v1/chat/completions", body)
    msg = got["choices"][0]["message"]
    assert msg.get("reasoning_content") == reasoning and msg.get("reasoning") == reasoning
    assert msg["content"] == content
    details = got["usage"]["completion_tokens_details"]
    if kwargs is None and not content:  # the block never closed: every token was thinking
        assert details["reasoning_tokens"] == got["usage"]["completion_tokens"]
    if kwargs == OFF:
        assert details["reasoning_tokens"] == 0
    # streamed: reasoning only in delta.reasoning_content, never in content
    streamed = {"reasoning_content": "", "content": ""}
    with httpx.stream("POST", thinking_server.url + "/v1/chat/completions", headers=AUTH,
                      json={**body, "stream": True}, timeout=120) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    for key in streamed:
                        streamed[key] += choice["delta"].get(key) or ""
    assert streamed == {"reasoning_content": reasoning or "", "content": content}
