"""Conversation files: format 2 holds the tree, format 1 files still open as one chain, files
from a newer KVScope or with broken fields are set aside with an error naming the field."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from app.conversations import Conversation, ConversationStore, Message, atomic
from app.conversations.store import from_json, to_json

V1_FILE = Path(__file__).with_name("v1_conversation.json")


def test_a_version_1_file_opens_unchanged_as_one_chain(tmp_path):
    shutil.copy(V1_FILE, tmp_path / "3f2a9c81b07d.json")  # named by its id, as saved
    (conv,) = ConversationStore(tmp_path).load_all()
    assert (conv.id, conv.title, conv.system_prompt) == (
        "3f2a9c81b07d", "Résumé of the KV cache ✓", "You are terse.")  # fmt: skip
    assert (conv.draft, conv.model) == ("half-typed follow-up", "tiny-llama (F32 GGUF)")
    assert (conv.created, conv.updated) == (1717000000.5, 1717000123.25)
    assert (conv.sampling, conv.preset) == ({}, "")
    assert [(m.role, m.content, m.interrupted) for m in conv.messages] == [
        ("user", "What is a paged KV cache?", False),
        ("assistant", "Keys and values stored in fixed-size blocks,\nlike pages of virtual memory.",
         False),
        ("user", "And prefix caching?", False),
        ("assistant", "Blocks whose tokens", True),
    ]  # fmt: skip
    assert conv.messages[1].stats == {"ttft": 0.21, "tok_s": 38.5, "prompt_tokens": 31,
                                      "cached_tokens": 16, "generated_tokens": 17,
                                      "finish": "stop"}  # fmt: skip
    assert conv.messages[3].stats == {"ttft": 0.05, "interrupted_by": "Stop"}
    assert len(conv.nodes) == 4  # one chain, no branches
    assert [m.parent for m in conv.messages[1:]] == [m.id for m in conv.messages[:-1]]
    assert from_json(json.loads(V1_FILE.read_text())) == conv  # ids do not change per load


def test_a_version_1_file_round_trips_through_version_2(tmp_path):
    shutil.copy(V1_FILE, tmp_path / "3f2a9c81b07d.json")  # named by its id, as saved
    store = ConversationStore(tmp_path)
    (conv,) = store.load_all()
    store.save(conv)
    saved = json.loads((tmp_path / "3f2a9c81b07d.json").read_text())
    assert saved["version"] == 2 and "messages" not in saved
    old = json.loads(V1_FILE.read_text())
    assert [{k: n[k] for k in ("role", "content", "stats", "interrupted")}
            for n in saved["nodes"]] == old["messages"]  # fmt: skip
    assert all(n["attachments"] == [] for n in saved["nodes"])
    (again,) = store.load_all()
    assert again == conv


def branched() -> Conversation:
    conv = Conversation(title="tree", sampling={"temperature": 0.3}, preset="Concise")
    q = conv.append(Message("user", "q", attachments=[{"name": "a.txt", "text": "A", "tokens": 1}]))
    a = conv.append(Message("assistant", "a", stats={"ttft": 0.1}))
    conv.add_sibling(a, Message("assistant", "a2", interrupted=True))
    conv.add_sibling(q, Message("user", "q2"))
    conv.switch_branch(q, 0)
    return conv


def test_a_tree_round_trips_with_its_choices(tmp_path):
    store = ConversationStore(tmp_path)
    conv = branched()
    store.save(conv)
    (loaded,) = store.load_all()
    assert loaded == conv
    assert [m.content for m in loaded.messages] == ["q", "a2"]
    saved = json.loads(store.path_for(conv.id).read_text())
    assert [n["content"] for n in saved["nodes"]] == ["q", "a", "a2", "q2"]
    assert saved["sampling"] == {"temperature": 0.3} and saved["preset"] == "Concise"
    assert set(saved["nodes"][0]) == {"id", "parent", "role", "content", "stats", "interrupted",
                                      "attachments", "created"}  # fmt: skip


def test_a_file_from_a_newer_version_is_refused_and_set_aside(tmp_path):
    d = to_json(branched())
    d["version"] = 3
    with pytest.raises(ValueError, match="version 3 was written by a newer KVScope"):
        from_json(d)
    (tmp_path / "future.json").write_text(json.dumps(d))
    store = ConversationStore(tmp_path)
    assert store.load_all() == []
    assert store.unreadable == [tmp_path / "future.json.bad"]


def _break(d: dict, path: tuple, value) -> dict:
    d = copy.deepcopy(d)
    target = d
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    return d


@pytest.mark.parametrize(
    "path, value, match",
    [
        (("nodes", 3, "parent"), "abc", r"nodes\[3\]\.parent 'abc' is not a message in this"),
        (("nodes", 0, "parent"), "N3", r"nodes\[0\]\.parent 'N3' comes after it"),
        (("nodes", 1, "id"), "N0", r"nodes\[1\]\.id 'N0' is used by an earlier message"),
        (("nodes", 2, "role"), "tool", r"nodes\[2\]\.role 'tool' must be one of"),
        (("nodes", 1, "content"), None, r"nodes\[1\]\.content must be a str"),
        (("nodes", 1, "stats"), [], r"nodes\[1\]\.stats must be a dict"),
        (("nodes", 1, "created"), "noon", r"nodes\[1\]\.created must be a number"),
        (("nodes", 1, "attachments"), [{"name": "f", "text": "t"}], r"nodes\[1\]\.attachments"),
        (("nodes", 0, "attachments", 0, "tokens"), 1.5, r"nodes\[0\]\.attachments\[0\]\.tokens"),
        (("chosen", "N0"), "N3", r"chosen\['N0'\] 'N3' is not a reply to 'N0'"),
        (("chosen", "zz"), "N1", r"chosen\['zz'\]: 'zz' is not a message"),
        (("sampling",), "hot", r"sampling must be a dict"),
        (("title",), 7, r"title must be a str"),
        (("version",), "2", r"version must be a positive integer"),
    ],
)
def test_broken_fields_are_named(path, value, match):
    conv = branched()
    good = to_json(conv)
    for i, n in enumerate(good["nodes"]):  # readable ids so the cases can name them
        n["id"] = f"N{i}"
    ids = {m.id: f"N{i}" for i, m in enumerate(conv.nodes.values())}
    for n in good["nodes"]:
        n["parent"] = ids.get(n["parent"])
    good["chosen"] = {ids.get(k, ""): ids[v] for k, v in good["chosen"].items()}
    assert from_json(good).messages  # the baseline is valid
    with pytest.raises(ValueError, match=match):
        from_json(_break(good, path, value))


def test_a_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    store = ConversationStore(tmp_path)
    conv = Conversation(messages=[Message("user", "first")])
    store.save(conv)
    before = store.path_for(conv.id).read_bytes()

    def half_then_full(obj, f, **kwargs):
        f.write('{"id": "trunc')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.json, "dump", half_then_full)
    conv.append(Message("assistant", "second"))
    with pytest.raises(OSError):
        store.save(conv)
    assert store.path_for(conv.id).read_bytes() == before
    assert not list(tmp_path.glob("*.tmp"))
