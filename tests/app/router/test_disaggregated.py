"""Prefill/decode disaggregation end to end: two tiny engine processes (`--role prefill`,
`--role decode`), the router between them, faults injected on the transfer path.

Every reply is checked against transformers' greedy generation of the same tiny model (never
against another KVScope engine); block accounting against the counters and block states the
engines publish, recomputed by hand from the prompt lengths."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from app.router.router import DisaggRouter
from ipc import protocol as P
from ipc.async_client import AsyncEngineClient
from ipc.client import EngineError
from tests.engine_fixtures import greedy_reference, tiny_hf_model
from tests.ipc.helpers import TINY, EngineProc

BS = 16
FAST = ["--heartbeat-interval", "0.2", "--telemetry-hz", "50"]
GREEDY = P.SamplingOptions(max_tokens=8, temperature=0, ignore_eos=True)


def _engine(role: str, *extra: str) -> EngineProc:
    return EngineProc([*TINY, *FAST, "--role", role, *extra], timeout=120)


@pytest.fixture(scope="module")
def reference():
    return greedy_reference(tiny_hf_model())


def _prompt(length: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt) % 120 + 3 for i in range(length)]


async def _connect(*procs: EngineProc) -> list[AsyncEngineClient]:
    clients = [AsyncEngineClient(p.endpoint, client_name="router") for p in procs]
    for c in clients:
        await c.connect(30)
    return clients


async def _collect(stream) -> tuple[list[int], P.Finish]:
    tokens: list[int] = []
    finish = None
    async for msg in stream:
        if isinstance(msg, P.Delta):
            tokens += msg.token_ids
        else:
            finish = msg
    assert finish is not None
    return tokens, finish


async def _counters(client: AsyncEngineClient, predicate, timeout: float = 60.0) -> dict:
    """The first telemetry matching predicate (the timeout only guards against a hang: another
    engine process publishes on its own schedule, slower on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tel = client.telemetry
        if tel is not None and predicate(tel):
            return tel
        await asyncio.sleep(0.05)
    raise AssertionError(f"telemetry never matched; last counters {tel.counters if tel else None}")


def _idle(tel: P.Telemetry) -> bool:
    """No block referenced (no request running, no lease held)."""
    arrays = tel.blocks.to_numpy()
    return not tel.requests and int((arrays["state"] == 2).sum()) == 0


def _router(prefill: AsyncEngineClient | None, decode: AsyncEngineClient | None) -> DisaggRouter:
    def live(c):
        return lambda: c if c is not None and c.state == "ready" else None

    return DisaggRouter(live(prefill), live(decode), ("prefill", "decode"))


def test_router_output_equals_transformers_and_pulls_only_missing_blocks(reference):
    prefill, decode = _engine("prefill"), _engine("decode")
    try:

        async def run() -> None:
            p, d = await _connect(prefill, decode)
            router = _router(p, d)
            system = _prompt(48, 1)  # three full blocks shared by every request
            prompts = [system + _prompt(n, s) for s, n in ((2, 20), (3, 37), (4, 5))]
            results = await asyncio.gather(*[
                _collect(await router.generate(f"r{i}", prompt=q, sampling=GREEDY))
                for i, q in enumerate(prompts)
            ])  # fmt: skip
            for q, (tokens, finish) in zip(prompts, results, strict=True):
                assert tokens == reference(q, 8)
                assert finish.reason == "length" and finish.usage.completion_tokens == 8
            assert router.handoffs == 3
            # Sequentially now: a second request with a known prompt pulls nothing.
            tokens, _ = await _collect(await router.generate("again", prompt=prompts[0],
                                                             sampling=GREEDY))  # fmt: skip
            assert tokens == reference(prompts[0], 8)
            full = [len(q) // BS for q in prompts]  # 4, 5, 3 full prompt blocks
            def ended(t: P.Telemetry) -> float:
                return t.counters.get("kv_transfer_pulls", 0) + t.counters.get(
                    "kv_transfer_releases", 0)  # fmt: skip

            tel = await _counters(d, lambda t: ended(t) >= 4 and _idle(t))
            c = tel.counters
            # Every lease ends once: pulled, or released when the pool already had every block.
            # The first two prompts have blocks of their own and must pull; the third (the
            # shared system blocks only) pulls unless another pull adopted them first; the last
            # request pulls nothing. Concurrent pulls may each fetch the shared blocks, but
            # never a block the pool held when the pull began.
            assert ended(tel) == 4 and 2 <= c["kv_transfer_pulls"] <= 3
            assert sum(full) - 2 * 3 <= c["kv_transfer_blocks_received"] <= sum(full)
            assert c["kv_transfer_pull_failures"] == 0
            assert c["kv_transfer_blocks_already_cached"] >= full[0]  # the last request
            ptel = await _counters(p, lambda t: _idle(t)
                                   and t.counters["kv_transfer_leases_active"] == 0)
            assert ptel.counters["kv_transfer_leases_granted"] == 4
            assert ptel.counters["kv_transfer_blocks_sent"] == c["kv_transfer_blocks_received"]
            for client in (p, d):
                await client.close()

        asyncio.run(run())
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("fault", ["drop", "corrupt"])
def test_a_failed_transfer_is_recomputed_on_the_decode_engine(fault, reference):
    # A dropped pull's lease ends by expiry: a short one keeps the wait short.
    lease = ["--kv-lease-seconds", "4"] if fault == "drop" else []
    prefill = _engine("prefill", "--kv-transfer-fault", fault, *lease)
    decode = _engine("decode", "--kv-transfer-timeout", "1")
    try:

        async def run() -> None:
            p, d = await _connect(prefill, decode)
            router = _router(p, d)
            q = _prompt(70, 5)
            tokens, finish = await _collect(await router.generate("f", prompt=q,
                                                                  sampling=GREEDY))  # fmt: skip
            assert tokens == reference(q, 8) and finish.reason == "length"
            tel = await _counters(d, lambda t: t.counters.get("kv_transfer_pulls", 0) == 1
                                  and _idle(t))  # fmt: skip
            assert tel.counters["kv_transfer_pull_failures"] == 1
            assert tel.counters["kv_transfer_blocks_adopted"] == 0
            # The dropped pull's lease ends on time; corrupt blocks were sent and released.
            await _counters(p, lambda t: _idle(t) and t.counters["kv_transfer_leases_active"] == 0,
                            timeout=40)  # fmt: skip

        asyncio.run(run())
    finally:
        prefill.stop()
        decode.stop()


def test_fail_policy_ends_the_request_with_a_clear_error():
    prefill = _engine("prefill", "--kv-transfer-fault", "drop")
    decode = _engine("decode", "--kv-transfer-timeout", "0.5", "--kv-transfer-failure", "fail")
    try:

        async def run() -> None:
            p, d = await _connect(prefill, decode)
            router = _router(p, d)
            stream = await router.generate("x", prompt=_prompt(40, 2), sampling=GREEDY)
            with pytest.raises(EngineError) as err:
                await _collect(stream)
            assert err.value.code == P.ERR_KV_TRANSFER_FAILED
            assert "decode engine" in err.value.message and "no reply" in err.value.message
            await _counters(d, _idle)

        asyncio.run(run())
    finally:
        prefill.stop()
        decode.stop()


def test_an_expired_lease_is_a_miss_and_the_prompt_is_recomputed(reference):
    prefill = _engine("prefill", "--kv-lease-seconds", "0.3")
    decode = _engine("decode")
    try:

        async def run() -> None:
            p, d = await _connect(prefill, decode)
            q = _prompt(50, 7)
            first = P.SamplingOptions(max_tokens=1, temperature=0, ignore_eos=True)
            tokens, fin = await _collect(await p.generate(
                "e", prompt=q, sampling=first,
                kv_transfer=P.KVTransferParams(do_remote_decode=True)))  # fmt: skip
            assert fin.kv_handoff is not None and len(fin.kv_handoff.block_hashes) == 3
            await _counters(p, lambda t: t.counters["kv_transfer_leases_expired"] == 1
                            and _idle(t))  # fmt: skip
            h = fin.kv_handoff
            kv = P.KVTransferParams(remote_endpoint=h.endpoint, remote_lease_id=h.lease_id,
                                    block_hashes=h.block_hashes, output_token_ids=tokens)
            rest, _ = await _collect(await d.generate("e", prompt=q, sampling=GREEDY,
                                                      kv_transfer=kv))  # fmt: skip
            assert tokens + rest == reference(q, 8)
            tel = await _counters(d, lambda t: t.counters.get("kv_transfer_pulls", 0) == 1)
            assert tel.counters["kv_transfer_pull_failures"] == 1

        asyncio.run(run())
    finally:
        prefill.stop()
        decode.stop()


def test_prefill_engine_killed_mid_transfer_then_the_decode_engine_serves_alone(reference):
    # The prefill engine never answers pulls, then dies while one waits on it.
    prefill = _engine("prefill", "--kv-transfer-fault", "drop")
    decode = _engine("decode", "--kv-transfer-timeout", "2")
    try:

        async def run() -> None:
            p, d = await _connect(prefill, decode)
            router = _router(p, d)
            q = _prompt(60, 9)
            stream = await router.generate("k", prompt=q, sampling=GREEDY)
            await _counters(d, lambda t: t.counters.get("kv_transfer_pulls_pending", 0) == 1)
            prefill.stop(signal.SIGKILL)
            tokens, _ = await _collect(stream)
            assert tokens == reference(q, 8)  # recomputed after the pull timed out
            deadline = time.monotonic() + 10
            while p.state == "ready" and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert router.status() == {"prefill": "gone", "decode": "ready"}
            q2 = _prompt(33, 11)
            tokens, _ = await _collect(await router.generate("w", prompt=q2, sampling=GREEDY))
            assert tokens == reference(q2, 8) and router.whole == 1
            await _counters(d, _idle)

        asyncio.run(run())
    finally:
        prefill.stop()
        decode.stop()


def test_decode_engine_killed_ends_its_requests_with_an_error_naming_it(reference):
    prefill = _engine("prefill", "--kv-lease-seconds", "1")
    decode = EngineProc([TINY[0], "tests.ipc.engines:paced_tiny", *TINY[2:], *FAST,
                         "--role", "decode"], timeout=120)  # fmt: skip
    try:

        async def run() -> None:
            p, d = await _connect(prefill, decode)
            router = _router(p, d)
            long = P.SamplingOptions(max_tokens=400, temperature=0, ignore_eos=True)
            stream = await router.generate("d", prompt=_prompt(40, 3), sampling=long)
            seen = 0
            with pytest.raises(EngineError) as err:
                async for msg in stream:
                    if isinstance(msg, P.Delta):
                        seen += len(msg.token_ids)
                        if seen == 3:
                            decode.stop(signal.SIGKILL)
            assert "decode engine" in err.value.message
            # The survivor: no leaked block once the lease ran out, and it serves whole requests.
            await _counters(p, lambda t: _idle(t) and t.counters["kv_transfer_leases_active"] == 0)
            deadline = time.monotonic() + 10
            while d.state == "ready" and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            q = _prompt(21, 4)
            tokens, _ = await _collect(await router.generate("s", prompt=q, sampling=GREEDY))
            assert tokens == reference(q, 8)
            assert router.status() == {"prefill": "ready", "decode": "gone"}

        asyncio.run(run())
    finally:
        prefill.stop()
        decode.stop()


def test_requests_the_roles_cannot_take_are_refused_with_the_field_named():
    prefill, decode = _engine("prefill"), _engine("decode")
    try:

        async def run() -> None:
            p, d = await _connect(prefill, decode)
            cases = [
                (d, P.KVTransferParams(do_remote_decode=True), "needs an engine started with "
                 "--role prefill"),
                (p, P.KVTransferParams(remote_endpoint=prefill.ready["kv_transfer_endpoint"],
                                       remote_lease_id="x"), "--role decode"),
            ]  # fmt: skip
            for client, kv, match in cases:
                stream = await client.generate("bad", prompt=[1, 2, 3], sampling=GREEDY,
                                               kv_transfer=kv)  # fmt: skip
                with pytest.raises(EngineError) as err:
                    await _collect(stream)
                assert err.value.code == P.ERR_INVALID_REQUEST and match in err.value.message
            assert p.model_info.role == "prefill" and d.model_info.role == "decode"
            assert p.model_info.kv_transfer_endpoint.startswith("tcp://127.0.0.1:")
            assert p.model_info.cache_identity == d.model_info.cache_identity != ""

        asyncio.run(run())
    finally:
        prefill.stop()
        decode.stop()
