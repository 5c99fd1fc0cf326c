"""`engine_proc serve --kv-events-config`: a real engine process (tiny random Llama, real
tokenizer) publishes its KV cache events in vLLM's wire format, and a subscriber written from
vLLM's source alone (vllm_subscriber.py, no KVScope import) rebuilds the engine's prefix index
from them: the same blocks (hashes folded to 64 bits by vLLM's documented rule, computed here),
parents, tokens and media as the engine's own kv_events stream describes. Also: replay from 0
equals what was received live, evictions are BlockRemoved, a reset is AllBlocksCleared, the
host and disk tiers are CPU and DISK, the array encoding with bytes hashes decodes too, and a bad
--kv-events-config is a usage error naming the flag and the key."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ipc import kv_events as K
from ipc import protocol as P
from ipc.client import EngineClient
from tests.engine_proc.server import vllm_subscriber as S
from tests.ipc.helpers import REPO, EngineProc

pytestmark = pytest.mark.slow

TINY_CHAT = ["--engine-factory", "tests.ui.engines:tiny_chat", "--num-threads", "1",
             "--telemetry-hz", "20"]  # fmt: skip
BLOCK_SIZE = 16
MEDIA = {K.POOL: "GPU", K.HOST: "CPU", K.DISK: "DISK"}
SYSTEM = ("You are a careful assistant for a small bakery. Answer in one short sentence, name "
          "the bread, its price in euros and whether it is baked today or was baked yesterday.")
QUESTIONS = ["Which bread has seeds?", "Is there rye today?", "What costs two euros?",
             "Do you sell croissants on Sunday mornings?", "Which loaf is the biggest one?",
             "Any gluten free bread?", "What is the sourdough price?", "Is the baguette fresh?",
             "How long does a brioche keep?", "Which bread goes with soup?"]  # fmt: skip


def fold(digest: bytes) -> int:
    """vLLM's rule (vllm/v1/core/kv_cache_utils.py maybe_convert_block_hash), written out here:
    the digest as one big-endian integer, low 64 bits."""
    return int.from_bytes(digest, "big") & (2**64 - 1)


class Rig:
    """An engine with --kv-events-config, the independent subscriber, and the engine's own
    kv_events stream as the reference."""

    def __init__(self, tmp: Path, kv_config: dict, *extra: str) -> None:
        cfg = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
               "replay_endpoint": "tcp://127.0.0.1:*", **kv_config}  # fmt: skip
        self.topic = cfg.get("topic", "").encode()
        self.proc = EngineProc([*TINY_CHAT, *extra, "--kv-events-config", json.dumps(cfg)])
        self.client = EngineClient(self.proc.endpoint, client_name="vllm-events-test")
        ready = self.proc.ready
        self.sub = S.Subscriber(ready["kv_events_endpoint"], ready["kv_events_replay_endpoint"],
                                self.topic)  # fmt: skip
        topics = (P.TOPIC_TELEMETRY, P.TOPIC_KV_EVENTS)
        self.native_sub = self.client.subscribe_telemetry(topics=topics)
        self.native = K.PrefixTree()
        time.sleep(0.5)  # both SUB sockets joined before the first request

    def chat(self, questions: list[str], max_tokens: int = 6) -> None:
        streams = [self.client.chat([{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": q}],
                                    max_tokens=max_tokens, temperature=0.0)
                   for q in questions]  # fmt: skip
        for s in streams:
            s.result(timeout=120)

    def settle(self) -> None:
        """Until the native tree reflects every batch: a control makes the engine drain and
        publish both streams, then a snapshot names the last native batch."""
        for _ in range(5):
            ack = self.client.control("get_config")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                msg = self.native_sub.recv(1.0)
                if isinstance(msg, K.KVEventBatch):
                    self.native.apply(msg)
                elif isinstance(msg, P.Telemetry) and msg.time >= ack.time:
                    if self.native.in_sync(msg.kv_events_seq):
                        return
                    break
            self.client.control("replay_kv_events")  # the native subscriber lost a batch
        raise AssertionError("the engine's kv_events stream never caught up")

    def history(self) -> list[tuple[bytes, int, bytes]]:
        return self.sub.replay(0)

    def vllm_tree(self) -> S.Tree:
        tree = S.Tree()
        for _, _, payload in self.history():
            for event in S.decode_payload(payload)[1]:
                tree.apply(event)
        return tree

    def close(self) -> None:
        self.sub.close()
        self.native_sub.close()
        self.client.close()
        assert self.proc.stop() == 0, self.proc.log()


def as_dict(tree: S.Tree) -> dict:
    return {h: (n.parent, tuple(n.tokens), frozenset(n.media)) for h, n in tree.nodes.items()}


def native_as_vllm(tree: K.PrefixTree, key=fold) -> dict:
    return {
        key(h): (None if n.parent_hash is None else key(n.parent_hash), tuple(n.token_ids),
                 frozenset(MEDIA[m] for m in n.media))
        for h, n in tree.nodes.items()
    }  # fmt: skip


def all_events(rig: Rig) -> list[dict]:
    return [e for _, _, p in rig.history() for e in S.decode_payload(p)[1]]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-events")
    r = Rig(tmp, {"topic": "kv-events"}, "--num-blocks", "16", "--kv-host-memory",
            str(1 << 20), "--kv-disk-dir", str(tmp / "kv-disk"))  # fmt: skip
    try:
        yield r
    finally:
        r.close()


def test_the_subscriber_imports_nothing_of_kvscope():
    tree = ast.parse(Path(S.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}  # fmt: skip
    names |= {n.module.split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.module}  # fmt: skip
    assert names <= {"__future__", "threading", "dataclasses", "typing", "msgpack", "zmq"}


def test_shared_prefix_chats_rebuild_the_engines_prefix_index(rig):
    rig.chat(QUESTIONS[:3])
    rig.settle()
    got, want = as_dict(rig.vllm_tree()), native_as_vllm(rig.native)
    assert got == want
    children: dict = {}
    for h, (parent, tokens, media) in got.items():
        children.setdefault(parent, []).append(h)
        assert len(tokens) == BLOCK_SIZE and media == {"GPU"}
    assert any(len(c) >= 3 for p, c in children.items() if p is not None)  # the shared prefix
    stored = next(e for e in all_events(rig) if e["type"] == "BlockStored")
    assert list(stored) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                            "block_size", "lora_id", "medium", "lora_name", "group_idx",
                            "kv_cache_spec_kind"]  # fmt: skip
    assert (stored["block_size"], stored["lora_id"], stored["group_idx"],
            stored["kv_cache_spec_kind"]) == (BLOCK_SIZE, None, 0, "full_attention")  # fmt: skip
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in stored["block_hashes"])


def test_replay_from_zero_is_what_was_received_live(rig):
    history = rig.history()
    assert [seq for _, seq, _ in history] == list(range(len(history)))
    assert {topic for topic, _, _ in history} == {b"kv-events"}
    deadline = time.monotonic() + 5
    while rig.sub.live()[-1:] != history[-1:] and time.monotonic() < deadline:
        time.sleep(0.05)
    live = rig.sub.live()
    assert live, "nothing received live"
    assert [seq for _, seq, _ in live] == list(range(live[0][1], live[-1][1] + 1))
    assert live == history[live[0][1] :]
    assert rig.sub.replay(live[-1][1]) == history[-1:]
    ts, _, rank = S.decode_payload(history[-1][2])
    assert rank == 0 and abs(ts - time.time()) < 600  # wall-clock seconds, as vLLM's


def test_evictions_are_block_removed_and_the_tiers_are_cpu_and_disk(rig):
    for i in range(0, len(QUESTIONS), 2):  # 10 prompts of ~4 blocks (2 shared) into 16
        rig.chat(QUESTIONS[i : i + 2], max_tokens=12)
    rig.settle()
    got, want = as_dict(rig.vllm_tree()), native_as_vllm(rig.native)
    assert got == want
    media = set().union(*(m for _, _, m in got.values()))
    assert media == {"GPU", "CPU", "DISK"}
    events = all_events(rig)
    assert any(e["type"] == "BlockRemoved" and e["medium"] == "GPU" for e in events)
    assert {e["medium"] for e in events if e["type"] == "BlockStored"} == media


def test_the_windows_vllm_path_draws_the_native_tree(rig):
    """The round trip: KVScope's engine in vLLM's format, read back through the window's own
    vLLM-format path (ipc.vllm_events decode + FleetTree, what the prefix-tree tab draws for a
    vLLM server), gives the tree its native stream gives."""
    from ipc.vllm_events.decode import decode_payload
    from ipc.vllm_events.fleet_tree import FleetTree

    rig.chat(QUESTIONS[:4], max_tokens=8)
    rig.settle()
    tree = FleetTree()
    for _, seq, payload in rig.history():
        tree.apply("kvscope", decode_payload(payload, seq))
    drawn = {h: (n.parent_hash, n.token_ids, n.media) for h, n in tree.nodes.items()}
    assert drawn == native_as_vllm(rig.native)
    assert len(drawn) > 8 and {"GPU", "CPU", "DISK"} <= set().union(*(m for *_, m in
                                                                       drawn.values()))


def test_reset_prefix_cache_is_all_blocks_cleared(rig):
    assert rig.client.reset_prefix_cache()
    rig.settle()
    history = rig.history()
    last = S.decode_payload(history[-1][2])[1]
    assert last == [{"type": "AllBlocksCleared"}]
    assert rig.vllm_tree().nodes == {} and rig.native.nodes == {}


def test_array_encoding_with_bytes_hashes(tmp_path):
    r = Rig(tmp_path, {"encoding": "array", "hash_type": "bytes", "topic": "kv@test"})
    try:
        r.chat(QUESTIONS[:2])
        r.settle()
        raw = msgpack_events(r)
        assert raw and all(isinstance(e, list) for e in raw)
        assert raw[-1][0] == "BlockStored" and len(raw[-1]) == 12
        assert as_dict(r.vllm_tree()) == native_as_vllm(r.native, key=bytes)
        assert all(len(h) == 32 for h in r.vllm_tree().nodes)
    finally:
        r.close()


def msgpack_events(r: Rig) -> list:
    import msgpack

    return [e for _, _, p in r.history() for e in msgpack.unpackb(p, raw=False)[1]]


@pytest.mark.parametrize(
    "argv",
    [["-m", "engine_proc", "serve"], ["-m", "app", "serve", "--port", "0"]],
    ids=["engine", "kvscope-serve"],
)
def test_a_bad_config_is_a_usage_error_naming_the_flag_and_key(argv):
    done = subprocess.run(
        [sys.executable, *argv, "--kv-events-config", '{"enable_kv_cache_events": true, '
         '"hwm": "lots"}'],  # fmt: skip
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "--kv-events-config" in done.stderr and "hwm" in done.stderr
