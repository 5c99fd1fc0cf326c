"""Search, export and import, presets, per-conversation sampling, attachments with the context
warning, and the Chat menu's shortcuts, in the panel with engine replies played by hand."""

from __future__ import annotations

import json

import openai.types.chat as oa
import pydantic
from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import QMainWindow

from app.api.requests import Limits, parse_chat
from app.conversations import ConversationStore
from app.conversations.presets import PresetStore
from app.settings import SamplingDefaults
from ipc import protocol as P
from ui.chat.chat_menu import SHORTCUTS, ChatMenu
from ui.chat.panel import ChatPanel


def _panel(qtbot, tmp_path) -> tuple[ChatPanel, list]:
    p = ChatPanel(ConversationStore(tmp_path / "conversations"), SamplingDefaults(
        temperature=0.0, max_tokens=9), presets=PresetStore(tmp_path / "presets.json"))
    p.quiet_dialogs = True
    qtbot.addWidget(p)
    submitted: list = []
    p.submit.connect(lambda rid, msgs, s: submitted.append((rid, msgs, s)))
    p.set_engine_ready(True)
    return p, submitted


def _say(p: ChatPanel, text: str, answer: str) -> None:
    p.input.setPlainText(text)
    rid = p.send_current()
    p.on_replies([
        P.Delta(request_id=rid, index=0, token_ids=[1], text=answer, token_times=[0.0], time=0.0),
        P.Finish(request_id=rid, index=0, reason="stop", ttft=0.1, tpot=0.01, e2e=0.2,
                 usage=P.Usage(prompt_tokens=30, cached_tokens=0, completion_tokens=12)),
    ])


def test_search_finds_every_branch_and_jumps_to_the_message(qtbot, tmp_path):
    p, _ = _panel(qtbot, tmp_path)
    _say(p, "Tell me about llamas.", "Llamas are camelids.")
    p.start_edit(p.current.messages[0])
    p.input.setPlainText("Tell me about alpacas.")
    p.send_current()
    p.on_replies([P.Finish(request_id=p.last_request[p.current.id], index=0, reason="stop",
                           ttft=0.1, tpot=0.01, e2e=0.2, usage=None)])
    llama_conv = p.current.id
    p.new_conversation()
    _say(p, "Something else entirely.", "Sure.")
    p.sidebar.search_edit.setText("LLAMAS")
    p.sidebar.run_search()
    hits = [p.sidebar.results.item(i) for i in range(p.sidebar.results.count())]
    # the title (from the first turn), the old branch's question and its reply
    assert len(hits) == 3 and p.sidebar.stack.currentIndex() == 1
    assert all("llamas" in h.text().lower() for h in hits)
    reply_hit = next(h for h in hits if "camelids" in h.text())
    p.sidebar.results.itemClicked.emit(reply_hit)
    # the conversation is shown, on the branch that holds the hit, scrolled to it
    assert p.current.id == llama_conv
    assert [m.content for m in p.current.messages] == ["Tell me about llamas.",
                                                       "Llamas are camelids."]
    assert "border" in p._view_for(p.current.messages[1]).styleSheet()  # flashed
    p.escape()  # Esc clears the search first
    assert p.sidebar.search_edit.text() == "" and p.sidebar.stack.currentIndex() == 0


def test_export_is_accepted_as_openai_messages_and_imports_back(qtbot, tmp_path):
    p, _ = _panel(qtbot, tmp_path)
    p.system_edit.setPlainText("You are terse.")
    _say(p, "What is **bold**?", "It is `strong`.")
    menu = ChatMenu(p, p)
    out = menu.export_json(str(tmp_path / "chat.json"))
    exported = json.loads(out.read_text())
    # two validators we did not write ourselves: the openai SDK's types, and our API's parser
    pydantic.TypeAdapter(list[oa.ChatCompletionMessageParam]).validate_python(exported)
    plan = parse_chat({"model": "m", "messages": exported}, Limits(512, 64))
    assert plan is not None
    assert exported == [{"role": "system", "content": "You are terse."},
                        {"role": "user", "content": "What is **bold**?"},
                        {"role": "assistant", "content": "It is `strong`."}]
    md = menu.export_markdown(str(tmp_path / "chat.md")).read_text()
    assert "What is **bold**?" in md and "It is `strong`." in md
    conv_id = menu.import_json(str(out))
    assert p.current.id == conv_id and p.current.system_prompt == "You are terse."
    assert [m.content for m in p.current.messages] == ["What is **bold**?", "It is `strong`."]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"role": "tool", "content": "x"}]))
    assert menu.import_json(str(bad)) is None
    assert "messages[0]" in p.notice.text() and "role" in p.notice.text()


