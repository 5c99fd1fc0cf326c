"""A torch-free stand-in with the LLMEngine API, for in-process server tests (auth, liveness).

Each request gets one block per 4 tokens; every step emits one token "x" per running request.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from engine_proc.engine.telemetry_types import BlockSnapshot, EngineSnapshot, RequestSnapshot
from engine_proc.outputs import RequestMetrics, RequestOutput
from engine_proc.sampling_params import SamplingParams
from ipc import protocol as P

BLOCK = 4


class FakeEngine:
    def __init__(self, num_blocks: int = 64, step_sleep: float = 0.0) -> None:
        self.num_blocks = num_blocks
        self.step_sleep = step_sleep
        self.requests: dict[str, dict[str, Any]] = {}
        self.free = list(range(num_blocks))
        self.limits = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "long_prefill_chunk": 0}
        self.caching = True

    def model_info(self) -> dict[str, Any]:
        return dict(
            name="fake",
            architecture="Fake",
            num_layers=1,
            num_kv_heads=1,
            head_dim=4,
            dtype="float32",
            device="cpu",
            block_size=BLOCK,
            num_blocks=self.num_blocks,
            kv_bytes_per_token=32,
            max_model_len=4096,
        )

    def live_config(self) -> dict[str, Any]:
        return {**self.limits, "enable_prefix_caching": self.caching}

    def set_limits(self, **kw: Any) -> dict[str, Any]:
        if kw.pop("default_prefill_chunk", False):
            self.limits["long_prefill_chunk"] = 512
        for k, v in kw.items():
            if v is not None:
                if not isinstance(v, int) or v < (0 if k == "long_prefill_chunk" else 1):
                    raise ValueError(f"{k} must be an integer >= 1, got {v!r}")
                self.limits[k] = v
        return self.live_config()

    def set_prefix_caching(self, enabled: bool) -> dict[str, Any]:
        self.caching = enabled
        return self.live_config()

    def reset_prefix_cache(self) -> bool:
        return True

    def add_request(
        self, rid: str, prompt: Any, params: SamplingParams, cache_salt: Any = None
    ) -> None:
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        prompt = getattr(prompt, "messages", prompt)  # a chat arrives as a ChatPrompt
        if not prompt:
            raise ValueError("prompt must not be empty")
        n_prompt = len(prompt)
        self.requests[rid] = dict(
            params=params,
            out=[],
            blocks=[],
            n_prompt=n_prompt,
            metrics=RequestMetrics(time.monotonic(), None, None, None),
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _alloc(self, r: dict[str, Any]) -> None:
        need = (r["n_prompt"] + len(r["out"]) + BLOCK - 1) // BLOCK
        while len(r["blocks"]) < need and self.free:
            r["blocks"].append(self.free.pop())

    def _release(self, rid: str) -> dict[str, Any]:
        r = self.requests.pop(rid)
        self.free.extend(reversed(r["blocks"]))
        r["blocks"] = []
        return r

    def _out(
        self, rid: str, r: dict[str, Any], new: list[int], reason: str | None
    ) -> RequestOutput:
        return RequestOutput(
            rid,
            0,
            new,
            "x" * len(new),
            list(r["out"]),
            "x" * len(r["out"]),
            r["n_prompt"],
            0,
            reason,
            None,
            r["metrics"],
        )

    def step(self) -> list[RequestOutput]:
        if self.step_sleep:
            time.sleep(self.step_sleep)
        outs = []
        now = time.monotonic()
        for rid in list(self.requests)[: self.limits["max_num_seqs"]]:
            r = self.requests[rid]
            r["out"].append(1)
            r["metrics"].token_times.append(now)
            self._alloc(r)
            if len(r["out"]) >= r["params"].max_tokens:
                r["metrics"].finished_time = now
                outs.append(self._out(rid, self._release(rid), [1], "length"))
            else:
                outs.append(self._out(rid, r, [1], None))
        return outs

    def abort_request(self, rid: str) -> list[RequestOutput]:
        if rid not in self.requests:
            raise ValueError(f"request_id {rid!r} is not an active request")
        r = self._release(rid)
        return [self._out(rid, r, [], "abort")]

    def snapshot(self) -> EngineSnapshot:
        n = self.num_blocks
        state = np.zeros(n, np.uint8)
        for r in self.requests.values():
            state[r["blocks"]] = 2
        blocks = BlockSnapshot(
            state,
            (state == 2).astype(np.int32),
            np.zeros(n, np.int32),
            np.zeros(n, np.uint32),
            -np.ones(n, np.int32),
        )
        reqs = [
            RequestSnapshot(
                rid,
                "running",
                list(r["blocks"]),
                r["n_prompt"],
                0,
                0,
                len(r["out"]),
                r["metrics"].arrival_time,
                None,
                None,
            )
            for rid, r in self.requests.items()
        ]
        counters = {
            "num_blocks_in_use": float((state == 2).sum()),
            "num_requests_running": float(len(self.requests)),
        }
        return EngineSnapshot(time.monotonic(), blocks, reqs, counters, self.live_config())


def welcome_message() -> P.Welcome:
    """The Welcome a server holding a FakeEngine would send (for raw-socket fakes)."""
    info = FakeEngine().model_info()
    cfg = P.LiveConfig(
        max_num_seqs=8, max_num_batched_tokens=64, long_prefill_chunk=0, enable_prefix_caching=True
    )
    return P.Welcome(
        protocol_version=P.PROTOCOL_VERSION, client_id="00", model=P.ModelInfo(**info),
        config=cfg, pub_endpoint="tcp://127.0.0.1:1", telemetry_hz=20.0,
        heartbeat_interval=0.125, client_timeout=0.5, max_message_bytes=1 << 20,
        server_time=0.0,
    )  # fmt: skip
