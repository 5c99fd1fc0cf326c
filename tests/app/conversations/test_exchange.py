"""Export to Markdown and to the OpenAI chat format, and import from it: the export is what the
OpenAI SDK's own types accept, and export -> import -> export changes nothing."""

from __future__ import annotations

import openai.types.chat
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.conversations import Conversation, Message
from app.conversations.exchange import from_openai_messages, to_markdown, to_openai_messages

OPENAI_MESSAGES = pydantic.TypeAdapter(list[openai.types.chat.ChatCompletionMessageParam])


def branched() -> Conversation:
    conv = Conversation(title="Fences", system_prompt="Answer in Markdown.")
    q = conv.append(Message("user", "Fix this:", attachments=[
        {"name": "bug.py", "text": "print('```')\n", "tokens": 6}]))  # fmt: skip
    conv.append(Message("assistant", "# Fixed\n\n```python\nprint(1)\n```"))
    conv.add_sibling(q, Message("user", "never mind"))
    conv.append(Message("assistant", "", interrupted=True))  # stopped before any token
    conv.switch_branch(q, 0)
    return conv


def test_markdown_has_the_title_the_system_prompt_and_each_turn_verbatim():
    expected = (
        "# Fences\n\n"
        "## System prompt\n\nAnswer in Markdown.\n\n"
        "## You\n\nFix this:\n\nAttached:\n- `bug.py` (6 tokens)\n\n"
        "## Assistant\n\n# Fixed\n\n```python\nprint(1)\n```\n"
    )
    assert to_markdown(branched()) == expected


def test_the_openai_export_is_the_branch_on_screen_in_the_sdks_types():
    exported = to_openai_messages(branched())
    assert exported == [
        {"role": "system", "content": "Answer in Markdown."},
        {"role": "user", "content": "Fix this:\n\nFile: bug.py\n````\nprint('```')\n````"},
        {"role": "assistant", "content": "# Fixed\n\n```python\nprint(1)\n```"},
    ]
    OPENAI_MESSAGES.validate_python(exported)  # the SDK's own schema, independent of ours


def test_export_import_export_is_identical():
    conv = branched()
    first = to_openai_messages(conv)
    again = from_openai_messages(first)
    assert to_openai_messages(again) == first
    assert again.system_prompt == "Answer in Markdown."
    assert again.title.startswith("Fix this: File: bug.py")  # the file came in as text
    conv.switch_branch(conv.messages[0], 1)  # the other branch: one user turn, empty reply
    assert to_openai_messages(from_openai_messages(to_openai_messages(conv))) == [
        {"role": "system", "content": "Answer in Markdown."},
        {"role": "user", "content": "never mind"},
    ]


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


@settings(max_examples=60, deadline=None)
@given(system=TEXT, turns=st.lists(TEXT, max_size=8))
def test_any_text_survives_the_round_trip(system, turns):
    conv = Conversation(system_prompt=system)
    for i, text in enumerate(turns):
        conv.append(Message("user" if i % 2 == 0 else "assistant", text))
    exported = to_openai_messages(conv)
    OPENAI_MESSAGES.validate_python(exported)
    assert to_openai_messages(from_openai_messages(exported)) == exported


def test_import_takes_an_object_with_a_title_text_parts_and_a_developer_message():
    conv = from_openai_messages({"title": "From elsewhere", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be kind."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "name": "ann"},
        {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": []},
    ]})  # fmt: skip
    assert conv.title == "From elsewhere" and conv.system_prompt == "Be kind."
    assert [(m.role, m.content) for m in conv.messages] == [("user", "a\nb"), ("assistant", "ok")]
    assert from_openai_messages([], title="Given").title == "Given"
    assert from_openai_messages([{"role": "assistant", "content": "hi"}]).title == "Imported chat"


@pytest.mark.parametrize(
    "data, match",
    [
        ([{"role": "tool", "content": "42", "tool_call_id": "c1"}],
         r"messages\[0\]\.role 'tool' is not supported: allowed system, developer, user, "
         r"assistant"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         r"messages\[0\]\.content\[0\]\.type 'image_url' is not supported: allowed 'text'"),
        ([{"role": "user"}], r"messages\[0\]\.content is missing"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}],
         r"messages\[1\]\.content must be a string or a list of text parts, got NoneType"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}],
         r"messages\[0\]\.content\[0\]\.text must be a string"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}],
         r"messages\[0\]\.tool_calls is not supported"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
         r"messages\[1\]\.role 'system': a system or developer message may only come first"),
        (["hello"], r"messages\[0\] must be an object"),
        ("hello", "expected a list of chat messages"),
        ({"messages": "hello"}, "messages must be a list"),
        ({"messages": [], "title": 3}, "title must be a string"),
        ([{"role": "user", "content": "x"}] * 10_001, "10001 messages, at most 10000 allowed"),
    ],
)  # fmt: skip
def test_import_refuses_what_it_cannot_hold(data, match):
    with pytest.raises(ValueError, match=match):
        from_openai_messages(data)
