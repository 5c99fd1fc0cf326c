"""Engine objects -> wire messages: what the server sends, built from what the engine returns
(RequestOutput, EngineSnapshot). Plain Python and numpy: no torch here."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from ipc import kv_events as K
from ipc import protocol as P


def finish_of(out: Any, abort_message: str | None) -> P.Finish:
    m = out.metrics
    reason = out.finish_reason
    error = out.error
    if reason == "abort":
        error = abort_message or error or "aborted"  # the server's reason is more precise
    elif error is None:
        error = abort_message
    return P.Finish(
        request_id=out.request_id,
        index=out.index,
        reason=reason,
        usage=P.Usage(
            prompt_tokens=int(out.num_prompt_tokens),
            cached_tokens=int(out.num_cached_tokens),
            completion_tokens=len(out.token_ids),
            draft_tokens=int(getattr(out, "num_draft_tokens", 0)),
            accepted_draft_tokens=int(getattr(out, "num_accepted_tokens", 0)),
        ),
        ttft=None if m is None else m.ttft,
        tpot=None if m is None else m.tpot,
        e2e=None if m is None else m.e2e,
        queue_time=None if m is None else m.queue_time,
        error=error,
    )


def synthetic_finish(rid: str, index: int, reason: str, why: str) -> P.Finish:
    return P.Finish(
        request_id=rid,
        index=index,
        reason=reason,  # type: ignore[arg-type]
        usage=P.Usage(prompt_tokens=0, cached_tokens=0, completion_tokens=0),
        error=why,
    )


def delta_of(out: Any) -> P.Delta:
    """The Delta for one RequestOutput that produced tokens or text."""
    m = out.metrics
    k = len(out.new_token_ids)
    now = time.monotonic()
    if m is not None and k and len(m.token_times) >= k:
        times = [float(t) for t in m.token_times[-k:]]
    else:  # the engine reports token times only on the final output: use now
        times = [now] * k
    return P.Delta(
        request_id=out.request_id,
        index=out.index,
        token_ids=list(out.new_token_ids),
        text=out.text_delta,
        token_times=times,
        time=now,
        logprobs=logprobs_of(getattr(out, "new_logprobs", None)),
    )


def logprobs_of(entries: list[Any] | None) -> list[P.TokenLogprobs] | None:
    if not entries:
        return None
    return [
        P.TokenLogprobs(
            token_id=int(e.token_id),
            token=e.token,
            logprob=float(e.logprob),
            top=[P.TopLogprob(token_id=int(t), token=s, logprob=float(lp)) for t, s, lp in e.top],
        )
        for e in entries
    ]


def live_config_of(cfg: dict[str, Any], paused: bool) -> P.LiveConfig:
    """engine.live_config() (or a snapshot's config) plus the server's pause switch."""
    return P.LiveConfig(
        max_num_seqs=int(cfg["max_num_seqs"]),
        max_num_batched_tokens=int(cfg["max_num_batched_tokens"]),
        long_prefill_chunk=int(cfg["long_prefill_chunk"]),
        enable_prefix_caching=bool(cfg["enable_prefix_caching"]),
        paused=paused,
        long_prefill_chunk_default=bool(cfg.get("long_prefill_chunk_default", False)),
    )


def telemetry_from_snapshot(
    snap: Any, seq: int, paused: bool, num_clients: int, origins: dict[str, str] | None = None
) -> P.Telemetry:
    """engine_proc.engine.telemetry_types.EngineSnapshot -> protocol Telemetry; `origins` maps
    request ids to the name of the client that sent them."""
    origins = origins or {}
    b = snap.blocks
    return P.Telemetry(
        seq=seq,
        time=float(snap.time),
        counters={k: float(v) for k, v in snap.counters.items()},
        config=live_config_of(snap.config, paused),
        blocks=P.BlockArrays.pack(
            state=b.state,
            ref_count=b.ref_count,
            filled=b.filled,
            short_hash=b.short_hash,
            parent=b.parent,
        ),
        requests=[
            P.RequestState(
                request_id=r.request_id,
                status=r.status,
                block_table=[int(x) for x in r.block_table],
                group_tables=[[int(x) for x in t] for t in r.group_tables],
                num_prompt_tokens=int(r.num_prompt_tokens),
                num_cached_tokens=int(r.num_cached_tokens),
                num_computed_tokens=int(r.num_computed_tokens),
                num_generated_tokens=int(r.num_generated_tokens),
                arrival_time=float(r.arrival_time),
                first_scheduled_time=_opt_float(r.first_scheduled_time),
                first_token_time=_opt_float(r.first_token_time),
                origin=origins.get(r.request_id.partition("#")[0], ""),
                structured=r.structured,
                num_tools=r.num_tools,
                allowed_tokens=[int(x) for x in r.allowed_tokens],
                draft_start=int(r.draft_start),
                draft_blocks=[int(x) for x in r.draft_blocks],
                draft_accepted=int(r.draft_accepted),
                num_draft_tokens=int(r.num_draft_tokens),
                num_accepted_tokens=int(r.num_accepted_tokens),
            )
            for r in snap.requests
        ],
        token_events=[
            P.TokenEvent(request_id=e.request_id, index=int(e.index), time=float(e.time))
            for e in snap.token_events
        ],
        steps=[
            P.StepStats(
                time=float(s.time),
                duration=float(s.duration),
                num_prefill_tokens=int(s.num_prefill_tokens),
                num_decode_tokens=int(s.num_decode_tokens),
                num_running=int(s.num_running),
                num_waiting=int(s.num_waiting),
            )
            for s in snap.steps
        ],
        num_clients=num_clients,
        histograms={
            name: P.Histogram(bounds=list(h.bounds), counts=list(h.counts), sum=float(h.sum))
            for name, h in getattr(snap, "histograms", {}).items()
        },
        finished_reasons=dict(getattr(snap, "finished_reasons", {})),
        expert_counts=[[int(n) for n in row] for row in getattr(snap, "expert_counts", [])],
        decode_step=str(getattr(snap, "decode_step", "")),
        decode_detail=str(getattr(snap, "decode_detail", "")),
    )


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


def ids_of_undecodable(data: bytes) -> tuple[str | None, str | None]:
    """Best effort: the request_id / control_id of a message that failed validation."""
    try:
        obj = msgspec.msgpack.decode(data)
    except Exception:
        return None, None
    if not isinstance(obj, dict):
        return None, None
    rid, ctl = obj.get("request_id"), obj.get("control_id")
    return (
        rid if isinstance(rid, str) and 0 < len(rid) <= 256 else None,
        ctl if isinstance(ctl, str) and len(ctl) <= 256 else None,
    )


def kv_event_batch(events: list[Any], seq: int, now: float, block_size: int) -> K.KVEventBatch:
    """engine_proc.core.kv_events -> one wire batch. Consecutive BlockStored events of one chain
    (each the parent of the next, as a prefill stores them) become one event with several
    hashes, and consecutive removals one BlockRemoved, as vLLM batches them. block_ids name
    pool blocks: a lower tier's events (medium host or disk) carry none."""
    out: list[K.KVEventWire] = []
    for e in events:
        last = out[-1] if out else None
        if hasattr(e, "token_ids"):  # BlockStored
            if (
                isinstance(last, K.BlockStored)
                and last.medium == e.medium
                and e.parent_block_hash == last.block_hashes[-1]
                and len(e.token_ids) == block_size
                and len(last.token_ids) == block_size * len(last.block_hashes)
            ):
                last.block_hashes.append(e.block_hash)
                last.token_ids.extend(e.token_ids)
                if e.medium == "pool":
                    last.block_ids.append(e.block_id)
            else:
                out.append(
                    K.BlockStored(
                        block_hashes=[e.block_hash],
                        parent_block_hash=e.parent_block_hash,
                        token_ids=list(e.token_ids),
                        block_size=block_size,
                        block_ids=[e.block_id] if e.medium == "pool" else [],
                        medium=e.medium,
                    )
                )
        elif hasattr(e, "block_hash"):  # BlockRemoved
            if isinstance(last, K.BlockRemoved) and last.medium == e.medium:
                last.block_hashes.append(e.block_hash)
            else:
                out.append(K.BlockRemoved(block_hashes=[e.block_hash], medium=e.medium))
        else:
            out.append(K.AllBlocksCleared(medium=e.medium))
    return K.KVEventBatch(seq=seq, time=now, events=out)
