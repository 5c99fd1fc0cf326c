"""*Engine → Serve OpenAI API…*: the window runs `python -m app serve --connect <its engine>` as a
child process, so HTTP clients reach the same engine (and show up in the block map and request
table with origin "http").

`ApiServer` owns that process through `app.supervisor.EngineSupervisor` (reader threads; their
callbacks reach the GUI thread as Qt signals) and never waits for it on the GUI thread: it starts
it, reads the `KVSCOPE_HTTP_READY <url>` line, sends SIGTERM to stop it and learns of the exit from
the supervisor. When the window's engine comes back on a new endpoint it restarts the server
against it on the same port. The API key and the engine token travel in the child's environment
($KVSCOPE_API_KEY, $KVSCOPE_TOKEN), not on its command line, where any local user could read them.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.supervisor import EngineSupervisor

log = logging.getLogger(__name__)

HTTP_READY_PREFIX = "KVSCOPE_HTTP_READY "  # the one line `app serve` prints on stdout
DEFAULT_PORT = 8000
KILL_AFTER_S = 6.0  # the server drains for up to 3 s after SIGTERM; then it is killed
TOKEN_ENV, API_KEY_ENV = "KVSCOPE_TOKEN", "KVSCOPE_API_KEY"

# states
OFF, WAITING, STARTING, SERVING, STOPPING = "off", "waiting", "starting", "serving", "stopping"


def api_command(endpoint: str, port: int, python: str | None = None) -> list[str]:
    """The HTTP server's command line for the engine at `endpoint` (loopback only)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    if not endpoint:
        raise ValueError("endpoint must be the engine's ROUTER endpoint, got ''")
    return [python or sys.executable, "-m", "app", "serve", "--connect", endpoint,
            "--port", str(port)]


