"""EngineLink's guard against requests the engine forgets without a Finish (no sockets: the
worker's bookkeeping is driven with hand-made telemetry)."""

from __future__ import annotations

import numpy as np

from app.load_generator import LoadConfig, LoadGenerator
from ipc import protocol as P
from ui.engine.link import LOST_AFTER_FRAMES, EngineLink


def _telemetry(seq: int, rids: list[str]) -> P.Telemetry:
    z = np.zeros(4)
    return P.Telemetry(
        seq=seq, time=float(seq), counters={},
        config=P.LiveConfig(max_num_seqs=1, max_num_batched_tokens=1, long_prefill_chunk=0,
                            enable_prefix_caching=True),
        blocks=P.BlockArrays.pack(state=z, ref_count=z, filled=z, short_hash=z, parent=z - 1),
        requests=[P.RequestState(request_id=r, status="running", block_table=[],
                                 num_prompt_tokens=1, num_cached_tokens=0, num_computed_tokens=1,
                                 num_generated_tokens=0, arrival_time=0.0) for r in rids])


def test_vanished_requests_are_reported_once(qtbot):
    link = EngineLink("tcp://127.0.0.1:9")
    got: list = []
    link.replies.connect(got.extend)
    gen = LoadGenerator(LoadConfig(concurrency=2))
    gen.start()
    load_ids = [r.request_id for r in gen.next_requests()]
    link._chat_ids = {"chat-a", "chat-b"}
    seq = 0
    lost_load: list = []
    # chat-b and the first load request stay; chat-a and the second load request vanish
    for _ in range(LOST_AFTER_FRAMES + 5):
        seq += 1
        msgs = [_telemetry(seq, ["chat-b", load_ids[0]])]
        lost_load += link._find_lost(msgs, gen)
    assert [e.request_id for e in got] == ["chat-a"]
    assert got[0].code == "engine_unreachable"
    assert link._chat_ids == {"chat-b"}
    assert [e.request_id for e in lost_load] == [load_ids[1]]
    # a request seen again in time is not lost: absence must be consecutive
    link._chat_ids.add("chat-c")
    for i in range(3 * LOST_AFTER_FRAMES):
        seq += 1
        present = ["chat-b", "chat-c"] if i % (LOST_AFTER_FRAMES - 1) == 0 else ["chat-b"]
        link._find_lost([_telemetry(seq, present)], gen)
    assert "chat-c" in link._chat_ids
