"""KVScope wire protocol: every message between the engine process and its clients.

Messages are `msgspec` Structs in three tagged unions (the tag is the `kind` field), encoded as
MessagePack maps. Decoding validates types, ranges and cross-field rules; anything that fails
raises `msgspec.ValidationError` / `msgspec.DecodeError` (the server answers with an `error`).
Pickle is never used. This module imports neither torch, Qt nor engine_proc: numpy only.

This module holds the constants (version, topics, size limits, error codes), the unions and
their codecs, and re-exports the structs, so `from ipc import protocol as P` reaches them all:
`ipc/messages.py` (request/reply messages and their shared pieces), `ipc/telemetry.py` (the
telemetry snapshot on PUB), `ipc/kv_events.py` (KV cache events on PUB).

Sockets (docs/PROTOCOL.md has the full description):
- client DEALER -> engine ROUTER: one frame per message, a `ClientMessage`.
- engine ROUTER -> client DEALER: one frame per message, an `EngineMessage`.
- engine PUB -> SUB: two frames, topic (`TOPIC_*`) then a `PubMessage`.
"""

from __future__ import annotations

from typing import Any, get_args

import msgspec

from ipc import kv_events as K
from ipc.messages import (
    SAMPLING_FIELDS,
    Abort,
    ChatMessage,
    Control,
    ControlAck,
    ControlOp,
    Delta,
    Detokenize,
    Error,
    Finish,
    FinishReason,
    Generate,
    Goodbye,
    Heartbeat,
    Hello,
    KVGroup,
    KVHandoff,
    KVTransferParams,
    LiveConfig,
    ModelInfo,
    RequestId,
    SamplingOptions,
    StructuredOutput,
    Tokenize,
    Tokenized,
    TokenLogprobs,
    TopLogprob,
    Usage,
    Welcome,
    sampling_to_dict,
)
from ipc.telemetry import (
    BLOCK_DTYPES,
    HISTOGRAM_NAMES,
    BlockArrays,
    Histogram,
    RequestState,
    StepStats,
    Telemetry,
    TokenEvent,
)

__all__ = [
    # re-exported from ipc.messages
    "Abort",
    "ChatMessage",
    "StructuredOutput",
    "Control",
    "ControlAck",
    "ControlOp",
    "Delta",
    "Detokenize",
    "Error",
    "Finish",
    "FinishReason",
    "Generate",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "KVGroup",
    "KVHandoff",
    "KVTransferParams",
    "LiveConfig",
    "ModelInfo",
    "RequestId",
    "SAMPLING_FIELDS",
    "SamplingOptions",
    "Tokenize",
    "Tokenized",
    "TokenLogprobs",
    "TopLogprob",
    "Usage",
    "Welcome",
    "sampling_to_dict",
    # re-exported from ipc.telemetry
    "BLOCK_DTYPES",
    "HISTOGRAM_NAMES",
    "BlockArrays",
    "Histogram",
    "RequestState",
    "StepStats",
    "Telemetry",
    "TokenEvent",
    # defined here
    "CLIENT_KINDS",
    "ClientMessage",
    "DEFAULT_CLIENT_TIMEOUT",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "ERROR_CODES",
    "EngineMessage",
    "MAX_CLIENT_MESSAGE_BYTES",
    "MAX_PUB_MESSAGE_BYTES",
    "MAX_REPLY_MESSAGE_BYTES",
    "PROGRESS_PREFIX",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "PubMessage",
    "READY_PREFIX",
    "TOPIC_GOODBYE",
    "TOPIC_HEARTBEAT",
    "TOPIC_KV_EVENTS",
    "TOPIC_TELEMETRY",
    "classify_decode_error",
    "decode_client",
    "decode_engine",
    "decode_pub",
    "encode",
    "ERR_BAD_MESSAGE",
    "ERR_UNKNOWN_KIND",
    "ERR_INVALID_MESSAGE",
    "ERR_UNAUTHORIZED",
    "ERR_VERSION_MISMATCH",
    "ERR_INVALID_REQUEST",
    "ERR_DUPLICATE_REQUEST_ID",
    "ERR_UNKNOWN_REQUEST",
    "ERR_INVALID_CONTROL",
    "ERR_OVERLOADED",
    "ERR_SHUTTING_DOWN",
    "ERR_INTERNAL",
    "ERR_KV_TRANSFER_FAILED",
]

PROTOCOL_VERSION = 1

# PUB topics (first frame of every published message)
TOPIC_TELEMETRY = b"telemetry"
TOPIC_HEARTBEAT = b"heartbeat"
TOPIC_GOODBYE = b"goodbye"
TOPIC_KV_EVENTS = K.TOPIC_KV_EVENTS  # KV cache events (ipc/kv_events.py)

# Size limits (ZMQ_MAXMSGSIZE); a bigger inbound message makes ZMQ drop the connection.
MAX_CLIENT_MESSAGE_BYTES = 1 << 20  # what the engine's ROUTER accepts
MAX_REPLY_MESSAGE_BYTES = 16 << 20  # what a client's DEALER accepts
MAX_PUB_MESSAGE_BYTES = 256 << 20  # what a SUB accepts (telemetry of huge block pools)

