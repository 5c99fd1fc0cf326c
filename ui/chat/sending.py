"""The chat panel's requests: Send (a new turn, or a branch when editing), Regenerate, Stop, the
replies streaming back (`on_replies`) and the engine going away (`interrupt_all`), with the
Send / Stop / Regenerate buttons' state.

ChatPanel inherits these methods (it holds the conversations, the composer, the transcript, the
ReplyTracker and the `submit` / `abort` / `conversation_selected` / `branch_sent` signals they
use)."""

from __future__ import annotations

import logging
from typing import Any

from app.conversations import Conversation, Message
from ui.chat.attachments import to_message
from ui.chat.branching import forked_request

log = logging.getLogger("ui.chat.panel")  # the panel's logger, as before this module was split off


class SendingMixin:
    """Sending and the replies it starts; mixed into ChatPanel (a QWidget), which defines the
    attributes and signals used here."""

    # --- sending ----------------------------------------------------------------------------
    def busy(self, conv_id: str | None = None) -> bool:
        return self.replies.busy(conv_id or (self.current.id if self.current else None))

    def set_engine_ready(self, ready: bool, notice: str = "") -> None:
        self.engine_ready = ready
        self.notice.setText(notice)
        self._update_buttons()

    def _update_buttons(self) -> None:
        has_user = self.current is not None and any(
            m.role == "user" for m in self.current.messages)
        self.composer.set_state(self.engine_ready, self.busy(), has_user)

    def send_current(self) -> str | None:
        """Send what is in the input box (as a new branch when editing); returns the request id
        (None when nothing was sent)."""
        if self.current is None:
            return None
        text = self.input.toPlainText().strip()
        if not (text or self.attach_bar.attachments()) or not self.engine_ready or self.busy():
            return None
        conv, edited = self.current, self.editing
        turn = to_message(text, self.attach_bar.attachments())
        if edited is not None:  # an edit changes the text; the files stay with the turn
            turn.attachments = list(edited.attachments) + turn.attachments
        if edited is not None and edited.id in conv.nodes:
            conv.add_sibling(edited, turn)
        else:
            conv.append(turn)
        previous_model, conv.model = conv.model, self.model_name or conv.model
        try:  # the user's turn is on disk before the input box is cleared
            if conv.title == "New chat":
                self.rename_conversation(conv.id, conv.auto_title())
            self.store.save(conv)
        except OSError as exc:
            conv.remove_leaf(turn)
            if edited is not None:
                conv.select(edited.id)
            conv.model = previous_model
            log.error("could not save conversation %s: %s", conv.id, exc)
            self.notice.setText(
                f"Could not save the conversation ({exc.strerror or exc}): nothing was sent and "
                "your text is kept. Free some disk space and send again."
            )
            return None
        self.editing = None
        self.notice.setText("")
        item = self._item_for(conv.id)
        if item is not None and conv.model:
            item.setToolTip(f"model: {conv.model}")
        self.composer.set_text("", quiet=True)
        self.attach_bar.clear()
        if edited is not None:
            self._show_current()  # the path changed below the edited turn
        else:
            self.transcript.append(turn)
        return self._start_reply(conv)

    def regenerate(self) -> str | None:
        """A new reply to the last user turn, as a sibling of the current one (kept: ‹ ›)."""
        conv = self.current
        if conv is None or not self.engine_ready or self.busy():
            return None
        path = conv.messages
        if not any(m.role == "user" for m in path):
            return None
        old = path[-1] if path[-1].role == "assistant" else None
        return self._start_reply(conv, sibling_of=old)

    def _start_reply(self, conv: Conversation, sibling_of: Message | None = None) -> str:
        reply = Message("assistant", "")
        if sibling_of is not None:
            conv.add_sibling(sibling_of, reply)
        else:
            conv.append(reply)
        prompt = conv.to_prompt()  # the new reply is empty, so not part of it
        rid = self.replies.start(conv.id, reply)
        reply.stats["request_id"] = rid
        forked = forked_request(conv)
        if forked:
            reply.stats["forked_from"] = forked
            self.fork_of[rid] = forked
        try:
            self.store.save(conv)
        except OSError as exc:  # the reply streams on; the periodic save tries again
            log.error("could not save conversation %s: %s", conv.id, exc)
            self._dirty.add(conv.id)
        self.transcript.stick_to_bottom = True
        self._show_current() if sibling_of is not None else self.transcript.append(reply, True)
        self.sidebar.move_to_top(conv.id, self.current is not None and self.current.id == conv.id)
        self.submit.emit(rid, prompt, self.sampling().to_wire())
        self.conversation_selected.emit(conv.id, rid)
        if forked:
            self.branch_sent.emit(rid, forked)
        self._update_buttons()
        return rid

    def stop_current(self) -> None:
        if self.current is None:
            return
        for rid in self.replies.requests_of(self.current.id):
            self.abort.emit(rid)

    # --- replies ------------------------------------------------------------------------------
    def on_replies(self, msgs: list[Any]) -> None:
        """Deltas, Finishes and Errors (ipc.protocol structs) for our requests."""
        changed = self.replies.apply(msgs, self.reasoning_open)
        for rid, conv_id, reply in changed:
            self._mark_dirty(conv_id)
            if self.current is not None and self.current.id == conv_id:
                v = self._view_for(reply)
                if v is not None:
                    v.refresh(streaming=rid in self.active)
        if changed:
            self._update_buttons()

    def interrupt_all(self, why: str) -> None:
        """The engine is gone: every streaming reply keeps its text and is marked interrupted."""
        for conv_id, reply in self.replies.interrupt_all(why):
            self._mark_dirty(conv_id)
            v = self._view_for(reply)
            if v is not None:
                v.refresh()
        self.flush_saves()
        self._update_buttons()
