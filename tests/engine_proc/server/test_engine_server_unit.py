"""EngineServer in a thread of this process over a torch-free fake engine: tokens, liveness,
shutdown, the n-sequence bookkeeping. Fast; the real engine runs in test_server.py."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from engine_proc.server import engine_server as server_module
from engine_proc.server.config import ServerConfig
from engine_proc.server.engine_server import EngineServer
from ipc import client as client_module
from ipc import connection as connection_module
from ipc import protocol as P
from ipc.client import ERR_ENGINE_GONE, EngineClient, EngineConnection, EngineError
from tests.ipc.fake_engine import FakeEngine, welcome_message
from tests.ipc.helpers import raw_dealer, recv_msg

TOKEN = "a-long-enough-test-token"


class Running:
    def __init__(self, engine: FakeEngine, **cfg: object) -> None:
        self.engine = engine
        self.server = EngineServer(engine, ServerConfig(**cfg), context=zmq.Context())
        self.endpoint, self.pub_endpoint = self.server.bind()
        self.rc: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.rc = self.server.serve_forever()

    def stop(self) -> int | None:
        self.server.request_stop("test over")
        self.thread.join(10)
        return self.rc


@pytest.fixture()
def fake():
    r = Running(FakeEngine(step_sleep=0.002), heartbeat_interval=0.1, client_timeout=0.5)
    yield r
    assert r.stop() == 0


def _wait(pred, hang_guard: float = 60.0) -> None:
    """Until pred() holds; the guard only stops a hung test (it asserts no timing)."""
    deadline = time.monotonic() + hang_guard
    while not pred():
        assert time.monotonic() < deadline, "condition never reached"
        time.sleep(0.01)


def test_token_required_on_every_message_when_remote() -> None:
    r = Running(
        FakeEngine(),
        endpoint="tcp://0.0.0.0:*",
        pub_endpoint="tcp://0.0.0.0:*",
        allow_remote=True,
        token=TOKEN,
    )
    try:
        assert r.endpoint.startswith("tcp://127.0.0.1:")  # wildcard reported as loopback
        d = raw_dealer(r.endpoint)
        d.send(P.encode(P.Hello(protocol_version=P.PROTOCOL_VERSION)))
        assert recv_msg(d).code == P.ERR_UNAUTHORIZED
        d.send(P.encode(P.Generate(request_id="x", prompt="p", token="wrong")))
        err = recv_msg(d)
        assert err.code == P.ERR_UNAUTHORIZED and err.request_id == "x"
        d.close()
        with pytest.raises(EngineError):
            EngineClient(r.endpoint, connect_timeout=5)
        with EngineClient(r.endpoint, token=TOKEN) as c:
            s = c.generate("abc", max_tokens=3).result(10)
            assert s.text == "xxx" and s.finish.reason == "length"
            assert c.get_config().max_num_seqs == 8
    finally:
        assert r.stop() == 0


def test_remote_bind_refused_without_flag() -> None:
    with pytest.raises(ValueError, match="allow-remote"):
        ServerConfig(endpoint="tcp://0.0.0.0:*")
    with pytest.raises(ValueError, match="token"):
        ServerConfig(endpoint="tcp://0.0.0.0:*", allow_remote=True)


class FrozenClock:
    """The server's clock (engine_proc.server.engine_server's time.monotonic), moved only by the
    test: client silence is measured on it, so liveness is checked with no wall-clock timing. Its
    values are multiples of 1/8, exact in binary floating point."""

    def __init__(self) -> None:
        self.now = 1024.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture()
def clocked_server(monkeypatch):
    """Start servers (FakeEngine, ServerConfig keywords) whose clock stands still."""
    clock = FrozenClock()
    monkeypatch.setattr(server_module, "time", SimpleNamespace(monotonic=clock.monotonic))
    started: list[Running] = []

    def start(**cfg: object) -> Running:
        cfg = {"heartbeat_interval": 0.125, "client_timeout": 0.5, **cfg}
        r = Running(FakeEngine(step_sleep=0.002), **cfg)
        r.clock = clock
        started.append(r)
        return r

    yield start
    for r in started:
        assert r.stop() == 0


@pytest.fixture()
def clocked(clocked_server):
    return clocked_server()


def _wait_heartbeat(sock, at: float) -> None:
    """Read a raw DEALER until the server's heartbeat stamped `at` (its clock) arrives."""
    while not (isinstance(msg := recv_msg(sock, timeout=60), P.Heartbeat) and msg.time == at):
        pass


