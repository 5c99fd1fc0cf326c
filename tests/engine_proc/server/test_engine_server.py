"""The engine server as a separate OS process (tiny random Llama), driven over ZeroMQ.

One engine process serves the package (conftest.py); bad input of every kind:
test_engine_server_bad_input.py. References are computed in-process with the same
tiny model, one prompt at a time (sequential greedy runs).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
import threading

import msgspec
import zmq

from engine_proc.sampling_params import SamplingParams
from ipc import protocol as P
from ipc.client import EngineClient, TelemetrySubscriber
from tests.engine_proc.server.engine_process import NUM_BLOCKS, _prompt, greedy
from tests.ipc.helpers import (
    REPO,
    is_msgpack_map,
    raw_dealer,
    recv_msg,
    wait_telemetry,
)


def test_ready_line_progress_and_welcome(engine, client) -> None:
    assert engine.endpoint.startswith("tcp://127.0.0.1:")
    assert engine.pub_endpoint.startswith("tcp://127.0.0.1:")
    assert engine.progress[0].startswith("KVSCOPE_PROGRESS 0.00")
    assert engine.progress[-1].startswith("KVSCOPE_PROGRESS 1.00")
    w = client.welcome
    assert w.protocol_version == P.PROTOCOL_VERSION
    assert w.model.num_blocks == NUM_BLOCKS and w.model.num_layers == 2
    assert w.model.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # 2 x layers x kv heads x dim x fp32
    assert w.pub_endpoint == engine.pub_endpoint


def test_stream_matches_in_process_engine(engine, client, reference) -> None:
    prompt = "hello world, this is a test"
    stream = client.generate(prompt, max_tokens=12, temperature=0.0)
    events = list(stream)
    deltas = [e for e in events if isinstance(e, P.Delta)]
    assert isinstance(events[-1], P.Finish) and len(deltas) >= 1
    assert stream.token_ids == greedy(reference, prompt, 12)
    assert stream.text == reference.tokenizer.decode(stream.token_ids)
    f = stream.finish
    assert f.reason == "length" and f.usage.completion_tokens == 12
    assert f.usage.prompt_tokens == len(prompt)
    assert f.ttft is not None and f.ttft > 0 and f.e2e >= f.ttft
    assert sum(len(d.token_times) for d in deltas) == 12


def test_64_concurrent_clients_equal_sequential_runs(engine, reference) -> None:
    n = 64
    expected = [greedy(reference, _prompt(i), 8 + i % 4) for i in range(n)]
    barrier = threading.Barrier(n)

    def one(i: int) -> list[int]:
        with EngineClient(engine.endpoint, client_name=f"t{i}") as c:
            barrier.wait(timeout=120)
            stream = c.generate(_prompt(i), max_tokens=8 + i % 4, temperature=0.0)
            got = [ev for ev in stream]
            assert isinstance(got[-1], P.Finish) and got[-1].reason == "length"
            return stream.token_ids

    with cf.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    assert results == expected


def test_one_client_many_threads(engine, client, reference) -> None:
    prompts = [_prompt(i) for i in range(16)]
    expected = [greedy(reference, p, 10) for p in prompts]
    with cf.ThreadPoolExecutor(16) as pool:
        got = list(
            pool.map(
                lambda p: client.generate(p, max_tokens=10, temperature=0.0).result(60).token_ids,
                prompts,
            )
        )
    assert got == expected


# ----------------------------------------------------------------- liveness and telemetry


def _blocks_free(rid: str):
    def pred(t: P.Telemetry) -> bool:
        return t.counters["num_blocks_in_use"] == 0 and all(r.request_id != rid for r in t.requests)

    return pred


def _paused_snapshot(client: EngineClient, sub: TelemetrySubscriber) -> P.Telemetry:
    """Pause the engine; the snapshot published right after the ack (cumulative counters as of
    the pause)."""
    ack = client.control("pause")
    assert ack.config.paused
    return wait_telemetry(sub, lambda t: t.time >= ack.time)


def _computed_tokens(t: P.Telemetry) -> tuple[float, float]:
    return t.counters["prompt_tokens_total"], t.counters["generation_tokens_total"]


def test_client_leaving_mid_stream_frees_its_blocks_without_another_engine_step(
    engine, client
) -> None:
    """docs/PROTOCOL.md section 5: a client that says goodbye or closes its socket has its
    requests aborted and their blocks freed at once. With the engine paused, the blocks must come
    free while no step runs (cumulative token counters unchanged)."""
    sub = TelemetrySubscriber(engine.pub_endpoint)
    try:
        c = EngineClient(engine.endpoint)
        stream = c.generate("a long one " * 5, max_tokens=900, temperature=0.0)
        for _, _ev in zip(range(3), stream, strict=False):
            pass
        paused = _paused_snapshot(client, sub)
        assert any(r.request_id == stream.request_id for r in paused.requests)
        assert paused.counters["num_blocks_in_use"] > 0
        c.close()  # goodbye
        freed = wait_telemetry(sub, _blocks_free(stream.request_id), timeout=60)
        assert _computed_tokens(freed) == _computed_tokens(paused)
        # Aborted for the goodbye, not after client_timeout of silence.
        assert f"client {c.welcome.client_id} gone (client said goodbye" in engine.log()
        client.resume()

        # A client that vanishes without a goodbye (socket closed, linger 0): the next message
        # the engine sends it (here a heartbeat: the paused engine sends no deltas) fails.
        routing_id = b"vanish-" + os.urandom(5)
        d = raw_dealer(engine.endpoint, routing_id=routing_id)
        d.send(
            P.encode(
                P.Generate(
                    request_id="vanish",
                    prompt="abc" * 10,
                    sampling=P.SamplingOptions(max_tokens=900, temperature=0.0),
                )
            )
        )
        assert isinstance(recv_msg(d), P.Delta)
        paused = _paused_snapshot(client, sub)
        assert any(r.request_id == "vanish" for r in paused.requests)
        d.close(linger=0)
        freed = wait_telemetry(sub, _blocks_free("vanish"), timeout=60)
        assert _computed_tokens(freed) == _computed_tokens(paused)
        # Noticed as unreachable, not after client_timeout of silence.
        assert f"client {routing_id.hex()} gone (client unreachable); 1 requests" in engine.log()
    finally:
        client.resume()
        sub.close()


def test_subscriber_sees_every_step_and_token_with_32_requests(engine, client) -> None:
    """Each snapshot's step stats and token events account for exactly what the cumulative
    counters gained since the previous snapshot, while 32 requests run (engine-side recount, no
    clock involved)."""
    sub = TelemetrySubscriber(engine.pub_endpoint)
    try:
        start = sub.latest(5.0)
        streams = [client.generate(_prompt(i), max_tokens=300, temperature=0.0) for i in range(32)]
        snaps: list[P.Telemetry] = [start]
        while not all(s.done for s in streams):
            msg = sub.recv(0.2)
            if isinstance(msg, P.Telemetry):
                snaps.append(msg)
            for s in streams:
                s.drain()
        assert all(s.finish.reason == "length" for s in streams)
        snaps.append(wait_telemetry(sub, lambda t: t.counters["num_requests_running"] == 0))
        gained = {
            name: snaps[-1].counters[name] - start.counters[name]
            for name in ("request_prompt_tokens_total", "generation_tokens_total")
        }
        # What the clients sent and received (one token per character with this tokenizer).
        assert [len(s.token_ids) for s in streams] == [300] * 32
        assert gained == {
            "request_prompt_tokens_total": sum(len(_prompt(i)) for i in range(32)),
            "generation_tokens_total": 32 * 300,
        }
        busy = [t for t in snaps if t.counters["num_requests_running"] >= 16]
        assert len(busy) >= 3, "snapshots must keep coming while the engine is busy"
        pairs = [(a, b) for a, b in zip(snaps, snaps[1:], strict=False) if b.seq == a.seq + 1]
        assert len(pairs) >= len(snaps) // 2, "the subscriber lost most snapshots"
        for a, b in pairs:
            (prompt_a, gen_a), (prompt_b, gen_b) = _computed_tokens(a), _computed_tokens(b)
            gained_prompt, gained_gen = prompt_b - prompt_a, gen_b - gen_a
            assert sum(st.num_prefill_tokens for st in b.steps) == gained_prompt
            assert len(b.token_events) == gained_gen
            # One token per running sequence per decode step, one more as a prompt completes.
            assert sum(st.num_decode_tokens for st in b.steps) <= gained_gen
        state = busy[len(busy) // 2].blocks.to_numpy()["state"]
        assert len(state) == NUM_BLOCKS and (state == 2).sum() > 0
    finally:
        sub.close()


def test_control_shows_in_next_snapshot_and_in_scheduling(engine, client) -> None:
    sub = TelemetrySubscriber(engine.pub_endpoint)
    try:
        ack = client.control("set_limits", max_num_seqs=2)
        assert ack.config.max_num_seqs == 2
        snap = wait_telemetry(sub, lambda t: t.time >= ack.time)
        assert snap.config.max_num_seqs == 2
        streams = [client.generate(_prompt(i), max_tokens=16, temperature=0.0) for i in range(6)]
        snaps: list[P.Telemetry] = []
        while not all(s.done for s in streams):
            msg = sub.recv(0.1)
            if isinstance(msg, P.Telemetry):
                snaps.append(msg)
            for s in streams:
                s.drain()
        assert max(t.counters["num_requests_running"] for t in snaps) <= 2
        assert max(st.num_running for t in snaps for st in t.steps) <= 2
        # Every step is reported (step stats accumulate between snapshots), so a queue that
        # lasted only a few fast steps is still seen.
        assert max(st.num_waiting for t in snaps for st in t.steps) >= 1
        assert client.set_limits(max_num_seqs=64).max_num_seqs == 64
        # a prefill chunk of one's own, then the engine's rule again
        assert client.set_limits(long_prefill_chunk=64).long_prefill_chunk_default is False
        ack = client.control("set_limits", default_prefill_chunk=True)
        assert ack.config.long_prefill_chunk_default and ack.config.long_prefill_chunk == 512
        snap = wait_telemetry(sub, lambda t: t.time >= ack.time)
        assert snap.config.long_prefill_chunk_default is True

        ack = client.control("set_prefix_caching", enable_prefix_caching=False)
        assert (
            wait_telemetry(sub, lambda t: t.time >= ack.time).config.enable_prefix_caching is False
        )
        prompt = "prefix caching check " * 4  # several full blocks
        client.generate(prompt, max_tokens=2).result(30)
        assert client.generate(prompt, max_tokens=2).result(30).finish.usage.cached_tokens == 0
        client.set_prefix_caching(True)
        client.generate(prompt, max_tokens=2).result(30)
        assert client.generate(prompt, max_tokens=2).result(30).finish.usage.cached_tokens > 0
        assert client.reset_prefix_cache() is True
        assert client.generate(prompt, max_tokens=2).result(30).finish.usage.cached_tokens == 0
    finally:
        sub.close()


def test_pause_and_resume(engine, client) -> None:
    sub = TelemetrySubscriber(engine.pub_endpoint)
    try:
        paused = _paused_snapshot(client, sub)
        assert paused.config.paused
        stream = client.generate("paused", max_tokens=4, temperature=0.0)
        # Snapshots published after the request arrived: it waits, and no step runs.
        rid = stream.request_id
        queued = [wait_telemetry(sub, lambda t: any(r.request_id == rid for r in t.requests))]
        queued.append(wait_telemetry(sub, lambda t: t.seq > queued[0].seq))
        for t in queued:
            assert t.config.paused and t.steps == [] and t.token_events == []
            (req,) = [r for r in t.requests if r.request_id == stream.request_id]
            assert req.status == "waiting" and req.num_generated_tokens == 0
            assert _computed_tokens(t) == _computed_tokens(paused)
        assert stream.drain() == []
        assert not client.resume().paused
        assert stream.result(30).finish.reason == "length"
    finally:
        client.resume()
        sub.close()


def test_n3_streams_every_index_and_telemetry_names_each_sequence(engine, client, reference):
    """n > 1 over the wire: deltas and one finish per index (0..2), the tokens of the in-process
    engine for each; telemetry lists sequence i >= 1 as "<request_id>#<i>" (docs/PROTOCOL.md
    4.3), in its requests and its token events."""
    params = dict(max_tokens=30, temperature=0.8, seed=7, n=3, ignore_eos=True)
    prompt = "three ways to say it"
    expected = {o.index: o.token_ids for o in reference.generate(prompt, SamplingParams(**params))}
    assert sorted(expected) == [0, 1, 2] and len({tuple(t) for t in expected.values()}) > 1
    sub = TelemetrySubscriber(engine.pub_endpoint)
    try:
        before = sub.latest(60)
        stream = client.generate(prompt, request_id="trio", **params)
        assert isinstance(next(stream), P.Delta)  # forked at its first token
        paused = _paused_snapshot(client, sub)
        ids = {"trio", "trio#1", "trio#2"}
        assert {r.request_id for r in paused.requests} == ids
        assert all(r.status == "running" for r in paused.requests)
        client.resume()
        for _ in stream:  # to the last finish
            pass
        assert sorted(stream.finishes) == [0, 1, 2]
        assert all(f.reason == "length" for f in stream.finishes.values())
        assert stream.token_ids_by_index == expected
        snaps = [before]
        while snaps[-1].counters["num_requests_running"] or len(snaps) == 1:
            snaps.append(wait_telemetry(sub, lambda t: t.seq > snaps[-1].seq))
        seen = [e.request_id for t in snaps[1:] for e in t.token_events]
        assert set(seen) == ids
        if [t.seq for t in snaps] == list(range(before.seq, before.seq + len(snaps))):
            assert {i: seen.count(i) for i in ids} == {i: 30 for i in ids}  # none lost
    finally:
        client.resume()
        sub.close()


def test_wire_carries_only_msgpack(engine) -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(engine.pub_endpoint)
    d = raw_dealer(engine.endpoint)
    try:
        frames: list[bytes] = []
        d.send(P.encode(P.Hello(protocol_version=P.PROTOCOL_VERSION)))
        d.send(
            P.encode(
                P.Generate(
                    request_id="wire", prompt="abc", sampling=P.SamplingOptions(max_tokens=5)
                )
            )
        )
        d.send(P.encode(P.Control(op="get_config")))
        d.send(b"garbage")
        kinds = set()
        while not {"welcome", "finish", "control_ack", "error"} <= kinds:
            assert d.poll(30_000)
            parts = d.recv_multipart()
            assert len(parts) == 1
            frames.append(parts[0])
            kinds.add(msgspec.msgpack.decode(parts[0])["kind"])
        topics = set()
        while not {P.TOPIC_TELEMETRY, P.TOPIC_HEARTBEAT} <= topics:
            assert sub.poll(30_000)
            topic, body = sub.recv_multipart()
            topics.add(topic)
            frames.append(body)
        for f in frames:
            assert f[:1] != b"\x80"  # pickle protocol >= 2 opcode PROTO
            assert is_msgpack_map(f)
    finally:
        d.close()
        sub.close(linger=0)


def test_non_loopback_bind_is_refused() -> None:
    cmd = [sys.executable, "-m", "engine_proc.server", "--endpoint", "tcp://0.0.0.0:*"]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 2 and "allow-remote" in r.stderr and "KVSCOPE_READY" not in r.stdout
    r = subprocess.run(
        cmd + ["--allow-remote"], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    assert r.returncode == 2 and "token" in r.stderr
    r = subprocess.run(
        cmd[:3] + ["--pub-endpoint", "tcp://*:0"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2
