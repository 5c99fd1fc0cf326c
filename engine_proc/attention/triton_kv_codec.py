"""Triton side of the KV cache's element formats: the KV-write kernel, which quantises each
token's row on its way into the pool, and the device function that turns a tile read from the
pool into its codes in the model dtype (the attention kernel applies the scales).

Formats (the ``KV_FORMAT`` constexpr of both kernels, ``KV_FORMATS`` below):

- 0 ``auto``: the model dtype, copied as is.
- 1 ``int8``: symmetric int8, one float16 scale per (token, KV head) in a scale tensor beside the
  pool, exactly as engine_proc/attention/kv_quant.py computes it on the torch path.
- 2 ``fp8``: float8 e4m3 (torch.float8_e4m3fn) with one float32 scale per layer for K and one
  for V (engine_proc/attention/kv_fp8.py). The pool is handed to the kernels as uint8 and the
  e4m3 codes are encoded and decoded with integer operations: Triton's interpreter converts
  float8e4nv wrongly (31.5 -> 16 in Triton 3.9) and sm_80 has no e4m3 conversion instruction,
  so one bit-exact path serves the interpreter and every GPU.

The module imports without triton (CPU-only installs): nothing is defined then.
"""

from __future__ import annotations

try:  # triton is optional: CPU installs use the torch reference backend
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # any import failure means "no usable triton here"
    triton = None
    tl = None
    TRITON_IMPORT_ERROR = exc

KV_FORMATS = {"auto": 0, "int8": 1, "fp8": 2}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MIN_SCALE = 1e-5  # kv_quant._MIN_SCALE: rows below 127e-5 in magnitude round to zero

if triton is not None:
    # Globals a jit function reads must be constexpr.
    _FP8_MAX = tl.constexpr(FP8_MAX)
    _INT8_MIN_SCALE = tl.constexpr(INT8_MIN_SCALE)

    @triton.jit
    def _rint(x):
        # Round half to even (torch.round) for |x| < 2**22: adding 1.5 * 2**23 leaves no
        # fraction bits, so the float32 add itself rounds; no fast-math folds it away.
        return (x + 12582912.0) - 12582912.0

    @triton.jit
    def fp8_encode(x):
        """float32 already within [-448, 448] -> e4m3fn code (round half to even) as int32."""
        sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
        a = tl.abs(x)
        bits = a.to(tl.int32, bitcast=True)
        # Normal range: round the 23-bit mantissa to 3 bits (the carry may bump the exponent),
        # then move the exponent bias from 127 to 7 (120 << 3 = 960).
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - 960
        # Below 2**-6 the codes are subnormal steps of 2**-9; a code of 8 is the smallest normal,
        # so rounding up across the boundary lands on the right code.
        sub = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
        code = tl.where(a < 0.015625, sub, normal)
        return code | (sign << 7)

    @triton.jit
    def fp8_to_half(code):
        """e4m3fn codes (uint8) -> float16 holding value / 256, exactly (0x7f / 0xff are NaN)."""
        c = code.to(tl.int32)
        # e4m3's exponent and mantissa bits, shifted into a float16, read 2**8 too small under
        # its exponent bias 15 (subnormals included); callers fold the 256 into their scales.
        half = (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
        return tl.where((c & 0x7F) == 0x7F, float("nan"), half)

    @triton.jit
    def codes_as(raw, KV_FORMAT: tl.constexpr, dtype: tl.constexpr):
        """A loaded K or V tile in the pool's format -> its codes in the model dtype, exactly
        (int8 codes and e4m3 values / 256 are representable in float16 and bfloat16). The
        scales are applied by the caller: int8's per key to the scores and to P, fp8's per
        layer to the softmax scale and the output."""
        if KV_FORMAT == 0:
            return raw
        elif KV_FORMAT == 1:
            # through float32 (exact): the interpreter turns int8 -> bfloat16 into NaN
            return raw.to(tl.float32).to(dtype)
        else:
            return fp8_to_half(raw).to(dtype)

    @triton.jit
    def _store_token_row(src, src_stride_h, dst, dst_stride_h, scale_dst, heads, dims, mask,
                         NUM_KV_HEADS: tl.constexpr, KV_FORMAT: tl.constexpr):  # fmt: skip
        # One token's [heads, head_dim] row into its slot, in the pool's format.
        row = tl.load(src + heads[:, None] * src_stride_h + dims[None, :], mask=mask, other=0.0)
        dst_rows = dst + heads[:, None] * dst_stride_h + dims[None, :]
        if KV_FORMAT == 0:
            tl.store(dst_rows, row.to(dst.dtype.element_ty), mask=mask)
        elif KV_FORMAT == 1:
            x = row.to(tl.float32)
            # The float16 scale is rounded first and the codes divided by it, as kv_quant does.
            scale = tl.maximum(tl.max(tl.abs(x), axis=1) / 127.0, _INT8_MIN_SCALE).to(tl.float16)
            tl.store(scale_dst + heads, scale, mask=heads < NUM_KV_HEADS)
            q = _rint(x / scale.to(tl.float32)[:, None])
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            tl.store(dst_rows, q.to(tl.int8), mask=mask)
        else:
            x = row.to(tl.float32) / tl.load(scale_dst)
            x = tl.minimum(tl.maximum(x, -_FP8_MAX), _FP8_MAX)  # saturate: e4m3fn has no inf
            tl.store(dst_rows, fp8_encode(x).to(tl.uint8), mask=mask)

    @triton.jit
    def write_kv_kernel(
        key_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
        value_ptr,
        k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous
        v_cache_ptr,
        k_scale_ptr,  # int8: [num_blocks, block_size, num_kv_heads]; fp8: one float32
        v_scale_ptr,
        slot_mapping_ptr,  # [num_tokens]
        key_stride_t,
        key_stride_h,
        value_stride_t,
        value_stride_h,
        kc_stride_b,
        kc_stride_s,
        kc_stride_h,
        vc_stride_b,
        vc_stride_s,
        vc_stride_h,
        sc_stride_b,  # int8 scales (K's and V's share a layout); unused otherwise
        sc_stride_s,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HEADS_P2: tl.constexpr,  # tl.arange needs power-of-2 extents; masks trim the padding
        HEAD_DIM_P2: tl.constexpr,
        KV_FORMAT: tl.constexpr,
    ):
        # One program per token: it writes all KV heads of that token, so a token's row is read
        # once and written as one contiguous [heads, head_dim] run of its slot (and the int8
        # scales of a token are one run of num_kv_heads values).
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:  # padding token (or one whose KV must not be stored)
            return
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, HEADS_P2)
        dims = tl.arange(0, HEAD_DIM_P2)
        mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
        scale_off = 0
        if KV_FORMAT == 1:
            scale_off = block * sc_stride_b + offset * sc_stride_s
        _store_token_row(
            key_ptr + token * key_stride_t, key_stride_h,
            k_cache_ptr + block * kc_stride_b + offset * kc_stride_s, kc_stride_h,
            k_scale_ptr + scale_off, heads, dims, mask, NUM_KV_HEADS, KV_FORMAT,
        )  # fmt: skip
        _store_token_row(
            value_ptr + token * value_stride_t, value_stride_h,
            v_cache_ptr + block * vc_stride_b + offset * vc_stride_s, vc_stride_h,
            v_scale_ptr + scale_off, heads, dims, mask, NUM_KV_HEADS, KV_FORMAT,
        )  # fmt: skip
