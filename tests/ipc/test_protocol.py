"""ipc.protocol: codecs and validation, against docs/PROTOCOL.md. No engine, no sockets. (The
loopback rule and the process boundaries: test_boundaries.py.)"""

from __future__ import annotations

import dataclasses
import pickle
import struct
from pathlib import Path
from typing import get_args

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_proc.sampling_params import SamplingParams
from ipc import kv_events as K
from ipc import protocol as P
from tests.ipc.helpers import DOC_CLIENT_KINDS, documented_error_code

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


# ------------------------------------------------------------ the wire as docs/PROTOCOL.md says

# Field names per message kind and nested struct, copied from docs/PROTOCOL.md section 4 (not
# from ipc/protocol.py): a renamed, added or dropped wire field breaks every other client.
_TOKEN = {"token"}
DOC_CLIENT_FIELDS = {
    "hello": _TOKEN | {"protocol_version", "client_name"},
    "generate": _TOKEN
    | {"request_id", "prompt", "messages", "sampling", "cache_salt", "kv_transfer", "tools",
       "chat_template_kwargs"},
    "tokenize": _TOKEN
    | {"request_id", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
       "tools", "chat_template_kwargs"},
    "detokenize": _TOKEN | {"request_id", "token_ids"},
    "abort": _TOKEN | {"request_id"},
    "control": _TOKEN
    | {"op", "control_id", "max_num_seqs", "max_num_batched_tokens", "long_prefill_chunk",
       "default_prefill_chunk", "enable_prefix_caching"},
    "heartbeat": _TOKEN | {"time", "paused"},  # one struct both ways; paused: engine -> client
    "goodbye": _TOKEN | {"reason"},
}  # fmt: skip
DOC_ENGINE_FIELDS = {
    "welcome": {"protocol_version", "client_id", "model", "config", "pub_endpoint",
                "telemetry_hz", "heartbeat_interval", "client_timeout", "max_message_bytes",
                "server_time"},
    "delta": {"request_id", "index", "token_ids", "text", "token_times", "time", "logprobs"},
    "tokenized": {"request_id", "token_ids", "text", "max_model_len"},
    "finish": {"request_id", "index", "reason", "usage", "ttft", "tpot", "e2e", "queue_time",
               "error", "kv_handoff"},
    "control_ack": {"control_id", "op", "config", "time", "result"},
    "error": {"code", "message", "request_id", "control_id"},
    "heartbeat": _TOKEN | {"time", "paused"},
    "goodbye": _TOKEN | {"reason"},
}  # fmt: skip
DOC_PUB_FIELDS = {
    "telemetry": {"seq", "time", "counters", "config", "blocks", "requests", "token_events",
                  "steps", "num_clients", "histograms", "finished_reasons", "kv_events_seq",
                  "expert_counts", "decode_step", "decode_detail"},
    "heartbeat": _TOKEN | {"time", "paused"},
    "goodbye": _TOKEN | {"reason"},
    "kv_events": {"seq", "time", "events"},
}  # fmt: skip
DOC_NESTED_FIELDS = {
    P.SamplingOptions: {"max_tokens", "temperature", "top_k", "top_p", "seed", "n", "stop",
                        "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                        "repetition_penalty", "logit_bias", "logprobs", "structured",
                        "speculative"},
    P.ChatMessage: {"role", "content", "tool_calls", "tool_call_id", "name",
                    "reasoning_content"},
    P.StructuredOutput: {"kind", "spec", "field"},
    P.ModelInfo: {"name", "architecture", "num_layers", "num_kv_heads", "head_dim", "dtype",
                  "device", "block_size", "num_blocks", "kv_bytes_per_token", "max_model_len",
                  "model_id", "num_heads", "vocab_size", "attention_backend", "kv_pool_bytes",
                  "decode_weights", "cuda_graph_sizes", "kv_cache_dtype", "kv_host_bytes",
                  "kv_disk_bytes", "role", "kv_transfer_endpoint", "cache_identity",
                  "kv_groups", "tool_parser", "reasoning_parser"},
    P.KVGroup: {"window", "layers"},
    P.KVTransferParams: {"do_remote_decode", "remote_endpoint", "remote_lease_id",
                         "block_hashes", "output_token_ids"},
    P.KVHandoff: {"lease_id", "endpoint", "block_hashes", "lease_seconds"},
    P.LiveConfig: {"max_num_seqs", "max_num_batched_tokens", "long_prefill_chunk",
                   "enable_prefix_caching", "paused", "long_prefill_chunk_default"},
    P.Usage: {"prompt_tokens", "cached_tokens", "completion_tokens", "draft_tokens",
              "accepted_draft_tokens"},
    P.TokenLogprobs: {"token_id", "token", "logprob", "top"},
    P.BlockArrays: {"num_blocks", "state", "ref_count", "filled", "short_hash", "parent",
                    "dtypes"},
    P.RequestState: {"request_id", "status", "block_table", "num_prompt_tokens",
                     "num_cached_tokens", "num_computed_tokens", "num_generated_tokens",
                     "arrival_time", "first_scheduled_time", "first_token_time", "origin",
                     "group_tables", "structured", "num_tools", "allowed_tokens",
                     "draft_start", "draft_blocks", "draft_accepted", "num_draft_tokens",
                     "num_accepted_tokens"},
    P.TokenEvent: {"request_id", "index", "time"},
    P.StepStats: {"time", "duration", "num_prefill_tokens", "num_decode_tokens", "num_running",
                  "num_waiting"},
    P.Histogram: {"bounds", "counts", "sum"},
    K.BlockStored: {"block_hashes", "parent_block_hash", "token_ids", "block_size", "block_ids",
                    "medium"},
    K.BlockRemoved: {"block_hashes", "medium"},
    K.AllBlocksCleared: {"medium"},
}  # fmt: skip
DOC_ERROR_CODES = {
    "bad_message", "unknown_kind", "invalid_message", "unauthorized", "version_mismatch",
    "invalid_request", "duplicate_request_id", "unknown_request", "invalid_control",
    "overloaded", "shutting_down", "internal_error", "kv_transfer_failed",
}  # fmt: skip
# SamplingOptions defaults from the table in section 4.1.
DOC_SAMPLING_DEFAULTS = dict(
    max_tokens=256, temperature=1.0, top_k=0, top_p=1.0, seed=None, n=1, stop=[],
    stop_token_ids=[], ignore_eos=False, presence_penalty=0.0, frequency_penalty=0.0,
    repetition_penalty=1.0, logit_bias={}, logprobs=None, structured=None, speculative=True,
)  # fmt: skip


