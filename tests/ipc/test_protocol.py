"""ipc.protocol and ipc.endpoints: codecs, validation, the loopback rule. No engine, no sockets."""

from __future__ import annotations

import ast
import dataclasses
import os
import pickle
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_proc.sampling_params import SamplingParams
from ipc import endpoints as E
from ipc import protocol as P

REPO = Path(__file__).resolve().parents[2]


def _config() -> P.LiveConfig:
    return P.LiveConfig(
        max_num_seqs=4, max_num_batched_tokens=64, long_prefill_chunk=0, enable_prefix_caching=True
    )


def _examples() -> list[msgspec.Struct]:
    blocks = P.BlockArrays.pack(
        state=np.array([0, 1, 2], np.uint8),
        ref_count=np.array([0, 0, 3]),
        filled=np.array([0, 16, 5]),
        short_hash=np.array([0, 2**32 - 1, 7]),
        parent=np.array([-1, -1, 1]),
    )
    return [
        P.Hello(protocol_version=P.PROTOCOL_VERSION, client_name="t", token="secret"),
        P.Generate(request_id="r1", prompt="hi", sampling=P.SamplingOptions(temperature=0.0)),
        P.Generate(request_id="r2", prompt=[1, 2, 3], cache_salt="s"),
        P.Generate(request_id="r3", messages=[P.ChatMessage(role="user", content="hi")]),
        P.Abort(request_id="r1"),
        P.Control(op="set_limits", control_id="c", max_num_seqs=2),
        P.Control(op="set_prefix_caching", enable_prefix_caching=False),
        P.Heartbeat(time=1.5),
        P.Goodbye(reason="bye"),
        P.Delta(request_id="r", index=0, token_ids=[5], text="a", token_times=[1.0], time=1.0),
        P.Finish(
            request_id="r",
            index=0,
            reason="stop",
            usage=P.Usage(prompt_tokens=3, cached_tokens=0, completion_tokens=1),
            ttft=0.1,
        ),
        P.ControlAck(control_id="c", op="pause", config=_config(), time=1.0),
        P.Error(code=P.ERR_INVALID_REQUEST, message="m", request_id="r"),
        P.Telemetry(
            seq=1,
            time=2.0,
            counters={"a": 1.0},
            config=_config(),
            blocks=blocks,
            requests=[],
            token_events=[P.TokenEvent(request_id="r", index=0, time=1.0)],
        ),
    ]


@pytest.mark.parametrize("msg", _examples(), ids=lambda m: type(m).__name__)
def test_roundtrip_and_wire_is_msgpack_map(msg: msgspec.Struct) -> None:
    data = P.encode(msg)
    # Independent reference: a generic MessagePack decoder sees a plain map with the kind tag.
    obj = msgspec.msgpack.decode(data)
    assert isinstance(obj, dict) and obj["kind"] == msg.__struct_config__.tag
    assert data[0] != pickle.PROTO[0]  # pickle (protocol >= 2) starts with its PROTO opcode
    decoders = []
    if isinstance(msg, P.Hello | P.Generate | P.Abort | P.Control | P.Heartbeat | P.Goodbye):
        decoders.append(P.decode_client)
    if isinstance(msg, P.Delta | P.Finish | P.ControlAck | P.Error | P.Heartbeat | P.Goodbye):
        decoders.append(P.decode_engine)
    if isinstance(msg, P.Telemetry | P.Heartbeat | P.Goodbye):
        decoders.append(P.decode_pub)
    for decode in decoders:
        assert decode(data) == msg


def test_sampling_options_mirror_sampling_params() -> None:
    ref = {f.name: f for f in dataclasses.fields(SamplingParams)}
    assert P.SAMPLING_FIELDS == tuple(ref)
    defaults = P.SamplingOptions()
    engine_defaults = SamplingParams()
    for name in ref:
        assert getattr(defaults, name) == getattr(engine_defaults, name), name
    # The server builds SamplingParams from the mirror: all fields pass through unchanged.
    opts = P.SamplingOptions(
        max_tokens=3,
        temperature=0.5,
        top_k=4,
        top_p=0.9,
        seed=7,
        n=2,
        stop=["x"],
        stop_token_ids=[1],
        ignore_eos=True,
    )
    sp = SamplingParams(**P.sampling_to_dict(opts))
    assert dataclasses.asdict(sp) == msgspec.structs.asdict(opts)


