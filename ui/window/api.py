"""*Engine → Serve OpenAI API…* in the main window: the checkable menu item, its port-and-key
dialog, the message box when the server cannot start, and the status-bar line with the number of
HTTP requests in flight. The server itself (an `app serve` child) is ui/window/api_server.py."""

from __future__ import annotations

from PySide6.QtCore import QObject
from PySide6.QtWidgets import QMessageBox

from ui.telemetry import HTTP_ORIGIN
from ui.window.api_server import DEFAULT_PORT, SERVING, ApiServerDialog
from ui.window.host import WindowHost


class ApiToggle(QObject):
    """Slots for the menu item, the dialog and `window.api`'s signals (a QObject, so that
    `sender()` tells a stale dialog from the current one)."""

    def __init__(self, window: WindowHost) -> None:
        super().__init__(window)
        self.w = window
        self.http_in_flight = 0

    def on_triggered(self, checked: bool) -> None:
        """The menu action (user-triggered only): on asks for port and key first."""
        w = self.w
        if not checked:
            w.api.stop()
            return
        try:
            port = int(w.settings.value("api/port", DEFAULT_PORT))
        except (TypeError, ValueError):
            port = DEFAULT_PORT
        dialog = ApiServerDialog(port if 0 <= port <= 65535 else DEFAULT_PORT, w)
        dialog.accepted.connect(self._on_dialog_accepted)
        dialog.rejected.connect(self._on_dialog_rejected)
        dialog.finished.connect(dialog.deleteLater)
        w.api_dialog = dialog
        dialog.open()  # window-modal, returns at once: the event loop keeps running

    def _on_dialog_accepted(self) -> None:
        dialog = self.sender()
        if dialog is not self.w.api_dialog:
            return
        port, key = dialog.values()
        self.w.api_dialog = None
        self.w.settings.setValue("api/port", port)  # never the key
        self.w.api.start(port, key)

    def _on_dialog_rejected(self) -> None:
        if self.sender() is self.w.api_dialog:
            self.w.api_dialog = None
            self.w.api_action.setChecked(self.w.api.wanted)

    def on_state(self, state: str) -> None:
        self.w.api_action.setChecked(self.w.api.wanted)
        self.http_in_flight = self.count_http()
        self.show_status()

    def on_failed(self, why: str, tail: list[str]) -> None:
        self.w.api_action.setChecked(False)
        box = QMessageBox(QMessageBox.Icon.Warning, "Serve OpenAI API", why + ".",
                          QMessageBox.StandardButton.Ok, self.w)
        if tail:
            box.setInformativeText("\n".join(tail[-6:]))
        box.finished.connect(box.deleteLater)
        self.w.api_error_box = box
        box.open()  # not exec(): nothing waits on the user

    def on_frame(self) -> None:
        """A telemetry frame arrived: recount the HTTP requests while the API is served."""
        if self.w.api.state == SERVING:
            n = self.count_http()
            if n != self.http_in_flight:  # setText re-lays the status bar out: only on change
                self.http_in_flight = n
                self.show_status()

    def count_http(self) -> int:
        latest = self.w.history.latest
        if latest is None:
            return 0
        return sum(1 for r in latest.requests
                   if r.origin == HTTP_ORIGIN and r.status != "finished")

    def show_status(self) -> None:
        self.w.status.show_api(self.w.api, self.http_in_flight)