def api_env(token: str | None, api_key: str | None,
            base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: exactly our token and key, never ones inherited from ours
    (a blank key in the dialog means no key, even when the shell exported one)."""
    env = dict(os.environ if base is None else base)
    for name, value in ((TOKEN_ENV, token), (API_KEY_ENV, api_key)):
        env.pop(name, None)
        if value:
            env[name] = value
    return env


class _Bridge(QObject):
    """Supervisor callbacks arrive on its reader threads; these signals queue them to the GUI.
    Each carries the number of the child it is about (a late word from an earlier one is
    ignored; `sender()` cannot tell, since the earlier bridge may be gone by then)."""

    line = Signal(int, str)
    exited = Signal(int, int)


class ApiServer(QObject):
    """One `app serve` child for the window's engine; all methods run on the GUI thread."""

    state_changed = Signal(str)  # off | waiting | starting | serving | stopping
    failed = Signal(str, list)  # why, the last lines of its output; the server is off
    restarted = Signal(str)  # a new engine endpoint: the server was restarted against it

    def __init__(self, *, token: str | None = None, log_file: Path | None = None,
                 python: str | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.token = token
        self.log_file = log_file
        self.python = python
        self.port = DEFAULT_PORT
        self.api_key: str | None = None
        self.endpoint: str | None = None  # the window's engine (None: not known yet)
        self.state = OFF
        self.url: str | None = None  # "http://127.0.0.1:PORT" once listening
        self.supervisor: EngineSupervisor | None = None
        self.served_endpoint: str | None = None  # what the running child is connected to
        self.last_error = ""
        self.last_tail: list[str] = []
        self._bridge: _Bridge | None = None
        self._child = 0  # number of the current child (see _Bridge)
        self._respawn = False  # stopping only to start again (new endpoint)

    # --- API ---------------------------------------------------------------------------------
    @property
    def wanted(self) -> bool:
        """On, or about to be (what the menu toggle shows)."""
        return self.state != OFF and (self.state != STOPPING or self._respawn)

    @property
    def restarting(self) -> bool:
        """Stopping only to start again against the engine's new endpoint."""
        return self.state == STOPPING and self._respawn

    def start(self, port: int, api_key: str | None = None) -> None:
        """Serve on 127.0.0.1:`port` (0 = any free port) now, or once the engine is known."""
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {port}")
        self.port, self.api_key = port, (api_key or None)
        if self.state == STOPPING:  # switched off and on again before the old one exited
            self._respawn = True
            return
        if self.state != OFF:
            return
        if self.endpoint is None:
            self._set_state(WAITING)
        else:
            self._spawn()

    def stop(self) -> None:
        """SIGTERM the server (without waiting); the state is off once it has exited."""
        self._respawn = False
        sup = self.supervisor
        if sup is None or not sup.running():
            self._forget()
            self._set_state(OFF)
            return
        self._set_state(STOPPING)
        self._terminate(sup)

    def set_endpoint(self, endpoint: str) -> None:
        """The window's engine is (now) at `endpoint`: serve it, restarting if it moved."""
        self.endpoint = endpoint
        if self.state == WAITING:
            self._spawn()
        elif self.state in (STARTING, SERVING) and endpoint != self.served_endpoint:
            log.info("engine moved to %s: restarting the API server", endpoint)
            self._respawn = True
            assert self.supervisor is not None
            self._set_state(STOPPING)
            self._terminate(self.supervisor)

    def shutdown(self, timeout: float = 4.0) -> None:
        """The window is closing: stop the server and wait for it (bounded)."""
        self._respawn = False
        sup = self.supervisor
        self._forget()
        if sup is not None:
            sup.stop(timeout=timeout)
        self._set_state(OFF)

    @property
    def pid(self) -> int | None:
        return self.supervisor.pid if self.supervisor else None

    # --- internals ---------------------------------------------------------------------------
    def _spawn(self) -> None:
        assert self.endpoint is not None and self.supervisor is None
        self._child += 1
        child = self._child
        bridge = _Bridge()
        bridge.line.connect(self._on_line, Qt.ConnectionType.QueuedConnection)
        bridge.exited.connect(self._on_exit, Qt.ConnectionType.QueuedConnection)
        self._bridge = bridge

        def on_log(line: str, b: _Bridge = bridge) -> None:  # reader thread: every output line
            if line.startswith(HTTP_READY_PREFIX):
                b.line.emit(child, line)

        sup = EngineSupervisor(
            api_command(self.endpoint, self.port, self.python),
            on_log=on_log,
            on_exit=lambda code, b=bridge: b.exited.emit(child, code),
            log_file=self.log_file,
            env=api_env(self.token, self.api_key),
            name="API server",
        )
        self.supervisor = sup
        self.served_endpoint = self.endpoint
        self.url = None
        self.last_error, self.last_tail = "", []
        self._set_state(STARTING)
        try:
            sup.start()
        except OSError as exc:
            self._forget()
            self._give_up(f"could not start the API server: {exc}", [])

    def _terminate(self, sup: EngineSupervisor) -> None:
        sup.terminate()
        QTimer.singleShot(int(KILL_AFTER_S * 1000), sup.kill)  # no-op once it has exited

    def _on_line(self, child: int, line: str) -> None:
        if child != self._child or self.supervisor is None or self.state != STARTING:
            return
        self.url = line[len(HTTP_READY_PREFIX):].strip()
        if self.port == 0:  # a restart (new engine endpoint) keeps the URL clients were given
            try:
                self.port = int(self.url.rsplit(":", 1)[1].rstrip("/"))
            except (IndexError, ValueError):
                log.warning("no port in the API server's ready line %r", line)
        self._set_state(SERVING)

    def _on_exit(self, child: int, code: int) -> None:
        if child != self._child or self.supervisor is None:
            return  # an earlier child's exit, already dealt with (or shut down)
        sup, previous = self.supervisor, self.served_endpoint
        tail = [ln for ln in (sup.tail(12) if sup else []) if ln.strip()]
        self._forget()
        if self.state == STOPPING:
            if self._respawn and self.endpoint is not None:
                self._respawn = False
                self._spawn()
                if self.state == STARTING and self.endpoint != previous:
                    self.restarted.emit(self.endpoint)
            else:
                self._set_state(OFF)
            return
        what = "could not start" if self.state == STARTING else "stopped"
        self._give_up(f"the API server {what} (exit code {code})", tail)

    def _give_up(self, why: str, tail: list[str]) -> None:
        self.last_error, self.last_tail = why, tail
        log.warning("%s: %s", why, " | ".join(tail[-3:]))
        self._set_state(OFF)
        self.failed.emit(why, tail)

    def _forget(self) -> None:
        self.supervisor = None
        self._bridge = None
        self.url = None
        self.served_endpoint = None

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.state_changed.emit(state)


class ApiServerDialog(QDialog):
    """Port and optional API key for *Serve OpenAI API…*."""

    def __init__(self, port: int, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Serve OpenAI API")
        self.setMinimumWidth(420)
        self.port = QSpinBox()
        self.port.setRange(0, 65535)
        self.port.setSpecialValueText("any free port")
        self.port.setValue(port)
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("none: any local program may call it")
        note = QLabel("Listens on 127.0.0.1 only (this machine). Clients send the key as "
                      "<code>Authorization: Bearer KEY</code>; the key is not remembered. "
                      "The server uses the engine this window is connected to.")
        note.setWordWrap(True)
        form = QFormLayout()
        form.addRow("Port", self.port)
        form.addRow("API key", self.key)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok
                                   | QDialogButtonBox.StandardButton.Cancel)
        buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Serve")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(note)
        lay.addWidget(buttons)

    def values(self) -> tuple[int, str | None]:
        return self.port.value(), (self.key.text().strip() or None)
