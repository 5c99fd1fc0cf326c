"""The fused CPU decode step: a whole decode step of the int4 model in one C++ call
(engine_proc/native/fused_decode.cpp) instead of ~40 torch operators per layer dispatched from
Python.

The extension is compiled on first use and cached (engine_proc/executor/fused_build.py). Without a
compiler, or when the build fails, the engine logs a warning and decodes with the eager path.

It runs one-token rows (``ROWS_PER_CALL`` a call) of a float32 model with 4-bit decode weights
and a float32 or float16 KV cache (float16 by default there: attention/kv_quant.py): decodes,
and short prompt chunks a row per token (model_runner.py).
Steps of up to ``PRECISE_ROWS`` rows (a person chatting, a few chats at once) compute the
4-bit products with bfloat16 activation pairs, so their replies are the dense model's (its
float32 products to 2^-18); wider steps, where the products' arithmetic is the bound, with
activations quantized to 8 bits per group of 32 against the 4-bit codes in integer dot
products (int4_q8_kernels.h, llama.cpp's Q4_1 x Q8_1 arithmetic): all four products on
AVX512-VNNI CPUs, the MLP's on AVX2 ones (``Q8_PRODUCTS``). CPUs with AVX2 but not
AVX512-BF16 compute their other products in float32 (no bfloat16 dot products to gain from).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from engine_proc.attention.base import AttentionMetadata
from engine_proc.executor import fused_head
from engine_proc.models.config import ModelConfig
from engine_proc.models.int4 import Int4Weight
from engine_proc.models.llama import LlamaLayer, LlamaModel

logger = logging.getLogger(__name__)

def architecture_unsupported_reason(config: ModelConfig) -> str | None:
    """The fused C++ step computes Llama's layer with Qwen2's q/k/v biases, Qwen3's q/k head
    norms and Gemma 3's additions (sliding-window layers over the hybrid KV cache with their own
    rotary base, sandwich norms, a GELU-tanh MLP, scaled embeddings, its attention scale): what
    else a family adds it cannot express yet, and those models decode eagerly."""
    features = [
        (config.hidden_act not in ("silu", "gelu_tanh"), f"a {config.hidden_act} MLP"),
        (config.has_experts, "routed experts"),
        (config.attn_logit_softcap is not None, "attention logit soft-capping"),
        (config.final_logit_softcap is not None, "final logit soft-capping"),
        (config.rotary_dim is not None, "partial rotary"),
        ((config.rope_scaling or {}).get("rope_type") == "longrope", "longrope tables"),
    ]
    missing = [name for present, name in features if present]
    if missing:
        return f"has no {', '.join(missing)} ({config.architecture})"
    if config.architecture == "Phi3ForCausalLM":
        # Llama's layer once qkv_proj / gate_up_proj are split at load, but unverified
        return "has not been run on Phi3ForCausalLM by any test yet"
    return None


# 4-bit product kernels (the C++ Int4Kernel enum, in order): torch's own; ours, reading torch's
# packed layout: portable scalar code (any CPU; slow, for tests), AVX512-BF16 dot products, or
# AVX2 float32 FMAs (CPUs without AVX512-BF16). Wide steps: see Q8_PRODUCTS.
INT4_KERNELS = ("torch", "portable", "avx512_bf16", "avx2_fp32")
# 8-bit-activation kernels of wide steps' products (the C++ Q8Kernel enum, in order); the
# fused step runs the fastest compiled in (module.best_q8_kernel()).
Q8_KERNELS = ("portable", "avx2", "avx512_vnni")
# Attention kernels of one chunk of a row (the C++ AttendKernel enum, in order, attention_regs.h):
# the step runs AVX-512's where it fits the heads, else AVX2's, else the generic one.
ATTEND_KERNELS = ("generic", "avx2", "avx512")
# The products of wide steps on 8-bit activations, by 4-bit kernel and the 8-bit kernel that
# runs them (none where the 8-bit kernel would be slower than the 4-bit one: the AVX2 kernel
# on AVX512-BF16 CPUs). Measured with the parity prompts twice over in 16-row steps (replies
# identical to the dense model's for 32 tokens, of 8, each copy): AVX2 keeps the attention's
# two in float32 (the MLP's on 8 bits: 7 and 7; all four: 5); on AVX512-BF16 the alternative is
# single bfloat16 activations, no closer (the MLP's on 8 bits: 6 and 7; all four: 7 and 7), and
# the VNNI kernel runs at about twice its speed (16 and 64 rows, Zen 5).
_MLP, _ALL = ("gate_up", "down"), fused_head.ALL_PRODUCTS
Q8_PRODUCTS = {
    ("avx2_fp32", "avx2"): _MLP,
    ("avx2_fp32", "avx512_vnni"): _MLP,
    ("avx512_bf16", "avx512_vnni"): _ALL,
}
# Rows of one extension call (a wider decode step makes several). Measured at 64 streams on 2
# cores: 64 rows a call 616 tok/s, 16 rows a call 517 (the products' threads share more work).
ROWS_PER_CALL = 64
# Steps of up to this many rows run the precise products (see the module docstring). Measured
# on 2 Zen 4 cores, one layer's four products precise / fast (weights in cache): 1 row 62 / 49
# us, 4 rows 173 / 98, 8 rows 340 / 191, 16 rows 662 / 379 (which would cost the 16-stream
# rate a quarter). Whole steps of the default model, precise and fast alternating in one process
# (median forward): 1 row 5.13 / 4.31 ms, 8 rows 21.3 / 15.5 ms.
PRECISE_ROWS = 8
# Prompt chunks of up to this many tokens in a step run as one-token rows of the precise
# products where one of our kernels runs them. Measured on 2 Zen 5 cores, a chunk after 300
# cached tokens, eager / fused rows: AVX512-BF16 kernel, 1 thread 8 tokens 58 / 16 ms, 64
# 273 / 102; 2 threads 8 64 / 14, 64 136 / 55, 128 240 / 109, 256 257 / 285 (from 256 tokens
# eager prompts run on oneDNN); the AVX2 float32 kernel on the same CPU (eager products there
# AVX-512 wide, so an AVX2 CPU's eager prompts can only be slower): 1 thread 8 56 / 28, 128
# 361 / 273; 2 threads 8 39 / 17, 128 208 / 152.
FUSED_PROMPT_TOKENS = 128


PACK_BLOCKS = (64, 32)  # columns per block of torch's packed 4-bit layouts our kernels read


@functools.cache
def torch_int4_pack_block() -> int | None:
    """The block width B of torch's packed 4-bit CPU layout, if it is one our kernels read:
    [N / B, K, B / 2] bytes, the low nibble of byte (b, k, j) column B b + j, the high nibble
    column B b + B / 2 + j. torch packs B = 64 where it runs its AVX-512 code and B = 32 on
    AVX2 CPUs; None for anything else (our kernels are then not used)."""
    n, k = 128, 64
    codes = torch.randint(
        0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0)
    )
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    if packed.dtype != torch.uint8 or packed.numel() != n * k // 2:
        return None
    for block in PACK_BLOCKS:
        bytes_ = packed.reshape(n // block, k, block // 2).int()
        cols = codes.view(n // block, block, k).transpose(1, 2)
        low, high = cols[..., : block // 2], cols[..., block // 2 :]
        if torch.equal(bytes_ & 15, low) and torch.equal(bytes_ >> 4, high):
            return block
    return None


def pick_int4_kernel(model: LlamaModel, module: ModuleType) -> str:
    """avx512_bf16 where compiled in, allowed (model.native_bf16), torch packs blocks of 64
    columns and every 4-bit matrix has a multiple of 64 outputs; else avx2_fp32 where compiled
    in (and torch's layout is one it reads); else torch's kernel."""
    shapes_fit = all(
        w is not None and w.out_features % 64 == 0
        for layer in model.layers
        for w in (layer.qkv_int4, layer.o_int4, layer.gate_up_int4, layer.down_int4)
    )
    block = torch_int4_pack_block()
    if not shapes_fit or block is None:
        return "torch"
    if model.native_bf16 and module.has_avx512_bf16() and block == 64:
        return "avx512_bf16"
    return "avx2_fp32" if module.has_avx2() else "torch"


def kernel_planes(planes: torch.Tensor, kernel: str, only_q8: bool = False) -> torch.Tensor:
    """The scale and low planes as ``kernel`` reads them: float16 for the portable and AVX2
    kernels when every value is a float16 (the default model's are its GGUF's Q4_1 d and m),
    the same weights in 20 bytes per 32 instead of 24 (one-row products read memory); else the
    float32 planes. only_q8: every product of this weight runs on 8-bit activations (their
    kernels read either), so the AVX512-BF16 kernel, which reads float32 only, never runs it.
    Measured on Zen 4, the VNNI kernel's one-row steps, same process alternating (1 thread,
    medians of 4 and 6): 8.96 and 9.54 ms with float32 planes, 7.29 and 8.09 with float16."""
    if kernel in ("portable", "avx2_fp32") or only_q8:
        half = planes.half()
        if torch.equal(half.float(), planes):
            return half
    return planes


# packed codes, K, N -> the strips layout of int4_q8_kernels.h
StripsOf = Callable[[torch.Tensor, int, int], torch.Tensor]


def _linear(
    w: Int4Weight | None,
    bias: torch.Tensor | None,
    kernel: str,
    strips: StripsOf | None,
    only_q8: bool,
) -> list[torch.Tensor]:
    assert w is not None
    b = torch.empty(0) if bias is None else bias.float().contiguous()
    n, k = w.out_features, w.in_features
    s = strips(w.packed, k, n) if strips is not None else torch.empty(0, dtype=torch.uint8)
    planes = kernel_planes(w.planes, kernel, only_q8 and strips is not None)
    return [w.packed, w.scales_zeros, planes, b, s]


def layer_tensors(
    layer: LlamaLayer,
    kernel: str,
    strips: StripsOf | None = None,
    q8_products: tuple[str, ...] = (),
    only_q8: bool = False,
) -> list[torch.Tensor]:
    """The 26 tensors per layer the C++ side reads, in its order, for ``kernel``; with
    ``strips``, the codes of the ``q8_products`` (names from Q8_PRODUCTS) in the 8-bit-activation
    kernel's layout."""
    products = {
        "qkv": (layer.qkv_int4, layer.qkv_bias),
        "o": (layer.o_int4, None),
        "gate_up": (layer.gate_up_int4, None),
        "down": (layer.down_int4, None),
    }
    tensors = [layer.input_norm.contiguous(), layer.post_norm.contiguous()]
    for name, (w, bias) in products.items():
        tensors += _linear(w, bias, kernel, strips if name in q8_products else None, only_q8)
    # Qwen3's and Gemma 3's per-head q/k RMSNorm weights [head_dim], Gemma's norms of the
    # attention's and the MLP's outputs [hidden]; empty: none
    for norm in (layer.q_norm, layer.k_norm, layer.attn_out_norm, layer.mlp_out_norm):
        tensors.append(torch.empty(0) if norm is None else norm.float().contiguous())
    return tensors


