"""GGUF file -> Checkpoint: the ModelConfig from the file's metadata, its tensors dequantized under
Hugging Face names (llama.cpp's q/k row permutation undone), Llama 3 rope scaling recovered from
rope_freqs.weight, and the tokenizer (engine_proc/loading/tokenizer_cache.py).
"""

from __future__ import annotations

import logging
import math
import re
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_proc.loading.checkpoint import Checkpoint, ProgressFn, split_fused_weights
from engine_proc.loading.gguf_header import GgufFile, GgufTensor
from engine_proc.loading.tokenizer_cache import gguf_tokenizer
from engine_proc.models.config import ModelConfig
from engine_proc.models.family import Family
from engine_proc.models.registry import family_for_gguf

if TYPE_CHECKING:  # torch is imported where tensors are read: gguf_config() runs without it
    import torch

logger = logging.getLogger(__name__)

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
# rotary tables, not weights: Llama 3's divisors, LongRoPE's factors (Phi-3)
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def load_gguf(path: Path, dtype: torch.dtype, report: ProgressFn) -> Checkpoint:
    from engine_proc.loading.experts import ExpertStacker  # torch: not on the catalog's path
    from engine_proc.loading.gguf_file import dequantize

    report(0.0, f"reading {path.name}")
    t0 = time.perf_counter()
    gguf_file, family, config = gguf_config(path)
    meta, tensors = gguf_file.metadata, gguf_file.tensors
    logger.debug("parsed GGUF header of %s in %.2f s", path.name, time.perf_counter() - t0)

    weights: dict[str, torch.Tensor] = {}
    stacker = ExpertStacker(config, dtype) if config.num_experts else None
    names = [n for n in tensors if n not in _ROPE_TENSORS]
    for i, name in enumerate(names):
        hf_name = _gguf_to_hf_name(name, family)
        if hf_name is None:
            logger.warning("ignoring unrecognised GGUF tensor %s", name)
            continue
        tensor = dequantize(tensors[name])
        if family.gguf_permutes_qk and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
            tensor = _unpermute_rope_rows(tensor, heads)
        if stacker is not None and stacker.wants(hf_name):
            stacker.take(hf_name, tensor)
        else:
            weights[hf_name] = tensor.to(dtype)
        report(0.95 * (i + 1) / len(names), f"dequantizing {name} ({i + 1}/{len(names)})")
    if stacker is not None:
        weights |= stacker.finish()
    logger.debug("dequantized %d tensors in %.2f s", len(weights), time.perf_counter() - t0)
    split_fused_weights(config, weights, family.fused_weights)  # Phi-3's attn_qkv, ffn_up

    report(0.96, "loading tokenizer")
    tokenizer = gguf_tokenizer(path, meta.get("tokenizer.chat_template"))
    file_type = meta.get("general.file_type")
    qtype = _file_type_name(file_type) if file_type is not None else "GGUF"
    display = f"{_strip_quant_suffix(path.stem)} ({qtype} GGUF)"
    return Checkpoint(config, weights, tokenizer, str(path), display)


def gguf_config(path: Path, rope_freqs: bool = True) -> tuple[GgufFile, Family, ModelConfig]:
    """A GGUF file's header -> (the file, its family, the ModelConfig), no tensor data read;
    ValueError naming what the engine cannot run. rope_freqs=False skips recovering Llama 3 rope
    scaling from rope_freqs.weight (the one check that reads a tensor, with torch)."""
    try:
        gguf_file = GgufFile(path)
    except (struct.error, UnicodeDecodeError, KeyError) as exc:
        raise ValueError(f"model={str(path)!r}: truncated or corrupt GGUF file ({exc!r})") from exc
    meta, tensors = gguf_file.metadata, gguf_file.tensors
    arch = meta.get("general.architecture")
    general_name = str(meta.get("general.name", "") or "")
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)  # Mixtral is stored as `llama`
    family = family_for_gguf(arch, general_name, f"model={str(path)!r}", experts)
    return gguf_file, family, _gguf_config(meta, arch, tensors, path, family, rope_freqs)


