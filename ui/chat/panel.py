"""The chat: conversations (renamable, deletable, saved), streamed replies, Stop, Regenerate, an
editable system prompt, sampling controls, and per-reply stats (TTFT, tok/s, prompt / cached /
generated tokens).

The panel never talks to the engine itself: it emits `submit(request_id, messages, sampling)` and
`abort(request_id)`, and the main window feeds engine replies back through `on_replies`. Everything
typed is saved (draft included) before any request leaves, so an engine crash loses nothing.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from PySide6.QtCore import QEvent, QObject, Qt, QTimer, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.conversations import Conversation, ConversationStore, Message
from app.settings import SamplingDefaults
from ui import theme
from ui.chat.message_view import MessageView
from ui.chat.thinking import split_thinking

log = logging.getLogger(__name__)

class _EnterFilter(QObject):
    """Enter sends, Shift+Enter inserts a newline."""

    def __init__(self, send) -> None:
        super().__init__()
        self._send = send

    def eventFilter(self, obj: QObject, ev: QEvent) -> bool:  # noqa: N802 - Qt name
        if ev.type() == QEvent.Type.KeyPress and isinstance(ev, QKeyEvent):
            if ev.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
                ev.modifiers() & Qt.KeyboardModifier.ShiftModifier
            ):
                self._send()
                return True
        return False


class ChatPanel(QWidget):
    submit = Signal(str, list, dict)  # request id, chat messages, sampling fields
    abort = Signal(str)
    conversation_selected = Signal(str, str)  # conversation id, its latest request id ("")

    def __init__(self, store: ConversationStore, sampling: SamplingDefaults,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.model_name = ""  # the engine's model (Welcome.model.name), saved with each turn
        self.convs: dict[str, Conversation] = {}
        self.current: Conversation | None = None
        # rid -> (conv id, reply, {"n": tokens streamed so far})
        self.active: dict[str, tuple[str, Message, dict]] = {}
        self.reasoning_open = False  # the model's prompt opens <think> (ModelInfo.reasoning_parser)
        self.last_request: dict[str, str] = {}  # conv id -> latest request id
        self.engine_ready = False
        self._seq = itertools.count(1)
        self._views: list[MessageView] = []
        self._dirty: set[str] = set()

        # conversation list
        self.conv_list = QListWidget()
        self.conv_list.setEditTriggers(QAbstractItemView.EditTrigger.DoubleClicked
                                       | QAbstractItemView.EditTrigger.EditKeyPressed)
        self.conv_list.currentItemChanged.connect(self._on_conv_changed)
        self.conv_list.itemChanged.connect(self._on_item_renamed)
        new_btn = QPushButton("New")
        new_btn.clicked.connect(lambda: self.new_conversation())
        ren_btn = QPushButton("Rename")
        ren_btn.clicked.connect(self._rename_current)
        del_btn = QPushButton("Delete")
        del_btn.clicked.connect(self._delete_current)
        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(0, 0, 0, 0)
        ll.addWidget(QLabel("Conversations"))
        ll.addWidget(self.conv_list, 1)
        row = QHBoxLayout()
        for b in (new_btn, ren_btn, del_btn):
            row.addWidget(b)
        ll.addLayout(row)
        ll.addWidget(self._sampling_box(sampling))

        # transcript
        self.system_edit = QPlainTextEdit()
        self.system_edit.setPlaceholderText("System prompt")
        self.system_edit.setMaximumHeight(52)
        self.system_edit.textChanged.connect(self._on_system_changed)
        self.transcript = QWidget()
        self.tlay = QVBoxLayout(self.transcript)
        self.tlay.setContentsMargins(4, 4, 4, 4)
        self.tlay.setSpacing(6)
        self.tlay.addStretch(1)
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setWidget(self.transcript)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.scroll.verticalScrollBar().rangeChanged.connect(self._follow)
        self._stick_to_bottom = True
        self.scroll.verticalScrollBar().valueChanged.connect(self._on_scrolled)

        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Message (Enter sends, Shift+Enter new line)")
        self.input.setMaximumHeight(80)
        self._enter = _EnterFilter(self.send_current)  # Qt does not own event filters
        self.input.installEventFilter(self._enter)
        self.input.textChanged.connect(self._on_draft_changed)
        self.send_btn = QPushButton("Send")
        self.send_btn.clicked.connect(self.send_current)
        self.stop_btn = QPushButton("Stop")
        self.stop_btn.clicked.connect(self.stop_current)
        self.regen_btn = QPushButton("Regenerate")
        self.regen_btn.clicked.connect(self.regenerate)
        self.notice = QLabel()
        self.notice.setStyleSheet(f"color: {theme.MUTED};")
        btns = QVBoxLayout()
        for b in (self.send_btn, self.stop_btn, self.regen_btn):
            btns.addWidget(b)
        in_row = QHBoxLayout()
        in_row.addWidget(self.input, 1)
        in_row.addLayout(btns)
        center = QWidget()
        cl = QVBoxLayout(center)
        cl.setContentsMargins(0, 0, 0, 0)
        cl.addWidget(self.system_edit)
        cl.addWidget(self.scroll, 1)
        cl.addWidget(self.notice)
        cl.addLayout(in_row)

        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(left)
        split.addWidget(center)
        split.setStretchFactor(0, 0)
        split.setStretchFactor(1, 1)
        split.setSizes([180, 560])
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(split)

        self._save_timer = QTimer(self)
        self._save_timer.setInterval(800)
        self._save_timer.setSingleShot(True)
        self._save_timer.timeout.connect(self.flush_saves)

        for conv in store.load_all():
            self.convs[conv.id] = conv
            self._add_item(conv)
        for bad in store.unreadable:  # listed, never selectable: the user decides what to do
            item = QListWidgetItem(f"⚠ unreadable: {bad.name}")
            item.setFlags(Qt.ItemFlag.NoItemFlags)
            item.setToolTip(f"{bad} could not be read and was set aside")
            self.conv_list.addItem(item)
        if not self.convs:
            self.new_conversation()
        else:
            self.conv_list.setCurrentRow(0)
        self._update_buttons()

    # --- sampling ----------------------------------------------------------------------------
    def _sampling_box(self, s: SamplingDefaults) -> QGroupBox:
        box = QGroupBox("Sampling")
        form = QFormLayout(box)
        form.setContentsMargins(6, 10, 6, 4)
        form.setVerticalSpacing(2)
        self.temperature = QDoubleSpinBox(decimals=2, minimum=0.0, maximum=2.0, singleStep=0.05)
        self.temperature.setValue(s.temperature)
        self.temperature.setToolTip("0 = greedy")
        self.top_p = QDoubleSpinBox(decimals=2, minimum=0.01, maximum=1.0, singleStep=0.05)
        self.top_p.setValue(s.top_p)
        self.top_k = QSpinBox(minimum=0, maximum=100000)
        self.top_k.setValue(s.top_k)
        self.top_k.setSpecialValueText("off")
        self.max_tokens = QSpinBox(minimum=1, maximum=32768)
        self.max_tokens.setValue(s.max_tokens)
        self.seed = QSpinBox(minimum=-1, maximum=2**31 - 1)
        self.seed.setValue(s.seed)
        self.seed.setSpecialValueText("random")
        for name, w in (("temperature", self.temperature), ("top-p", self.top_p),
                        ("top-k", self.top_k), ("max tokens", self.max_tokens),
                        ("seed", self.seed)):
            form.addRow(name, w)
        return box

    def sampling(self) -> SamplingDefaults:
        return SamplingDefaults(
            temperature=self.temperature.value(), top_p=self.top_p.value(),
            top_k=self.top_k.value(), max_tokens=self.max_tokens.value(), seed=self.seed.value())

    # --- conversations ----------------------------------------------------------------------
    def _add_item(self, conv: Conversation, top: bool = False) -> QListWidgetItem:
        item = QListWidgetItem(conv.title)
        item.setData(Qt.ItemDataRole.UserRole, conv.id)
        item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
        if conv.model:
            item.setToolTip(f"model: {conv.model}")
        self.conv_list.blockSignals(True)
        if top:
            self.conv_list.insertItem(0, item)
        else:
            self.conv_list.addItem(item)
        self.conv_list.blockSignals(False)
        return item

    def _item_for(self, conv_id: str) -> QListWidgetItem | None:
        for i in range(self.conv_list.count()):
            item = self.conv_list.item(i)
            if item.data(Qt.ItemDataRole.UserRole) == conv_id:
                return item
        return None

    def new_conversation(self, title: str = "New chat") -> Conversation:
        conv = Conversation(title=title)
        if self.current is not None:
            conv.system_prompt = self.current.system_prompt  # most people keep theirs
        self.convs[conv.id] = conv
        self.store.save(conv)
        item = self._add_item(conv, top=True)
        self.conv_list.setCurrentItem(item)
        return conv

    def select_conversation(self, conv_id: str) -> None:
        item = self._item_for(conv_id)
        if item is not None:
            self.conv_list.setCurrentItem(item)

    def rename_conversation(self, conv_id: str, title: str) -> None:
        title = " ".join(title.split())
        if not title:
            raise ValueError("a conversation title must not be empty")
        conv = self.convs[conv_id]
        conv.title = title
        item = self._item_for(conv_id)
        if item is not None and item.text() != title:
            self.conv_list.blockSignals(True)
            item.setText(title)
            self.conv_list.blockSignals(False)
        self.store.save(conv)

    def delete_conversation(self, conv_id: str) -> None:
        for rid, (cid, _, _) in list(self.active.items()):
            if cid == conv_id:
                self.abort.emit(rid)
                del self.active[rid]
        conv = self.convs.pop(conv_id)
        self.store.delete(conv.id)
        item = self._item_for(conv_id)
        if item is not None:
            self.conv_list.takeItem(self.conv_list.row(item))
        if not self.convs:
            self.current = None
            self.new_conversation()

    def _rename_current(self) -> None:
        item = self.conv_list.currentItem()
        if item is not None:
            self.conv_list.editItem(item)

    def _delete_current(self) -> None:
        if self.current is None:
            return
        ok = QMessageBox.question(self, "Delete conversation",
                                  f"Delete “{self.current.title}”? This cannot be undone.")
        if ok == QMessageBox.StandardButton.Yes:
            self.delete_conversation(self.current.id)

    def _on_item_renamed(self, item: QListWidgetItem) -> None:
        conv_id = item.data(Qt.ItemDataRole.UserRole)
        if conv_id in self.convs:
            try:
                self.rename_conversation(conv_id, item.text())
            except ValueError:
                self.conv_list.blockSignals(True)
                item.setText(self.convs[conv_id].title)
                self.conv_list.blockSignals(False)

    def _on_conv_changed(self, item: QListWidgetItem | None, _prev: Any = None) -> None:
        if self.current is not None:
            self._save_draft()
        conv_id = item.data(Qt.ItemDataRole.UserRole) if item is not None else None
        self.current = self.convs.get(conv_id) if conv_id else None
        self._rebuild_transcript()
        if self.current is not None:
            self.system_edit.blockSignals(True)
            self.system_edit.setPlainText(self.current.system_prompt)
            self.system_edit.blockSignals(False)
            self.input.blockSignals(True)
            self.input.setPlainText(self.current.draft)
            self.input.blockSignals(False)
            self.conversation_selected.emit(self.current.id,
                                            self.last_request.get(self.current.id, ""))
        self._update_buttons()

    def _rebuild_transcript(self) -> None:
        for v in self._views:
            v.setParent(None)
            v.deleteLater()
        self._views = []
        if self.current is None:
            return
        streaming = {id(m) for _, m, _ in self.active.values()}
        for m in self.current.messages:
            self._append_view(m, streaming=id(m) in streaming)
        self._stick_to_bottom = True

    def _append_view(self, m: Message, streaming: bool = False) -> MessageView:
        v = MessageView(m, thinking_opens_reply=self.reasoning_open)
        v.refresh(streaming)
        self.tlay.insertWidget(self.tlay.count() - 1, v)
        self._views.append(v)
        return v

    def _view_for(self, m: Message) -> MessageView | None:
        for v in reversed(self._views):
            if v.msg is m:
                return v
        return None

    def _on_scrolled(self, value: int) -> None:
        sb = self.scroll.verticalScrollBar()
        self._stick_to_bottom = value >= sb.maximum() - 30

    def _follow(self, _lo: int, hi: int) -> None:
        if self._stick_to_bottom:
            self.scroll.verticalScrollBar().setValue(hi)

    # --- drafts and saving ------------------------------------------------------------------
    def _on_draft_changed(self) -> None:
        if self.current is not None:
            self.current.draft = self.input.toPlainText()
            self._mark_dirty(self.current.id)

    def _on_system_changed(self) -> None:
        if self.current is not None:
            self.current.system_prompt = self.system_edit.toPlainText()
            self._mark_dirty(self.current.id)

    def _save_draft(self) -> None:
        assert self.current is not None
        self.current.draft = self.input.toPlainText()
        self._mark_dirty(self.current.id)

    def _mark_dirty(self, conv_id: str) -> None:
        self._dirty.add(conv_id)
        if not self._save_timer.isActive():
            self._save_timer.start()

    def flush_saves(self) -> None:
        for conv_id in list(self._dirty):
            conv = self.convs.get(conv_id)
            if conv is not None:
                try:
                    self.store.save(conv)
                except OSError as exc:
                    log.error("could not save conversation %s: %s", conv_id, exc)
                    continue
            self._dirty.discard(conv_id)

    # --- sending ----------------------------------------------------------------------------
    def busy(self, conv_id: str | None = None) -> bool:
        cid = conv_id or (self.current.id if self.current else None)
        return any(c == cid for c, _, _ in self.active.values())

    def set_engine_ready(self, ready: bool, notice: str = "") -> None:
        self.engine_ready = ready
        self.notice.setText(notice)
        self._update_buttons()

    def _update_buttons(self) -> None:
        busy = self.busy()
        self.send_btn.setEnabled(self.engine_ready and not busy)
        self.stop_btn.setEnabled(busy)
        has_user = self.current is not None and any(
            m.role == "user" for m in self.current.messages)
        self.regen_btn.setEnabled(self.engine_ready and not busy and has_user)

    def send_current(self) -> str | None:
        """Send what is in the input box; returns the request id (None when nothing was sent)."""
        if self.current is None:
            return None
        text = self.input.toPlainText().strip()
        if not text or not self.engine_ready or self.busy():
            return None
        conv = self.current
        conv.messages.append(Message("user", text))
        previous_model, conv.model = conv.model, self.model_name or conv.model
        try:  # the user's turn is on disk before the input box is cleared
            if conv.title == "New chat":
                self.rename_conversation(conv.id, conv.auto_title())
            self.store.save(conv)
        except OSError as exc:
            conv.messages.pop()
            conv.model = previous_model
            log.error("could not save conversation %s: %s", conv.id, exc)
            self.notice.setText(
                f"Could not save the conversation ({exc.strerror or exc}): nothing was sent and "
                "your text is kept. Free some disk space and send again."
            )
            return None
        conv.draft = ""
        item = self._item_for(conv.id)
        if item is not None and conv.model:
            item.setToolTip(f"model: {conv.model}")
        self.input.blockSignals(True)
        self.input.clear()
        self.input.blockSignals(False)
        self._append_view(conv.messages[-1])
        return self._start_reply(conv)

    def regenerate(self) -> str | None:
        conv = self.current
        if conv is None or not self.engine_ready or self.busy():
            return None
        while conv.messages and conv.messages[-1].role == "assistant":
            conv.messages.pop()
        if not conv.messages:
            return None
        self._rebuild_transcript()
        return self._start_reply(conv)

    def _start_reply(self, conv: Conversation) -> str:
        prompt = conv.to_prompt()
        reply = Message("assistant", "")
        conv.messages.append(reply)
        try:
            self.store.save(conv)
        except OSError as exc:  # the reply streams on; the periodic save tries again
            log.error("could not save conversation %s: %s", conv.id, exc)
            self._dirty.add(conv.id)
        rid = f"chat-{conv.id}-{next(self._seq)}-{int(time.time() * 1000) % 100000}"
        self.active[rid] = (conv.id, reply, {"n": 0})
        self.last_request[conv.id] = rid
        self._stick_to_bottom = True
        self._append_view(reply, streaming=True)
        self._move_to_top(conv.id)
        self.submit.emit(rid, prompt, self.sampling().to_wire())
        self.conversation_selected.emit(conv.id, rid)
        self._update_buttons()
        return rid

    def _move_to_top(self, conv_id: str) -> None:
        item = self._item_for(conv_id)
        if item is None or self.conv_list.row(item) == 0:
            return
        self.conv_list.blockSignals(True)
        row = self.conv_list.row(item)
        taken = self.conv_list.takeItem(row)
        self.conv_list.insertItem(0, taken)
        if self.current is not None and self.current.id == conv_id:
            self.conv_list.setCurrentItem(taken)
        self.conv_list.blockSignals(False)

    def stop_current(self) -> None:
        if self.current is None:
            return
        for rid, (cid, _, _) in list(self.active.items()):
            if cid == self.current.id:
                self.abort.emit(rid)

    # --- replies ------------------------------------------------------------------------------
    def on_replies(self, msgs: list[Any]) -> None:
        """Deltas, Finishes and Errors (ipc.protocol structs) for our requests."""
        touched: set[str] = set()
        for msg in msgs:
            rid = getattr(msg, "request_id", None)
            entry = self.active.get(rid) if rid else None
            if entry is None:
                continue
            conv_id, reply, timing = entry
            kind = type(msg).__name__
            if kind == "Delta":
                if msg.index != 0:
                    continue
                reply.content += msg.text
                timing["n"] += len(msg.token_ids)
                self._track_thinking(reply, timing, len(msg.token_ids))
            elif kind == "Finish":
                if msg.index != 0:
                    continue
                self._track_thinking(reply, timing, 0, finished=True)
                thought = {k: v for k, v in reply.stats.items() if k.startswith("thinking_")}
                reply.stats = thought | self._finish_stats(msg)
                if msg.reason in ("abort", "error"):
                    reply.interrupted = True
                    reply.stats["interrupted_by"] = (
                        "stopped" if msg.reason == "abort" else f"error: {msg.error or ''}")
                del self.active[rid]
            elif kind == "Error":
                if getattr(msg, "code", "") == "unknown_request":
                    continue  # an abort that raced the finish
                reply.interrupted = True
                why = ("interrupted: " + msg.message if msg.code == "engine_unreachable"
                       else "engine refused the request")
                reply.stats = dict(reply.stats) | {"error": f"[{msg.code}] {msg.message}",
                                                   "interrupted_by": why}
                del self.active[rid]
            touched.add(rid)
            self._mark_dirty(conv_id)
            if self.current is not None and self.current.id == conv_id:
                v = self._view_for(reply)
                if v is not None:
                    v.refresh(streaming=rid in self.active)
        if touched:
            self._update_buttons()

    def _track_thinking(self, reply: Message, timing: dict, n: int,
                        finished: bool = False) -> None:  # fmt: skip
        """A reply's thinking tokens and time, into its stats: tokens counted while the block
        is open, the time from its first token to the answer's start (or the reply's end)."""
        if "thinking_s" in reply.stats:
            return
        split = split_thinking(reply.content, self.reasoning_open)
        if split.reasoning is None:
            return
        now = time.monotonic()
        t0 = timing.setdefault("think_t0", now)
        reply.stats["thinking_tokens"] = reply.stats.get("thinking_tokens", 0) + n
        if not split.thinking or finished:
            reply.stats["thinking_s"] = now - t0

    @staticmethod
    def _finish_stats(msg: Any) -> dict:
        """From an engine Finish, or a server's over HTTP (ui/remote/link.py), which may lack
        usage (None) or cached tokens (usage.cached_tokens None)."""
        u = msg.usage
        n = u.completion_tokens if u is not None else 0
        tok_s = None
        if msg.tpot:
            tok_s = 1.0 / msg.tpot
        elif msg.e2e and msg.ttft is not None and n > 1 and msg.e2e > msg.ttft:
            tok_s = (n - 1) / (msg.e2e - msg.ttft)
        stats = {"ttft": msg.ttft, "tok_s": tok_s, "finish_reason": msg.reason, "e2e": msg.e2e}
        if u is not None:
            stats |= {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                      "completion_tokens": n}
        return stats

    def interrupt_all(self, why: str) -> None:
        """The engine is gone: every streaming reply keeps its text and is marked interrupted."""
        for _rid, (conv_id, reply, timing) in list(self.active.items()):
            reply.interrupted = True
            reply.stats = dict(reply.stats) | {"interrupted_by": why,
                                              "completion_tokens": timing["n"]}
            self._mark_dirty(conv_id)
            v = self._view_for(reply)
            if v is not None:
                v.refresh()
        self.active.clear()
        self.flush_saves()
        self._update_buttons()

    def shutdown(self) -> None:
        if self.current is not None:
            self._save_draft()
        self.flush_saves()
