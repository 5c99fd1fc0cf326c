"""Edit and branch in the chat panel, engine replies played by hand: an edit makes a sibling
branch, ‹ › switches the transcript, Regenerate keeps the old reply, the tree is saved and read
back, a file of the previous format opens unchanged, and a branch's request names the request it
forked from (the block map's highlight)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from app.conversations import ConversationStore
from app.conversations.presets import PresetStore
from app.settings import SamplingDefaults
from ipc import protocol as P
from ui.chat.panel import ChatPanel

V1_FILE = Path(__file__).parents[2] / "app" / "conversations" / "v1_conversation.json"


def _panel(qtbot, tmp_path: Path) -> tuple[ChatPanel, list, list]:
    p = ChatPanel(ConversationStore(tmp_path / "conversations"), SamplingDefaults(
        temperature=0.0, max_tokens=9), presets=PresetStore(tmp_path / "presets.json"))
    qtbot.addWidget(p)
    submitted, forks = [], []
    p.submit.connect(lambda rid, msgs, s: submitted.append((rid, msgs)))
    p.branch_sent.connect(lambda rid, src: forks.append((rid, src)))
    p.set_engine_ready(True)
    return p, submitted, forks


def _reply(p: ChatPanel, rid: str, text: str) -> None:
    p.on_replies([
        P.Delta(request_id=rid, index=0, token_ids=[1], text=text, token_times=[0.0], time=0.0),
        P.Finish(request_id=rid, index=0, reason="stop", ttft=0.1, tpot=0.01, e2e=0.2,
                 usage=P.Usage(prompt_tokens=20, cached_tokens=16, completion_tokens=1)),
    ])


def _say(p: ChatPanel, text: str, answer: str) -> str:
    p.input.setPlainText(text)
    rid = p.send_current()
    assert rid is not None
    _reply(p, rid, answer)
    return rid


def _shown(p: ChatPanel) -> list[str]:
    """The transcript as drawn: each view's message text."""
    return [v.msg.content for v in p.transcript.views]


def test_edit_makes_a_branch_and_the_arrows_switch_between_them(qtbot, tmp_path):
    p, submitted, forks = _panel(qtbot, tmp_path)
    p.system_edit.setPlainText("Be brief.")
    _say(p, "What is a block?", "A slab of KV.")
    first_rid = _say(p, "And a page?", "The same idea.")
    conv = p.current
    second_user = conv.messages[2]
    view = p._view_for(second_user)
    assert not view.edit_btn.isHidden()  # user turns carry Edit
    assert view.branch_nav.isHidden()  # no siblings yet
    view.edit_requested.emit()
    assert p.editing is second_user and p.input.toPlainText() == "And a page?"
    p.input.setPlainText("And a token?")
    rid = p.send_current()
    # the request carries the shared history and the edited turn, not the old branch
    assert submitted[-1] == (rid, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a block?"},
        {"role": "assistant", "content": "A slab of KV."},
        {"role": "user", "content": "And a token?"}])
    assert forks == [(rid, first_rid)]  # the block map compares it with the old branch's request
    _reply(p, rid, "One piece of text.")
    assert _shown(p) == ["What is a block?", "A slab of KV.", "And a token?",
                         "One piece of text."]
    edited = conv.messages[2]
    assert conv.branch_position(edited) == (2, 2)
    nav = p._view_for(edited).branch_nav
    assert nav.label.text() == "2/2" and not nav.next_btn.isEnabled()
    nav.prev_btn.click()
    assert _shown(p) == ["What is a block?", "A slab of KV.", "And a page?", "The same idea."]
    assert p._view_for(p.current.messages[2]).branch_nav.label.text() == "1/2"
    p._view_for(p.current.messages[2]).branch_nav.next_btn.click()
    assert _shown(p)[2:] == ["And a token?", "One piece of text."]
    # the reply's stats line says what the cache gave it
    stats = p._view_for(p.current.messages[3]).stats.text()
    assert "16 prompt tokens reused from the earlier branch" in stats


def test_regenerate_keeps_the_old_reply_as_a_sibling(qtbot, tmp_path):
    p, submitted, forks = _panel(qtbot, tmp_path)
    first = _say(p, "Name a colour.", "Blue.")
    rid = p.regenerate()
    assert submitted[-1][1] == submitted[-2][1]  # the same prompt
    assert forks == [(rid, first)]
    _reply(p, rid, "Green.")
    conv = p.current
    assert [m.content for m in conv.messages] == ["Name a colour.", "Green."]
    assert [m.content for m in conv.siblings(conv.messages[1])] == ["Blue.", "Green."]
    p.switch_branch(conv.messages[1], -1)
    assert _shown(p) == ["Name a colour.", "Blue."]


def test_the_tree_is_saved_and_read_back_on_the_branch_last_shown(qtbot, tmp_path):
    p, _, _ = _panel(qtbot, tmp_path)
    _say(p, "One?", "1.")
    p.start_edit(p.current.messages[0])
    p.input.setPlainText("Two?")
    _reply(p, p.send_current(), "2.")
    p.switch_branch(p.current.messages[0], -1)
    p.flush_saves()
    conv_id = p.current.id
    saved = json.loads((tmp_path / "conversations" / f"{conv_id}.json").read_text())
    assert saved["version"] == 2 and len(saved["nodes"]) == 4
    again, _, _ = _panel(qtbot, tmp_path)
    again.select_conversation(conv_id)
    assert _shown(again) == ["One?", "1."]
    again.switch_branch(again.current.messages[0], 1)
    assert _shown(again) == ["Two?", "2."]


def test_a_file_of_the_previous_format_opens_unchanged(qtbot, tmp_path):
    d = tmp_path / "conversations"
    d.mkdir()
    shutil.copy(V1_FILE, d / V1_FILE.name.replace("v1_conversation", "3f2a9c81b07d"))
    v1 = json.loads(V1_FILE.read_text())
    p, _, _ = _panel(qtbot, tmp_path)
    assert p.current.id == v1["id"] and p.current.title == v1["title"]
    assert p.system_edit.toPlainText() == v1["system_prompt"]
    assert _shown(p) == [m["content"] for m in v1["messages"]]
    assert p.input.toPlainText() == v1.get("draft", "")


def test_escape_cancels_an_edit_and_brings_the_draft_back(qtbot, tmp_path):
    p, submitted, _ = _panel(qtbot, tmp_path)
    _say(p, "Hello?", "Hi.")
    p.input.setPlainText("half a thought")
    p.start_edit(p.current.messages[0])
    assert p.input.toPlainText() == "Hello?"
    p.escape()
    assert p.editing is None and p.input.toPlainText() == "half a thought"
    assert len(p.current.nodes) == 2 and len(submitted) == 1
