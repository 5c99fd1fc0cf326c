"""The paged-attention Triton kernel: ONE launch for a whole mixed batch (decode tokens, prompt
chunks whose earlier context is already cached, fresh prompts).

The program layout follows vLLM's unified attention kernel: a 2D grid of (query block of some
sequence, KV head). A program finds its sequence by binary search over ``query_start_loc`` on the
device, so the launch needs no host copy of the per-sequence lengths and its grid depends only on
the token and sequence counts (which keeps it capturable in a CUDA graph). K and V tiles are read
in the pool's format (``KV_FORMAT``, triton_kv_codec.py) and dequantised in registers: a
quantised pool is never copied out in the model dtype.

Launch planning and checks live in triton_backend.py; this module only defines kernels, and
nothing without triton.
"""

from __future__ import annotations

from engine_proc.attention.triton_kv_codec import triton

# Whether the kernels were decorated in interpreter mode (TRITON_INTERPRET=1 at import): they then
# run on host memory.
INTERPRETED = False

if triton is not None:
    import triton.language as tl

    from engine_proc.attention.triton_kv_codec import codes_as

    @triton.jit
    def _find_seq(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
        # Sequence s owns the global query blocks starting at query_start_loc[s] // BLOCK_Q + s.
        # That start index strictly increases with s (the "+ s" keeps sequences with zero or few
        # query tokens apart), so the owner is the last s whose start is <= q_block_idx.
        # Typed so the loop-carried values stay int32 tensors even if num_seqs is specialized.
        lo: tl.int32 = 0
        hi: tl.int32 = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if start <= q_block_idx:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _dot(a, b, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
        # Triton 3.9's interpreter computes tl.dot on bfloat16 operands wrongly (numpy has no
        # bfloat16). There the operands, already holding bfloat16 values, are widened exactly to
        # float32 first; compiled kernels always take the native path.
        if DOT_IN_FP32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b, input_precision=DOT_PRECISION)

    @triton.jit
    def _soft_capped(s, softcap):
        # s: scores in log2 units; softcap * tanh(score / softcap) on the natural-unit score
        # (Gemma 2), with tanh(x) = 1 - 2 / (exp(2x) + 1) on exp2 (saturates to +-1, no NaN).
        log2e: tl.constexpr = 1.4426950408889634
        x = s / (log2e * softcap)
        t = 1.0 - 2.0 / (tl.math.exp2(2.0 * log2e * x) + 1.0)
        return softcap * t * log2e

    # The sequence count and block-table width change every step, and a window per layer:
    # specializing on them (== 1, divisible by 16) would JIT-compile new variants while serving.
    @triton.jit(do_not_specialize=["num_seqs", "max_blocks_per_seq", "bt_stride_s", "window"])
    def paged_attention_kernel(
        out_ptr,  # [num_tokens, num_heads, head_dim]
        query_ptr,  # [num_tokens, num_heads, head_dim], last dim contiguous
        k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous
        v_cache_ptr,
        k_scale_ptr,  # int8: [num_blocks, block_size, num_kv_heads]; fp8: one float32
        v_scale_ptr,
        block_tables_ptr,  # [num_seqs, max_blocks_per_seq], -1 padded
        seq_lens_ptr,  # [num_seqs]
        query_start_loc_ptr,  # [num_seqs + 1]
        scale_log2,  # softmax scale * log2(e): the softmax runs on exp2, the cheaper unit
        softcap,  # > 0: scores become softcap * tanh(score / softcap) (Gemma 2); 0: none
        window,  # > 0: a query sees itself and the window - 1 keys before it; 0: every key
        num_seqs,
        max_blocks_per_seq,
        q_stride_t,
        q_stride_h,
        o_stride_t,
        o_stride_h,
        bt_stride_s,
        kc_stride_b,
        kc_stride_s,
        kc_stride_h,
        vc_stride_b,
        vc_stride_s,
        vc_stride_h,
        sc_stride_b,  # int8 scales (K's and V's share a layout); unused otherwise
        sc_stride_s,
        GROUP: tl.constexpr,  # query heads per KV head (GQA ratio)
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_P2: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # tokens per KV block (any positive integer)
        TILE: tl.constexpr,  # keys per online-softmax step, power of 2 (>= 16 for tl.dot)
        BLOCK_Q: tl.constexpr,  # query tokens per program
        BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q * GROUP rounded up to a power of 2
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 models (tf32 over a quantised pool)
        DOT_IN_FP32: tl.constexpr,  # interpreter + bfloat16 only, see _dot
        KV_FORMAT: tl.constexpr,  # 0 model dtype, 1 int8, 2 fp8 (triton_kv_codec.KV_FORMATS)
    ):
        q_block_idx = tl.program_id(0)
        kv_head = tl.program_id(1)

        seq = _find_seq(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        local_block = q_block_idx - (q_start // BLOCK_Q + seq)
        # The grid is an upper bound on the number of query blocks (so the host never has to
        # read the query lengths); surplus programs of a sequence stop here.
        if local_block * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len  # tokens of this sequence cached before this step

        # Row r of the tile is (query token r // GROUP, query head r % GROUP of this KV head):
        # every query head sharing the KV head rides in the same program, so each K/V tile is
        # loaded once for the whole group instead of GROUP times.
        rows = tl.arange(0, BLOCK_M)
        q_idx = local_block * BLOCK_Q + rows // GROUP  # token index within the sequence's chunk
        head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
        dims = tl.arange(0, HEAD_DIM_P2)
        dim_valid = dims < HEAD_DIM

        token = (q_start + q_idx).to(tl.int64)
        q = tl.load(
            query_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        q_pos = context_len + q_idx  # absolute position: each row sees keys 0..q_pos

        # Keys past the last query token of this block are invisible to every row: stop there.
        kv_end = context_len + tl.minimum((local_block + 1) * BLOCK_Q, q_len)
        # A sliding window: keys before the first row's window are invisible to every row (and
        # their blocks may be released, -1): start at the tile holding the first visible one.
        span = tl.where(window > 0, window, kv_end + 1)
        kv_start = tl.maximum(context_len + local_block * BLOCK_Q - span + 1, 0) // TILE * TILE

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)

        qk_scale = scale_log2
        if KV_FORMAT == 2:  # fp8: K's layer scale goes into the scores' (codes_as: x 256)
            qk_scale = scale_log2 * tl.load(k_scale_ptr) * 256.0

        keys = tl.arange(0, TILE)
        bt_row = block_tables_ptr + seq.to(tl.int64) * bt_stride_s
        for tile_start in range(kv_start, kv_end, TILE):
            k_pos = tile_start + keys
            in_range = k_pos < kv_end
            logical = k_pos // BLOCK_SIZE
            # Block-table entries past the needed range are -1 padding (or past the row): the
            # mask keeps them from being read, and a -1 that does show up is never dereferenced.
            phys = tl.load(
                bt_row + logical,
                mask=in_range & (logical < max_blocks_per_seq),
                other=-1,
            ).to(tl.int64)
            key_valid = in_range & (phys >= 0)
            phys = tl.where(key_valid, phys, 0)
            in_block = k_pos % BLOCK_SIZE

            k_off = phys * kc_stride_b + in_block * kc_stride_s + kv_head * kc_stride_h
            k = tl.load(  # [HEAD_DIM_P2, TILE]: already transposed for q @ k
                k_cache_ptr + k_off[None, :] + dims[:, None],
                mask=key_valid[None, :] & dim_valid[:, None],
                other=0,
            )
            v_off = phys * vc_stride_b + in_block * vc_stride_s + kv_head * vc_stride_h
            v = tl.load(  # [TILE, HEAD_DIM_P2]
                v_cache_ptr + v_off[:, None] + dims[None, :],
                mask=key_valid[:, None] & dim_valid[None, :],
                other=0,
            )
            k = codes_as(k, KV_FORMAT, q.dtype)
            v = codes_as(v, KV_FORMAT, q.dtype)

            s = _dot(q, k, DOT_PRECISION, DOT_IN_FP32) * qk_scale
            if KV_FORMAT == 1:  # int8: a scale per key, applied to its score column
                s_off = phys * sc_stride_b + in_block * sc_stride_s + kv_head
                k_scale = tl.load(k_scale_ptr + s_off, mask=key_valid, other=0.0)
                s = s * k_scale.to(tl.float32)[None, :]
            if softcap > 0.0:
                s = _soft_capped(s, softcap)
            visible = row_valid[:, None] & key_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
            visible = visible & (k_pos[None, :] > q_pos[:, None] - span)
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row with no visible key so far (padding rows) keeps a max of -inf; subtracting 0
            # instead avoids -inf - -inf = NaN, and its exp2 terms are 0 either way.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)  # rescales what was accumulated under the old max
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]
            if KV_FORMAT == 1:  # int8: P @ (codes * scale) = (P * scale) @ codes
                v_scale = tl.load(v_scale_ptr + s_off, mask=key_valid, other=0.0)
                p = p * v_scale.to(tl.float32)[None, :]
            # P is rounded to the K/V dtype before P @ V, as flash-style kernels do (tensor cores).
            acc += _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_IN_FP32)
            m_i = m_new

        # Every real row sees at least its own key, so l_i > 0 there; padding rows are not stored.
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if KV_FORMAT == 2:  # fp8: V's layer scale (codes_as: x 256)
            acc = acc * (tl.load(v_scale_ptr) * 256.0)
        tl.store(
            out_ptr + token[:, None] * o_stride_t + head[:, None] * o_stride_h + dims[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )

    INTERPRETED = type(paged_attention_kernel).__name__ == "InterpretedFunction"
