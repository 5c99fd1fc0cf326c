"""The Qt-free parts of the app: conversation files, the load generator, the supervisor's line
protocol and process handling, and subcommand dispatch."""

from __future__ import annotations

import json
import sys
import threading

import pytest

from app import __main__ as app_main
from app.conversations import Conversation, ConversationStore, Message
from app.load_generator import ID_PREFIX, LoadConfig, LoadGenerator, drive
from app.supervisor import EngineSupervisor, parse_line
from ipc import protocol as P
from tests.ui.conftest import DictSettings


def test_conversations_round_trip_and_bad_files(tmp_path):
    store = ConversationStore(tmp_path)
    c = Conversation(title="naïve ünïcode ✓", system_prompt="be brief")
    c.append(Message("user", "hello"))
    c.append(Message("assistant", "hi", stats={"ttft": 0.1, "prompt_tokens": 5}, interrupted=True))
    c.draft = "half-typed"
    store.save(c)
    (tmp_path / "broken.json").write_text("{not json")
    (loaded,) = store.load_all()
    assert loaded == c
    assert (tmp_path / "broken.json.bad").exists()  # set aside, not fatal
    assert json.loads((tmp_path / f"{c.id}.json").read_text())["version"] == 2
    assert loaded.to_prompt() == [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "hello"},
                                  {"role": "assistant", "content": "hi"}]
    store.delete(c.id)
    assert store.load_all() == []
    with pytest.raises(ValueError, match="conversation id"):
        store.path_for("../etc/passwd")
    with pytest.raises(ValueError, match="role"):
        Message("robot", "x")


class FakeConn:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def submit_generate(self, rid, *, messages, sampling):
        self.sent.append((rid, messages, sampling))


def test_load_generator_keeps_n_in_flight():
    gen = LoadGenerator(LoadConfig(concurrency=5, system_prompt_tokens=64, min_output_tokens=4,
                                   max_output_tokens=9, seed=1))
    conn = FakeConn()
    drive(conn, gen, [])
    assert not conn.sent  # not started
    gen.start()
    drive(conn, gen, [])
    assert len(conn.sent) == 5 and len(gen.in_flight) == 5
    systems = {m[0]["content"] for _, m, _ in conn.sent}
    users = {m[1]["content"] for _, m, _ in conn.sent}
    assert len(systems) == 1 and len(next(iter(systems)).split()) >= 50  # one shared prefix
    assert len(users) > 1  # varied turns
    assert all(4 <= s["max_tokens"] <= 9 and s["ignore_eos"] for _, _, s in conn.sent)
    assert all(r.startswith(ID_PREFIX) for r, _, _ in conn.sent)
    rid = conn.sent[0][0]
    usage = P.Usage(prompt_tokens=70, cached_tokens=64, completion_tokens=4)
    msgs = [P.Delta(request_id=rid, index=0, token_ids=[1, 2], text="ab", token_times=[0, 0],
                    time=0.0),
            P.Finish(request_id=rid, index=0, reason="length", usage=usage),
            P.Finish(request_id="chat-not-ours", index=0, reason="stop", usage=usage),
            P.Error(code=P.ERR_INVALID_REQUEST, message="x", request_id=conn.sent[1][0])]
    drive(conn, gen, msgs)
    assert len(conn.sent) == 7 and len(gen.in_flight) == 5  # two replaced
    assert (gen.stats.finished, gen.stats.errors, gen.stats.generated_tokens) == (1, 1, 2)
    assert gen.stats.cached_tokens == 64
    left = gen.stop()
    assert sorted(left) == sorted(gen.in_flight) and len(left) == 5
    drive(conn, gen, [])
    assert len(conn.sent) == 7  # stopped: nothing new
    with pytest.raises(ValueError, match="concurrency"):
        LoadConfig(concurrency=0)
    with pytest.raises(ValueError, match="min_output_tokens"):
        LoadConfig(min_output_tokens=10, max_output_tokens=5)


def test_parse_line():
    assert parse_line("KVSCOPE_PROGRESS 0.42 dequantizing blk.1\n") == \
        ("progress", (0.42, "dequantizing blk.1"))
    kind, info = parse_line('KVSCOPE_READY {"endpoint": "tcp://127.0.0.1:5", "pid": 3}\n')
    assert kind == "ready" and info["endpoint"] == "tcp://127.0.0.1:5"
    assert parse_line("KVSCOPE_READY {oops")[0] == "log"
    assert parse_line("KVSCOPE_PROGRESS x y")[0] == "log"
    assert parse_line("plain text\n") == ("log", "plain text")


