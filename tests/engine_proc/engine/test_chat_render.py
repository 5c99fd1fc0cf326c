"""engine_proc/engine/chat_render.py on the default model's tokenizer: tools through a template
that reads them, the Hermes fallback for one that does not (SmolLM2's), template arguments, the
detected parser families, and bad tools named."""

from __future__ import annotations

import copy
import json

import pytest

from engine_proc.engine.chat_render import (
    ChatPrompt,
    reasoning_parser_of,
    render,
    tool_parser_of,
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
HISTORY = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18 C", "tool_call_id": "c1", "name": "get_weather"},
]  # fmt: skip
# A Qwen-2.5-like template that reads tools and tool calls itself, and a thinking flag
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments.city }}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and "
    "not enable_thinking %}<think>\n\n</think>{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from tests.tiny_models import tiny_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir()))


def test_a_template_without_tools_gets_the_hermes_fallback(tokenizer) -> None:
    assert "tools" not in tokenizer.chat_template  # SmolLM2's
    text = render(tokenizer, ChatPrompt(copy.deepcopy(HISTORY), TOOLS))
    system, _, rest = text.partition("<|im_end|>")
    assert system.startswith("<|im_start|>system\n") and json.dumps(TOOLS[0]) in system
    assert '<tool_call>\n{"name": <function name>' in system
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    assert f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>" in rest
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in rest
    assert text.endswith("<|im_start|>assistant\n")
    assert tool_parser_of(tokenizer) == "hermes" and reasoning_parser_of(tokenizer) == ""


def test_a_template_with_tools_renders_them_and_its_arguments(tokenizer) -> None:
    tok = copy.copy(tokenizer)
    tok.chat_template = TOOL_TEMPLATE
    text = render(tok, ChatPrompt(copy.deepcopy(HISTORY), TOOLS))
    # (HF's Jinja trims the newline after a block tag)
    assert text.startswith("TOOLS:get_weather;user: weather?")
    assert "assistant: <tool_call>get_weather Paris</tool_call>tool: 18 C" in text
    assert text.endswith("assistant:<think>\n")
    off = render(tok, ChatPrompt(HISTORY[:1], None, {"enable_thinking": False}))
    assert off == "user: weather?assistant:<think>\n\n</think>"
    assert reasoning_parser_of(tok) == "think_open" and tool_parser_of(tok) == "hermes"


@pytest.mark.parametrize(("marker", "family"), [
    ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
    ("[func_name1(params_name1=params_value1)]", "pythonic"), ("<tool_call>", "hermes"),
])  # fmt: skip
def test_parser_family_from_the_template(marker, family) -> None:
    class Tok:
        chat_template = "{% if tools %}" + marker + "{% endif %}"

    assert tool_parser_of(Tok()) == family


@pytest.mark.parametrize(("tools", "named"), [
    ({"name": "f"}, "tools must be a list"),
    ([{"type": "code"}], "tools[0]"),
    ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}],
     "tools[0].function.parameters"),
])  # fmt: skip
def test_bad_tools_are_a_value_error_naming_the_field(tokenizer, tools, named) -> None:
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        render(tokenizer, ChatPrompt(HISTORY[:1], tools))
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        render(tokenizer, ChatPrompt(HISTORY[:1], None, {"tools": []}))
