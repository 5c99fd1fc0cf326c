"""System-prompt presets above the system prompt: pick one to fill the prompt, save the prompt
being edited under a name, delete a preset. The presets live in `presets.json` in the data
directory (app/conversations/presets.py); the conversation remembers which one it uses."""

from __future__ import annotations

import logging

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QInputDialog, QToolButton, QWidget

from app.conversations.presets import Preset, PresetStore

log = logging.getLogger(__name__)

NONE_TEXT = "Custom prompt"


class PresetsBar(QWidget):
    chosen = Signal(str, str)  # preset name ("" = none), its system prompt
    error = Signal(str)

    def __init__(self, store: PresetStore, current_prompt, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self._current_prompt = current_prompt  # () -> the system prompt being edited
        self.combo = QComboBox()
        self.combo.setToolTip("system-prompt presets (saved for every conversation)")
        self.combo.activated.connect(self._on_activated)
        self.save_btn = QToolButton(text="Save as preset…", autoRaise=True)
        self.save_btn.clicked.connect(lambda: self.save_current())
        self.delete_btn = QToolButton(text="Delete preset", autoRaise=True)
        self.delete_btn.clicked.connect(self.delete_selected)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.combo, 1)
        lay.addWidget(self.save_btn)
        lay.addWidget(self.delete_btn)
        self.presets: list[Preset] = []
        self.reload()

    def reload(self, select: str = "") -> None:
        self.presets = self.store.load()
        self.combo.blockSignals(True)
        self.combo.clear()
        self.combo.addItem(NONE_TEXT, "")
        for p in self.presets:
            self.combo.addItem(p.name, p.name)
        self.combo.blockSignals(False)
        self.show_preset(select)

    def show_preset(self, name: str) -> None:
        """Show the conversation's preset without applying it (its prompt may be edited)."""
        i = self.combo.findData(name) if name else 0
        self.combo.setCurrentIndex(max(i, 0))
        self.delete_btn.setEnabled(self.combo.currentIndex() > 0)

    def _on_activated(self, index: int) -> None:
        name = self.combo.itemData(index) or ""
        self.delete_btn.setEnabled(bool(name))
        preset = next((p for p in self.presets if p.name == name), None)
        if preset is not None:
            self.chosen.emit(preset.name, preset.system_prompt)
        else:
            self.chosen.emit("", self._current_prompt())

    def save_current(self, name: str | None = None) -> bool:
        if name is None:
            name, ok = QInputDialog.getText(self, "Save preset", "Preset name:")
            if not ok:
                return False
        try:
            self.store.upsert(Preset(name=name, system_prompt=self._current_prompt()))
        except (ValueError, OSError) as exc:
            log.warning("could not save preset %r: %s", name, exc)
            self.error.emit(f"Could not save the preset: {exc}")
            return False
        saved = " ".join(name.split())
        self.reload(select=saved)
        self.chosen.emit(saved, self._current_prompt())
        return True

    def delete_selected(self) -> None:
        name = self.combo.currentData() or ""
        if not name:
            return
        try:
            self.store.delete(name)
        except (ValueError, OSError) as exc:
            self.error.emit(f"Could not delete the preset: {exc}")
            return
        self.reload()
        self.chosen.emit("", self._current_prompt())