def test_presets_fill_the_system_prompt_and_new_ones_are_kept(qtbot, tmp_path):
    p, submitted = _panel(qtbot, tmp_path)
    bar = p.presets_bar
    names = [bar.combo.itemText(i) for i in range(bar.combo.count())]
    assert "Concise" in names
    bar.combo.setCurrentIndex(names.index("Concise"))
    bar._on_activated(names.index("Concise"))
    concise = PresetStore(tmp_path / "presets.json").get("Concise")
    assert p.system_edit.toPlainText() == concise.system_prompt
    assert p.current.preset == "Concise"
    p.system_edit.setPlainText("Answer in French.")
    assert bar.save_current("French")
    assert PresetStore(tmp_path / "presets.json").get("French").system_prompt == "Answer in French."
    p.input.setPlainText("Hello")
    p.send_current()
    assert submitted[-1][1][0] == {"role": "system", "content": "Answer in French."}
    assert not bar.save_current("   ")  # a blank name is refused, with the reason shown
    assert "name" in p.notice.text()


def test_sampling_is_kept_per_conversation(qtbot, tmp_path):
    p, submitted = _panel(qtbot, tmp_path)
    first = p.current.id
    p.temperature.setValue(1.3)
    p.max_tokens.setValue(77)
    second = p.new_conversation().id
    p.temperature.setValue(0.2)
    p.select_conversation(first)
    assert p.temperature.value() == 1.3 and p.max_tokens.value() == 77
    p.input.setPlainText("hi")
    p.send_current()
    assert submitted[-1][2]["temperature"] == 1.3 and submitted[-1][2]["max_tokens"] == 77
    p.flush_saves()
    again, _ = _panel(qtbot, tmp_path)
    again.select_conversation(second)
    assert again.temperature.value() == 0.2


def test_an_attachment_is_sent_after_the_text_and_a_long_one_warns(qtbot, tmp_path):
    p, submitted = _panel(qtbot, tmp_path)
    f = tmp_path / "notes.py"
    f.write_text("def f():\n    return 1\n")
    assert len(p.attach_bar.add_paths([str(f)])) == 1
    p.input.setPlainText("What does this do?")
    p.send_current()
    sent = submitted[-1][1][-1]["content"]
    assert sent == "What does this do?\n\nFile: notes.py\n```\ndef f():\n    return 1\n```"
    assert p.attach_bar.attachments() == []  # cleared once sent
    assert "notes.py" in p._view_for(p.current.messages[0]).attachments_line.text()
    # past the context: 4,000 characters is ~1,000 tokens (estimated: no engine here)
    p.max_model_len = 600
    big = tmp_path / "big.txt"
    big.write_text("word " * 800)
    p.attach_bar.add_paths([str(big)])
    warning = p.attach_bar.warning_label.text()
    assert "past the model's context of 600 tokens" in warning
    assert not p.attach_bar.warning_label.isHidden()
    p.attach_bar.remove("big.txt")  # back under: the warning goes
    assert p.attach_bar.warning_label.isHidden()


def test_the_chat_menu_carries_the_shortcuts(qtbot, tmp_path):
    p, _ = _panel(qtbot, tmp_path)
    win = QMainWindow()
    qtbot.addWidget(win)
    win.setCentralWidget(p)
    menu = ChatMenu(p, win)
    m = menu.add_to(win.menuBar())
    shown = {a.text(): a.shortcut().toString() for a in m.actions() if not a.isSeparator()}
    for key, seq in SHORTCUTS.items():
        assert menu.actions[key].shortcut() == QKeySequence(seq)
        assert seq.replace("Esc", "Esc") in shown.values()
    before = len(p.convs)
    menu.actions["new"].trigger()
    assert len(p.convs) == before + 1
    menu.actions["focus_input"].trigger()
    win.show()
    menu.actions["focus_input"].trigger()
    qtbot.waitUntil(lambda: p.input.hasFocus(), timeout=2000)
