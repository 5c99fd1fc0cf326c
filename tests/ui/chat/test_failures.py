"""Chaos on the desktop side: the disk full while a conversation is saved, a corrupt conversation
file, corrupt settings. Nothing typed is lost, nothing on disk is truncated, the user is told."""

from __future__ import annotations

import errno
import json
import logging

import pytest
from PySide6.QtCore import QSettings

from app.conversations import Conversation, ConversationStore, Message
from app.settings import SamplingDefaults, load_sampling
from ui.chat.panel import ChatPanel


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("titled", [False, True])  # a new chat is renamed (and saved) first
def test_disk_full_while_sending_keeps_the_text_and_the_file(
    qtbot, tmp_path, monkeypatch, titled
):
    store = ConversationStore(tmp_path)
    panel = ChatPanel(store, SamplingDefaults(temperature=0.0))
    qtbot.addWidget(panel)
    submitted = []
    panel.submit.connect(lambda *a: submitted.append(a))
    panel.set_engine_ready(True)
    if titled:
        panel.rename_conversation(panel.current.id, "An old chat")
    path = store.path_for(panel.current.id)
    on_disk = path.read_bytes()
    monkeypatch.setattr(json, "dump", _disk_full)
    panel.input.setPlainText("a question I typed carefully")
    assert panel.send_current() is None
    assert submitted == []
    assert panel.input.toPlainText() == "a question I typed carefully"
    assert "No space left" in panel.notice.text() and "kept" in panel.notice.text()
    assert path.read_bytes() == on_disk  # the old file, whole
    assert not list(tmp_path.glob("*.tmp"))
    assert [m.role for m in panel.current.messages] == []
    monkeypatch.undo()  # space again: the same text goes out
    assert panel.send_current() is not None and submitted


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    store = ConversationStore(tmp_path)
    conv = Conversation(title="kept")
    conv.append(Message("user", "first"))
    store.save(conv)
    before = store.path_for(conv.id).read_bytes()

    def half_then_full(obj, f, **kwargs):
        f.write('{"id": "trunc')
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", half_then_full)
    conv.append(Message("user", "second"))
    with pytest.raises(OSError):
        store.save(conv)
    assert store.path_for(conv.id).read_bytes() == before
    assert not list(tmp_path.glob("*.tmp"))


def test_a_corrupt_conversation_is_listed_as_unreadable_and_the_others_load(qtbot, tmp_path):
    store = ConversationStore(tmp_path)
    good = Conversation(title="good one")
    good.append(Message("user", "hello"))
    store.save(good)
    (tmp_path / "broken.json").write_text('{"id": "broken", "messages": [')
    panel = ChatPanel(ConversationStore(tmp_path), SamplingDefaults())
    qtbot.addWidget(panel)
    texts = [panel.conv_list.item(i).text() for i in range(panel.conv_list.count())]
    assert "good one" in texts
    assert "⚠ unreadable: broken.json.bad" in texts
    assert (tmp_path / "broken.json.bad").exists()


def test_corrupt_settings_give_defaults_and_a_warning(tmp_path, caplog):
    ini = tmp_path / "settings.ini"
    ini.write_bytes(b"[sampling]\ntemperature=hot\ntop_p=7\ntop_k=\x00\xff\nmax_tokens=12\n")
    with caplog.at_level(logging.WARNING, logger="app.settings"):
        s = load_sampling(QSettings(str(ini), QSettings.Format.IniFormat))
    d = SamplingDefaults()
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (d.temperature, d.top_p, d.top_k, 12)
    warned = caplog.text
    assert "sampling/temperature" in warned and "sampling/top_p" in warned
