"""System-prompt presets: built-ins until the user saves their own, names unique ignoring case,
and a bad file set aside instead of blocking the chat."""

from __future__ import annotations

import json
import logging

import pytest

from app.conversations import DEFAULT_SYSTEM_PROMPT
from app.conversations.presets import Preset, PresetStore


def test_without_a_file_the_builtins_are_offered(tmp_path):
    store = PresetStore(tmp_path / "presets.json")
    presets = store.load()
    assert [p.name for p in presets] == ["Helpful assistant", "Concise", "Code reviewer"]
    assert presets[0].system_prompt == DEFAULT_SYSTEM_PROMPT
    assert all(p.system_prompt.strip() for p in presets)
    assert not (tmp_path / "presets.json").exists()  # nothing written until the user saves


def test_saved_presets_come_back_in_order(tmp_path):
    path = tmp_path / "presets.json"
    store = PresetStore(path)
    store.save([Preset("  Pirate ", "Talk like a pirate."), Preset("Empty", "")])
    assert json.loads(path.read_text(encoding="utf-8")) == {
        "version": 1,
        "presets": [
            {"name": "Pirate", "system_prompt": "Talk like a pirate."},
            {"name": "Empty", "system_prompt": ""},
        ],
    }
    assert store.load() == [Preset("Pirate", "Talk like a pirate."), Preset("Empty", "")]
    store.save([])
    assert store.load() == []  # the user deleted them all: no built-ins sneak back


def test_upsert_get_and_delete_ignore_case(tmp_path):
    store = PresetStore(tmp_path / "presets.json")
    store.upsert(Preset("concise", "Shorter still."))  # replaces the built-in, in its place
    assert [p.name for p in store.load()] == ["Helpful assistant", "concise", "Code reviewer"]
    assert store.get("  CONCISE ") == Preset("concise", "Shorter still.")
    presets = store.upsert(Preset("Translator", "Translate to French."))
    assert [p.name for p in presets] == [p.name for p in store.load()]
    assert presets[-1].name == "Translator"
    assert store.delete("code REVIEWER") is True and store.delete("nope") is False
    assert store.get("Code reviewer") is None
    assert [p.name for p in store.load()] == ["Helpful assistant", "concise", "Translator"]


@pytest.mark.parametrize("name", ["", "   ", "x" * 81, None])
def test_names_must_have_1_to_80_characters(name):
    with pytest.raises(ValueError, match="name must be"):
        Preset(name, "p")


def test_a_name_of_80_characters_after_stripping_is_kept():
    assert Preset("  " + "n" * 80 + "\n", "p").name == "n" * 80


def test_duplicate_names_are_refused_and_the_file_is_untouched(tmp_path):
    path = tmp_path / "presets.json"
    store = PresetStore(path)
    store.save([Preset("A", "a")])
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"presets\[1\]\.name 'a' is already used"):
        store.save([Preset("A", "a"), Preset("a", "b")])
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"version": 1, "presets": [{"name": "A", "system_prompt": "x"},
                                              {"name": "a", "system_prompt": "y"}]}),
        json.dumps({"version": 1, "presets": [{"name": "", "system_prompt": "x"}]}),
        json.dumps({"version": 2, "presets": []}),
        json.dumps([{"name": "A", "system_prompt": "x"}]),
    ],
)  # fmt: skip
def test_an_unreadable_file_is_set_aside_and_logged(tmp_path, caplog, content):
    path = tmp_path / "presets.json"
    path.write_text(content, encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="app.conversations.presets"):
        presets = PresetStore(path).load()
    assert [p.name for p in presets] == ["Helpful assistant", "Concise", "Code reviewer"]
    assert not path.exists()
    assert (tmp_path / "presets.json.bad").read_text(encoding="utf-8") == content
    assert "presets.json" in caplog.text
