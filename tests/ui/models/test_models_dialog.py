"""*File → Models…* (ui/models) over stores laid out as each tool documents them
(tests/engine_proc/catalog/stores_fixture.py): the real catalog command runs in a QProcess; Load
asks the window to restart on the chosen path (the restart itself is recorded, not run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.conversations import Conversation, ConversationStore
from app.conversations.store import from_json, to_json
from app.models.catalog import FOLDERS_KEY
from app.settings import SamplingDefaults, open_settings
from tests.engine_proc.catalog.stores_fixture import make_home, with_builtin
from tests.ui.conftest import DictSettings
from ui.models.dialog import ModelsDialog
from ui.models.table import COLUMNS
from ui.window.main_window import EngineSource, MainWindow
from ui.window.models_menu import model_path

ROOT = Path(__file__).resolve().parents[3]
STATUS = COLUMNS.index("Status")
FIT = COLUMNS.index("Fit")


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    root = tmp_path_factory.mktemp("models-ui")
    return root, with_builtin(make_home(root))


@pytest.fixture()
def env(home, monkeypatch):
    root, expected = home
    monkeypatch.setenv("HOME", str(root / "home"))
    for var in ("HF_HOME", "HF_HUB_CACHE", "OLLAMA_MODELS", "LLAMA_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(ROOT)  # the engine-side command imports this checkout's engine_proc
    return root, expected


def _listed(qtbot, dialog: ModelsDialog, n: int) -> dict[str, int]:
    qtbot.waitUntil(lambda: dialog.model.rowCount() == n and not dialog.runner.running(),
                    timeout=60_000)  # fmt: skip
    return {row["name"]: i for i, row in enumerate(dialog.model.rows)}


def _row(dialog: ModelsDialog, name: str) -> int:
    return next(i for i, row in enumerate(dialog.model.rows) if row["name"] == name)


def test_dialog_lists_models_and_greys_refused_ones(qtbot, env):
    root, expected = env
    settings = DictSettings({FOLDERS_KEY: [str(root / "my-models")]})
    dialog = ModelsDialog(settings)
    qtbot.addWidget(dialog)
    dialog.refresh()
    rows = _listed(qtbot, dialog, len(expected))
    assert set(rows) == set(expected)
    m = dialog.model
    bert = m.index(rows["tiny-bert"], STATUS)
    assert not (m.flags(bert) & Qt.ItemFlag.ItemIsEnabled)
    assert "'bert' is not supported" in m.data(bert)
    assert "cannot run this model" in m.data(bert, Qt.ItemDataRole.ToolTipRole)
    ok = m.index(rows["tinyllama:latest"], FIT)
    assert m.flags(ok) & Qt.ItemFlag.ItemIsEnabled
    assert m.data(ok) in ("fits", "tight", "won't fit")
    assert "free memory now" in dialog.status.text()
    # a refused row cannot be loaded
    dialog.view.selectRow(dialog.proxy.mapFromSource(bert).row())
    assert not dialog.load_button.isEnabled()


def test_context_and_kv_type_change_the_estimate(qtbot, env, monkeypatch):
    root, expected = env
    dialog = ModelsDialog(DictSettings({}))
    qtbot.addWidget(dialog)
    dialog.refresh()
    n = len(expected) - 2  # the refused two are in the user folder, not added here
    _listed(qtbot, dialog, n)
    before = dialog.model.rows[_row(dialog, "tinyllama:latest")]["estimate"]
    dialog.kv_dtype.setCurrentIndex(dialog.kv_dtype.findData("int8"))
    qtbot.waitUntil(lambda: dialog.model.rows[_row(dialog, "tinyllama:latest")]["estimate"]
                    ["kv_cache_dtype"] == "int8", timeout=60_000)  # fmt: skip
    after = dialog.model.rows[_row(dialog, "tinyllama:latest")]["estimate"]
    assert after["kv_bytes_per_token"] < before["kv_bytes_per_token"]
    runs = []
    real_run = dialog.runner.run
    monkeypatch.setattr(dialog.runner, "run", lambda *a: (runs.append(a), real_run(*a)))
    dialog.context.setCurrentIndex(dialog.context.findData(2048))
    assert runs[-1][1:] == (2048, "int8", "float32")
    _listed(qtbot, dialog, n)
    est = dialog.model.rows[_row(dialog, "tinyllama:latest")]["estimate"]
    assert est["context"] == 512  # capped at the tiny model's context length
    assert est["kv_cache_dtype"] == "int8"


def test_add_folder_is_remembered_and_listed(qtbot, env):
    root, expected = env
    settings = DictSettings({})
    dialog = ModelsDialog(settings)
    qtbot.addWidget(dialog)
    dialog.add_folder(str(root / "my-models"))
    assert settings.value(FOLDERS_KEY) == [str(root / "my-models")]
    _listed(qtbot, dialog, len(expected))


@pytest.fixture
def window(qtbot, tmp_path, monkeypatch, env):
    d = tmp_path / "data"
    w = MainWindow(open_settings(d), ConversationStore(d / "conversations"),
                   EngineSource(command=["/bin/false"]), data_dir=d)  # fmt: skip
    qtbot.addWidget(w)
    w.restarts = []
    monkeypatch.setattr(
        w.lifecycle, "restart", lambda: w.restarts.append(w.source.options.to_args())
    )
    yield w
    w.shutdown()


def test_load_restarts_the_engine_on_the_chosen_model(qtbot, window, env):
    root, expected = env
    w = window
    assert [a.text() for a in w.menuBar().actions()][:2] == ["&File", "&Engine"]
    dialog = w.model_menu.open_models_dialog()
    _listed(qtbot, dialog, len(expected) - 2)
    target = str(expected["tinyllama:latest"])
    assert dialog.select_path(target)
    assert dialog.load_button.isEnabled()
    with qtbot.waitSignal(dialog.load_requested) as sig:
        qtbot.mouseClick(dialog.load_button, Qt.MouseButton.LeftButton)
    assert sig.args == [target]
    assert len(w.restarts) == 1
    args = w.restarts[0]
    assert args[args.index("--model") + 1] == target
    assert w.settings.value("engine/model") == target
    assert not dialog.isVisible()


def test_open_model_takes_a_gguf_or_a_config_json(window, env, tmp_path):
    root, expected = env
    w = window
    hf = expected["tiny-org/tiny-llama"]
    assert model_path(str(hf / "config.json")) == str(hf)
    assert w.model_menu.load_model(str(hf / "config.json"))
    assert w.restarts[-1][w.restarts[-1].index("--model") + 1] == str(hf)
    assert not w.model_menu.load_model(str(hf / "config.json"))  # the same: no restart
    assert len(w.restarts) == 1
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="neither a .gguf file nor a folder with config.json"):
        model_path(str(tmp_path / "notes.txt"))
    assert not w.model_menu.load_model(str(tmp_path / "notes.txt"))
    assert "neither" in w.statusBar().currentMessage()


def test_conversations_record_their_model(qtbot, tmp_path):
    from ui.chat.panel import ChatPanel

    store = ConversationStore(tmp_path / "convs")
    panel = ChatPanel(store, SamplingDefaults())
    qtbot.addWidget(panel)
    panel.model_name = "tiny-llama (F32 GGUF)"
    panel.set_engine_ready(True)
    panel.new_conversation()
    panel.input.setPlainText("hello")
    assert panel.send_current() is not None
    saved = json.loads(store.path_for(panel.current.id).read_text())
    assert saved["model"] == "tiny-llama (F32 GGUF)"
    assert panel.conv_list.currentItem().toolTip() == "model: tiny-llama (F32 GGUF)"
    old = to_json(Conversation())
    del old["model"]  # files written before the field
    assert from_json(old).model == ""


def test_a_catalog_that_cannot_run_is_reported(qtbot, tmp_path):
    from ui.models.runner import CatalogRunner

    runner = CatalogRunner(python=str(tmp_path / "no-python"))
    dialog = ModelsDialog(DictSettings({}), runner=runner)
    qtbot.addWidget(dialog)
    with qtbot.waitSignal(runner.failed, timeout=10_000):
        dialog.refresh()
    assert "Could not list the models" in dialog.status.text()
    assert dialog.refresh_button.isEnabled() and dialog.model.rowCount() == 0
