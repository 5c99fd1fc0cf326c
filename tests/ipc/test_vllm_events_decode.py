"""ipc/vllm_events/decode.py: payloads in every layout the fake publishers speak (vLLM's maps
and arrays, vLLM 0.9's short arrays, SGLang's), int and bytes hashes, fields it does not know,
missing optional ones; garbage named; the live and replay frame layouts."""

from __future__ import annotations

import msgspec
import pytest

from ipc.vllm_events.decode import (
    END_SEQ,
    DecodeError,
    decode_payload,
    parse_live,
    parse_replay,
    replay_request,
    topic_epoch,
)
from ipc.vllm_events.events import Cleared, Removed, Stored
from tests.ui.remote.fake_kv_publishers import LAYOUTS, encode

STORE = ("store", [11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, "GPU")
REMOVE = ("remove", [12], "GPU")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_decodes_to_the_same_events(layout):
    medium = "GPU" if layout != "vllm-v0" else None
    store = STORE[:5] + (medium,)
    remove = REMOVE[:2] + (medium,)
    batch = decode_payload(encode(layout, [store, remove, ("clear",)], ts=5.0, rank=3), seq=9)
    assert batch.seq == 9 and batch.ts == 5.0
    assert batch.dp_rank == (None if layout == "vllm-v0" else 3)
    stored, removed, cleared = batch.events
    assert stored == Stored(block_hashes=(11, 12), parent_block_hash=None,
                            token_ids=(1, 2, 3, 4, 5, 6, 7, 8), block_size=4, medium=medium)
    assert removed == Removed(block_hashes=(12,), medium=medium)
    assert cleared == Cleared()


def test_bytes_hashes_and_a_parent():
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    ev = ("store", [h2], h1, [9, 9], 2, "CPU_PINNED")
    (stored,) = decode_payload(encode("sglang", [ev, ev][:1])).events
    assert stored.block_hashes == (h2,) and stored.parent_block_hash == h1
    assert stored.medium == "CPU_PINNED"


def test_sglang_metadata_and_vllm_extra_fields_are_ignored():
    sglang = ["BlockStored", [1], None, [5], 1, None, "GPU", {"cache_salt": "x"}, "later"]
    vllm = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [5], "block_size": 1, "medium": "GPU", "lora_name": "a",
            "extra_keys": [["img", 3]], "group_idx": 2, "ownership": "x", "new_field": {}}
    a, b = decode_payload(msgspec.msgpack.encode([0.0, [sglang, vllm], 0])).events
    assert a.block_hashes == b.block_hashes == (1,) and a.group_idx == 0
    assert b.group_idx == 2 and b.lora_id is None


def test_missing_optional_fields_take_defaults():
    short = ["BlockStored", [1], None, [5, 6], 2]  # no lora_id, no medium
    removed = {"type": "BlockRemoved", "block_hashes": [1]}
    batch = decode_payload(msgspec.msgpack.encode({"ts": 1, "events": [short, removed]}))
    assert batch.dp_rank is None and batch.ts == 1.0
    assert batch.events[0].medium is None and batch.events[0].lora_id is None
    assert batch.events[1] == Removed(block_hashes=(1,))


def test_the_batch_as_a_map_with_either_rank_name():
    for name in ("data_parallel_rank", "attn_dp_rank"):
        raw = msgspec.msgpack.encode({"ts": 0.5, "events": [], name: 1})
        assert decode_payload(raw).dp_rank == 1


@pytest.mark.parametrize("payload, says", [
    (b"\xc1 not msgpack", "not msgpack"),
    (msgspec.msgpack.encode("hello"), "a batch is"),
    (msgspec.msgpack.encode([0.0]), "a batch is"),
    (msgspec.msgpack.encode(["x", []]), "ts is str"),
    (msgspec.msgpack.encode([0.0, {}]), "events is dict"),
    (msgspec.msgpack.encode([0.0, [], "r"]), "rank is str"),
    (msgspec.msgpack.encode([0.0, [["BlockMoved", [1]]]]), "unknown type 'BlockMoved'"),
    (msgspec.msgpack.encode([0.0, [{"block_hashes": [1]}]]), "unknown type None"),
    (msgspec.msgpack.encode([0.0, [7]]), "event 0 is int"),
    (msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved"}]]), "has no block_hashes"),
    (msgspec.msgpack.encode([0.0, [["BlockRemoved", [1.5]]]]), "block_hashes[0] is float"),
    (msgspec.msgpack.encode([0.0, [["BlockRemoved", [True]]]]), "block_hashes[0] is bool"),
    (msgspec.msgpack.encode([0.0, [["BlockStored", [1], "p", [1], 1]]]), "parent_block_hash"),
    (msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [1], 0]]]), "block_size is 0"),
    (msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, ["a"], 1]]]), "holds str"),
    (msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [1], 1, None, 5]]]),
     "medium is int"),
])  # fmt: skip
def test_garbage_is_a_decode_error_saying_what_is_wrong(payload, says):
    with pytest.raises(DecodeError, match=None) as err:
        decode_payload(payload)
    assert says in str(err.value)
    assert isinstance(err.value, ValueError)


def test_live_frames_match_the_topic_by_prefix():
    f = parse_live([b"kv@a\x00sgl-kv-epoch=e1", (5).to_bytes(8, "big"), b"p"], b"kv@a")
    assert (f.seq, f.payload) == (5, b"p") and topic_epoch(f.topic) == b"e1"
    assert topic_epoch(b"kv@a") is None
    assert topic_epoch(b"t\x00sgl-kv-epoch=e2\x00sgl-kv-snapshot=b") == b"e2"
    with pytest.raises(DecodeError, match="3 frames"):
        parse_live([b"kv", b"p"], b"kv")
    with pytest.raises(DecodeError, match="does not start with"):
        parse_live([b"other", (1).to_bytes(8, "big"), b"p"], b"kv")
    with pytest.raises(DecodeError, match="8 bytes"):
        parse_live([b"kv", b"\x01", b"p"], b"kv")


SEQ = (7).to_bytes(8, "big")


@pytest.mark.parametrize("frames, topic", [
    ([b"", b"kv", SEQ, b"p"], b"kv"),  # vLLM after #45177, DEALER
    ([b"", SEQ, b"p"], b""),  # vLLM before it, SGLang; DEALER (or REQ with an empty topic)
    ([b"kv", SEQ, b"p"], b"kv"),  # vLLM after #45177, REQ
    ([SEQ, b"p"], b""),  # vLLM before it, REQ
])  # fmt: skip
def test_replay_answers_in_every_layout(frames, topic):
    f = parse_replay(frames)
    assert f is not None and (f.topic, f.seq, f.payload) == (topic, 7, b"p")


@pytest.mark.parametrize("frames", [[b"", b"", END_SEQ, b""], [b"", END_SEQ, b""],
                                    [END_SEQ, b""]])
def test_the_end_marker_in_every_layout(frames):
    assert parse_replay(frames) is None


def test_bad_replay_frames():
    for frames, says in (([b"x"], "2 to 4 frames"), ([b"a", b"b", SEQ, b"p"], "delimiter"),
                         ([b"", END_SEQ, b"p"], "carries a payload"),
                         ([b"", b"\x01", b"p"], "8 bytes")):
        with pytest.raises(DecodeError, match=says):
            parse_replay(frames)


def test_replay_request_is_an_empty_delimiter_and_the_start():
    assert replay_request(258) == [b"", b"\x00\x00\x00\x00\x00\x00\x01\x02"]
