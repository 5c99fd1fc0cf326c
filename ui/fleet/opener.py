"""The main window's way to a fleet: *Engine → Connect to a fleet…* opens the dialog, and each
fleet accepted opens a `FleetPanel` window of its own beside the main window (which keeps
watching what it watched), closed with it."""

from __future__ import annotations

from PySide6.QtCore import QObject
from PySide6.QtWidgets import QWidget

from app.remote.fleet import Replica
from ui.fleet.dialog import FleetDialog
from ui.fleet.panel import FleetPanel


class FleetOpener(QObject):
    def __init__(self, window: QWidget) -> None:
        super().__init__(window)
        self.window = window
        self.dialog: FleetDialog | None = None
        self.panels: list[FleetPanel] = []

    def open_dialog(self) -> None:
        dialog = FleetDialog(parent=self.window)
        dialog.accepted.connect(self._on_accepted)
        dialog.finished.connect(dialog.deleteLater)
        self.dialog = dialog
        dialog.open()  # window-modal, returns at once

    def _on_accepted(self) -> None:
        dialog = self.sender()
        if dialog is not self.dialog:
            return
        self.dialog = None
        self.open_fleet(dialog.replicas(), dialog.api_key())

    def open_fleet(self, replicas: list[Replica], api_key: str | None = None,
                   **scraper_options) -> FleetPanel:  # fmt: skip
        panel = FleetPanel(replicas, api_key=api_key, scraper_options=scraper_options)
        panel.resize(1200, 800)
        panel.show()
        panel.start()
        self.panels.append(panel)
        return panel

    def shutdown(self) -> None:
        for panel in self.panels:
            panel.stop()
            panel.close()
        self.panels.clear()