def _server_turn(probe) -> None:
    """Return once the server loop has finished what it was doing: two round trips in a row
    from another client (the second is answered in a later turn of the loop than the first)."""
    for i in range(2):
        probe.send(P.encode(P.Abort(request_id=f"probe-{i}")))
        assert recv_msg(probe, timeout=60).code == P.ERR_UNKNOWN_REQUEST


def test_client_silent_past_client_timeout_is_aborted_heartbeats_keep_it(clocked) -> None:
    """docs/PROTOCOL.md section 5 on the server's own clock: right after each heartbeat it sends
    (every heartbeat_interval, 0.125 s here) the server checks silence; a client heard from
    within client_timeout (0.5 s) keeps its requests, one silent for longer loses them and
    their blocks."""
    server, clock, engine = clocked.server, clocked.clock, clocked.engine
    routing_id = b"silence-test"
    d = raw_dealer(clocked.endpoint, routing_id=routing_id)
    probe = raw_dealer(clocked.endpoint)
    d.send(
        P.encode(
            P.Generate(
                request_id="quiet", prompt="abcd", sampling=P.SamplingOptions(max_tokens=10**6)
            )
        )
    )
    assert isinstance(recv_msg(d), P.Delta)
    # 2.5 s of server clock (five client timeouts), heard from every 0.25 s.
    for _ in range(10):
        clock.now += 0.25
        _wait_heartbeat(d, clock.now)  # one heartbeat (and silence check) per move of the clock
        d.send(P.encode(P.Heartbeat()))
        _wait(lambda: server._clients[routing_id].last_seen == clock.now)
    # Silent from here: checked at 0.25 s and at exactly client_timeout, it keeps its request...
    for _ in range(2):
        clock.now += 0.25
        _wait_heartbeat(d, clock.now)
    _server_turn(probe)
    assert "quiet" in engine.requests and routing_id in server._clients
    # ... but not past it.
    clock.now += 0.125
    _wait(lambda: not engine.requests)
    assert routing_id not in server._clients
    assert len(engine.free) == engine.num_blocks
    d.close()
    probe.close()


def test_goodbye_aborts_at_once(clocked) -> None:
    d = raw_dealer(clocked.endpoint)
    d.send(
        P.encode(
            P.Generate(request_id="g", prompt="abcd", sampling=P.SamplingOptions(max_tokens=10**6))
        )
    )
    assert isinstance(recv_msg(d), P.Delta)
    # The socket stays open and the server clock stands still: only the goodbye can end it.
    d.send(P.encode(P.Goodbye(reason="done")))
    _wait(lambda: not clocked.engine.requests)
    assert len(clocked.engine.free) == clocked.engine.num_blocks
    d.close()


def test_connection_poll_api(fake) -> None:
    conn = EngineConnection(fake.endpoint, pub_endpoint=fake.pub_endpoint, subscribe=True)
    w = conn.hello(5)
    assert w.model.name == "fake" and w.pub_endpoint == fake.pub_endpoint
    rids = [conn.submit_generate(prompt="ab", sampling={"max_tokens": 3}) for _ in range(4)]
    cid = conn.submit_control("set_limits", max_num_seqs=3)
    finished, acks, telemetry = set(), [], 0
    deadline = time.monotonic() + 60  # a hang guard: the loop ends when everything arrived
    while (len(finished) < 4 or not acks or not telemetry) and time.monotonic() < deadline:
        for msg in conn.poll(100):
            if isinstance(msg, P.Finish):
                finished.add(msg.request_id)
            elif isinstance(msg, P.ControlAck):
                acks.append(msg)
            elif isinstance(msg, P.Telemetry):
                telemetry += 1
    assert finished == set(rids) and not conn.active_requests
    assert acks[0].control_id == cid and acks[0].config.max_num_seqs == 3
    assert telemetry >= 1
    conn.close()