def _err(data: bytes) -> P.ProtocolError:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)) as info:
        P.decode_client(data)
    return P.classify_decode_error(info.value)


@pytest.mark.parametrize(
    ("obj", "code", "needle"),
    [
        ({"kind": "nope"}, P.ERR_UNKNOWN_KIND, "kind"),
        ({"request_id": "x"}, P.ERR_UNKNOWN_KIND, "kind"),
        ({"kind": 3}, P.ERR_UNKNOWN_KIND, "kind"),
        ({"kind": "welcome"}, P.ERR_UNKNOWN_KIND, "kind"),  # an engine kind sent by a client
        ({"kind": "generate", "prompt": "x"}, P.ERR_INVALID_MESSAGE, "request_id"),
        ({"kind": "generate", "request_id": "x"}, P.ERR_INVALID_MESSAGE, "prompt"),
        (
            {"kind": "generate", "request_id": "", "prompt": "x"},
            P.ERR_INVALID_MESSAGE,
            "request_id",
        ),
        (
            {
                "kind": "generate",
                "request_id": "x",
                "prompt": "p",
                "messages": [{"role": "u", "content": "c"}],
            },
            P.ERR_INVALID_MESSAGE,
            "exactly one",
        ),
        (
            {"kind": "generate", "request_id": "x", "prompt": "p", "sampling": {"max_tokens": "9"}},
            P.ERR_INVALID_MESSAGE,
            "max_tokens",
        ),
        (
            {"kind": "generate", "request_id": "x", "prompt": "p", "sampling": {"temprature": 0}},
            P.ERR_INVALID_MESSAGE,
            "temprature",
        ),
        (
            {"kind": "generate", "request_id": "x", "prompt": "p", "sampling": {"ignore_eos": 1}},
            P.ERR_INVALID_MESSAGE,
            "ignore_eos",
        ),
        ({"kind": "abort"}, P.ERR_INVALID_MESSAGE, "request_id"),
        ({"kind": "abort", "request_id": 5}, P.ERR_INVALID_MESSAGE, "request_id"),
        ({"kind": "control", "op": "explode"}, P.ERR_INVALID_MESSAGE, "op"),
        ({"kind": "control", "op": "set_limits"}, P.ERR_INVALID_MESSAGE, "max_num_seqs"),
        (
            {"kind": "control", "op": "pause", "max_num_seqs": 3},
            P.ERR_INVALID_MESSAGE,
            "set_limits",
        ),
        ({"kind": "control", "op": "set_prefix_caching"}, P.ERR_INVALID_MESSAGE, "enable_prefix"),
        ({"kind": "hello"}, P.ERR_INVALID_MESSAGE, "protocol_version"),
        ({"kind": "heartbeat", "extra": 1}, P.ERR_INVALID_MESSAGE, "extra"),
        ([1, 2], P.ERR_INVALID_MESSAGE, "object"),
    ],
)
def test_validation_names_the_field(obj: object, code: str, needle: str) -> None:
    err = _err(msgspec.msgpack.encode(obj))
    assert err.code == code
    assert needle in err.message


