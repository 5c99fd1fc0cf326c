"""KVScope wire protocol, the engine's telemetry on PUB (topic `TOPIC_TELEMETRY`): one
`Telemetry` snapshot per publish, with the block pool as packed arrays and cumulative histograms.

`ipc.protocol` re-exports every name here; import them from there. numpy only: no torch, no Qt.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ipc.messages import LiveConfig, _EngineMsg


class BlockArrays(msgspec.Struct, kw_only=True):
    """BlockSnapshot arrays as raw little-endian bytes; `dtypes` holds numpy dtype strings."""

    num_blocks: int
    state: bytes  # uint8: 0 empty, 1 cached (free, hashed), 2 in use
    ref_count: bytes  # int32
    filled: bytes  # int32: token slots holding K/V
    short_hash: bytes  # uint32: first 4 bytes of the prefix hash, 0 = none
    parent: bytes  # int32: block holding the previous block of the chain, -1 = none
    dtypes: dict[str, str]

    @classmethod
    def pack(cls, **arrays: np.ndarray) -> BlockArrays:
        """Pack the five arrays (keyword names as the fields) with their wire dtypes."""
        n = len(arrays["state"])
        fields: dict[str, bytes] = {}
        for name, dtype in BLOCK_DTYPES.items():
            arr = np.ascontiguousarray(arrays[name], dtype=dtype)
            assert arr.shape == (n,), f"{name} has shape {arr.shape}, expected ({n},)"
            fields[name] = arr.tobytes()
        return cls(num_blocks=n, dtypes=dict(BLOCK_DTYPES), **fields)

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Decode to read-only numpy arrays; ValueError when sizes or dtypes do not match."""
        out: dict[str, np.ndarray] = {}
        for name in BLOCK_DTYPES:
            dtype = np.dtype(self.dtypes.get(name, BLOCK_DTYPES[name]))
            raw = getattr(self, name)
            if len(raw) != self.num_blocks * dtype.itemsize:
                raise ValueError(
                    f"blocks.{name} has {len(raw)} bytes, expected "
                    f"{self.num_blocks} x {dtype.itemsize}"
                )
            out[name] = np.frombuffer(raw, dtype=dtype)
        return out


BLOCK_DTYPES: dict[str, str] = {
    "state": "|u1",
    "ref_count": "<i4",
    "filled": "<i4",
    "short_hash": "<u4",
    "parent": "<i4",
}


class RequestState(msgspec.Struct, kw_only=True):
    """Mirror of engine_proc.engine.telemetry_types.RequestSnapshot."""

    request_id: str
    status: str  # waiting | running | preempted | finished
    block_table: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int
    num_generated_tokens: int
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    origin: str = ""  # client_name of the client that sent it ("http", "gui", ...)
    # hybrid KV cache: each sliding-window group's table (group 1 first), -1 where a block was
    # released after leaving the window; empty for models with one group
    group_tables: list[list[int]] = []
    # agents: the kind of the grammar its output follows ("" none: json, json_object, regex,
    # choice, grammar), the tools it offered the model, and how many tokens the grammar allowed
    # at each of its recent steps (oldest first, bounded)
    structured: str = ""
    num_tools: int = 0
    allowed_tokens: list[int] = []
    # speculative decoding: the request's latest speculative step since the previous snapshot
    # (empty draft_blocks: none). Its drafts' K/V went to positions draft_start.. (the physical
    # block of each slot in draft_blocks, noted before the rollback freed any); the first
    # draft_accepted were confirmed, the rest rolled back. num_draft_tokens /
    # num_accepted_tokens: its drafts verified and confirmed so far.
    draft_start: int = 0
    draft_blocks: list[int] = []
    draft_accepted: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class TokenEvent(msgspec.Struct, kw_only=True):
    request_id: str
    index: int  # 0 = first output token
    time: float  # engine monotonic clock


class StepStats(msgspec.Struct, kw_only=True):
    time: float  # end of step, engine monotonic clock
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int


class Histogram(msgspec.Struct, kw_only=True):
    """A cumulative histogram since the engine started: `counts[i]` observations fell in
    (bounds[i-1], bounds[i]], the last entry above every bound (+Inf); never reset, so a
    subscriber that lost snapshots still reads exact totals."""

    bounds: list[float]
    counts: list[int]  # len(bounds) + 1
    sum: float


class Telemetry(_EngineMsg, tag="telemetry", kw_only=True):
    seq: int  # increases by one per published snapshot (gaps = dropped snapshots)
    time: float  # engine monotonic clock
    counters: dict[str, float]
    config: LiveConfig
    blocks: BlockArrays
    requests: list[RequestState]
    token_events: list[TokenEvent] = msgspec.field(default_factory=list)  # since previous seq
    steps: list[StepStats] = msgspec.field(default_factory=list)  # since previous seq
    num_clients: int = 0
    # Cumulative since start (names below); empty from engines that keep none.
    histograms: dict[str, Histogram] = msgspec.field(default_factory=dict)
    finished_reasons: dict[str, int] = msgspec.field(default_factory=dict)  # stop/length/abort/..
    kv_events_seq: int = 0  # seq of the last KV event batch published before this snapshot
    # Routed-experts models: tokens routed to each expert, [layer][expert], cumulative since the
    # model was loaded (rows of dense layers 0); empty for models without experts.
    expert_counts: list[list[int]] = msgspec.field(default_factory=list)
    # The CPU decode step: "fused", "building" (eager while the fused step compiles) or "eager";
    # decode_detail: the fused step's 4-bit kernel, "here" / "elsewhere" (which process builds
    # it) or why it decodes eagerly. "" from engines without a fused step (GPUs, older ones).
    decode_step: str = ""
    decode_detail: str = ""


# Histogram names in Telemetry.histograms (vLLM's metric names without prefix and unit suffix
# where they have one): observed per finished sequence unless noted.
HISTOGRAM_NAMES = (
    "time_to_first_token_seconds",  # at the first token
    "inter_token_latency_seconds",  # per output token after the first
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_max_num_generation_tokens",  # per request: its max_tokens
    "request_time_per_output_token_seconds",  # per sequence: its mean gap after the first token
    "iteration_tokens_total",  # per engine step: tokens computed in it
)