def test_shutdown_finishes_in_flight_with_abort() -> None:
    r = Running(FakeEngine(step_sleep=0.002))
    c = EngineClient(r.endpoint)
    streams = [c.generate("abcd", max_tokens=10**6) for _ in range(3)]
    for s in streams:
        assert isinstance(next(s), P.Delta)
    other = EngineClient(r.endpoint)
    ack = other.shutdown()
    assert ack.op == "shutdown"
    for s in streams:
        s.result(10)
        assert s.finish.reason == "abort" and "shutting down" in s.finish.error
    r.thread.join(10)
    assert r.rc == 0 and not r.engine.requests
    assert len(r.engine.free) == r.engine.num_blocks
    _wait(lambda: bool(c._engine_gone))  # the engine's goodbye reached the client
    with pytest.raises(EngineError) as info:
        c.generate("abcd", max_tokens=2)
    assert "goodbye" in info.value.message
    c.close()
    other.close()


def test_bad_endpoint_fails_fast() -> None:
    with pytest.raises(EngineError):
        EngineClient("no-such-transport://x", connect_timeout=5)


def test_engine_step_failure_fails_requests_not_the_loop(fake) -> None:
    with EngineClient(fake.endpoint) as c:
        original = fake.engine.step
        calls = {"n": 0}

        def broken():
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("boom")
            return original()

        fake.engine.step = broken
        s = c.generate("abcd", max_tokens=5)
        s.result(10)
        assert s.finish.reason == "error" and "boom" in s.finish.error
        assert c.generate("abcd", max_tokens=2).result(10).text == "xx"


# ----------------------------------------------------------------- documented refusals


def _generate(rid: str, max_tokens: int = 10**6, prompt: str = "abcd") -> bytes:
    return P.encode(
        P.Generate(request_id=rid, prompt=prompt, sampling=P.SamplingOptions(max_tokens=max_tokens))
    )


def test_overloaded_past_max_pending_until_a_request_ends(clocked_server) -> None:
    r = clocked_server(max_pending=2)
    d = raw_dealer(r.endpoint)
    d.send(P.encode(P.Control(op="pause")))  # no deltas: the next reply is the refusal
    assert isinstance(recv_msg(d), P.ControlAck)
    d.send(_generate("a"))
    d.send(_generate("b"))
    d.send(_generate("c"))
    err = recv_msg(d, timeout=60)
    assert isinstance(err, P.Error) and (err.code, err.request_id) == (P.ERR_OVERLOADED, "c")
    assert "max_pending" in err.message
    assert set(r.engine.requests) == {"a", "b"}  # c never started
    d.send(P.encode(P.Abort(request_id="a")))
    d.send(_generate("c"))
    _wait(lambda: "c" in r.engine.requests)
    d.close()


def test_generate_while_shutting_down_is_refused_then_goodbye() -> None:
    engine = FakeEngine()
    ctx = zmq.Context()
    server = EngineServer(engine, ServerConfig(), context=ctx)
    endpoint, _ = server.bind()
    d = raw_dealer(endpoint, ctx=ctx)
    try:
        d.send(_generate("late"))
        assert server.router.poll(60_000)  # it has arrived, not yet read
        server.request_stop("test stop")
        assert server.serve_forever() == 0  # stops at once: answers what arrived, says goodbye
        err = recv_msg(d)
        assert (err.code, err.request_id) == (P.ERR_SHUTTING_DOWN, "late")
        assert isinstance(bye := recv_msg(d), P.Goodbye) and bye.reason == "test stop"
        assert not engine.requests
    finally:
        d.close()
        ctx.term()


