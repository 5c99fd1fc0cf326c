"""What `--role prefill|decode` adds to the engine's socket loop (docs/PROTOCOL.md section 10).

prefill: requests sent with `kv_transfer.do_remote_decode` lease their prompt blocks when they
finish; their Finish carries a KVHandoff; a transfer ROUTER serves pulls; leases expire.
decode: requests sent with `kv_transfer.remote_endpoint` first pull the prompt blocks this pool
lacks (on the puller thread), then join the engine with them and the prefill engine's tokens. A
pull that fails is recomputed here (`kv_transfer_failure="recompute"`) or ends the request with
the error `kv_transfer_failed` ("fail").
"""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass
from typing import Any

import zmq

from engine_proc.kv_transfer.service import KVPuller, PullJob, PullResult, TransferServer
from engine_proc.kv_transfer.transfer import KVTransferRequest
from ipc import protocol as P

log = logging.getLogger(__name__)

ROLES = ("", "prefill", "decode")
TRANSFER_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(slots=True)
class DisaggConfig:
    role: str = ""  # "": whole requests (colocated)
    transfer_endpoint: str = "tcp://127.0.0.1:*"  # prefill: where pulls are served
    lease_seconds: float = 30.0
    transfer_timeout: float = 10.0
    transfer_failure: str = "recompute"
    fault: str = ""  # test hook of the prefill side: "drop" | "corrupt"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES[1:]} or empty, got {self.role!r}")
        if self.transfer_failure not in TRANSFER_FAILURE_POLICIES:
            raise ValueError(
                f"kv_transfer_failure must be one of {TRANSFER_FAILURE_POLICIES}, "
                f"got {self.transfer_failure!r}"
            )
        if not self.lease_seconds > 0 or not self.transfer_timeout > 0:
            raise ValueError("kv_lease_seconds and kv_transfer_timeout must be > 0")


@dataclass(slots=True)
class PendingPull:
    client: bytes
    prompt: Any
    params: Any
    cache_salt: str | None
    output_token_ids: list[int]
    started: float


class Disaggregation:
    """The role's sockets and bookkeeping; the server calls in from its loop."""

    def __init__(
        self, cfg: DisaggConfig, engine: Any, ctx: zmq.Context, token: str | None,
        allow_remote: bool, wake: Any,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.engine = engine
        self.server: TransferServer | None = None
        self.puller: KVPuller | None = None
        self.pending: dict[str, PendingPull] = {}
        self.pulls = self.pull_failures = self.bytes_received = self.blocks_received = 0
        self.pull_seconds = 0.0
        self.releases = 0  # leases ended without a pull: the pool had every block
        self.last_pull_seconds: dict[str, float] = {}  # request id -> its pull, for telemetry
        engine.transfer.leases.lease_seconds = cfg.lease_seconds
        identity = engine.cache_identity
        if cfg.role == "prefill":
            self.server = TransferServer(ctx, cfg.transfer_endpoint, engine.transfer, identity,
                                         token, allow_remote, cfg.fault, wake)  # fmt: skip
            self.server.start()
        elif cfg.role == "decode":
            self.puller = KVPuller(ctx, identity, engine.transfer.block_bytes, token,
                                   cfg.transfer_timeout, wake)  # fmt: skip

    @property
    def transfer_endpoint(self) -> str:
        return self.server.endpoint if self.server is not None else ""

    def refusal(self, kv: P.KVTransferParams) -> str | None:
        """Why this engine cannot take a request with these kv_transfer params."""
        if kv.do_remote_decode and self.cfg.role != "prefill":
            return "kv_transfer.do_remote_decode needs an engine started with --role prefill"
        if kv.remote_endpoint is not None and self.cfg.role != "decode":
            return "kv_transfer.remote_endpoint needs an engine started with --role decode"
        return None

    def request_of(self, kv: P.KVTransferParams) -> KVTransferRequest:
        return KVTransferRequest(
            do_remote_decode=kv.do_remote_decode, output_token_ids=list(kv.output_token_ids)
        )

    def start_pull(self, rid: str, kv: P.KVTransferParams, pending: PendingPull) -> bool:
        """Queue a pull of the blocks this pool lacks; False when nothing needs pulling."""
        assert self.puller is not None and kv.remote_endpoint and kv.remote_lease_id
        missing = self.engine.transfer.missing(list(kv.block_hashes))
        if not missing:  # end the lease at once; the request runs meanwhile
            self.puller.submit(PullJob(rid, kv.remote_endpoint, kv.remote_lease_id, []))
            return False
        self.pending[rid] = pending
        self.puller.submit(PullJob(rid, kv.remote_endpoint, kv.remote_lease_id, missing))
        return True

    def completed(self) -> list[tuple[str, PendingPull, PullResult]]:
        """Finished pulls whose request is still waiting (aborted ones are dropped)."""
        if self.puller is None:
            return []
        done = []
        while True:
            try:
                result = self.puller.results.get_nowait()
            except queue.Empty:
                return done
            if result.release_only:
                self.releases += 1
                continue
            pending = self.pending.pop(result.request_id, None)
            self.pulls += 1
            self.pull_seconds += result.seconds
            self.last_pull_seconds[result.request_id] = result.seconds
            if len(self.last_pull_seconds) > 256:
                self.last_pull_seconds.pop(next(iter(self.last_pull_seconds)))
            if result.error:
                self.pull_failures += 1
                log.warning("KV pull for %s failed after %.3f s: %s", result.request_id,
                            result.seconds, result.error)  # fmt: skip
            else:
                self.bytes_received += result.num_bytes
                self.blocks_received += len(result.payloads)
            if pending is not None:
                done.append((result.request_id, pending, result))

    def forget(self, rid: str) -> None:
        self.pending.pop(rid, None)  # its pull result, when it comes, is dropped

    def handoff(self, out: Any) -> P.KVHandoff | None:
        if out.kv_handoff is None or self.server is None:
            return None
        lease_id, hashes = out.kv_handoff
        return P.KVHandoff(lease_id=lease_id, endpoint=self.server.endpoint,
                           block_hashes=hashes, lease_seconds=self.cfg.lease_seconds)  # fmt: skip

    def tick(self) -> None:
        if self.server is not None:
            leases = self.engine.transfer.leases
            leases.collect()  # pulled on the server's thread: their blocks back to the pool
            leases.expire(self.engine.clock())

    def counters(self) -> dict[str, float]:
        return {
            "kv_transfer_pulls": float(self.pulls),
            "kv_transfer_pull_failures": float(self.pull_failures),
            "kv_transfer_pull_seconds": self.pull_seconds,
            "kv_transfer_bytes_received": float(self.bytes_received),
            "kv_transfer_blocks_received": float(self.blocks_received),
            "kv_transfer_pulls_pending": float(len(self.pending)),
            "kv_transfer_releases": float(self.releases),
        }

    def close(self) -> None:
        if self.puller is not None:
            self.puller.close()
        if self.server is not None:
            self.server.close()
        self.engine.transfer.leases.release_all()