def test_supervisor_reports_progress_ready_and_exit(tmp_path):
    script = (
        "import sys, time\n"
        "print('KVSCOPE_PROGRESS 0.50 half', flush=True)\n"
        "print('KVSCOPE_READY {\"endpoint\": \"tcp://127.0.0.1:9\"}', flush=True)\n"
        "print('some log', file=sys.stderr, flush=True)\n"
        "print('Traceback: boom', file=sys.stderr, flush=True)\n"
        "sys.exit(3)\n"
    )
    got: dict = {"progress": []}
    done = threading.Event()
    sup = EngineSupervisor(
        [sys.executable, "-c", script],
        on_progress=lambda f, m: got["progress"].append((f, m)),
        on_ready=lambda info: got.__setitem__("ready", info),
        on_exit=lambda code: (got.__setitem__("code", code), done.set()),
        log_file=tmp_path / "engine.log",
    )
    sup.start()
    assert done.wait(30)
    assert got["progress"] == [(0.5, "half")]
    assert got["ready"] == {"endpoint": "tcp://127.0.0.1:9"}
    assert got["code"] == 3
    tail = sup.tail(5)
    assert "Traceback: boom" in tail and tail[-1] == "[engine exited with code 3]"
    assert "Traceback: boom" in (tmp_path / "engine.log").read_text()


def test_supervisor_stop_terminates(tmp_path):
    sup = EngineSupervisor([sys.executable, "-c", "import time; time.sleep(60)"])
    sup.start()
    assert sup.running()
    code = sup.stop(timeout=5)
    assert code is not None and not sup.running()


def test_subcommands_are_lazy(monkeypatch, capsys):
    monkeypatch.setitem(app_main.SUBCOMMANDS, "bench", "app.no_such_module_for_test")
    assert app_main.main(["bench", "--help"]) == 2
    assert "unavailable" in capsys.readouterr().err
    called = {}
    fake = type(sys)("fake_sub")
    fake.main = lambda argv: called.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "fake_sub", fake)
    monkeypatch.setitem(app_main.SUBCOMMANDS, "chat", "fake_sub")
    assert app_main.main(["chat", "-x"]) == 0
    assert called["argv"] == ["-x"]


def test_engine_options_remember_flags_and_ignore_stale_settings():
    from app.supervisor import EngineOptions

    parse = app_main.build_parser().parse_args
    settings = DictSettings({})
    opts = app_main._engine_options(parse(["--decode-weights", "int4"]), settings)
    assert isinstance(opts, EngineOptions) and opts.decode_weights == "int4"
    assert "--decode-weights" in opts.to_args() and "int4" in opts.to_args()
    # Next start without the flag: remembered.
    assert app_main._engine_options(parse([]), settings).decode_weights == "int4"
    # A stale or hand-edited value is dropped instead of crashing the engine at start.
    bad = DictSettings({"engine/decode_weights": "int3", "engine/dtype": "float8"})
    opts = app_main._engine_options(parse([]), bad)
    assert opts.decode_weights == "auto" and opts.dtype is None  # the app's default
    assert opts.to_args()[opts.to_args().index("--decode-weights") + 1] == "auto"


def test_kv_events_config_reaches_the_spawned_engine_and_is_not_remembered():
    from app.api.keeper import engine_options
    from app.serve import build_parser, check_security

    cfg = '{"enable_kv_cache_events": true, "topic": "kv"}'
    parse, settings = app_main.build_parser().parse_args, DictSettings({})
    args = app_main._engine_options(parse(["--kv-events-config", cfg]), settings).to_args()
    assert args[args.index("--kv-events-config") + 1] == cfg  # the window's engine
    assert "--kv-events-config" not in app_main._engine_options(parse([]), settings).to_args()
    serve = build_parser().parse_args(["--kv-events-config", cfg])
    args = engine_options(serve).to_args()
    assert args[args.index("--kv-events-config") + 1] == cfg  # kvscope serve's engine
    assert "--kv-events-config" not in engine_options(build_parser().parse_args([])).to_args()
    both = build_parser().parse_args(["--kv-events-config", cfg, "--disaggregated"])
    assert "--kv-events-config" in (check_security(both, []) or "")


def test_decode_activations_reach_the_engines_of_serve_and_chat():
    from app.api.keeper import engine_options
    from app.chat import build_parser as chat_parser
    from app.serve import build_parser

    args = engine_options(build_parser().parse_args(["--decode-activations", "int8"])).to_args()
    assert args[args.index("--decode-activations") + 1] == "int8"
    # the apps' default: llama.cpp's arithmetic where our kernels run it, else exact
    args = engine_options(build_parser().parse_args([])).to_args()
    assert args[args.index("--decode-activations") + 1] == "auto"
    assert chat_parser().parse_args(["--decode-activations", "int8"]).decode_activations == "int8"
    assert chat_parser().parse_args([]).decode_activations == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--decode-activations", "int4"])


def _cpuinfo(cores: int, threads_per_core: int) -> str:
    return "\n\n".join(f"processor\t: {i}\nphysical id\t: 0\ncore id\t\t: {i // threads_per_core}"
                       for i in range(cores * threads_per_core))


def test_gui_engine_threads_leave_the_window_a_core():
    from app.supervisor import gui_engine_threads

    assert gui_engine_threads(_cpuinfo(2, 1), logical=2) == 1  # this CI machine's shape
    assert gui_engine_threads(_cpuinfo(8, 1), logical=8) == 7
    assert gui_engine_threads(_cpuinfo(4, 2), logical=8) == 4  # SMT siblings serve the GUI
    assert gui_engine_threads("", logical=1) == 1
    assert gui_engine_threads("", logical=6) == 5
    opts = app_main._engine_options(app_main.build_parser().parse_args([]), DictSettings({}))
    assert opts.num_threads >= 1 and "--num-threads" in opts.to_args()