def takes_int8_activations(activations: str, kernel: str, q8_kernel: str) -> bool:
    """Whether every step goes on 8-bit activations (EngineConfig.decode_activations): "int8"
    wherever our 4-bit kernels (their strips fit the model's shapes) meet a vector 8-bit kernel;
    "auto" where that was measured faster and as close to the float32 model as llama.cpp
    (python -m engine_proc.bench.decode_quality): the AVX2 4-bit kernel (1.6-1.8x one chat's
    speed, Zen 1) and the AVX512-BF16 one with VNNI (0.98-1.09x one chat, 1.12x a chat beside
    16 others, Zen 4); not where the 8-bit kernel is AVX2 beside the AVX512-BF16 kernel (no
    such CPU measured)."""
    vector_q8 = q8_kernel != "portable"
    if activations == "int8":
        return kernel in ("avx2_fp32", "avx512_bf16") and vector_q8
    on_avx2 = kernel == "avx2_fp32" and vector_q8
    on_avx512 = kernel == "avx512_bf16" and q8_kernel == "avx512_vnni"
    return activations == "auto" and (on_avx2 or on_avx512)


@dataclass(slots=True)
class FusedDecodeStep:
    """Runs pure decode steps of ``model`` through the extension's FusedDecoder."""

    model: LlamaModel
    module: ModuleType
    decoder: object
    int4_kernel: str = "torch"  # one of INT4_KERNELS
    precise_rows: int = PRECISE_ROWS  # steps up to this many rows: precise products (ours)
    q8_products: tuple[str, ...] = ()  # wider steps' products on 8-bit activations
    q8_kernel: str = "portable"  # the 8-bit-activation kernel running them (Q8_KERNELS)
    # Prompt chunks of up to this many tokens (a step's together) run as one-token rows of
    # precise products (model_runner.py); 0: none
    max_prompt_tokens: int = 0
    # Logits of wider steps (hidden -> float32 logits), when set: 8-bit or bfloat16 activations
    # against the exact 8-bit output projection (fused_head.use_head_kernel); else compute_logits'.
    wide_head: Callable[[torch.Tensor], torch.Tensor] | None = None
    # "q8" (8-bit activations), "bf16", "q8_float" (the exact 8-bit head's float32 kernel, for
    # every row under int8_activations) or "none"
    wide_head_kind: str = "none"
    # decode_activations="int8": every step's four products (and the 8-bit head) on 8-bit
    # activations, precise_rows 0
    int8_activations: bool = False
    # the attention kernel forced (one of ATTEND_KERNELS); None: the fastest that fits the heads
    attention_kernel: str | None = None

    @classmethod
    def create(
        cls,
        model: LlamaModel,
        module: ModuleType,
        int4_kernel: str | None = None,
        attention_chunks: int = 0,
        attention_kernel: str | None = None,
        q8_activations: bool = True,
        activations: str = "exact",
    ) -> FusedDecodeStep:
        """int4_kernel: one of INT4_KERNELS; None picks avx512_bf16 where it can run.
        attention_chunks: key chunks per sequence attended in parallel and merged; 0 picks by
        context length and thread count (tests force the merge with more).
        attention_kernel: one of ATTEND_KERNELS; None runs the fastest that fits the heads
        (tests run the others).
        q8_activations: wide steps quantize the activations of the Q8_PRODUCTS to 8 bits
        (int4_q8_kernels.h), as llama.cpp does; False keeps the 4-bit kernel's products.
        activations: "int8" puts every step's four products on 8-bit activations where a
        vector 8-bit kernel is compiled in (EngineConfig.decode_activations), and says so where
        none is; "auto" does the same silently; "exact" as above."""
        c = model.config
        if attention_kernel is not None and attention_kernel not in ATTEND_KERNELS:
            raise ValueError(f"attention_kernel must be one of {ATTEND_KERNELS} or None, got "
                             f"{attention_kernel!r}")  # fmt: skip
        kernel = int4_kernel or pick_int4_kernel(model, module)
        if kernel not in INT4_KERNELS:
            raise ValueError(f"int4_kernel must be one of {INT4_KERNELS}, got {kernel!r}")
        block = torch_int4_pack_block()
        if kernel != "torch" and block is None:
            raise ValueError(f"int4_kernel {kernel!r} cannot read this torch's packed layout")
        if kernel == "avx512_bf16" and block != 64:
            raise ValueError(f"int4_kernel avx512_bf16 reads 64-column blocks, torch packs {block}")
        q8_kernel = Q8_KERNELS[module.best_q8_kernel()]
        q8_products = Q8_PRODUCTS.get((kernel, q8_kernel), ()) if q8_activations else ()
        int8 = takes_int8_activations(activations, kernel, q8_kernel)
        if activations == "int8" and not int8:
            logger.warning("decode_activations='int8' needs our 4-bit kernels (AVX2, torch's "
                           "packed layout, outputs in multiples of 64); here the %s kernel runs "
                           "with float32 activations", kernel)  # fmt: skip
        if int8:
            q8_products = _ALL
        strips = functools.partial(_strips, module, block)
        tensors = [
            t
            for layer in model.layers
            for t in layer_tensors(layer, kernel, strips, q8_products, only_q8=int8)
        ]
        rotary, local = model.rotary, model.local_rotary
        none = torch.empty(0)
        decoder = module.FusedDecoder(
            tensors, model.embed, rotary.cos, rotary.sin, none if local is None else local.cos,
            none if local is None else local.sin, c.num_heads, c.num_kv_heads, c.head_dim,
            c.rms_norm_eps, INT4_KERNELS.index(kernel), block or 64, attention_chunks,
            -1 if attention_kernel is None else ATTEND_KERNELS.index(attention_kernel),
            float(model.embed_scale or 0.0), float(model.scale), c.hidden_act == "gelu_tanh",
            [layer.window or 0 for layer in model.layers],
            [layer.kv_group for layer in model.layers], [layer.kv_slot for layer in model.layers],
        )  # fmt: skip
        logger.info(
            "fused decode step: 4-bit products by the %s kernel, %s %s on 8-bit activations (%s)",
            kernel, "every step's" if int8 else "wide steps'", ", ".join(q8_products) or "none",
            q8_kernel,
        )  # fmt: skip
        prompt_tokens = FUSED_PROMPT_TOKENS if kernel in ("avx512_bf16", "avx2_fp32") else 0
        return cls(model, module, decoder, kernel, q8_products=q8_products, q8_kernel=q8_kernel,
                   max_prompt_tokens=prompt_tokens, precise_rows=0 if int8 else PRECISE_ROWS,
                   int8_activations=int8, attention_kernel=attention_kernel)  # fmt: skip

    @staticmethod
    def can_run(meta: AttentionMetadata) -> bool:
        lens = meta.query_lens_cpu
        return meta.max_query_len == 1 and len(lens) == sum(lens)

    def is_precise(self, rows: int) -> bool:
        """Whether a step of this many decode rows runs the precise products and head."""
        return rows <= self.precise_rows

    def compute_logits(self, hidden: torch.Tensor, precise: bool | None = None) -> torch.Tensor:
        """Logits of a fused step's rows: as precise as its products (the model's exact head
        up to ``precise_rows`` rows, or where ``precise`` says), ``wide_head``'s otherwise
        where it is set (fused_head.py)."""
        if precise is None:
            precise = self.is_precise(hidden.shape[0])
        if self.wide_head is not None and not precise:
            return self.wide_head(hidden)
        return self.model.compute_logits(hidden)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata, precise: bool | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Final-norm hidden states [rows, hidden] of a step that ``can_run``, its products
        precise as ``is_precise`` says for its rows unless ``precise`` is given. Rows are
        independent (each reads and writes only its own sequence's blocks), so a wide step runs
        as calls of at most ``ROWS_PER_CALL`` rows."""
        if precise is None:
            precise = self.is_precise(len(input_ids))
        groups = [meta, *meta.groups]
        return self.forward_rows(
            input_ids, positions, kv_cache, [g.slot_mapping for g in groups],
            [g.block_tables for g in groups], meta.seq_lens, precise,
        )  # fmt: skip

    def forward_rows(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
        slots: list[torch.Tensor], block_tables: list[torch.Tensor], seq_lens: torch.Tensor,
        precise: bool,
    ) -> torch.Tensor:  # fmt: skip
        """Final-norm hidden states of one-token rows (row r: token input_ids[r] at
        positions[r], K/V written to slots[g][r], attending to the first seq_lens[r] positions
        of block_tables[g][r] in the layers of KV group g; a sliding layer to its window's
        last of them), ``ROWS_PER_CALL`` rows a call, in order: a later call may read K/V an
        earlier one wrote (a prompt's tokens as rows)."""
        rows = len(input_ids)
        parts = [
            self.decoder.forward(
                input_ids[i:j], positions[i:j], kv_cache, [s[i:j] for s in slots],
                [t[i:j] for t in block_tables], seq_lens[i:j], self.model.norm, precise,
            )  # fmt: skip
            for i in range(0, rows, ROWS_PER_CALL)
            for j in [min(rows, i + ROWS_PER_CALL)]
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _strips(module: ModuleType, block: int, packed: torch.Tensor, k: int, n: int) -> torch.Tensor:
    return module.int4_strips(packed, k, n, block)