def test_not_msgpack_is_bad_message() -> None:
    assert _err(b"\xc1").code == P.ERR_BAD_MESSAGE
    # A pickled hello is refused like any other garbage, never unpickled.
    assert _err(pickle.dumps({"kind": "hello", "protocol_version": 1})).code in P.ERROR_CODES


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_decode_errors(data: bytes) -> None:
    try:
        P.decode_client(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        assert P.classify_decode_error(exc).code in P.ERROR_CODES


def test_block_arrays_roundtrip_and_size_check() -> None:
    rng = np.random.default_rng(0)
    n = 1000
    arrays = dict(
        state=rng.integers(0, 3, n).astype(np.uint8),
        ref_count=rng.integers(0, 5, n).astype(np.int32),
        filled=rng.integers(0, 17, n).astype(np.int32),
        short_hash=rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32),
        parent=rng.integers(-1, n, n).astype(np.int32),
    )
    msg = P.decode_pub(
        P.encode(
            P.Telemetry(
                seq=1,
                time=0.0,
                counters={},
                config=_config(),
                blocks=P.BlockArrays.pack(**arrays),
                requests=[],
            )
        )
    )
    out = msg.blocks.to_numpy()
    for name, arr in arrays.items():
        assert out[name].dtype == arr.dtype
        np.testing.assert_array_equal(out[name], arr)
    bad = msgspec.structs.replace(msg.blocks, filled=msg.blocks.filled[:-1])
    with pytest.raises(ValueError, match="filled"):
        bad.to_numpy()


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:5555",
        "tcp://127.0.0.1:*",
        "tcp://127.9.9.9:1",
        "tcp://[::1]:5555",
        "tcp://localhost:80",
        "inproc://x",
        "ipc://auto",
    ],
)
def test_loopback_endpoints_allowed(endpoint: str) -> None:
    assert E.is_loopback(endpoint)
    E.check_bind(endpoint, allow_remote=False, token=None)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://0.0.0.0:5555",
        "tcp://*:5555",
        "tcp://eth0:5555",
        "tcp://192.168.1.4:5555",
        "tcp://[::]:5555",
        "tcp://example.com:5555",
        "pgm://eth0;239.192.1.1:5555",
        "tcp://127.0.0.1;10.0.0.1:5555",
        "ipc:///tmp/kvscope.sock",
    ],
)
def test_remote_endpoints_refused_without_flag_and_token(endpoint: str) -> None:
    assert not E.is_loopback(endpoint)
    with pytest.raises(ValueError, match="allow-remote"):
        E.check_bind(endpoint, allow_remote=False, token="x" * 32)
    with pytest.raises(ValueError, match="token"):
        E.check_bind(endpoint, allow_remote=True, token=None)
    with pytest.raises(ValueError, match="token"):
        E.check_bind(endpoint, allow_remote=True, token="short")
    E.check_bind(endpoint, allow_remote=True, token="x" * 32)


def test_private_runtime_dir_makes_ipc_loopback() -> None:
    d = E.private_runtime_dir()
    try:
        assert E.is_loopback(f"ipc://{d}/engine.sock")
        ep, used = E.resolve_auto("ipc://auto", d, "engine.sock")
        assert ep == f"ipc://{d}/engine.sock" and used == d
    finally:
        Path(d).rmdir()


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_boundaries_no_pickle_no_torch_in_ipc() -> None:
    for path in [*(REPO / "ipc").glob("*.py"), REPO / "app" / "chat.py"]:
        imported = _imports(path)
        assert not imported & {
            "torch",
            "triton",
            "PySide6",
            "engine_proc",
            "pickle",
            "transformers",
        }, path
    assert "pickle" not in _imports(REPO / "engine_proc" / "server.py")


def test_app_chat_and_ipc_do_not_load_torch_or_the_engine() -> None:
    code = (
        "import sys, app.chat, ipc.client, ipc.protocol, ipc.endpoints\n"
        "banned = ('torch', 'engine_proc', 'PySide6', 'transformers')\n"
        "bad = [m for m in banned if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr


def test_gui_and_app_entry_points_do_not_load_torch_or_the_engine() -> None:
    code = (
        "import sys, app.__main__, app.bench, app.supervisor, ui.main_window, ui.demo\n"
        "banned = ('torch', 'triton', 'engine_proc', 'transformers')\n"
        "bad = [m for m in banned if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "QT_QPA_PLATFORM": "offscreen"}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
