"""Conversations, drafts and settings survive an app restart (no engine needed)."""

from __future__ import annotations

from app.conversations import ConversationStore, Message
from app.settings import data_dir, open_settings
from ui.window.main_window import EngineSource, MainWindow


def _window(d) -> MainWindow:
    # an endpoint nobody listens on; the engine is never started in this test
    return MainWindow(open_settings(d), ConversationStore(data_dir(d) / "conversations"),
                      EngineSource(connect="tcp://127.0.0.1:9"), data_dir=d)


def test_conversations_survive_an_app_restart(qtbot, tmp_path):
    d = tmp_path / "data"
    w = _window(d)
    qtbot.addWidget(w)
    chat = w.chat
    first = chat.current
    first.append(Message("user", "question one"))
    first.append(Message("assistant", "answer one", stats={"ttft": 0.2}))
    chat.rename_conversation(first.id, "Renamed chat")
    second = chat.new_conversation()
    chat.system_edit.setPlainText("You are terse.")
    chat.input.setPlainText("a draft I never sent")
    third = chat.new_conversation()
    chat.delete_conversation(third.id)
    chat.temperature.setValue(0.25)
    chat.max_tokens.setValue(77)
    w.shutdown()  # what closing the window does

    w2 = _window(d)
    qtbot.addWidget(w2)
    convs = w2.chat.convs
    assert set(convs) == {first.id, second.id}
    assert convs[first.id].title == "Renamed chat"
    assert [(m.role, m.content) for m in convs[first.id].messages] == [
        ("user", "question one"), ("assistant", "answer one")]
    assert convs[first.id].messages[1].stats == {"ttft": 0.2}
    assert convs[second.id].draft == "a draft I never sent"
    assert convs[second.id].system_prompt == "You are terse."
    assert w2.chat.temperature.value() == 0.25 and w2.chat.max_tokens.value() == 77
    # the list shows both, and selecting the second brings its draft back into the input box
    w2.chat.select_conversation(second.id)
    assert w2.chat.input.toPlainText() == "a draft I never sent"
    w2.shutdown()


def test_env_var_moves_the_data_dir(data_dir):
    from app.settings import data_dir as resolve

    assert resolve() == data_dir and data_dir.is_dir()
    s = open_settings()
    s.setValue("x/y", 1)
    s.sync()
    assert (data_dir / "settings.ini").exists()


def test_decode_weights_menu_is_greyed_out_when_attached(qtbot, tmp_path):
    w = _window(tmp_path / "data")  # attached (--connect): the engine's weights are not ours
    qtbot.addWidget(w)
    actions = w.decode_weight_actions
    assert actions["dense"].isChecked()
    assert not w.decode_weights_menu.isEnabled()
    w.shutdown()