def _gguf_config(
    meta: dict[str, Any], arch: str, tensors: dict[str, GgufTensor], path: Path, family: Family,
    rope_freqs: bool = True,
) -> ModelConfig:  # fmt: skip
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
    if not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise ValueError(f"model={str(path)!r}: rope.dimension_count={rope_dim} for head_dim="
                         f"{head_dim} (even, at most head_dim expected)")  # fmt: skip
    if rope_dim < head_dim and family.gguf_permutes_qk:  # its row permutation spans the head
        raise ValueError(f"model={str(path)!r}: partial rotary (rope.dimension_count={rope_dim}, "
                         f"head_dim={head_dim}) is not supported for {arch} GGUFs")  # fmt: skip
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"model={str(path)!r}: value heads of another size than key heads")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"model={str(path)!r}: GGUF file has no token_embd.weight")
    embd = tensors["token_embd.weight"]
    eos_ids = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id")]
    common = dict(
        architecture="LlamaForCausalLM",
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
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        rotary_dim=rope_dim if rope_dim < head_dim else None,  # partial rotary (Phi-4-mini)
    )
    try:
        extra = family.gguf_fields(key, common)
    except ValueError as exc:
        raise ValueError(f"model={str(path)!r}: {exc}") from None
    if "rope_scaling" not in extra and "rope_factors_long.weight" in tensors:
        # LongRoPE's factors are tensors: the catalog (rope_freqs=False) sizes without them
        extra["rope_scaling"] = _gguf_longrope(meta, arch, tensors, common) if rope_freqs else None
    if "rope_scaling" not in extra and (rope_freqs or "rope_freqs.weight" not in tensors):
        extra["rope_scaling"] = _gguf_rope_scaling(meta, arch, tensors, head_dim, path)
    if extra.get("num_experts"):  # layers without a router keep a dense MLP
        routed = [f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(common["num_layers"])]
        extra["dense_mlp_layers"] = tuple(i for i, r in enumerate(routed) if not r)
    config = ModelConfig(**(common | extra))
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
    import torch

    from engine_proc.loading.gguf_file import dequantize

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


def _gguf_longrope(meta: dict[str, Any], arch: str, tensors: dict[str, GgufTensor],
                   common: dict) -> dict:  # fmt: skip
    """LongRoPE (Phi-3) from llama.cpp's rope_factors_long / _short tensors and metadata."""
    from engine_proc.loading.gguf_file import dequantize
    from engine_proc.models.families.phi3 import default_attention_factor, longrope

    context = common["max_position_embeddings"]
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length", context))
    attention = meta.get(f"{arch}.rope.scaling.attn_factor")
    if attention is None:
        attention = default_attention_factor(context / original, original)
    short, long = (dequantize(tensors[f"rope_factors_{k}.weight"]).reshape(-1).tolist()
                   for k in ("short", "long"))  # fmt: skip
    return longrope(short, long, original, float(attention))


def _llama3_freq_factors(scaling: dict, theta: float, head_dim: int) -> torch.Tensor:
    """Divisors llama.cpp's converter stores in rope_freqs.weight for these llama3 parameters:
    plain inverse frequencies over the ones the engine's rotary tables use."""
    import torch

    from engine_proc.models.layers import llama3_scale

    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return inv_freq / llama3_scale(inv_freq, scaling)


def _gguf_to_hf_name(name: str, family: Family) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = _GGUF_BLOCK_RE.match(name)
    names = _GGUF_LAYER_NAMES | family.gguf_layer_names
    if match is None or match.group(2) not in names:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


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


def _file_type_name(file_type: int) -> str:
    import gguf

    try:
        return gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return "GGUF"


def _strip_quant_suffix(stem: str) -> str:
    """'SmolLM2-135M-Instruct.Q4_1' -> 'SmolLM2-135M-Instruct'."""
    return re.sub(r"[.\-_](I?Q\d\w*|F16|F32|BF16)$", "", stem, flags=re.IGNORECASE) or stem
