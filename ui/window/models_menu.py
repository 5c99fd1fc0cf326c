"""The window's *File* menu (`window.model_menu`): *Open model…* (a .gguf file, or a Hugging Face
folder picked by its config.json) and *Models…* (ui/models/dialog.py). Loading a model restarts
a spawned engine on it, with the loading progress in the status bar as any restart, and
remembers it (settings `engine/model`) for the next start."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QFileDialog, QMenuBar

from ui.models.dialog import ModelsDialog
from ui.window.host import WindowHost

OPEN_FILTER = "Models (*.gguf config.json);;GGUF files (*.gguf);;Hugging Face folder (config.json)"


def model_path(chosen: str) -> str:
    """A picked file as the engine takes it: a .gguf file, or the folder of a config.json;
    ValueError naming what is accepted."""
    path = Path(chosen)
    if path.name == "config.json" and path.is_file():
        return str(path.parent)
    if path.is_dir() and (path / "config.json").is_file():
        return str(path)
    if path.is_file() and (path.suffix.lower() == ".gguf" or _gguf_magic(path)):
        return str(path)  # Ollama's blobs/sha256-<hex> are GGUFs without the suffix
    raise ValueError(f"model {chosen!r} is neither a .gguf file nor a folder with config.json")


def _gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


class ModelMenu:
    def __init__(self, window: WindowHost) -> None:
        self.w = window
        self.dialog: ModelsDialog | None = None

    def add_file_menu(self, bar: QMenuBar) -> None:
        w = self.w
        menu = bar.addMenu("&File")
        open_action = self.open_action = QAction("&Open model…", w)
        open_action.setShortcut(QKeySequence.StandardKey.Open)
        open_action.setToolTip("a .gguf file, or the config.json of a Hugging Face folder")
        open_action.triggered.connect(self.open_model_file)
        menu.addAction(open_action)
        models = self.models_action = QAction("&Models…", w)
        models.setShortcut(QKeySequence("Ctrl+Shift+M"))
        models.setToolTip("models found on this machine, what each needs, and load one")
        models.triggered.connect(self.open_models_dialog)
        menu.addAction(models)
        menu.setToolTipsVisible(True)

    def open_model_file(self) -> None:
        chosen, _ = QFileDialog.getOpenFileName(self.w, "Open model", "", OPEN_FILTER)
        if chosen:
            self.load_model(chosen)

    def open_models_dialog(self) -> ModelsDialog:
        w = self.w
        o = w.source.options
        dialog = self.dialog = ModelsDialog(w.settings, w, o.kv_cache_dtype or "auto",
                                            o.dtype or "float32", o.model)  # fmt: skip
        dialog.load_requested.connect(self.load_model)
        dialog.show()
        dialog.refresh()
        return dialog

    def load_model(self, chosen: str) -> bool:
        """Restart the spawned engine on `chosen` (asking first when replies are in flight) and
        remember it; an attached engine keeps its model (the choice is for engines this app
        starts). Returns whether anything changed."""
        w = self.w
        try:
            path = model_path(chosen)
        except ValueError as exc:
            w.statusBar().showMessage(str(exc), 10000)
            return False
        return w.option_menus.change_options("the model", {"model": path},
                                             {"engine/model": path})  # fmt: skip