def _wire_fields(struct: type) -> set[str]:
    return {f.encode_name for f in msgspec.structs.fields(struct)}


def _kinds(union: object) -> dict[str, type]:
    return {t.__struct_config__.tag: t for t in get_args(union)}


@pytest.mark.parametrize(
    ("union", "doc"),
    [
        (P.ClientMessage, DOC_CLIENT_FIELDS),
        (P.EngineMessage, DOC_ENGINE_FIELDS),
        (P.PubMessage, DOC_PUB_FIELDS),
    ],
    ids=["client", "engine", "pub"],
)
def test_message_kinds_and_fields_are_the_documented_ones(union, doc) -> None:
    kinds = _kinds(union)
    assert set(kinds) == set(doc)
    for kind, cls in kinds.items():
        assert cls.__struct_config__.tag_field == "kind"
        assert _wire_fields(cls) == doc[kind], kind


def test_nested_structs_error_codes_and_defaults_are_the_documented_ones() -> None:
    for cls, fields in DOC_NESTED_FIELDS.items():
        assert _wire_fields(cls) == fields, cls.__name__
    assert set(P.ERROR_CODES) == DOC_ERROR_CODES
    assert msgspec.structs.asdict(P.SamplingOptions()) == DOC_SAMPLING_DEFAULTS
    # TopLogprob travels as a 3-element array [token_id, token, logprob].
    assert msgspec.msgpack.decode(P.encode(P.TopLogprob(token_id=5, token="a", logprob=-0.5))) == [
        5, "a", -0.5,
    ]  # fmt: skip


