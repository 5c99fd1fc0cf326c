"""The main window's engine lifecycle: `EngineSource` (ui/window/source.py) says whether we spawn
the engine (through app.supervisor) or attach to one (`--connect`); either way one `EngineLink`
worker thread carries all ZeroMQ traffic. Also restart (which *Engine → Decode weights* and *Engine
→ KV cache*, ui/window/options.py, call when the options the engine starts with change), and what
happens when the engine (or a server watched over HTTP, ui/window/remote.py) fails or stops
answering: the error banner with its last log lines and Restart."""

from __future__ import annotations

import logging

from PySide6.QtCore import QObject, QTimer, Signal

from app.remote.probe import is_http_url
from app.supervisor import (
    EngineSupervisor,
    engine_command,
)
from ui.engine.link import EngineLink
from ui.window.controls import config_dict
from ui.window.host import WindowHost

log = logging.getLogger(__name__)


class _SupervisorBridge(QObject):
    """Supervisor callbacks arrive on its reader threads; signals carry them to the GUI thread."""

    progress = Signal(float, str)
    ready = Signal(dict)
    exited = Signal(int)


class EngineLifecycle(QObject):
    """Starts, links, restarts and gives up on the window's engine. A QObject, so that
    `sender()` tells the current link or supervisor bridge from a replaced one."""

    def __init__(self, window: WindowHost) -> None:
        super().__init__(window)
        self.w = window
        self.bridge: _SupervisorBridge | None = None
        self._stall_count = 0  # +1 per recovery from "not answering" (see _give_up_on)

    def on_frames(self, frames: list) -> None:
        """The lower tiers' blocks and hits, and the decode step, from the latest telemetry."""
        if frames and self.sender() is self.w.link:
            self.w.status.show_tiers(frames[-1].counters)
            self.w.status.show_decode_step(frames[-1].decode_step, frames[-1].decode_detail)

    # --- start and link --------------------------------------------------------------------------
    def start(self) -> None:
        w = self.w
        w.remote.reset()
        w.banner.setVisible(False)
        w.chat.set_engine_ready(False, "starting the engine…")
        w.banner.restart_btn.setText("Reconnect" if w.source.is_remote else "Restart engine")
        if w.source.connect:
            w.set_state("starting", f"connecting to {w.source.connect}")
            self.open_link(w.source.connect)
            return
        w.set_state("loading")
        w.status.start_progress()
        bridge = _SupervisorBridge()
        bridge.progress.connect(self._on_progress)
        bridge.ready.connect(self._on_engine_ready)
        bridge.exited.connect(self._on_engine_exited)
        self.bridge = bridge
        # A fixed command (tests, --connect-less custom set-ups) still takes the options' flags:
        # argparse lets the later copy of a flag win.
        if w.source.command:
            cmd = [*w.source.command, *w.source.options.to_args()]
        else:
            cmd = engine_command(w.source.options)
        log_file = (w.data_dir / "engine.log") if w.data_dir else None
        sup = EngineSupervisor(
            cmd,
            on_progress=lambda f, m, b=bridge: b.progress.emit(f, m),
            on_ready=lambda info, b=bridge: b.ready.emit(info),
            on_exit=lambda code, b=bridge: b.exited.emit(code),
            log_file=log_file,
            nice=w.source.engine_nice,
        )
        w.supervisor = sup
        try:
            sup.start()
        except OSError as exc:
            self.fail(f"could not start the engine: {exc}")

    def _on_progress(self, frac: float, msg: str) -> None:
        if self.sender() is not self.bridge:
            return  # a previous engine's late line
        self.w.status.show_progress(frac, msg)
        self.w.chat.set_engine_ready(False, f"loading the engine: {msg} ({frac * 100:.0f}%)")

    def _on_engine_ready(self, info: dict) -> None:
        if self.sender() is not self.bridge:
            return
        self.w.status.progress_text.setText("connecting…")
        self.open_link(info["endpoint"])

    def open_link(self, endpoint: str) -> None:
        w = self.w
        if is_http_url(endpoint):
            w.remote.open_link(endpoint)
            return
        if endpoint.startswith("demo:"):
            from ui.engine.demo import DemoLink

            link = DemoLink()
        else:
            link = EngineLink(endpoint, token=w.source.token,
                              stall_timeout=w.source.stall_timeout)
            w.engine_endpoint = endpoint
            w.api.set_endpoint(endpoint)  # (re)starts the HTTP server when it is on
        link.connected.connect(self._on_connected)
        link.connect_failed.connect(lambda why: self.fail(f"could not connect: {why}"))
        link.replies.connect(w.feed.on_replies)
        link.frames.connect(w.feed.on_frames)
        link.frames.connect(self.on_frames)
        link.control_reply.connect(w.on_control_reply)
        link.load_stats.connect(w.load_panel.show_stats)
        link.stalled.connect(self.on_stalled)
        link.recovered.connect(self.on_recovered)
        link.goodbye.connect(self._on_goodbye)
        if hasattr(link, "prefix_tree"):
            link.prefix_tree.connect(w.feed.on_prefix_tree)
        w.link = link
        w.sync_tree_wanted()
        link.start()

    def _on_connected(self, welcome) -> None:
        w = self.w
        if self.sender() is not w.link:
            return
        w.welcome = welcome
        w.status.hide_progress()
        w.status.show_engine(welcome.model)
        w.block_map.vocab_size = welcome.model.vocab_size
        w.chat.reasoning_open = welcome.model.reasoning_parser == "think_open"
        w.chat.model_name = welcome.model.name  # conversations record the model they ran on
        w.chat.max_model_len = welcome.model.max_model_len  # the attachments' context warning
        w.status.show_tiers({})
        w.status.show_decode_step("", "")
        w.remote.set_controls_remote(None)
        w.controls.setEnabled(True)
        w.controls.show_config(config_dict(welcome.config))
        w.load_panel.setEnabled(True)
        w.chat.set_engine_ready(True)
        w.banner.setVisible(False)
        w.set_state("ready")

    # --- failures --------------------------------------------------------------------------------
    def _exit_expected(self) -> bool:
        return self.w.closing or (self.w.supervisor is not None and self.w.supervisor.stopping)

    def _on_engine_exited(self, code: int) -> None:
        if self.sender() is not self.bridge or self._exit_expected():
            return
        self.fail(f"the engine exited with code {code}")

    def on_stalled(self, why: str) -> None:
        w = self.w
        if self.sender() is not w.link:
            return
        if w.supervisor is not None and not w.supervisor.running():
            return  # the exit handler says it better
        w.set_state("not answering", why)
        if w.source.is_remote:  # the link keeps trying; a restarted server is picked up again
            self.show_banner(f"The server at {w.source.connect} is not answering ({why}). "
                             "Trying again every second; replies in progress are cut off.")
            return
        self.show_banner(f"The engine is not answering ({why}). It may be busy with a long "
                         "step; Restart stops it and starts a new one.")
        if w.supervisor is None:  # attached: nobody will tell us it died, so give up later
            link, stall = w.link, self._stall_count
            QTimer.singleShot(int(w.source.stall_timeout * 1000),
                              lambda: self._give_up_on(link, stall))

    def _give_up_on(self, link, stall: int) -> None:
        # Only for the silence that armed it: a timer left from an earlier stall that recovered
        # must not give up on a later one the moment it starts.
        if link is self.w.link and stall == self._stall_count and self.w.state == "not answering":
            self.fail("the engine stopped answering")

    def on_recovered(self) -> None:
        if self.sender() is not self.w.link or self.w.state != "not answering":
            return
        self._stall_count += 1  # disarms this stall's give-up timer
        self.w.banner.setVisible(False)
        self.w.set_state("ready")

    def _on_goodbye(self, reason: str) -> None:
        if self.sender() is not self.w.link or self._exit_expected():
            return
        self.fail(f"the engine shut down: {reason}")

    def fail(self, why: str) -> None:
        """The engine is gone: stay responsive, keep every reply, offer Restart."""
        w = self.w
        w.last_error = why
        log.warning("engine failure: %s", why)
        w.chat.interrupt_all("interrupted: engine stopped")
        w.chat.set_engine_ready(False, "engine unavailable: your messages are saved")
        w.controls.setEnabled(False)
        w.load_panel.set_running(False)
        w.load_panel.setEnabled(False)
        w.status.hide_progress()
        if w.link is not None:
            w.link.stop(timeout=1.0)
            w.link = None
        w.set_state("disconnected", why)
        if w.source.is_remote:
            self.show_banner(f"Cannot watch {w.source.connect}: {why}.")
        else:
            self.show_banner(f"Engine failure: {why}.")

    def show_banner(self, text: str) -> None:
        w = self.w
        tail = w.supervisor.tail(40) if w.supervisor else []
        w.banner.text.setText(text + (" Last lines of its log below." if tail else ""))
        w.banner.log.setPlainText("\n".join(tail) if tail else "(no engine log: attached "
                                  "with --connect)")
        w.banner.log.setVisible(bool(tail))
        w.banner.log_btn.setChecked(bool(tail))
        w.banner.setVisible(True)

    def restart(self) -> None:
        w = self.w
        w.chat.interrupt_all("interrupted: engine restarted")
        if w.link is not None:
            w.link.stop(timeout=1.0)
            w.link = None
        if w.supervisor is not None:
            w.supervisor.stop(timeout=3.0)
            w.supervisor = None
        self.bridge = None
        w.history.clear()
        w.charts.clear()
        w.block_map.clear()
        w.metric_history.clear()
        w.metric_charts.clear()
        w.kv_aggregate.clear()
        w.status.show_tiers({})
        w.status.show_decode_step("", "")
        w.remote.aliases.clear()
        w.load_panel.set_running(False)
        self.start()
