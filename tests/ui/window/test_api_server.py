"""*Engine → Serve OpenAI API…*: the window runs `python -m app serve` against its own engine (a
real tiny engine process, one per module). Checked against the outside world: an HTTP client's
request shows up in the request table with origin "http", the process is gone and the port free
after the toggle goes off, a taken port is reported, an engine restart moves the server along."""

from __future__ import annotations

import os
import socket
import threading

import httpx
import pytest
from PySide6.QtWidgets import QApplication

from tests.ui.conftest import window_on_tiny_engine
from ui.kv.request_table import TABLE_COLUMNS
from ui.window import api_server as api
from ui.window.main_window import MainWindow, wait_until

ENGINE_ARGS = ("--num-kv-blocks", "64", "--max-model-len", "512")
ORIGIN_COL = TABLE_COLUMNS.index("origin")


@pytest.fixture(scope="module")
def win(qapp, tmp_path_factory):
    with window_on_tiny_engine(tmp_path_factory.mktemp("kvscope-data"), *ENGINE_ARGS,
                               show=True) as w:
        yield w


def _toggle_on(win: MainWindow, qtbot, port: int) -> None:
    assert win.api.state == api.OFF and not win.api_action.isChecked()
    win.api_action.trigger()
    dialog = win.api_dialog
    assert dialog is not None and dialog.isVisible()
    dialog.port.setValue(port)
    dialog.accept()


def _wait_serving(win: MainWindow, qtbot) -> str:
    qtbot.waitUntil(lambda: win.api.state != api.STARTING, timeout=60_000)
    assert win.api.state == api.SERVING, (win.api.last_error, win.api.last_tail)
    text = win.api_label.text()
    assert win.api_label.isVisible() and text.startswith("API http://127.0.0.1:"), text
    url = text.split()[1]
    assert url.endswith("/v1")
    base = url[: -len("/v1")]
    # Listening comes before attaching to the engine: wait until /health says it serves.
    qtbot.waitUntil(lambda: _health(base) == 200, timeout=60_000)
    return base


def _health(base: str) -> int:
    try:
        return httpx.get(base + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _table_origins(win: MainWindow) -> dict[str, str]:
    t = win.block_map.table
    return {t.item(r, 0).text(): t.item(r, ORIGIN_COL).text() for r in range(t.rowCount())
            if t.item(r, 0) is not None and t.item(r, ORIGIN_COL) is not None}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _paused(win: MainWindow, value: bool) -> bool:
    f = win.history.latest
    return f is not None and bool(f.config.get("paused")) == value


def test_command_and_environment():
    cmd = api.api_command("tcp://127.0.0.1:5557", 8123, python="/py")
    assert cmd == ["/py", "-m", "app", "serve", "--connect", "tcp://127.0.0.1:5557",
                   "--port", "8123"]
    with pytest.raises(ValueError, match="port"):
        api.api_command("tcp://127.0.0.1:5557", 70000)
    base = {"PATH": "/bin", "KVSCOPE_API_KEY": "from-the-shell", "KVSCOPE_TOKEN": "old"}
    env = api.api_env(None, None, base)
    # a blank key in the dialog means no key, whatever the shell exported
    assert "KVSCOPE_API_KEY" not in env and "KVSCOPE_TOKEN" not in env and env["PATH"] == "/bin"
    env = api.api_env("tok", "sekrit", base)
    assert env["KVSCOPE_API_KEY"] == "sekrit" and env["KVSCOPE_TOKEN"] == "tok"
    assert base["KVSCOPE_API_KEY"] == "from-the-shell"  # not modified


def test_server_follows_the_endpoint_without_an_engine(qtbot):
    """The state machine alone: `app serve --connect` listens before any engine answers."""
    server = api.ApiServer()
    server.start(0)
    assert server.state == api.WAITING and server.pid is None  # no endpoint known yet
    server.set_endpoint("tcp://127.0.0.1:9")
    qtbot.waitUntil(lambda: server.state != api.STARTING, timeout=60_000)
    assert server.state == api.SERVING, (server.last_error, server.last_tail)
    first_pid, url = server.pid, server.url
    assert url is not None and url.startswith("http://127.0.0.1:")
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503  # no engine behind it
    moved: list[str] = []
    server.restarted.connect(moved.append)
    server.set_endpoint("tcp://127.0.0.1:10")
    qtbot.waitUntil(lambda: server.state == api.SERVING and server.pid != first_pid,
                    timeout=60_000)
    assert moved == ["tcp://127.0.0.1:10"] and server.url == url and _gone(first_pid)
    assert server.served_endpoint == "tcp://127.0.0.1:10"
    pid = server.pid
    server.stop()
    qtbot.waitUntil(lambda: server.state == api.OFF, timeout=30_000)
    assert _gone(pid) and _port_free(int(url.rsplit(":", 1)[1]))


@pytest.mark.slow
def test_http_requests_show_in_the_table_with_their_origin(win, qtbot):
    _toggle_on(win, qtbot, 0)
    url = _wait_serving(win, qtbot)
    pid = win.api.pid
    assert pid is not None and win.api.served_endpoint == win.engine_endpoint
    port = int(url.rsplit(":", 1)[1])
    assert int(win.settings.value("api/port")) == 0  # remembered (the key never is)
    assert "0 HTTP in flight" in win.api_label.text()

    # Paused, the engine holds both requests waiting: they stay in the telemetry (and the table)
    # however fast or slow this machine is.
    win.link.control("pause")
    qtbot.waitUntil(lambda: _paused(win, True), timeout=30_000)
    result: dict = {}

    def post() -> None:
        try:
            result["r"] = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "prompt": "hi", "max_tokens": 40, "ignore_eos": True})
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            result["r"] = exc

    t = threading.Thread(target=post, daemon=True)
    t.start()
    win.chat.new_conversation()
    win.chat.max_tokens.setValue(8)
    win.chat.input.setPlainText("Hello from the window.")
    chat_rid = win.chat.send_current()
    assert chat_rid is not None
    wait_until(lambda: sorted(_table_origins(win).values()) == ["gui", "http"], 30,
               QApplication.instance())
    origins = _table_origins(win)
    assert sorted(origins.values()) == ["gui", "http"], origins
    assert origins[chat_rid] == "gui"
    http_rid = next(rid for rid, o in origins.items() if o == "http")
    assert http_rid != chat_rid
    qtbot.waitUntil(lambda: "1 HTTP in flight" in win.api_label.text(), timeout=10_000)

    win.link.control("resume")
    t.join(120)
    r = result.get("r")
    assert isinstance(r, httpx.Response) and r.status_code == 200, r
    assert r.json()["usage"]["completion_tokens"] == 40
    qtbot.waitUntil(lambda: "0 HTTP in flight" in win.api_label.text(), timeout=30_000)
    qtbot.waitUntil(lambda: not win.chat.busy(), timeout=60_000)

    # off: the process is gone and the port free again
    win.api_action.trigger()
    assert not win.api_action.isChecked()
    qtbot.waitUntil(lambda: win.api.state == api.OFF, timeout=30_000)
    assert _gone(pid) and _port_free(port)
    assert not win.api_label.isVisible()


