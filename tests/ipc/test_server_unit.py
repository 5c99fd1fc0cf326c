"""EngineServer in a thread of this process over a torch-free fake engine: tokens, liveness,
shutdown, the n-sequence bookkeeping. Fast; the real engine runs in test_server.py."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from engine_proc.server import EngineServer, ServerConfig
from ipc import protocol as P
from ipc.client import EngineClient, EngineConnection, EngineError
from tests.ipc.fake_engine import FakeEngine
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


def _wait(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
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


def test_silent_client_is_aborted_and_blocks_freed(fake) -> None:
    d = raw_dealer(fake.endpoint)
    d.send(
        P.encode(
            P.Generate(
                request_id="quiet", prompt="abcd", sampling=P.SamplingOptions(max_tokens=10**6)
            )
        )
    )
    assert isinstance(recv_msg(d), P.Delta)
    assert fake.engine.requests
    # The raw socket never heartbeats: past client_timeout (0.5 s) the request is aborted.
    _wait(lambda: not fake.engine.requests)
    assert len(fake.engine.free) == fake.engine.num_blocks
    d.close()


def test_heartbeating_client_keeps_its_request(fake) -> None:
    conn = EngineConnection(fake.endpoint)
    conn.hello(5)
    rid = conn.submit_generate(prompt="abcd", sampling={"max_tokens": 10**6})
    heartbeats = 0
    deadline = time.monotonic() + 1.5  # three client timeouts
    while time.monotonic() < deadline:
        for msg in conn.poll(50):
            heartbeats += isinstance(msg, P.Heartbeat)
    assert rid in fake.engine.requests and heartbeats >= 5
    conn.close()  # goodbye: aborted at once
    _wait(lambda: not fake.engine.requests, timeout=1.0)
    assert len(fake.engine.free) == fake.engine.num_blocks


def test_connection_poll_api(fake) -> None:
    conn = EngineConnection(fake.endpoint, pub_endpoint=fake.pub_endpoint, subscribe=True)
    w = conn.hello(5)
    assert w.model.name == "fake" and w.pub_endpoint == fake.pub_endpoint
    rids = [conn.submit_generate(prompt="ab", sampling={"max_tokens": 3}) for _ in range(4)]
    cid = conn.submit_control("set_limits", max_num_seqs=3)
    finished, acks, telemetry = set(), [], 0
    deadline = time.monotonic() + 10
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