def test_engine_bugs_are_internal_errors_and_the_server_keeps_serving(fake) -> None:
    engine = fake.engine
    add = engine.add_request

    def add_broken(rid, *args, **kwargs):
        if rid == "bug":
            raise RuntimeError("add_request exploded")
        return add(rid, *args, **kwargs)

    def set_limits_broken(**kwargs):
        raise KeyError("set_limits exploded")

    engine.add_request = add_broken
    engine.set_limits = set_limits_broken
    with EngineClient(fake.endpoint) as c:
        with pytest.raises(EngineError) as info:
            c.generate("abcd", request_id="bug", max_tokens=3).result(60)
        assert info.value.code == P.ERR_INTERNAL and info.value.request_id == "bug"
        assert "add_request exploded" in info.value.message
        with pytest.raises(EngineError) as info:
            c.set_limits(max_num_seqs=2)
        assert info.value.code == P.ERR_INTERNAL and "set_limits exploded" in info.value.message
        # A handler that fails outright (this fake engine has no tokenizer): the message's
        # request_id still comes back with the error.
        d = raw_dealer(fake.endpoint)
        d.send(P.encode(P.Tokenize(request_id="tok", prompt="abc")))
        err = recv_msg(d)
        assert (err.code, err.request_id) == (P.ERR_INTERNAL, "tok")
        d.close()
        assert c.generate("abcd", max_tokens=2).result(60).text == "xx"
    assert not engine.requests


def test_reconnecting_client_keeps_its_requests(clocked_server) -> None:
    """ROUTER_HANDOVER: a new connection with the same routing id takes over the requests of the
    old one, even while the old connection still looks alive (a half-open TCP link). The engine
    is paused and its clock frozen: nothing is sent while the two connections swap."""
    r = clocked_server()
    routing_id = b"k-reconnect-1"
    a = raw_dealer(r.endpoint, routing_id=routing_id)
    a.send(_generate("kept", max_tokens=40))
    assert isinstance(recv_msg(a), P.Delta)
    with EngineClient(r.endpoint) as control:
        control.pause()
        b = raw_dealer(r.endpoint, routing_id=routing_id)
        b.send(P.encode(P.Control(op="get_config", control_id="here")))
        assert isinstance(recv_msg(b, timeout=60), P.ControlAck)  # the server routes to b now
        a.close(linger=0)
        control.resume()
        while not isinstance(msg := recv_msg(b, timeout=60), P.Finish):
            assert isinstance(msg, P.Delta | P.Heartbeat), msg
        assert (msg.request_id, msg.reason, msg.usage.completion_tokens) == ("kept", "length", 40)
    b.close()


@pytest.mark.slow
def test_client_that_never_reads_is_dropped(clocked_server) -> None:
    """A client that leaves ROUTER_SNDHWM (100,000) replies unread counts as gone: its requests
    are aborted. inproc has no socket buffers between the two queues, and the frozen clock rules
    out the silence timeout."""
    r = clocked_server(endpoint="inproc://never-reads", pub_endpoint="inproc://never-reads-pub")
    r.engine.limits["max_num_seqs"] = 64
    d = r.server.ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.RCVHWM, 1)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.ROUTING_ID, b"k-never-reads")
    d.connect(r.endpoint)
    for i in range(64):
        d.send(_generate(f"r{i}"))
    _wait(lambda: len(r.engine.requests) == 64)
    _wait(lambda: b"k-never-reads" not in r.server._clients, hang_guard=120)
    _wait(lambda: not r.engine.requests)
    assert len(r.engine.free) == r.engine.num_blocks
    d.close()


