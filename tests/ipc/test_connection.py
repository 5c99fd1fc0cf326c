"""ipc/connection.py and the clients above it when the engine's connection is dropped.

A raw ROUTER plays the engine so the test can send what a real engine never sends: a reply over
the client's MAX_REPLY_MESSAGE_BYTES. ZeroMQ then closes that connection and the DEALER has
nowhere to queue; every client must say so instead of blocking on its next send.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from ipc import protocol as P
from ipc.async_client import AsyncEngineClient
from ipc.client import ERR_ENGINE_GONE, EngineClient, EngineConnection, EngineError
from tests.ipc.fake_engine import welcome_message


class OversizeReplier:
    """Welcomes a Hello; answers the first other message from each client with a reply 1 byte
    over the client's limit."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        answered: set[bytes] = set()
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            ident, data = self.router.recv_multipart()
            self.seen += 1
            if isinstance(P.decode_client(data), P.Hello):
                self.router.send_multipart([ident, P.encode(welcome_message())])
            elif ident not in answered:
                answered.add(ident)
                self.router.send_multipart([ident, b"\0" * (P.MAX_REPLY_MESSAGE_BYTES + 1)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.router.close()
        self.ctx.term()


@pytest.fixture
def replier():
    r = OversizeReplier()
    yield r
    r.close()


def _send_until_refused(send, attempts: int = 200) -> EngineError:
    """The drop is asynchronous: keep sending (0.05 s apart) until the client refuses."""
    for _ in range(attempts):
        try:
            send()
        except EngineError as err:
            return err
        threading.Event().wait(0.05)
    raise AssertionError("the client kept accepting sends on a dropped connection")


def test_connection_refuses_to_send_after_an_oversized_reply_dropped_it(replier) -> None:
    conn = EngineConnection(replier.endpoint)
    try:
        conn.send_hello()
        err = _send_until_refused(lambda: conn.submit_abort("r1"))
        assert err.code == ERR_ENGINE_GONE
        assert "16 MiB" in err.message and replier.endpoint in err.message
        assert [type(m) for m in conn.poll(0)] == [P.Welcome]  # never the oversized reply
        conn.track_request("r2", 1)  # a request in flight: its heartbeat cannot be sent either
        conn.heartbeat_interval = 0.0
        lost = conn.poll(0)
        assert [(type(m), m.code, m.request_id) for m in lost] == [(P.Error, ERR_ENGINE_GONE, "r2")]
        assert conn.active_requests == {}
        conn.close(goodbye=True)  # the goodbye's send must not block either
    finally:
        if not conn.dealer.closed:
            conn.close(goodbye=False)


def test_engine_client_fails_the_request_instead_of_hanging(replier) -> None:
    client = EngineClient(replier.endpoint, connect_timeout=5)
    try:
        messages: list[str] = []
        for _ in range(200):
            stream = client.generate(prompt=[1, 2, 3], max_tokens=2)
            try:
                stream.next_event(timeout=0.5)  # None: sent before the drop, never answered
            except EngineError as err:
                assert err.code == ERR_ENGINE_GONE
                messages.append(err.message)
                if "cannot send" in err.message:
                    break
        assert messages and "cannot send" in messages[-1], messages
    finally:
        client.close()


def test_async_client_marks_the_engine_gone(replier) -> None:
    async def scenario() -> tuple[str, str]:
        client = AsyncEngineClient(replier.endpoint)
        client.state = "ready"  # skip the hello: the fake never welcomes
        client._tasks.append(asyncio.create_task(client._read_dealer()))
        try:
            for _ in range(200):
                try:
                    await client.abort("r1")
                except EngineError as err:
                    return err.code, client.state
                await asyncio.sleep(0.05)
            raise AssertionError("the async client kept accepting sends on a dropped connection")
        finally:
            await client.close()

    code, state = asyncio.run(scenario())
    assert code == ERR_ENGINE_GONE and state == "gone"
