"""The window's Chat menu: the chat's keyboard shortcuts (shown beside each action), export and
import, and system-prompt presets.

Ctrl+N new chat · Ctrl+F search · Esc stop · Ctrl+Shift+R regenerate · Ctrl+L the input box.
The actions' shortcuts work anywhere in the window (Qt.WindowShortcut), so they hold while the
block map or a chart has the focus.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QFileDialog, QMenu, QMenuBar, QMessageBox, QWidget

from app.conversations.exchange import from_openai_messages, to_markdown, to_openai_messages
from ui.chat.panel import ChatPanel

log = logging.getLogger(__name__)

MAX_IMPORT_BYTES = 16 * 1024 * 1024

SHORTCUTS = {
    "new": "Ctrl+N",
    "find": "Ctrl+F",
    "stop": "Esc",
    "regenerate": "Ctrl+Shift+R",
    "focus_input": "Ctrl+L",
}


class ChatMenu:
    def __init__(self, panel: ChatPanel, parent: QWidget) -> None:
        self.panel = panel
        self.parent = parent
        self.actions: dict[str, QAction] = {}

    def add_to(self, bar: QMenuBar) -> QMenu:
        menu = bar.addMenu("&Chat")
        p = self.panel
        for key, text, slot in (
            ("new", "&New chat", lambda: p.new_conversation()),
            ("find", "&Search chats…", p.sidebar.focus_search),
            ("stop", "S&top the reply (or cancel an edit, clear the search)", p.escape),
            ("regenerate", "&Regenerate the reply", p.regenerate),
            ("focus_input", "&Type a message", p.focus_input),
        ):
            menu.addAction(self._action(key, text, slot))
        menu.addSeparator()
        menu.addAction(self._action("export_md", "Export as &Markdown…", self.export_markdown))
        menu.addAction(self._action("export_json", "Export as OpenAI &JSON…", self.export_json))
        menu.addAction(self._action("import_json", "&Import OpenAI JSON…", self.import_json))
        return menu

    def _action(self, key: str, text: str, slot) -> QAction:
        a = QAction(text, self.parent)
        if key in SHORTCUTS:
            a.setShortcut(QKeySequence(SHORTCUTS[key]))
            a.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
        a.triggered.connect(lambda _checked=False: slot())
        self.actions[key] = a
        return a

    # --- export and import ------------------------------------------------------------------
    def export_markdown(self, path: str | None = None) -> Path | None:
        conv = self.panel.current
        if conv is None:
            return None
        path = path or self._save_name(conv.title, "Markdown (*.md)", ".md")
        if not path:
            return None
        return self._write(Path(path), to_markdown(conv))

    def export_json(self, path: str | None = None) -> Path | None:
        conv = self.panel.current
        if conv is None:
            return None
        path = path or self._save_name(conv.title, "JSON (*.json)", ".json")
        if not path:
            return None
        text = json.dumps(to_openai_messages(conv), ensure_ascii=False, indent=1)
        return self._write(Path(path), text)

    def import_json(self, path: str | None = None) -> str | None:
        """Open a messages file (a list, or {"messages": [...]}) as a new conversation; returns
        its id, or None after saying what was wrong."""
        if path is None:
            path, _ = QFileDialog.getOpenFileName(self.parent, "Import conversation", "",
                                                  "JSON (*.json);;All files (*)")
            if not path:
                return None
        try:
            p = Path(path)
            if p.stat().st_size > MAX_IMPORT_BYTES:
                raise ValueError(f"the file is {p.stat().st_size:,} bytes; the limit is "
                                 f"{MAX_IMPORT_BYTES:,}")
            data = json.loads(p.read_text(encoding="utf-8"))
            conv = from_openai_messages(data, title=p.stem)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            self._error("Import conversation", f"Could not import {path}:\n{exc}")
            return None
        self.panel.add_conversation(conv)
        return conv.id

    def _save_name(self, title: str, filt: str, suffix: str) -> str:
        safe = "".join(c if c.isalnum() or c in " -_" else "_" for c in title).strip() or "chat"
        path, _ = QFileDialog.getSaveFileName(self.parent, "Export conversation",
                                              safe + suffix, filt)
        return path

    def _write(self, path: Path, text: str) -> Path | None:
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as exc:
            self._error("Export conversation", f"Could not write {path}:\n{exc}")
            return None
        log.info("exported conversation to %s", path)
        return path

    def _error(self, title: str, text: str) -> None:
        log.warning("%s", text.replace("\n", " "))
        self.panel.notice.setText(text.replace("\n", " "))
        if not getattr(self.panel, "quiet_dialogs", False):
            QMessageBox.warning(self.parent, title, text)