def _expected_maps() -> list[dict]:
    """_examples() as docs/PROTOCOL.md lays them out: MessagePack maps (fields holding their
    default may be omitted, and are), blocks as raw little-endian bytes."""
    cfg = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "long_prefill_chunk": 0,
           "enable_prefix_caching": True}  # fmt: skip
    blocks = {
        "num_blocks": 3,
        "state": bytes([0, 1, 2]),
        "ref_count": struct.pack("<3i", 0, 0, 3),
        "filled": struct.pack("<3i", 0, 16, 5),
        "short_hash": struct.pack("<3I", 0, 2**32 - 1, 7),
        "parent": struct.pack("<3i", -1, -1, 1),
        "dtypes": {"state": "|u1", "ref_count": "<i4", "filled": "<i4", "short_hash": "<u4",
                   "parent": "<i4"},
    }  # fmt: skip
    return [
        {"kind": "hello", "protocol_version": 1, "client_name": "t", "token": "secret"},
        {"kind": "generate", "request_id": "r1", "prompt": "hi", "sampling": {"temperature": 0.0}},
        {"kind": "generate", "request_id": "r2", "prompt": [1, 2, 3], "sampling": {},
         "cache_salt": "s"},
        {"kind": "generate", "request_id": "r3", "messages": [{"role": "user", "content": "hi"}],
         "sampling": {}},
        {"kind": "abort", "request_id": "r1"},
        {"kind": "control", "op": "set_limits", "control_id": "c", "max_num_seqs": 2},
        {"kind": "control", "op": "set_prefix_caching", "enable_prefix_caching": False},
        {"kind": "heartbeat", "time": 1.5},
        {"kind": "goodbye", "reason": "bye"},
        {"kind": "delta", "request_id": "r", "index": 0, "token_ids": [5], "text": "a",
         "token_times": [1.0], "time": 1.0},
        {"kind": "finish", "request_id": "r", "index": 0, "reason": "stop",
         "usage": {"prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": 1},
         "ttft": 0.1},
        {"kind": "control_ack", "control_id": "c", "op": "pause", "config": cfg, "time": 1.0},
        {"kind": "error", "code": "invalid_request", "message": "m", "request_id": "r"},
        {"kind": "telemetry", "seq": 1, "time": 2.0, "counters": {"a": 1.0}, "config": cfg,
         "blocks": blocks, "requests": [],
         "token_events": [{"request_id": "r", "index": 0, "time": 1.0}]},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("msg", "expected"),
    list(zip(_examples(), _expected_maps(), strict=True)),
    ids=[type(m).__name__ for m in _examples()],
)
def test_wire_map_is_the_documented_one_and_decodes_back(
    msg: msgspec.Struct, expected: dict
) -> None:
    data = P.encode(msg)
    # Independent reference: a generic MessagePack decoder sees exactly the documented map.
    assert msgspec.msgpack.decode(data) == expected
    assert data[0] != pickle.PROTO[0]  # pickle (protocol >= 2) starts with its PROTO opcode
    # ... and a map written by another client (here: the generic encoder) decodes to the struct.
    wire = msgspec.msgpack.encode(expected)
    kind = expected["kind"]
    decoders = [
        decode
        for decode, doc in (
            (P.decode_client, DOC_CLIENT_FIELDS),
            (P.decode_engine, DOC_ENGINE_FIELDS),
            (P.decode_pub, DOC_PUB_FIELDS),
        )
        if kind in doc
    ]
    assert decoders
    for decode in decoders:
        assert decode(wire) == msg


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
    return P.classify_decode_error(info.value, data)


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
            {"kind": "control", "op": "set_limits", "default_prefill_chunk": True,
             "long_prefill_chunk": 64},
            P.ERR_INVALID_MESSAGE,
            "not both",
        ),
        (
            {"kind": "control", "op": "pause", "default_prefill_chunk": True},
            P.ERR_INVALID_MESSAGE,
            "set_limits",
        ),
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
    assert _err(pickle.dumps({"kind": "hello", "protocol_version": 1})).code == P.ERR_BAD_MESSAGE
    # One MessagePack value followed by garbage is not MessagePack either, even when the first
    # value alone has the wrong type (msgspec's typed decoder reports that first).
    assert _err(b"\x05\xc1").code == P.ERR_BAD_MESSAGE
    assert _err(msgspec.msgpack.encode([1, 2])[:-1]).code == P.ERR_BAD_MESSAGE
    assert _err(msgspec.msgpack.encode({"kind": "abort", "request_id": 1}) + b"\x00").code == (
        P.ERR_BAD_MESSAGE
    )
    # A non-string key ahead of `kind` does not hide an unknown kind.
    assert _err(msgspec.msgpack.encode({1: 2, "kind": "nope"})).code == P.ERR_UNKNOWN_KIND
    assert _err(msgspec.msgpack.encode({1: 2, "kind": "abort"})).code == P.ERR_INVALID_MESSAGE


_maps = st.dictionaries(
    st.sampled_from(["kind", "request_id", "protocol_version", "op", "prompt", "x"]),
    st.one_of(
        st.sampled_from([*DOC_CLIENT_KINDS, "welcome", "GENERATE"]),
        st.integers(-(2**63), 2**64 - 1),
        st.text(max_size=4),
        st.none(),
    ),
    max_size=4,
).map(msgspec.msgpack.encode)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), _maps, _maps.map(lambda m: m + b"\xc1")))
def test_random_frames_get_their_documented_code(data: bytes) -> None:
    try:
        P.decode_client(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        assert P.classify_decode_error(exc, data).code == documented_error_code(data)


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
