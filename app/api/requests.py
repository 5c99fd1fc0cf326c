"""Request bodies of the OpenAI API -> validated generation plans.

Every problem is a 400 whose message names the field and the allowed values (never FastAPI's
422). A field that would change the output and that the engine cannot honour is refused by name;
harmless metadata (`user`, `metadata`, `store`, ...) is accepted; any other unknown field is
refused too, so a typo such as `temprature` does not pass silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.api.errors import APIError, bad_request
from app.api.fields import (
    bool_field,
    float_field,
    int_field,
    is_int,
    logit_bias,
    stop_strings,
)
from app.api.structured import structured_of
from app.api.tools.request import (
    MESSAGE_FIELDS,
    apply_tools,
    message_tool_fields,
    parse_template_kwargs,
    parse_tools,
)
from ipc import protocol as P

MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 64  # prompts in one /v1/completions body

# Accepted and ignored: they describe the caller, not the output.
HARMLESS_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
)

# Known fields that would change the output, with why they are refused (or when they are fine).
UNSUPPORTED_FIELDS = {
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "verbosity": "verbosity is not supported",
    "min_tokens": "min_tokens is not supported",
    "min_p": "min_p is not supported",
    "suffix": "suffix (insertion) is not supported",
    "chat_template": "custom chat templates are not supported",
    "prompt_logprobs": "prompt logprobs are not supported",
}

COMMON_FIELDS = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream",
        "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "logprobs", "ignore_eos", "stop_token_ids", "cache_salt",
        "skip_special_tokens", "include_stop_str_in_output", "best_of", "echo",
        "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "grammar", "speculative",
    }
)  # fmt: skip
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tool_choice",
    "parallel_tool_calls", "modalities", "add_generation_prompt",
    "tools", "chat_template_kwargs", "reasoning_effort",  # app/api/tools/request.py
}  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(slots=True)
class Limits:
    """What one request may ask for (the server's bounds, from its command line)."""

    max_model_len: int
    max_tokens: int  # per sequence; defaults to max_model_len
    max_n: int = 16
    max_prompts: int = MAX_PROMPTS


@dataclass(slots=True)
class GenerationPlan:
    """One validated /v1/chat/completions or /v1/completions request."""

    kind: str  # "chat" | "completion"
    model: str
    prompts: list[str | list[int]] = field(default_factory=list)  # completion prompts
    messages: list[P.ChatMessage] | None = None  # chat
    sampling: P.SamplingOptions = field(default_factory=P.SamplingOptions)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    cache_salt: str | None = None
    # chat: tools (app/api/tools/) and thinking (app/api/reasoning.py), read by ChoiceReader
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools, validated
    tool_choice: str | dict[str, Any] = "auto"  # auto | none | required | {"type": "function", ...}
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template
    tool_parser: str = "hermes"  # the family that reads calls (app/api/tools/__init__.py)
    reasoning: bool = False  # split <think> ... </think> into reasoning
    reasoning_open: bool = False  # the prompt already opened the thinking block

    @property
    def num_prompts(self) -> int:
        return 1 if self.kind == "chat" else len(self.prompts)


# ------------------------------------------------------------------ entry points


def parse_chat(body: Any, limits: Limits) -> GenerationPlan:
    body = _object(body)
    _check_fields(body, CHAT_FIELDS)
    plan = GenerationPlan(kind="chat", model=_model(body), messages=_messages(body))
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request(
            "modalities must be ['text'] (the model reads and writes text)", "modalities"
        )
    if body.get("add_generation_prompt", True) is not True:
        raise bad_request("add_generation_prompt must be true", "add_generation_prompt")
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        max_tokens = int_field(body, "max_completion_tokens", 1, limits.max_tokens)
    else:
        max_tokens = int_field(body, "max_tokens", 1, limits.max_tokens, default=limits.max_tokens)
    logprobs = bool_field(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None:
        if not logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        top = int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    _fill_common(plan, body, limits, max_tokens, (top or 0) if logprobs else None)
    apply_tools(plan, body)
    return plan


def parse_completion(body: Any, limits: Limits) -> GenerationPlan:
    body = _object(body)
    _check_fields(body, COMPLETION_FIELDS)
    plan = GenerationPlan(kind="completion", model=_model(body), prompts=_prompts(body, limits))
    max_tokens = int_field(body, "max_tokens", 1, limits.max_tokens, default=16)  # OpenAI's default
    k = body.get("logprobs")
    top = None if k is None else int_field(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    _fill_common(plan, body, limits, max_tokens, top)
    return plan


def parse_tokenize(body: Any) -> dict[str, Any]:
    """vLLM's /tokenize: {prompt, add_special_tokens} or {messages, add_generation_prompt}."""
    body = _object(body)
    allowed = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
               "return_token_strs", "tools", "chat_template_kwargs"}  # fmt: skip
    _check_fields(body, allowed)
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give exactly one of `prompt` (a string) and `messages`", "prompt")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise bad_request("prompt must be a string", "prompt")
        return {"prompt": body["prompt"],
                "add_special_tokens": bool_field(body, "add_special_tokens", True)}  # fmt: skip
    return {
        "messages": _messages(body),
        "add_generation_prompt": bool_field(body, "add_generation_prompt", True),
        "tools": parse_tools(body),
        "chat_template_kwargs": parse_template_kwargs(body),
    }


def parse_detokenize(body: Any, vocab_size: int) -> list[int]:
    body = _object(body)
    _check_fields(body, {"model", "tokens"})
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise bad_request("tokens must be a list of integer token ids", "tokens")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"tokens must be in [0, {vocab_size}); got {bad[:5]}", "tokens")
    return tokens


def check_model(plan_model: str | None, served: list[str]) -> None:
    """404 for a model the server does not serve (None: the request named none)."""
    if plan_model is not None and plan_model not in served:
        raise APIError(
            404,
            f"The model `{plan_model}` does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )


# ------------------------------------------------------------------ shared pieces


def _fill_common(
    plan: GenerationPlan, body: dict[str, Any], limits: Limits, max_tokens: int, top: int | None
) -> None:
    n = int_field(body, "n", 1, limits.max_n, default=1)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad_request(
            f"best_of must equal n ({n}): best-of ranking is not supported", "best_of"
        )
    if body.get("echo") not in (None, False):
        raise bad_request("echo is not supported", "echo")
    if body.get("skip_special_tokens", True) is not True:
        raise bad_request("skip_special_tokens must be true", "skip_special_tokens")
    if body.get("include_stop_str_in_output", False) is not False:
        raise bad_request("include_stop_str_in_output must be false", "include_stop_str_in_output")
    plan.stream = bool_field(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not plan.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {
            "include_usage",
            "continuous_usage_stats",
        }:
            raise bad_request(
                "stream_options must be an object with include_usage (a boolean)", "stream_options"
            )
        plan.include_usage = bool_field(options, "include_usage", False,
                                        "stream_options.include_usage")
    temperature = float_field(body, "temperature", 0.0, 2.0, default=1.0)
    top_p = float_field(body, "top_p", 0.0, 1.0, default=1.0, low_open=True)
    top_k = int_field(body, "top_k", -1, 1 << 20, default=0, note=" (0 or -1 = off)")
    seed = body.get("seed")
    if seed is not None:
        seed = int_field(body, "seed", 0, 2**63 - 1)
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
        raise bad_request("cache_salt must be a non-empty string", "cache_salt")
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(
        is_int(t) and t >= 0 for t in stop_token_ids
    ):
        raise bad_request(
            "stop_token_ids must be a list of token ids (integers >= 0)", "stop_token_ids"
        )
    plan.logprobs = top is not None
    plan.cache_salt = cache_salt
    plan.sampling = P.SamplingOptions(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=max(top_k, 0),
        top_p=top_p,
        seed=seed,
        n=n,
        stop=stop_strings(body),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=bool_field(body, "ignore_eos", False),
        presence_penalty=float_field(body, "presence_penalty", -2.0, 2.0, default=0.0),
        frequency_penalty=float_field(body, "frequency_penalty", -2.0, 2.0, default=0.0),
        repetition_penalty=float_field(
            body, "repetition_penalty", 0.0, 10.0, default=1.0, low_open=True
        ),
        logit_bias=logit_bias(body),
        logprobs=top,
        structured=structured_of(body, plan.kind),  # app/api/structured.py
        # KVScope's own: false keeps this request out of speculative decoding (same output)
        speculative=bool_field(body, "speculative", True),
    )


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_fields(body: dict[str, Any], allowed: frozenset[str] | set[str]) -> None:
    for name, value in body.items():
        if name in UNSUPPORTED_FIELDS and value not in (None, [], {}, False, ""):
            raise bad_request(f"{name}: {UNSUPPORTED_FIELDS[name]}", name, "unsupported_parameter")
        if name not in allowed and name not in HARMLESS_FIELDS and name not in UNSUPPORTED_FIELDS:
            raise bad_request(f"unknown field `{name}`", name, "unknown_parameter")


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        return ""
    if not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    return model


def _messages(body: dict[str, Any]) -> list[P.ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content}", "messages")
    out = []
    call_names: dict[str, str] = {}  # tool call id -> function name, for tool turns
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with role and content", where)
        extra = set(m) - {"role", "content", "name"} - MESSAGE_FIELDS
        if extra:
            raise bad_request(f"{where} has unknown fields {sorted(extra)}", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"{where}.role must be one of {list(CHAT_ROLES)}, got {role!r}",
                              f"{where}.role")  # fmt: skip
        fields = message_tool_fields(m, role, where, call_names)
        if m.get("content") is None and fields.get("tool_calls"):
            content = ""  # an assistant turn that only called tools
        else:
            content = _content(m.get("content"), f"{where}.content")
        role = "system" if role == "developer" else role
        out.append(P.ChatMessage(role=role, content=content, **fields))
    return out


def _content(content: Any, where: str) -> str:
    """A string, or a list of text parts as the SDKs send it (joined with newlines)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind in ("image_url", "input_image", "image"):
                raise bad_request(f"{where}[{j}]: image parts are not supported (text-only model)",
                                  where, "unsupported_content")  # fmt: skip
            elif kind in ("input_audio", "audio", "file"):
                raise bad_request(f"{where}[{j}]: {kind} parts are not supported", where,
                                  "unsupported_content")  # fmt: skip
            else:
                raise bad_request(f"{where}[{j}] must be {{'type': 'text', 'text': str}}", where)
        return "\n".join(texts)
    raise bad_request(f"{where} must be a string or a list of text parts", where)


def _prompts(body: dict[str, Any], limits: Limits) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompt)
    ):
        prompts = list(prompt)
    else:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists (none empty)",
            "prompt",
        )
    if len(prompts) > limits.max_prompts:
        raise bad_request(f"at most {limits.max_prompts} prompts per request, got {len(prompts)}",
                          "prompt")  # fmt: skip
    if any(p == "" for p in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    return prompts
