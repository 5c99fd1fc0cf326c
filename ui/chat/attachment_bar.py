"""The strip above the chat input that holds a message's attachments: one chip per file (name,
kind, token count, ×), an "Attach…" button, drops of local files, the last errors and the
panel's context warning. Files are read by ui/chat/attachments.py; tokens are counted by a
ui/chat/token_counter.py TokenCounter when one is set, else estimated.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from PySide6.QtCore import QEvent, QMimeData, QObject, Signal
from PySide6.QtGui import QDragEnterEvent, QDragMoveEvent, QDropEvent
from PySide6.QtWidgets import (
    QAbstractScrollArea,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from ui import theme
from ui.chat.attachments import (
    Attachment,
    AttachmentError,
    attachment_block,
    check_total,
    estimate_tokens,
    read_attachment,
)
from ui.chat.token_counter import TokenCounter

WARNING_COLOUR = "#f5a623"
ERROR_COLOUR = "#e6194b"


def local_paths(mime: QMimeData | None) -> list[str]:
    """The local files among a drag's URLs (web links and the like are not attachments)."""
    if mime is None or not mime.hasUrls():
        return []
    return [u.toLocalFile() for u in mime.urls() if u.isLocalFile() and u.toLocalFile()]


class FileDropFilter(QObject):
    """An event filter that turns drops of local files on a widget into `on_paths(paths)`; other
    drops (text) keep their usual handling. Install it with `accept_file_drops`."""

    def __init__(self, on_paths: Callable[[list[str]], None], parent: QObject) -> None:
        super().__init__(parent)
        self._on_paths = on_paths

    def eventFilter(self, obj: QObject, ev: QEvent) -> bool:  # noqa: N802 - Qt name
        kind = ev.type()
        if kind not in (QEvent.Type.DragEnter, QEvent.Type.DragMove, QEvent.Type.Drop):
            return False
        assert isinstance(ev, QDropEvent)  # the base of the drag events
        paths = local_paths(ev.mimeData())
        if not paths:
            return False
        ev.acceptProposedAction()
        if kind == QEvent.Type.Drop:
            self._on_paths(paths)
        return True


def accept_file_drops(widget: QWidget, on_paths: Callable[[list[str]], None]) -> FileDropFilter:
    """Make `widget` (e.g. the chat's input box) take dropped files: `on_paths(paths)` gets them.
    A text box's drops arrive on its viewport, so the filter goes there too."""
    drop = FileDropFilter(on_paths, widget)
    widget.setAcceptDrops(True)
    widget.installEventFilter(drop)
    if isinstance(widget, QAbstractScrollArea):
        widget.viewport().setAcceptDrops(True)
        widget.viewport().installEventFilter(drop)
    return drop


def token_text(a: Attachment) -> str:
    if a.tokens is None:
        return "counting…"
    return f"{'≈' if a.tokens_estimated else ''}{a.tokens:,} tokens"


class AttachmentChip(QFrame):
    """One attachment: "name · kind · tokens" and a remove button."""

    def __init__(self, a: Attachment, on_remove: Callable[[], None]) -> None:
        super().__init__()
        self.setObjectName("attachmentChip")
        self.setStyleSheet(f"#attachmentChip {{ border: 1px solid {theme.MUTED}; "
                           "border-radius: 4px; }")
        row = QHBoxLayout(self)
        row.setContentsMargins(6, 1, 2, 1)
        row.setSpacing(4)
        self.label = QLabel()
        self.remove_btn = QToolButton()
        self.remove_btn.setText("×")
        self.remove_btn.setAutoRaise(True)
        self.remove_btn.setToolTip(f"Remove {a.name}")
        self.remove_btn.clicked.connect(on_remove)
        row.addWidget(self.label)
        row.addWidget(self.remove_btn)
        self.show_attachment(a)

    def show_attachment(self, a: Attachment) -> None:
        kind = "PDF" if a.kind == "pdf" else "text"
        self.label.setText(f"{a.name} · {kind} · {token_text(a)}")
        self.setToolTip(f"{a.name}: {a.size:,} bytes, {len(a.text):,} characters of text")


