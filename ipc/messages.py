"""KVScope wire protocol, the request/reply messages: the structs a client's DEALER and the
engine's ROUTER exchange (client -> engine, engine -> client) and the pieces they share.

`ipc.protocol` re-exports every name here and holds the unions and codecs; import them from there.
This module imports neither torch, Qt nor engine_proc.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
ControlOp = Literal[
    "get_config",
    "set_limits",
    "set_prefix_caching",
    "reset_prefix_cache",
    "pause",
    "resume",
    "shutdown",
    "replay_kv_events",  # publish AllBlocksCleared and the whole prefix index (ipc/kv_events.py)
]
FinishReason = Literal["stop", "length", "abort", "error"]

_STRICT = dict(kw_only=True, forbid_unknown_fields=True, omit_defaults=True)


# ---------------------------------------------------------------- shared pieces


StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]


class StructuredOutput(msgspec.Struct, **_STRICT):
    """A constraint on a request's output, compiled by the engine against its tokenizer.

    kind / spec: "json" a JSON schema (its JSON text); "json_object" any JSON object (spec "");
    "regex" a regular expression; "choice" a JSON list of the allowed strings; "grammar" a
    GBNF grammar (llama.cpp's; xgrammar's EBNF). `field` is the API field the
    constraint came from ("response_format", "structured_outputs.json", "grammar",
    "tool_choice", ...): the engine's refusal of a grammar names it.
    """

    kind: StructuredKind
    spec: str = ""
    field: str = "structured_outputs"


class SamplingOptions(msgspec.Struct, **_STRICT):
    """Mirror of engine_proc.sampling_params.SamplingParams (same names and defaults).

    Only types are checked here; the engine validates values and its ValueError text comes back
    as an `error` with code `invalid_request`.
    """

    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # [-2, 2], OpenAI: subtracted once from every seen output token
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0, HF/vLLM: divides (or multiplies) prompt+output logits
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)  # token id -> [-100, 100]
    logprobs: int | None = None  # None = off; k >= 0: the chosen token's logprob and the top k
    structured: StructuredOutput | None = None  # a grammar every output token must follow
    speculative: bool = True  # false: no speculative decoding for this request


SAMPLING_FIELDS = tuple(SamplingOptions.__struct_fields__)


class KVTransferParams(msgspec.Struct, **_STRICT):
    """Prefill/decode disaggregation (docs/PROTOCOL.md section 10). To a prefill engine:
    `do_remote_decode` (keep the prompt's KV blocks under a lease; the Finish names them). To a
    decode engine: where to pull them from and the tokens the prefill engine already produced."""

    do_remote_decode: bool = False
    remote_endpoint: str | None = None  # the prefill engine's transfer endpoint
    remote_lease_id: str | None = None
    block_hashes: list[bytes] = msgspec.field(default_factory=list)  # the prompt's full blocks
    output_token_ids: list[int] = msgspec.field(default_factory=list)  # already generated

    def __post_init__(self) -> None:
        pulls = self.remote_endpoint is not None
        if pulls == (self.remote_lease_id is None):
            raise ValueError("remote_endpoint and remote_lease_id go together")
        if self.do_remote_decode and (pulls or self.output_token_ids):
            raise ValueError(
                "do_remote_decode (to a prefill engine) excludes remote_endpoint and "
                "output_token_ids (to a decode engine)"
            )
        if any(len(h) != 32 for h in self.block_hashes):
            raise ValueError("block_hashes must be 32-byte sha256 chain hashes")


class KVHandoff(msgspec.Struct, kw_only=True):
    """In a prefill engine's Finish: the prompt blocks held for pulling, and until when."""

    lease_id: str
    endpoint: str  # transfer endpoint (ipc/kv_transfer.py)
    block_hashes: list[bytes]  # the prompt's full blocks, chain order
    lease_seconds: float


class ChatMessage(msgspec.Struct, **_STRICT):
    """One turn as the chat template reads it. Tool calls are in the shape HF chat templates
    expect: [{"id", "type": "function", "function": {"name", "arguments": <dict>}}] (arguments
    parsed from OpenAI's JSON string); a `tool` turn names the call it answers."""

    role: str
    content: str
    tool_calls: list[dict[str, Any]] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the id of the call this is the result of
    name: str | None = None  # tool turns: the function's name (some templates print it)
    reasoning_content: str | None = None  # assistant turns: their thinking (templates may keep it)


class KVGroup(msgspec.Struct, kw_only=True):
    """One group of a hybrid KV cache: layers of one attention type, one block table each."""

    window: int | None  # None: full attention; else the tokens a sliding layer's query sees
    layers: list[int]


class ModelInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """engine.model_info(); unknown extra keys from newer engines are ignored."""

    name: str
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    block_size: int
    num_blocks: int
    kv_bytes_per_token: int
    max_model_len: int
    model_id: str = ""
    num_heads: int = 0
    vocab_size: int = 0
    attention_backend: str = ""
    kv_pool_bytes: int = 0  # num_blocks x block_size x kv_bytes_per_token
    decode_weights: str = ""  # "dense" or "int4" (4-bit copies for decode-sized products)
    cuda_graph_sizes: list[int] = []  # decode batch sizes replayed from CUDA graphs; [] = eager
    # the pool's format: "auto" (the model dtype), "fp32" / "fp16" (that float type under a
    # model of another), "int8" (+ a float16 scale per token and head) or "fp8"
    kv_cache_dtype: str = "auto"
    kv_host_bytes: int = 0  # host-memory KV tier below the pool; 0 = none
    kv_disk_bytes: int = 0  # disk KV tier (survives restarts); 0 = none
    role: str = ""  # "" (serves whole requests), "prefill" or "decode" (disaggregated)
    kv_transfer_endpoint: str = ""  # prefill role: where decode engines pull KV blocks
    cache_identity: str = ""  # all that decides K/V contents besides tokens (model, dtypes, ...)
    # how the API reads replies: the tool-call family its chat template teaches (hermes,
    # llama3_json, mistral, pythonic; hermes for templates without tools, the engine's fallback)
    # and "think" / "think_open" when it has thinking markers (open: the prompt opens the block)
    tool_parser: str = ""
    reasoning_parser: str = ""
    # hybrid KV cache (sliding-window layers): group 0 full attention, then the sliding groups;
    # [] or one group: every layer in one table
    kv_groups: list[KVGroup] = []


class LiveConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """engine.live_config() plus the server's pause switch."""

    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_chunk: int
    enable_prefix_caching: bool
    paused: bool = False
    # long_prefill_chunk is the engine's rule (its value here the chunk beside other requests;
    # a prompt alone takes the whole budget), not a number someone set
    long_prefill_chunk_default: bool = False


class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    completion_tokens: int
    # speculative decoding: drafts the engine verified for this sequence, and how many of them
    # it confirmed (0 and 0 without speculation, and from engines older than these fields;
    # older peers ignore them: Usage accepts unknown fields)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


# ---------------------------------------------------------------- client -> engine


class _ClientMsg(msgspec.Struct, tag_field="kind", **_STRICT):
    token: str | None = None  # access token; required on every message when the engine has one


class Hello(_ClientMsg, tag="hello", kw_only=True):
    protocol_version: int
    client_name: str = ""


class Generate(_ClientMsg, tag="generate", kw_only=True):
    request_id: RequestId
    prompt: str | list[int] | None = None  # text, or token ids
    messages: list[ChatMessage] | None = None  # chat (the model's chat template applies)
    sampling: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    cache_salt: str | None = None
    kv_transfer: KVTransferParams | None = None  # disaggregated serving (section 10)
    # chat only: OpenAI function tools, rendered by the chat template (apply_chat_template's
    # `tools`), and extra template arguments (`enable_thinking`, `reasoning_effort`, ...)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of `prompt` and `messages` must be given")
        if self.messages is not None and not self.messages:
            raise ValueError("`messages` must not be empty")
        if self.kv_transfer is not None and self.sampling.n != 1:
            raise ValueError("kv_transfer needs sampling.n == 1")


class Tokenize(_ClientMsg, tag="tokenize", kw_only=True):
    """Text or chat -> token ids, as `generate` would see them; answered with `tokenized`."""

    request_id: RequestId  # echoed in the reply (not a generate request: never in flight)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only: BOS as generate adds it
    add_generation_prompt: bool = True  # messages only: the assistant turn's opening
    tools: list[dict[str, Any]] | None = None  # messages only, as in Generate
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of `prompt` and `messages` must be given")


class Detokenize(_ClientMsg, tag="detokenize", kw_only=True):
    """Token ids -> text; answered with `tokenized`."""

    request_id: RequestId
    token_ids: list[int]


class Abort(_ClientMsg, tag="abort", kw_only=True):
    request_id: RequestId


class Control(_ClientMsg, tag="control", kw_only=True):
    op: ControlOp
    control_id: str = ""  # echoed in the ControlAck / Error, for matching replies
    max_num_seqs: int | None = None  # set_limits
    max_num_batched_tokens: int | None = None  # set_limits
    long_prefill_chunk: int | None = None  # set_limits
    # set_limits: true returns long_prefill_chunk to the engine's rule (LiveConfig's
    # long_prefill_chunk_default)
    default_prefill_chunk: bool | None = None
    enable_prefix_caching: bool | None = None  # set_prefix_caching

    def __post_init__(self) -> None:
        limits = (self.max_num_seqs, self.max_num_batched_tokens, self.long_prefill_chunk,
                  self.default_prefill_chunk or None)  # fmt: skip
        if self.op == "set_limits" and all(v is None for v in limits):
            raise ValueError(
                "set_limits needs at least one of max_num_seqs, max_num_batched_tokens, "
                "long_prefill_chunk, default_prefill_chunk"
            )
        if self.default_prefill_chunk and self.long_prefill_chunk is not None:
            raise ValueError("give long_prefill_chunk or default_prefill_chunk, not both")
        if self.op != "set_limits" and (any(v is not None for v in limits)
                                        or self.default_prefill_chunk is not None):
            raise ValueError(f"limits are only allowed with op 'set_limits', got op {self.op!r}")
        if self.op == "set_prefix_caching" and self.enable_prefix_caching is None:
            raise ValueError("set_prefix_caching needs enable_prefix_caching (true or false)")
        if self.op != "set_prefix_caching" and self.enable_prefix_caching is not None:
            raise ValueError(
                f"enable_prefix_caching is only allowed with op 'set_prefix_caching', "
                f"got op {self.op!r}"
            )


class Heartbeat(_ClientMsg, tag="heartbeat", kw_only=True):
    """Both directions and on PUB: `time` is the sender's monotonic clock."""

    time: float = 0.0
    paused: bool = False  # engine -> client only


class Goodbye(_ClientMsg, tag="goodbye", kw_only=True):
    """Client: I am leaving, abort my requests. Engine: I am shutting down."""

    reason: str = ""


# ---------------------------------------------------------------- engine -> client


class _EngineMsg(msgspec.Struct, tag_field="kind", **_STRICT):
    pass


class Welcome(_EngineMsg, tag="welcome", kw_only=True):
    """Reply to Hello."""

    protocol_version: int
    client_id: str  # hex of the ROUTER routing id the engine sees for this client
    model: ModelInfo
    config: LiveConfig
    pub_endpoint: str
    telemetry_hz: float
    heartbeat_interval: float
    client_timeout: float
    max_message_bytes: int
    server_time: float  # engine monotonic clock


class TopLogprob(msgspec.Struct, kw_only=True, array_like=True):
    """One candidate: sent as a 3-element array [token_id, token, logprob] (compact)."""

    token_id: int
    token: str  # the token decoded alone (may hold U+FFFD for part of a character)
    logprob: float


class TokenLogprobs(msgspec.Struct, kw_only=True):
    """Log-probabilities of one sampled token (log-softmax of the model's raw logits)."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = []  # the k most likely tokens, best first (k = sampling.logprobs)


class Delta(_EngineMsg, tag="delta", kw_only=True):
    request_id: str
    index: int  # sequence index within the request (0..n-1)
    token_ids: list[int]  # new tokens of this step
    text: str  # text that became final in this step
    token_times: list[float]  # engine monotonic clock, one per new token
    time: float  # engine clock when the delta was sent
    logprobs: list[TokenLogprobs] | None = None  # one per token_ids entry, when asked for


class Finish(_EngineMsg, tag="finish", kw_only=True):
    request_id: str
    index: int
    reason: FinishReason
    usage: Usage
    ttft: float | None = None  # seconds
    tpot: float | None = None
    e2e: float | None = None
    queue_time: float | None = None
    error: str | None = None  # why, when reason is abort or error
    kv_handoff: KVHandoff | None = None  # prefill role, do_remote_decode: blocks to pull


class Tokenized(_EngineMsg, tag="tokenized", kw_only=True):
    """Reply to `tokenize` and `detokenize`."""

    request_id: str
    token_ids: list[int]
    text: str  # detokenize: the decoded text; tokenize: the text that was tokenized
    max_model_len: int


class ControlAck(_EngineMsg, tag="control_ack", kw_only=True):
    control_id: str
    op: ControlOp
    config: LiveConfig  # the configuration after the change
    time: float  # engine clock; every Telemetry with time >= this one shows the change
    result: bool | None = None  # reset_prefix_cache: whether the cache was reset


class Error(_EngineMsg, tag="error", kw_only=True):
    code: str  # one of ipc.protocol.ERROR_CODES
    message: str
    request_id: str | None = None
    control_id: str | None = None


def sampling_to_dict(options: SamplingOptions) -> dict[str, Any]:
    """Keyword arguments for engine_proc's SamplingParams (all fields, same names)."""
    return {name: getattr(options, name) for name in SAMPLING_FIELDS}