@pytest.mark.slow
def test_cancelling_the_dialog_starts_nothing(win, qtbot):
    win.api_action.trigger()
    assert win.api_action.isChecked() and win.api_dialog is not None
    win.api_dialog.reject()
    assert not win.api_action.isChecked() and win.api_dialog is None
    assert win.api.state == api.OFF and win.api.pid is None and not win.api_label.isVisible()


@pytest.mark.slow
def test_a_taken_port_is_reported_and_the_toggle_goes_off(win, qtbot):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        _toggle_on(win, qtbot, port)
        qtbot.waitUntil(lambda: win.api.state == api.OFF, timeout=60_000)
    assert not win.api_action.isChecked() and not win.api_label.isVisible()
    box = win.api_error_box
    assert box is not None and box.isVisible()
    assert "could not start" in box.text()
    assert f"{port}" in box.informativeText() and "in use" in box.informativeText()
    box.close()


@pytest.mark.slow
def test_an_engine_restart_moves_the_server_to_the_new_engine(win, qtbot):
    _toggle_on(win, qtbot, 0)
    url = _wait_serving(win, qtbot)
    old_endpoint, old_pid = win.engine_endpoint, win.api.pid
    shown: list[str] = []  # the window's slot runs first: the label as each state showed it
    win.api.state_changed.connect(lambda _state: shown.append(win.api_label.text()))
    win.restart_engine()
    qtbot.waitUntil(lambda: win.state in ("ready", "busy")
                    and win.engine_endpoint != old_endpoint, timeout=180_000)
    qtbot.waitUntil(lambda: win.api.state == api.SERVING and win.api.pid != old_pid,
                    timeout=60_000)
    assert win.api.served_endpoint == win.engine_endpoint
    assert _wait_serving(win, qtbot) == url  # same port: clients keep their URL
    assert _gone(old_pid)
    assert shown[:2] == ["API restarting for the new engine…", "API starting…"], shown
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_closing_the_window_stops_the_server(win, qtbot):
    if win.api.state == api.OFF:
        _toggle_on(win, qtbot, 0)
    url = _wait_serving(win, qtbot)
    pid = win.api.pid
    box = win.api_error_box
    win.close()
    assert win.api.state == api.OFF and _gone(pid)
    assert _port_free(int(url.rsplit(":", 1)[1]))
    qtbot.wait(500)  # the child's exit arrives late: it was asked to stop, so no error
    assert win.api_error_box is box and win.api.state == api.OFF and not win.api.last_error
