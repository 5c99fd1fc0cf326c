"""Runs `python -m engine_proc models --json` (app/models.py builds the command) in a QProcess,
so the GUI thread never waits on the disk or the headers, and hands back its JSON."""

from __future__ import annotations

import sys

from PySide6.QtCore import QObject, QProcess, Signal

from app.models.catalog import catalog_command, parse_catalog


class CatalogRunner(QObject):
    finished = Signal(dict)  # {"models": [...], "available_bytes": ...}
    failed = Signal(str)

    def __init__(self, parent: QObject | None = None, python: str | None = None) -> None:
        super().__init__(parent)
        self.python = python or sys.executable
        self.proc: QProcess | None = None

    def running(self) -> bool:
        return self.proc is not None and self.proc.state() != QProcess.ProcessState.NotRunning

    def run(self, dirs: list[str], context: int | None, kv_cache_dtype: str, dtype: str) -> None:
        """Start a listing (a running one is dropped: its answer is for older options)."""
        cmd = catalog_command(dirs, context, kv_cache_dtype, dtype, python=self.python)
        self.cancel()
        proc = self.proc = QProcess(self)
        proc.finished.connect(lambda code, status, p=proc: self._done(p, code))
        proc.errorOccurred.connect(lambda err, p=proc: self._error(p, err))
        proc.start(cmd[0], cmd[1:])

    def cancel(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.state() != QProcess.ProcessState.NotRunning:
            proc.kill()
            proc.waitForFinished(2000)
        if proc is not None:
            proc.deleteLater()

    def _done(self, proc: QProcess, code: int) -> None:
        if proc is not self.proc:
            return  # cancelled, or the runner is being destroyed with its process
        self.proc = None
        try:
            out = bytes(proc.readAllStandardOutput().data()).decode("utf-8", "replace")
            err = bytes(proc.readAllStandardError().data()).decode("utf-8", "replace")
        except RuntimeError:  # deleted with its parent while it ran
            return
        proc.deleteLater()
        try:
            self.finished.emit(parse_catalog(out))
        except ValueError as exc:
            self.failed.emit(f"{exc}" + (f"\n{err.strip()[-500:]}" if code and err else ""))

    def _error(self, proc: QProcess, error: QProcess.ProcessError) -> None:
        if proc is self.proc and error == QProcess.ProcessError.FailedToStart:
            self.proc = None
            self.failed.emit(f"could not start {self.python}: {proc.errorString()}")
