"""The engine server process against bad input: named request errors, fuzzed messages (each
gets its documented error while a good client is served), abort floods, oversize frames."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc import protocol as P
from ipc.client import EngineClient, EngineError
from tests.engine_proc.server.engine_process import greedy
from tests.ipc.helpers import (
    documented_error_code,
    raw_dealer,
    recv_msg,
)


def test_request_errors_come_back_named(engine, client) -> None:
    with pytest.raises(EngineError) as info:
        client.generate("x", max_tokens=4, temperature=-1.0).result(30)
    assert info.value.code == P.ERR_INVALID_REQUEST and "temperature" in info.value.message
    with pytest.raises(EngineError) as info:
        client.generate("", max_tokens=4).result(30)
    assert info.value.code == P.ERR_INVALID_REQUEST and "prompt" in info.value.message
    with pytest.raises(EngineError) as info:
        client.control("set_limits", max_num_seqs=0)
    assert info.value.code == P.ERR_INVALID_CONTROL and "max_num_seqs" in info.value.message
    # Duplicate id while the first is in flight (raw socket: the client library refuses it).
    d = raw_dealer(engine.endpoint)
    try:
        gen = P.Generate(request_id="dup", prompt="abc", sampling=P.SamplingOptions(max_tokens=400))
        d.send(P.encode(gen))
        d.send(P.encode(gen))
        got = [recv_msg(d) for _ in range(3)]
        errors = [m for m in got if isinstance(m, P.Error)]
        assert errors and errors[0].code == P.ERR_DUPLICATE_REQUEST_ID
        assert errors[0].request_id == "dup"
        d.send(P.encode(P.Abort(request_id="dup")))
        while not isinstance(m := recv_msg(d), P.Finish):
            pass
        assert m.reason == "abort" and m.error
    finally:
        d.close()


# ----------------------------------------------------------------- fuzzing the ROUTER

_ints = st.integers(-(2**63), 2**64 - 1)  # what MessagePack can carry
_field_values = st.one_of(
    st.none(),
    st.booleans(),
    _ints,
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.lists(_ints, max_size=5),
    st.dictionaries(st.text(max_size=5), _ints, max_size=3),
)
_field_names = st.sampled_from(
    [
        "request_id",
        "prompt",
        "messages",
        "sampling",
        "op",
        "protocol_version",
        "token",
        "max_num_seqs",
        "control_id",
        "time",
        "reason",
        "cache_salt",
        "bogus",
    ]
)
_kinds = st.one_of(
    st.sampled_from(list(P.CLIENT_KINDS) + ["welcome", "delta", "telemetry", "", "GENERATE"]),
    _field_values,
)


def _invalid(data: bytes) -> bool:
    try:
        P.decode_client(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return True
    return False


_garbage = st.one_of(
    st.binary(max_size=300),
    st.builds(
        lambda kind, fields: msgspec.msgpack.encode({"kind": kind, **fields}),
        _kinds,
        st.dictionaries(_field_names, _field_values, max_size=4),
    ),
    st.builds(msgspec.msgpack.encode, _field_values),
).filter(_invalid)

# Well-formed messages the engine refuses, each with the code docs/PROTOCOL.md gives it.
_semantic = st.one_of(
    st.builds(
        lambda i: (P.Abort(request_id=f"nobody-{i}"), P.ERR_UNKNOWN_REQUEST), st.integers(0, 10**9)
    ),
    st.builds(
        lambda v: (P.Hello(protocol_version=v), P.ERR_VERSION_MISMATCH),
        st.one_of(st.integers(-(2**63), 0), st.integers(2, 2**63 - 1)),
    ),
    st.builds(
        lambda t, k: (
            P.Generate(
                request_id="bad",
                prompt="x",
                sampling=P.SamplingOptions(temperature=t, max_tokens=k),
            ),
            P.ERR_INVALID_REQUEST,
        ),
        st.floats(-5, -0.01),
        st.integers(-5, 3),
    ),
    st.just((P.Generate(request_id="bad2", prompt=[10**6]), P.ERR_INVALID_REQUEST)),
    st.just((P.Control(op="set_limits", max_num_batched_tokens=0), P.ERR_INVALID_CONTROL)),
)


_background_expected: dict[int, list[int]] = {}


class _Background:
    """A well-behaved client streaming one long greedy request during the abuse."""

    def __init__(self, endpoint: str, reference, max_tokens: int = 100) -> None:
        self.prompt = "the well-behaved client"
        if max_tokens not in _background_expected:
            _background_expected[max_tokens] = greedy(reference, self.prompt, max_tokens)
        self.expected = _background_expected[max_tokens]
        self.max_tokens = max_tokens
        self.client = EngineClient(endpoint, client_name="good")
        self.stream = self.client.generate(self.prompt, max_tokens=max_tokens, temperature=0.0)

    def check(self) -> None:
        self.stream.result(60)
        self.client.close()
        assert self.stream.finish.reason == "length"
        assert self.stream.token_ids == self.expected


@contextlib.contextmanager
def _raw_beside_a_good_client(engine, reference) -> Iterator[zmq.Socket]:
    """A raw DEALER for the abuse while a _Background client streams; that client's reply is
    checked once the socket is closed."""
    bg = _Background(engine.endpoint, reference)
    d = raw_dealer(engine.endpoint)
    try:
        yield d
    finally:
        d.close()
    bg.check()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    frames=st.lists(
        st.one_of(
            _garbage.map(lambda f: (f, documented_error_code(f))),
            _semantic.map(lambda m: (P.encode(m[0]), m[1])),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_fuzz_every_bad_message_gets_its_documented_error(
    engine, frames: list[tuple[bytes, str]]
) -> None:
    d = raw_dealer(engine.endpoint)
    try:
        for f, _ in frames:
            d.send(f)
        replies = [recv_msg(d, timeout=30) for _ in frames]  # answered in order, one each
        assert all(isinstance(m, P.Error) for m in replies), replies
        assert [m.code for m in replies] == [code for _, code in frames]
    finally:
        d.close()


def test_fuzz_run_with_a_concurrent_good_client(engine, reference) -> None:
    with _raw_beside_a_good_client(engine, reference) as d:
        test_fuzz_every_bad_message_gets_its_documented_error(engine)
        # Multi-frame messages are refused too.
        d.send_multipart([P.encode(P.Heartbeat()), b"extra"])
        assert recv_msg(d).code == P.ERR_BAD_MESSAGE


def test_abort_flood_for_unknown_ids(engine, reference) -> None:
    with _raw_beside_a_good_client(engine, reference) as d:
        n = 1000
        for i in range(n):
            d.send(P.encode(P.Abort(request_id=f"ghost-{i}")))
        got = [recv_msg(d, timeout=30) for _ in range(n)]
        assert all(isinstance(m, P.Error) and m.code == P.ERR_UNKNOWN_REQUEST for m in got)
        assert sorted(m.request_id for m in got) == sorted(f"ghost-{i}" for i in range(n))


def test_oversize_frame_is_dropped_and_engine_keeps_serving(engine, reference) -> None:
    with _raw_beside_a_good_client(engine, reference) as d:
        d.send(b"\x81" + b"x" * (P.MAX_CLIENT_MESSAGE_BYTES + 10))
        # ZMQ drops the frame and the connection; the DEALER reconnects by itself (a hello sent
        # while it does may be lost: send again until one is answered). The oversize frame gets
        # no reply: the first thing that comes back is the welcome.
        for _ in range(30):
            d.send(P.encode(P.Hello(protocol_version=P.PROTOCOL_VERSION)))
            if d.poll(2000):
                break
        assert isinstance(recv_msg(d), P.Welcome)


