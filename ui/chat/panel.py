"""The chat: conversations (renamable, deletable, searchable, saved), streamed replies, Stop,
Regenerate, edit-and-branch, system-prompt presets, per-conversation sampling, and per-reply
stats (TTFT, tok/s, prompt / cached / generated tokens).

The panel never talks to the engine itself: it emits `submit(request_id, messages, sampling)` and
`abort(request_id)`, and the main window feeds engine replies back through `on_replies`. Everything
typed is saved (draft included) before any request leaves, so an engine crash loses nothing.

Editing a user turn or regenerating a reply adds a sibling branch to the conversation's tree
(app/conversations/model.py); `branch_sent(new request, request of the branch it forked from)`
lets the block map show the KV blocks the two share.

Sending, regenerating, stopping and the replies streaming back are ui/chat/sending.py's
(SendingMixin, which ChatPanel inherits).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QListWidgetItem,
    QMessageBox,
    QPlainTextEdit,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.conversations import Conversation, ConversationStore, Message
from app.conversations.presets import PresetStore
from app.conversations.search import search as search_conversations
from app.settings import SamplingDefaults
from ui.chat.attachments import context_warning, estimate_tokens
from ui.chat.composer import Composer
from ui.chat.message_view import MessageView
from ui.chat.presets_bar import PresetsBar
from ui.chat.replies import ReplyTracker
from ui.chat.sampling_box import SamplingBox
from ui.chat.sending import SendingMixin
from ui.chat.sidebar import ConversationSidebar
from ui.chat.transcript import Transcript

log = logging.getLogger(__name__)


class ChatPanel(SendingMixin, QWidget):
    submit = Signal(str, list, dict)  # request id, chat messages, sampling fields
    abort = Signal(str)
    conversation_selected = Signal(str, str)  # conversation id, its latest request id ("")
    branch_sent = Signal(str, str)  # new request id, the request of the branch it forked from

    def __init__(self, store: ConversationStore, sampling: SamplingDefaults,
                 parent: QWidget | None = None, presets: PresetStore | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.model_name = ""  # the engine's model (Welcome.model.name), saved with each turn
        self.convs: dict[str, Conversation] = {}
        self.current: Conversation | None = None
        self.replies = ReplyTracker()
        self.active = self.replies.active  # rid -> (conv id, reply, timing)
        self.last_request = self.replies.last_request  # conv id -> latest request id
        self.reasoning_open = False  # the model's prompt opens <think> (ModelInfo.reasoning_parser)
        self.fork_of: dict[str, str] = {}  # request id -> the request of the branch it forked
        self.engine_ready = False
        self.editing: Message | None = None  # the user turn an edit will branch from
        self._dirty: set[str] = set()

        # conversation list, search, sampling
        self.sidebar = ConversationSidebar(self._search)
        self.conv_list = self.sidebar.list
        self.conv_list.currentItemChanged.connect(self._on_conv_changed)
        self.conv_list.itemChanged.connect(self._on_item_renamed)
        self.sidebar.new_requested.connect(lambda: self.new_conversation())
        self.sidebar.rename_requested.connect(self._rename_current)
        self.sidebar.delete_requested.connect(self._delete_current)
        self.sidebar.jump.connect(self.jump_to)
        self.sampling_box = SamplingBox(sampling)
        self.sampling_box.changed.connect(self._on_sampling_changed)
        for name in ("temperature", "top_p", "top_k", "max_tokens", "seed"):
            setattr(self, name, getattr(self.sampling_box, name))  # tests and the window use them
        self.sidebar.lay.addWidget(self.sampling_box)

        # system prompt and its presets, transcript
        presets = presets or PresetStore(Path(store.directory).parent / "presets.json")
        self.system_edit = QPlainTextEdit()
        self.system_edit.setPlaceholderText("System prompt")
        self.system_edit.setMaximumHeight(52)
        self.system_edit.textChanged.connect(self._on_system_changed)
        self.presets_bar = PresetsBar(presets, self.system_edit.toPlainText)
        self.presets_bar.chosen.connect(self._on_preset_chosen)
        self.presets_bar.error.connect(self.notice_text)
        self.transcript = Transcript(self._make_view)

        self.composer = Composer(self.send_current, self.stop_current, self.regenerate)
        self.input = self.composer.input  # the names tests and the window use
        self.send_btn, self.stop_btn = self.composer.send_btn, self.composer.stop_btn
        self.regen_btn, self.notice = self.composer.regen_btn, self.composer.notice
        self.attach_bar = self.composer.attach_bar
        self.input.textChanged.connect(self._on_draft_changed)
        self.attach_bar.changed.connect(self._update_context_warning)
        self.max_model_len = 0  # the engine's context length (Welcome), for the warning
        center = QWidget()
        self.center_lay = cl = QVBoxLayout(center)
        cl.setContentsMargins(0, 0, 0, 0)
        cl.addWidget(self.presets_bar)
        cl.addWidget(self.system_edit)
        cl.addWidget(self.transcript, 1)
        cl.addWidget(self.composer)

        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(self.sidebar)
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

    def notice_text(self, text: str) -> None:
        self.notice.setText(text)

    # --- sampling and presets ------------------------------------------------------------------
    def sampling(self) -> SamplingDefaults:
        return self.sampling_box.values()

    def _on_sampling_changed(self) -> None:
        if self.current is not None:  # each conversation keeps its own settings
            self.current.sampling = self.sampling_box.to_dict()
            self._mark_dirty(self.current.id)

    def _on_preset_chosen(self, name: str, prompt: str) -> None:
        if self.current is None:
            return
        self.current.preset = name
        if prompt != self.system_edit.toPlainText():
            self.system_edit.setPlainText(prompt)  # saves it through _on_system_changed
        self._mark_dirty(self.current.id)

    # --- conversations ----------------------------------------------------------------------
    def _add_item(self, conv: Conversation, top: bool = False) -> QListWidgetItem:
        return self.sidebar.add_item(conv.id, conv.title,
                                     f"model: {conv.model}" if conv.model else "", top)

    def _item_for(self, conv_id: str) -> QListWidgetItem | None:
        return self.sidebar.item_for(conv_id)

    def new_conversation(self, title: str = "New chat") -> Conversation:
        conv = Conversation(title=title)
        if self.current is not None:
            conv.system_prompt = self.current.system_prompt  # most people keep theirs
            conv.preset = self.current.preset
            conv.sampling = dict(self.current.sampling)
        return self.add_conversation(conv)

    def add_conversation(self, conv: Conversation) -> Conversation:
        """A new or imported conversation, saved, listed first and shown."""
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
        self.sidebar.set_title(conv_id, title)
        self.store.save(conv)

    def delete_conversation(self, conv_id: str) -> None:
        for rid in self.replies.requests_of(conv_id):
            self.abort.emit(rid)
            del self.active[rid]
        conv = self.convs.pop(conv_id)
        self.store.delete(conv.id)
        self.sidebar.remove(conv_id)
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
                self.sidebar.set_title(conv_id, self.convs[conv_id].title)

    def _on_conv_changed(self, item: QListWidgetItem | None, _prev: Any = None) -> None:
        if self.current is not None:
            self._save_draft()
        self.cancel_edit()
        conv_id = item.data(Qt.ItemDataRole.UserRole) if item is not None else None
        self.current = self.convs.get(conv_id) if conv_id else None
        self._show_current()
        if self.current is not None:
            self.system_edit.blockSignals(True)
            self.system_edit.setPlainText(self.current.system_prompt)
            self.system_edit.blockSignals(False)
            self.presets_bar.show_preset(self.current.preset)
            self.sampling_box.set_from_dict(self.current.sampling)
            self.composer.set_text(self.current.draft, quiet=True)
            self.conversation_selected.emit(self.current.id,
                                            self.last_request.get(self.current.id, ""))
        self._update_buttons()

    # --- search ---------------------------------------------------------------------------------
    def _search(self, query: str) -> list:
        """(conversation title, SearchHit) pairs: the sidebar shows where each hit is."""
        hits = search_conversations(self.convs.values(), query)
        return [(self.convs[h.conv_id].title, h) for h in hits]

    def jump_to(self, conv_id: str, message_id: str = "") -> bool:
        """Show a conversation and, for a message hit, the branch holding it, scrolled to it."""
        if conv_id not in self.convs:
            return False
        self.select_conversation(conv_id)
        conv = self.convs[conv_id]
        if not message_id or message_id not in conv.nodes:
            return True
        conv.select(message_id)
        self._mark_dirty(conv_id)
        self._show_current()
        return self.transcript.reveal(conv.nodes[message_id])

    # --- transcript and branches ---------------------------------------------------------
    def _make_view(self, m: Message, streaming: bool) -> MessageView:
        v = MessageView(m, thinking_opens_reply=self.reasoning_open)
        conv = self.current
        if conv is not None and m.id in conv.nodes:
            v.set_branch(*conv.branch_position(m))
        v.branch_step.connect(lambda step, m=m: self.switch_branch(m, step))
        v.edit_requested.connect(lambda m=m: self.start_edit(m))
        v.refresh(streaming)
        return v

    def _view_for(self, m: Message) -> MessageView | None:
        return self.transcript.view_for(m)

    def _show_current(self) -> None:
        self.transcript.show_messages(self.current.messages if self.current else [],
                                      self.replies.streaming_ids())

    def switch_branch(self, m: Message, step: int) -> None:
        conv = self.current
        if conv is None or m.id not in conv.nodes or self.busy():
            return  # a streaming reply stays on screen until it ends
        try:
            conv.switch_branch(m, step)
        except ValueError as exc:
            log.debug("no branch there: %s", exc)
            return
        self._mark_dirty(conv.id)
        self._show_current()
        self._update_buttons()

    def start_edit(self, m: Message) -> None:
        """Put a user turn in the input box; sending it makes a sibling branch (Esc cancels)."""
        if self.current is None or m.role != "user" or self.busy():
            return
        self._save_draft()
        self.editing = m
        self.input.setPlainText(m.content)
        self.notice.setText("Editing a message: Send makes a new branch from here "
                            "(the old one stays, ‹ › switches) · Esc cancels")
        self.focus_input()

    def cancel_edit(self) -> None:
        if self.editing is None:
            return
        self.editing = None
        self.notice.setText("")
        if self.current is not None:
            self.input.setPlainText(self.current.draft)

    def escape(self) -> None:
        """Esc: clear the search, or cancel an edit, or stop the reply."""
        if self.sidebar.search_edit.text():
            self.sidebar.search_edit.clear()
        elif self.editing is not None:
            self.cancel_edit()
        else:
            self.stop_current()

    def focus_input(self) -> None:
        self.composer.focus()

    def history_tokens(self) -> int:
        """The current branch's tokens so far: the last reply's prompt plus what it generated
        (the engine's own count), else an estimate of the whole prompt."""
        path = self.current.messages if self.current else ()
        for m in reversed(path):
            if m.role == "assistant" and isinstance(m.stats.get("prompt_tokens"), int):
                later = "\n".join(x.prompt_text() for x in path[path.index(m) + 1:])
                return (m.stats["prompt_tokens"] + int(m.stats.get("completion_tokens") or 0)
                        + estimate_tokens(later))
        prompt = self.current.to_prompt() if self.current else []
        return estimate_tokens("\n".join(p["content"] for p in prompt))

    def _update_context_warning(self) -> None:
        if self.max_model_len <= 0:
            return
        attached, _ = self.attach_bar.token_total()
        self.attach_bar.set_warning(context_warning(
            self.history_tokens(), attached, estimate_tokens(self.input.toPlainText()),
            self.max_tokens.value(), self.max_model_len))

    # --- drafts and saving ------------------------------------------------------------------
    def _on_draft_changed(self) -> None:
        if self.current is not None and self.editing is None:
            self.current.draft = self.input.toPlainText()
            self._mark_dirty(self.current.id)
        if self.attach_bar.attachments():
            self._update_context_warning()

    def _on_system_changed(self) -> None:
        if self.current is not None:
            self.current.system_prompt = self.system_edit.toPlainText()
            self._mark_dirty(self.current.id)

    def _save_draft(self) -> None:
        assert self.current is not None
        if self.editing is None:
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

    def shutdown(self) -> None:
        if self.current is not None:
            self._save_draft()
        self.flush_saves()
