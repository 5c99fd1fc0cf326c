"""The conversation tree: edits and regenerated replies become branches, the branch on screen
follows `chosen`, and every mutation keeps the tree consistent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.conversations import Conversation, Message


def texts(conv: Conversation) -> list[str]:
    return [m.content for m in conv.messages]


def chat(*turns: str) -> Conversation:
    """u1, a1, u2, ... alternating user and assistant turns, built the pre-tree way."""
    roles = ["user", "assistant"]
    msgs = [Message(roles[i % 2], t) for i, t in enumerate(turns)]
    return Conversation(title="t", system_prompt="sys", messages=msgs)


def test_a_list_of_messages_becomes_one_chain():
    conv = chat("u1", "a1", "u2")
    msgs = conv.messages
    assert texts(conv) == ["u1", "a1", "u2"]
    assert [m.parent for m in msgs] == [None, msgs[0].id, msgs[1].id]
    assert list(conv.nodes) == [m.id for m in msgs]
    assert conv.branch_position(msgs[1]) == (1, 1)


def test_messages_is_read_only():
    conv = chat("u1")
    with pytest.raises(AttributeError):
        conv.messages = []
    with pytest.raises(AttributeError):
        conv.messages.append(Message("user", "lost"))  # no silent change to a copy
    assert texts(conv) == ["u1"]


def test_append_continues_the_branch_on_screen():
    conv = Conversation()
    assert conv.messages == () and conv.to_prompt()[0]["role"] == "system"
    first = conv.append(Message("user", "q"))
    reply = conv.append(Message("assistant", "r"))
    assert reply.parent == first.id and first.parent is None
    assert texts(conv) == ["q", "r"]


def test_editing_a_user_turn_keeps_the_old_branch_reachable():
    conv = chat("u1", "a1", "u2", "a2")
    u2 = conv.messages[2]
    edited = conv.add_sibling(u2, Message("user", "u2 edited"))
    assert texts(conv) == ["u1", "a1", "u2 edited"]  # the path ends at the edit
    assert conv.branch_position(edited) == (2, 2)
    assert conv.fork_source(edited) is u2 and conv.fork_source(u2) is None
    conv.append(Message("assistant", "a2'"))
    back = conv.switch_branch(edited, -1)
    assert back is u2
    assert texts(conv) == ["u1", "a1", "u2", "a2"]  # the old subtree, down to its leaf
    conv.switch_branch(u2, +1)
    assert texts(conv) == ["u1", "a1", "u2 edited", "a2'"]
    assert len(conv.nodes) == 6


def test_regenerating_a_reply_changes_what_the_engine_is_sent():
    conv = chat("u1", "a1")
    a1 = conv.messages[1]
    conv.add_sibling(a1, Message("assistant", "a1 again"))
    assert conv.to_prompt() == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1 again"},
    ]
    assert [m.content for m in conv.siblings(a1)] == ["a1", "a1 again"]


def test_switch_branch_out_of_range_names_the_allowed_steps():
    conv = chat("u1")
    u1 = conv.messages[0]
    conv.add_sibling(u1, Message("user", "v2"))
    third = conv.add_sibling(u1, Message("user", "v3"))
    with pytest.raises(ValueError, match=r"step must be in -2\.\.0 for branch 3 of 3, got 1"):
        conv.switch_branch(third, 1)
    assert conv.switch_branch(third, -2) is u1
    assert texts(conv) == ["u1"]


def test_select_jumps_to_a_message_on_another_branch():
    conv = chat("u1", "a1", "u2", "a2")
    hidden = conv.messages[3]
    conv.add_sibling(conv.messages[0], Message("user", "other start"))
    conv.append(Message("assistant", "other reply"))
    assert texts(conv) == ["other start", "other reply"]
    conv.select(hidden.id)
    assert texts(conv) == ["u1", "a1", "u2", "a2"]
    with pytest.raises(ValueError, match="not in conversation"):
        conv.select("nope")


def test_without_a_valid_choice_the_newest_child_is_shown():
    root = Message("user", "q", id="r")
    old = Message("assistant", "old", id="o", parent="r")
    new = Message("assistant", "new", id="n", parent="r")
    conv = Conversation(nodes={"r": root, "o": old, "n": new}, chosen={})
    assert texts(conv) == ["q", "new"]


def test_remove_leaf_undoes_an_append_and_an_edit():
    conv = chat("u1", "a1")
    sent = conv.append(Message("user", "u2"))
    conv.remove_leaf(sent)
    assert texts(conv) == ["u1", "a1"] and sent.id not in conv.nodes
    a1 = conv.messages[1]
    again = conv.add_sibling(a1, Message("assistant", "a1 again"))
    conv.remove_leaf(again)
    assert texts(conv) == ["u1", "a1"] and conv.branch_position(a1) == (1, 1)
    with pytest.raises(ValueError, match="only a leaf"):
        conv.remove_leaf(conv.messages[0])


def test_a_message_joins_only_once():
    conv = chat("u1")
    with pytest.raises(ValueError, match="already in conversation"):
        conv.append(conv.messages[0])


def test_prompt_text_fences_each_attached_file():
    msg = Message(
        "user",
        "Review these.",
        attachments=[
            {"name": "a.py", "text": "x = 1\n", "tokens": 4},
            {"name": "notes.md", "text": "use ```code``` here", "tokens": None},
        ],
    )
    expected = (
        "Review these.\n\n"
        "File: a.py\n```\nx = 1\n```\n\n"
        "File: notes.md\n````\nuse ```code``` here\n````"
    )
    assert msg.prompt_text() == expected
    assert Message("user", "plain").prompt_text() == "plain"
    only_file = Message("user", "", attachments=[{"name": "f", "text": "t", "tokens": 1}])
    assert only_file.prompt_text() == "File: f\n```\nt\n```"


def test_to_prompt_inlines_files_and_skips_empty_replies():
    conv = Conversation(system_prompt="  ")
    conv.append(Message("user", "see", attachments=[{"name": "f", "text": "t", "tokens": 1}]))
    conv.append(Message("assistant", "", interrupted=True))
    assert conv.to_prompt() == [{"role": "user", "content": "see\n\nFile: f\n```\nt\n```"}]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"role": "robot", "content": "x"}, "role"),
        ({"role": "assistant", "content": "x", "attachments": [{"name": "f", "text": ""}]},
         "only user messages"),
        ({"role": "user", "content": "x", "attachments": [{"name": "", "text": ""}]},
         r"attachments\[0\]\.name"),
        ({"role": "user", "content": "x", "attachments": [{"name": "f", "text": 3}]},
         r"attachments\[0\]\.text"),
        ({"role": "user", "content": "x",
          "attachments": [{"name": "f", "text": "", "tokens": "9"}]}, r"attachments\[0\]\.tokens"),
    ],
)  # fmt: skip
def test_invalid_messages_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Message(**kwargs)


def test_auto_title_uses_the_branch_on_screen():
    conv = chat("first   question\nhere", "a1")
    assert conv.auto_title() == "first question here"
    conv.add_sibling(conv.messages[0], Message("user", "x" * 50))
    assert conv.auto_title() == "x" * 40 + "…"


# Random edit sessions: whatever happens, the branch on screen is a root-to-leaf path, every
# message stays reachable, and switching away and back restores the same branch.
OPS = st.lists(st.tuples(st.sampled_from(["append", "sibling", "switch", "remove"]),
                         st.integers(0, 50), st.integers(-3, 3)), max_size=40)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_random_edits_keep_the_tree_consistent(ops):
    conv = Conversation()
    added = removed = 0
    for op, pick, step in ops:
        path = conv.messages
        target = path[pick % len(path)] if path else None
        role = "user" if len(path) % 2 == 0 else "assistant"
        if op == "append" or target is None:
            conv.append(Message(role, f"m{added}"))
            added += 1
        elif op == "sibling":
            conv.add_sibling(target, Message(target.role, f"m{added}"))
            added += 1
        elif op == "switch":
            index, count = conv.branch_position(target)
            if 1 <= index + step <= count:
                before = texts(conv)
                other = conv.switch_branch(target, step)
                assert other in conv.messages
                conv.switch_branch(other, -step)
                assert texts(conv) == before
        elif not any(m.parent == path[-1].id for m in conv.nodes.values()):
            conv.remove_leaf(path[-1])
            removed += 1
        path = conv.messages
        assert len(conv.nodes) == added - removed
        assert [m.parent for m in path] == [None, *(m.id for m in path)][: len(path)]
        assert not path or not any(m.parent == path[-1].id for m in conv.nodes.values())
    for m in list(conv.nodes.values()):
        conv.select(m.id)
        assert m in conv.messages