# Heartbeats (seconds); the Welcome message carries the values the engine actually uses.
# Start-up lines a spawned engine prints on stdout (docs/PROTOCOL.md section 3).
READY_PREFIX = "KVSCOPE_READY"
PROGRESS_PREFIX = "KVSCOPE_PROGRESS"

DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_CLIENT_TIMEOUT = 10.0

# Error codes (Error.code)
ERR_BAD_MESSAGE = "bad_message"  # not MessagePack, or not exactly one frame
ERR_UNKNOWN_KIND = "unknown_kind"  # `kind` missing or not a client message kind
ERR_INVALID_MESSAGE = "invalid_message"  # wrong type, missing or unknown field, bad value
ERR_UNAUTHORIZED = "unauthorized"  # token missing or wrong
ERR_VERSION_MISMATCH = "version_mismatch"  # hello with another protocol version
ERR_INVALID_REQUEST = "invalid_request"  # the engine refused the request (ValueError text)
ERR_DUPLICATE_REQUEST_ID = "duplicate_request_id"  # id of a request still in flight
ERR_UNKNOWN_REQUEST = "unknown_request"  # abort of an id that is not in flight
ERR_INVALID_CONTROL = "invalid_control"  # the engine refused a control value
ERR_OVERLOADED = "overloaded"  # too many requests in flight
ERR_SHUTTING_DOWN = "shutting_down"  # the engine is stopping and takes no new work
ERR_INTERNAL = "internal_error"  # a bug in the engine; the loop keeps serving
ERR_KV_TRANSFER_FAILED = "kv_transfer_failed"  # decode role, --kv-transfer-failure fail

ERROR_CODES = (
    ERR_BAD_MESSAGE,
    ERR_UNKNOWN_KIND,
    ERR_INVALID_MESSAGE,
    ERR_UNAUTHORIZED,
    ERR_VERSION_MISMATCH,
    ERR_INVALID_REQUEST,
    ERR_DUPLICATE_REQUEST_ID,
    ERR_UNKNOWN_REQUEST,
    ERR_INVALID_CONTROL,
    ERR_OVERLOADED,
    ERR_SHUTTING_DOWN,
    ERR_INTERNAL,
    ERR_KV_TRANSFER_FAILED,
)


# ---------------------------------------------------------------- unions, codecs

ClientMessage = Hello | Generate | Tokenize | Detokenize | Abort | Control | Heartbeat | Goodbye
EngineMessage = Welcome | Delta | Finish | Tokenized | ControlAck | Error | Heartbeat | Goodbye
PubMessage = Telemetry | Heartbeat | Goodbye | K.KVEventBatch

CLIENT_KINDS: tuple[str, ...] = tuple(t.__struct_config__.tag for t in get_args(ClientMessage))

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_engine_decoder = msgspec.msgpack.Decoder(EngineMessage)
_pub_decoder = msgspec.msgpack.Decoder(PubMessage)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_client(data: bytes) -> Any:
    """Decode a ClientMessage; raises msgspec.DecodeError / msgspec.ValidationError."""
    return _client_decoder.decode(data)


def decode_engine(data: bytes) -> Any:
    """Decode an EngineMessage (what a client's DEALER receives)."""
    return _engine_decoder.decode(data)


def decode_pub(data: bytes) -> Any:
    """Decode a PubMessage (the second frame of a published message)."""
    return _pub_decoder.decode(data)


class ProtocolError(Exception):
    """A frame that does not decode; `code` is one of the ERR_* codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def classify_decode_error(exc: Exception, data: bytes | None = None) -> ProtocolError:
    """Map a failure to decode the client frame `data` to its code in docs/PROTOCOL.md, with a
    message naming the field: `bad_message` when the frame is not one MessagePack value (msgspec's
    typed decoder may stop at a wrong type before it sees the garbage behind it), `unknown_kind`
    when it is a map without a string `kind` naming a client message, else `invalid_message`.
    Without `data` the code is inferred from msgspec's text alone."""
    text = str(exc)
    if data is not None:
        try:
            obj = msgspec.msgpack.decode(data)
        except msgspec.DecodeError as raw:
            return ProtocolError(ERR_BAD_MESSAGE, f"not a MessagePack message: {raw}")
        if isinstance(obj, dict) and obj.get("kind") not in CLIENT_KINDS:
            got = repr(obj.get("kind"))[:80]
            return ProtocolError(ERR_UNKNOWN_KIND, f"kind must be one of {CLIENT_KINDS}, got {got}")
        return ProtocolError(ERR_INVALID_MESSAGE, text)
    if isinstance(exc, msgspec.ValidationError):
        if "`$.kind`" in text or "missing required field `kind`" in text:
            return ProtocolError(ERR_UNKNOWN_KIND, f"{text}; kind must be one of {CLIENT_KINDS}")
        return ProtocolError(ERR_INVALID_MESSAGE, text)
    return ProtocolError(ERR_BAD_MESSAGE, f"not a MessagePack message: {text}")