class AttachmentBar(QWidget):
    changed = Signal()  # attachments added or removed, or a token count arrived
    failed = Signal(str)  # why files could not be attached (also shown in the error label)

    def __init__(self, counter: TokenCounter | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._items: list[tuple[tuple[int, int], Attachment, AttachmentChip]] = []  # key, a, chip
        self._serial = itertools.count(1)
        self._counter: TokenCounter | None = None
        self.setAcceptDrops(True)
        self.attach_btn = QPushButton("Attach…")
        self.attach_btn.setToolTip("Attach text, code or PDF files (or drop them here)")
        self.attach_btn.clicked.connect(self.open_dialog)
        self.chips = QHBoxLayout()
        self.chips.setSpacing(4)
        top = QHBoxLayout()
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(self.attach_btn)
        top.addLayout(self.chips)
        top.addStretch(1)
        self.error_label = self._message_label(ERROR_COLOUR)
        self.warning_label = self._message_label(WARNING_COLOUR)
        box = QVBoxLayout(self)
        box.setContentsMargins(0, 0, 0, 0)
        box.setSpacing(2)
        box.addLayout(top)
        box.addWidget(self.error_label)
        box.addWidget(self.warning_label)
        self.set_counter(counter)

    @staticmethod
    def _message_label(colour: str) -> QLabel:
        label = QLabel()
        label.setWordWrap(True)
        label.setStyleSheet(f"color: {colour};")
        label.hide()
        return label

    # --- the attachments ------------------------------------------------------------------
    def attachments(self) -> list[Attachment]:
        return [a for _, a, _ in self._items]

    def token_total(self) -> tuple[int, bool]:
        """The attachments' tokens (an estimate stands in for a count still running) and
        whether any of it is estimated."""
        total, estimated = 0, False
        for _, a, _ in self._items:
            if a.tokens is None or a.tokens_estimated:
                estimated = True
            total += a.tokens if a.tokens is not None else estimate_tokens(attachment_block(a))
        return total, estimated

    def add_paths(self, paths: Iterable[str]) -> list[Attachment]:
        """Read and attach each file; the ones that fail are named in the error label (and
        `failed`), the others are attached all the same. Returns those attached."""
        added, errors = [], []
        for path in paths:
            try:
                a = read_attachment(path)
                check_total(self.attachments(), a)
            except AttachmentError as exc:
                errors.append(str(exc))
                continue
            self._add(a)
            added.append(a)
        self._show_error("\n".join(errors))
        if errors:
            self.failed.emit("\n".join(errors))
        if added:
            self.changed.emit()
        return added

    def _add(self, a: Attachment) -> None:
        key = (id(self), next(self._serial))
        chip = AttachmentChip(a, lambda: self._remove_key(key))
        self._items.append((key, a, chip))
        self.chips.addWidget(chip)
        if self._counter is not None:
            self._counter.count(key, attachment_block(a))
        else:
            self._set(key, estimate_tokens(attachment_block(a)), estimated=True)

    def remove(self, name_or_index: str | int) -> None:
        self._remove_key(self._items[self._index(name_or_index)][0])

    def _remove_key(self, key: tuple[int, int]) -> None:
        i = next(i for i, item in enumerate(self._items) if item[0] == key)
        _, _, chip = self._items.pop(i)
        if self._counter is not None:
            self._counter.forget(key)
        self.chips.removeWidget(chip)
        chip.deleteLater()
        self.changed.emit()

    def clear(self) -> None:
        """Drop every attachment (the message was sent) and the error and warning lines."""
        for key, _, chip in self._items:
            if self._counter is not None:
                self._counter.forget(key)
            self.chips.removeWidget(chip)
            chip.deleteLater()
        had = bool(self._items)
        self._items.clear()
        self._show_error("")
        self.set_warning(None)
        if had:
            self.changed.emit()

    # --- token counts ---------------------------------------------------------------------
    def set_counter(self, counter: TokenCounter | None) -> None:
        """Count the next attachments' tokens with `counter` (None: estimate them)."""
        if self._counter is not None:
            self._counter.counted.disconnect(self._on_counted)
        self._counter = counter
        if counter is not None:
            counter.counted.connect(self._on_counted)

    def set_tokens(self, name_or_index: str | int, n: int, estimated: bool = False) -> None:
        """Show `n` tokens for the attachment at that index, or the first with that name."""
        self._set(self._items[self._index(name_or_index)][0], n, estimated=estimated)

    def _on_counted(self, key: object, n: int, estimated: bool) -> None:
        if any(k == key for k, _, _ in self._items):
            self._set(key, n, estimated=estimated)  # type: ignore[arg-type]

    def _set(self, key: tuple[int, int], n: int, *, estimated: bool) -> None:
        for k, a, chip in self._items:
            if k == key:
                a.tokens, a.tokens_estimated = n, estimated
                chip.show_attachment(a)
                self.changed.emit()
                return

    def _index(self, name_or_index: str | int) -> int:
        names = [a.name for _, a, _ in self._items]
        if isinstance(name_or_index, int):
            if not 0 <= name_or_index < len(names):
                raise IndexError(f"attachment index {name_or_index} is out of range: "
                                 f"{len(names)} attached")
            return name_or_index
        if name_or_index not in names:
            raise KeyError(f"no attachment named {name_or_index!r}; attached: {names}")
        return names.index(name_or_index)

    # --- messages ---------------------------------------------------------------------------
    def set_warning(self, text: str | None) -> None:
        """The panel's warning (context_warning's sentence), or None to hide it."""
        self.warning_label.setText(text or "")
        self.warning_label.setVisible(bool(text))

    def _show_error(self, text: str) -> None:
        self.error_label.setText(text)
        self.error_label.setVisible(bool(text))

    # --- files in ---------------------------------------------------------------------------
    def open_dialog(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(
            self, "Attach files", "", "All files (*);;PDF files (*.pdf)")
        if paths:
            self.add_paths(paths)

    def dragEnterEvent(self, ev: QDragEnterEvent) -> None:  # noqa: N802 - Qt name
        if local_paths(ev.mimeData()):
            ev.acceptProposedAction()
        else:
            ev.ignore()

    def dragMoveEvent(self, ev: QDragMoveEvent) -> None:  # noqa: N802 - Qt name
        self.dragEnterEvent(ev)  # type: ignore[arg-type]

    def dropEvent(self, ev: QDropEvent) -> None:  # noqa: N802 - Qt name
        paths = local_paths(ev.mimeData())
        if not paths:
            ev.ignore()
            return
        ev.acceptProposedAction()
        self.add_paths(paths)