def test_client_refuses_a_message_over_the_engine_limit(fake) -> None:
    with EngineClient(fake.endpoint) as c:
        big = "x" * (P.MAX_CLIENT_MESSAGE_BYTES + 1)
        with pytest.raises(EngineError) as info:
            c.generate(big, max_tokens=2).result(60)
        assert info.value.code == P.ERR_INVALID_MESSAGE
        assert f"limit of {P.MAX_CLIENT_MESSAGE_BYTES} bytes" in info.value.message
        assert c.generate("abcd", max_tokens=2).result(60).text == "xx"  # the client goes on


# ----------------------------------------------------------------- the client's side


class MuteEngine:
    """A ROUTER that welcomes clients and then sends only what the test gives it."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.peer = b""
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            if self.sock.poll(10):
                peer, data = self.sock.recv_multipart()
                self.peer, msg = peer, P.decode_client(data)
                if isinstance(msg, P.Hello):
                    self._send(welcome_message())
                self.inbox.put(msg)
            while not self.outbox.empty():
                self._send(self.outbox.get())

    def _send(self, msg) -> None:
        self.sock.send_multipart([self.peer, P.encode(msg)])

    def next_of(self, kind: type, pred=lambda m: True):
        while not (isinstance(msg := self.inbox.get(timeout=60), kind) and pred(msg)):
            pass
        return msg

    def close(self) -> None:
        self.running = False
        self.thread.join(10)
        self.sock.close()
        self.ctx.term()


def test_client_gives_up_on_a_silent_engine_not_on_a_talking_one(monkeypatch) -> None:
    """EngineClient with a request in flight treats the engine as gone after
    max(3 heartbeat intervals, client_timeout) = 0.5 s without any message from it, on the
    client's own (here frozen) clock."""
    clock = FrozenClock()
    for module in (client_module, connection_module):
        monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=clock.monotonic))
    mute = MuteEngine()
    try:
        with EngineClient(mute.endpoint, connect_timeout=60) as c:
            stream = c.generate("abcd", request_id="r", max_tokens=100)
            mute.next_of(P.Generate)
            # 2 s of client clock (four timeouts), with a delta every 0.25 s: it keeps waiting.
            for i in range(8):
                clock.now += 0.25
                mute.outbox.put(
                    P.Delta(request_id="r", index=0, token_ids=[1], text="x",
                            token_times=[0.0], time=0.0)
                )  # fmt: skip
                assert isinstance(stream.next_event(timeout=60), P.Delta), i
            # Then nothing more: past 0.5 s of silence the stream ends with an error.
            clock.now += 0.75
            with pytest.raises(EngineError) as info:
                stream.next_event(timeout=60)
            assert info.value.code == ERR_ENGINE_GONE
            assert "no message from the engine" in info.value.message
    finally:
        mute.close()


def test_replies_up_to_16_mib_reach_the_client(fake) -> None:
    """docs/PROTOCOL.md section 1: clients accept replies up to 16 MiB, far above the 1 MiB the
    engine accepts from them (the Python client's DEALER sets ZMQ_MAXMSGSIZE to that)."""
    fake.engine.detokenize = lambda ids: "y" * ids[0]  # a reply of the size the client asks for
    conn = EngineConnection(fake.endpoint)
    try:
        for chars in (P.MAX_CLIENT_MESSAGE_BYTES + 1, P.MAX_REPLY_MESSAGE_BYTES - 1024):
            conn.send(P.Detokenize(request_id=f"r{chars}", token_ids=[chars]))
            got: list[P.Tokenized] = []
            for _ in range(600):  # a hang guard, polled in 0.1 s steps
                got += [m for m in conn.poll(100) if isinstance(m, P.Tokenized)]
                if got:
                    break
            assert [(m.request_id, len(m.text)) for m in got] == [(f"r{chars}", chars)]
    finally:
        conn.close(goodbye=False)  # (a dropped connection would block the goodbye's send)
