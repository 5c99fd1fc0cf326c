// The output projection of decode-sized steps: a bfloat16 copy, or exact 8-bit codes.
#pragma once

#include "common.h"
#include "tile_gemm.h"

namespace kvscope {

// out[r, n] = round_bf16(sum_k bf16(x[r, k]) * w[n, k]) for a bfloat16 [N, K] weight, float32
// sums: the output projection of the int4 mode. native: AVX512-BF16 dot products (dpbf16ps)
// where compiled in; otherwise bf16 -> float32 widening and float32 FMAs (same products, exact
// in float32; only the summation order differs).
void bf16_gemv_rows(const bf16* x, const bf16* w, int64_t rows, int64_t k, int64_t n0, int64_t n1,
                    int64_t n, bool native, float* out) {
#if KVSCOPE_HAVE_AVX512_BF16
  if (native && k % 32 == 0) {
    for (int64_t j = n0; j < n1; ++j) {
      const bf16* wj = w + j * k;
      for (int64_t r = 0; r < rows; ++r) {
        const bf16* xr = x + r * k;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < k; i += 32) {
          const __m512bh a = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(xr + i));
          const __m512bh b = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(wj + i));
          acc = _mm512_dpbf16_ps(acc, a, b);
        }
        out[r * n + j] = static_cast<float>(bf16(_mm512_reduce_add_ps(acc)));
      }
    }
    return;
  }
#endif
  (void)native;
  std::vector<float> wf(k);
  for (int64_t j = n0; j < n1; ++j) {
    const bf16* wj = w + j * k;
    for (int64_t i = 0; i < k; ++i) wf[i] = static_cast<float>(wj[i]);
    for (int64_t r = 0; r < rows; ++r) {
      const bf16* xr = x + r * k;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < k; ++i) s += static_cast<float>(xr[i]) * wf[i];
      out[r * n + j] = static_cast<float>(bf16(s));
    }
  }
}

// Logits [rows, N] (float32 holding bfloat16 values) of a float32 hidden state [rows, K]
// against a bfloat16 output projection [N, K].
at::Tensor bf16_logits(const at::Tensor& hidden, const at::Tensor& weight, bool native) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(), "bf16 weight");
  const at::Tensor x = hidden.to(at::kBFloat16).contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  at::Tensor out = at::empty({rows, n}, at::kFloat);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 256, [&](int64_t n0, int64_t n1) {
    bf16_gemv_rows(xp, wp, rows, k, n0, n1, n, native, op);
  });
  return out;
}

// ---- 8-bit output projection ---------------------------------------------------------------
// A weight whose every group of 32 along K is exactly int8 codes times one scale (a GGUF Q8_0
// tensor, dequantized: the default model's tied embeddings) is held as those codes, half the
// bytes of a bfloat16 copy and exact. Layout for products that vectorize across 16 outputs:
// codes [N / 16, K, 16] int8, scales [N / 16, K / 32, 16] float32.

// (codes, scales), or an empty list when the weight is not exactly 8-bit (or N % 16 != 0).
std::vector<at::Tensor> q8_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2, "float32 [N, K] weight");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), groups = k / kGroupSize;
  if (n % 16 || k % kGroupSize) return {};
  at::Tensor codes = at::empty({n / 16, k, 16}, at::kChar);
  at::Tensor scales = at::empty({n / 16, groups, 16}, at::kFloat);
  const float* wp = w.data_ptr<float>();
  int8_t* cp = codes.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, n, 256, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1 && exact.load(std::memory_order_relaxed); ++j) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* x = wp + j * k + g * kGroupSize;
        float amax = 0.f;
        for (int64_t i = 0; i < kGroupSize; ++i) amax = std::max(amax, std::fabs(x[i]));
        // Q8_0 sets scale = amax / 127, so the largest code is +-127 and the division is exact.
        const float d = amax / 127.f;
        sp[((j / 16) * groups + g) * 16 + j % 16] = d;
        for (int64_t i = 0; i < kGroupSize; ++i) {
          const float q = d > 0.f ? std::nearbyint(x[i] / d) : 0.f;
          if (q * d != x[i]) exact.store(false, std::memory_order_relaxed);
          cp[((j / 16) * k + g * kGroupSize + i) * 16 + j % 16] = static_cast<int8_t>(q);
        }
      }
    }
  });
  if (!exact.load()) return {};
  return {codes, scales};
}

// 16 outputs of one row: per group, 32 products summed in four interleaved float32 chains
// (so consecutive FMAs do not wait on each other), then times the 16 group scales.
void q8_block(const int8_t* c, const float* d, const float* x, int64_t k, float* out) {
  const int64_t groups = k / kGroupSize;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                      _mm512_setzero_ps()};
    for (int64_t i = g * kGroupSize; i < (g + 1) * kGroupSize; i += 4) {
      KVSCOPE_UNROLL
      for (int u = 0; u < 4; ++u) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + (i + u) * 16));
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
        part[u] = _mm512_fmadd_ps(_mm512_set1_ps(x[i + u]), w, part[u]);
      }
    }
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(part[0], part[1]), _mm512_add_ps(part[2], part[3]));
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(d + g * 16), sum, acc);
  }
  _mm512_storeu_ps(out, acc);
#else
  float acc[16] = {0};
  for (int64_t g = 0; g < groups; ++g) {
    float part[16] = {0};
    for (int64_t i = g * kGroupSize; i < (g + 1) * kGroupSize; ++i)
      KVSCOPE_UNROLL
      for (int j = 0; j < 16; ++j) part[j] += x[i] * static_cast<float>(c[i * 16 + j]);
    KVSCOPE_UNROLL
    for (int j = 0; j < 16; ++j) acc[j] += d[g * 16 + j] * part[j];
  }
  std::copy(acc, acc + 16, out);
#endif
}

// 16 outputs of R rows (x: R rows of K, out: R rows of stride `ld`): per row and group, 32
// products summed in four interleaved float32 chains (so consecutive FMAs do not wait on each
// other), then times the 16 group scales. Each converted weight vector feeds all R rows; a row's
// sums are the same whatever R is (same chains, same order).
template <int R>
void q8_rows(const int8_t* c, const float* d, const float* x, int64_t k, float* out, int64_t ld) {
  const int64_t groups = k / kGroupSize;
#if defined(__AVX512F__)
  __m512 acc[R];
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[R][4];
    KVSCOPE_UNROLL
    for (int r = 0; r < R; ++r)
      KVSCOPE_UNROLL
      for (int u = 0; u < 4; ++u) part[r][u] = _mm512_setzero_ps();
    for (int64_t i = g * kGroupSize; i < (g + 1) * kGroupSize; i += 4) {
      KVSCOPE_UNROLL
      for (int u = 0; u < 4; ++u) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + (i + u) * 16));
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
        KVSCOPE_UNROLL
        for (int r = 0; r < R; ++r)
          part[r][u] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k + i + u]), w, part[r][u]);
      }
    }
    const __m512 scale = _mm512_loadu_ps(d + g * 16);
    KVSCOPE_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(part[r][0], part[r][1]),
                                       _mm512_add_ps(part[r][2], part[r][3]));
      acc[r] = _mm512_fmadd_ps(scale, sum, acc[r]);
    }
  }
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ld, acc[r]);
#else
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r) {
    float acc[16] = {0};
    for (int64_t g = 0; g < groups; ++g) {
      float part[16] = {0};
      for (int64_t i = g * kGroupSize; i < (g + 1) * kGroupSize; ++i)
        KVSCOPE_UNROLL
        for (int j = 0; j < 16; ++j) part[j] += x[r * k + i] * static_cast<float>(c[i * 16 + j]);
      KVSCOPE_UNROLL
      for (int j = 0; j < 16; ++j) acc[j] += d[g * 16 + j] * part[j];
    }
    std::copy(acc, acc + 16, out + r * ld);
  }
#endif
}

#if KVSCOPE_HAVE_AVX2
// The 16 codes of one input of a block as float32 (exact).
inline void q8_codes16(const int8_t* c16, __m256 (&c)[2]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c16));
  c[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  c[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
}

// B blocks of 16 outputs (codes c + b * K * 16, scales d + b * groups * 16, outputs out + 16 b)
// of R rows, codes converted in registers, sums folded per group: D = sum(code x) in one
// float32 chain per output and row, then acc + scale D (one FMA per weight, where multiplying
// each code by its scale first took two; the tiles of wider calls hold code * scale, the same
// products to float32 rounding).
template <int R, int B>
void q8_rows_avx2(const int8_t* c, const float* d, const float* x, int64_t k, float* out,
                  int64_t ld) {
  const int64_t groups = k / kGroupSize;
  __m256 acc[R][B][2];
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r)
    KVSCOPE_UNROLL
    for (int b = 0; b < B; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 dot[R][B][2];
    KVSCOPE_UNROLL
    for (int r = 0; r < R; ++r)
      KVSCOPE_UNROLL
      for (int b = 0; b < B; ++b) dot[r][b][0] = dot[r][b][1] = _mm256_setzero_ps();
    for (int64_t i = g * kGroupSize; i < (g + 1) * kGroupSize; ++i) {
      __m256 w[B][2];
      KVSCOPE_UNROLL
      for (int b = 0; b < B; ++b) {
        // the codes 16 inputs ahead: 1.06x measured for one row
        _mm_prefetch(reinterpret_cast<const char*>(c + (b * k + i + 16) * 16), _MM_HINT_T0);
        q8_codes16(c + (b * k + i) * 16, w[b]);
      }
      KVSCOPE_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * k + i);
        KVSCOPE_UNROLL
        for (int b = 0; b < B; ++b) {
          dot[r][b][0] = _mm256_fmadd_ps(w[b][0], xb, dot[r][b][0]);
          dot[r][b][1] = _mm256_fmadd_ps(w[b][1], xb, dot[r][b][1]);
        }
      }
    }
    KVSCOPE_UNROLL
    for (int b = 0; b < B; ++b) {
      KVSCOPE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = _mm256_loadu_ps(d + (b * groups + g) * 16 + 8 * h);
        KVSCOPE_UNROLL
        for (int r = 0; r < R; ++r) acc[r][b][h] = fold_group(acc[r][b][h], scale, dot[r][b][h]);
      }
    }
  }
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r)
    KVSCOPE_UNROLL
    for (int b = 0; b < B; ++b) {
      _mm256_storeu_ps(out + r * ld + 16 * b, acc[r][b][0]);
      _mm256_storeu_ps(out + r * ld + 16 * b + 8, acc[r][b][1]);
    }
}

// One block of 16 outputs (codes [K, 16], scales [K / 32, 16]) as a float32 tile [K, 16] of
// its weights, code * scale (exact).
inline void q8_tile_avx2(const int8_t* c, const float* d, int64_t k, float* tile) {
  for (int64_t g = 0; g < k / kGroupSize; ++g) {
    const __m256 scale[2] = {_mm256_loadu_ps(d + g * 16), _mm256_loadu_ps(d + g * 16 + 8)};
    for (int64_t i = g * kGroupSize; i < (g + 1) * kGroupSize; ++i) {
      __m256 w[2];
      q8_codes16(c + i * 16, w);
      _mm256_storeu_ps(tile + i * kTileCols, _mm256_mul_ps(w[0], scale[0]));
      _mm256_storeu_ps(tile + i * kTileCols + 8, _mm256_mul_ps(w[1], scale[1]));
    }
  }
}
#endif

// Logits [rows, N] float32 = hidden [rows, K] (float32) x the exact 8-bit weight: float32
// products and sums, as the dense float32 model computes them (in another order).
at::Tensor q8_logits(const at::Tensor& hidden, const at::Tensor& codes, const at::Tensor& scales) {
  const at::Tensor x = hidden.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat && codes.scalar_type() == at::kChar, "q8 dtypes");
  const int64_t rows = x.size(0), k = x.size(1), blocks = codes.size(0), groups = k / kGroupSize;
  TORCH_CHECK(codes.size(1) == k && codes.size(2) == 16, "q8 codes [N / 16, K, 16]");
  at::Tensor out = at::empty({rows, blocks * 16}, at::kFloat);
  if (rows == 0) return out;  // the row kernels assume at least one row
  const float* xp = x.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
#if KVSCOPE_HAVE_AVX2 && !defined(__AVX512F__)
  // AVX2: codes converted in registers for one or two rows (sums folded per group), weights
  // into a float32 tile per block for more
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    const int64_t ld = blocks * 16;
    if (rows >= kAvx2TileRows) {
      float* tile = tile_buffer(k);
      for (int64_t b = b0; b < b1; ++b) {
        q8_tile_avx2(cp + b * k * 16, sp + b * groups * 16, k, tile);
        tile_all_rows(tile, xp, rows, k, op + b * 16, ld);
      }
      return;
    }
    for (int64_t b = b0; b < b1;) {  // one row: blocks in pairs, four chains
      const int8_t* c = cp + b * k * 16;
      const float* d = sp + b * groups * 16;
      if (rows == 2) {
        q8_rows_avx2<2, 1>(c, d, xp, k, op + b * 16, ld);
        b += 1;
      } else if (b + 2 <= b1) {
        q8_rows_avx2<1, 2>(c, d, xp, k, op + b * 16, ld);
        b += 2;
      } else {
        q8_rows_avx2<1, 1>(c, d, xp, k, op + b * 16, ld);
        b += 1;
      }
    }
  });
  return out;
#endif
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    const int64_t ld = blocks * 16;
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* c = cp + b * k * 16;
      const float* d = sp + b * groups * 16;
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) q8_rows<4>(c, d, xp + r * k, k, op + r * ld + b * 16, ld);
      for (; r < rows; ++r) q8_block(c, d, xp + r * k, k, op + r * ld + b * 16);  // = q8_rows<1>
    }
  });
  return out;
}

// ---- The 8-bit output projection with bfloat16 activations (wide decode steps) ------------
// The same exact 8-bit codes, multiplied with the hidden state rounded to bfloat16 by dot
// products (dpbf16ps, twice the float32 FMA's products per instruction). Per block of 16
// outputs the codes are widened once into bfloat16 pairs (k, k + 1) per output, exact, in a
// buffer of K / 2 x 16 pairs that stays in L1 while every row passes over it.
#if KVSCOPE_HAVE_AVX512_BF16
// codes [K, 16] int8 of one block -> pairs [K / 2][16] of (code k, code k + 1) as bfloat16.
inline void widen_q8_block(const int8_t* c, int64_t k, int32_t* pairs) {
  constexpr int kOrAnd = 0xF8;  // vpternlogd truth table of a | (b & c)
  for (int64_t kk = 0; kk < k; kk += 2) {
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + kk * 16))));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + (kk + 1) * 16))));
    // small integers are exact in bfloat16: a float32's top 16 bits
    _mm512_storeu_si512(pairs + kk / 2 * 16,
                        _mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(a), 16),
                                                  _mm512_castps_si512(b),
                                                  _mm512_set1_epi32(static_cast<int>(0xFFFF0000)),
                                                  kOrAnd));
  }
}

// B blocks of 16 outputs (pairs[b], scales d[b], out + 16 b) of R rows (x: bfloat16 rows of
// K): per group of 32, 16 dot products per row and block into a chain of their own, then
// times the 16 group scales. Each broadcast activation pair feeds B products, each widened
// code register R.
template <int R, int B>
void q8_bf16_rows(const int32_t* const* pairs, const float* const* d, const bf16* x, int64_t k,
                  float* out, int64_t ld) {
  const int64_t groups = k / kGroupSize;
  __m512 acc[R][B];
  fill_registers(acc, _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[R][B];
    fill_registers(part, _mm512_setzero_ps());
    for (int64_t kk = g * kGroupSize; kk < (g + 1) * kGroupSize; kk += 2) {
      __m512bh w[B];
      KVSCOPE_UNROLL
      for (int b = 0; b < B; ++b) w[b] = (__m512bh)_mm512_loadu_si512(pairs[b] + kk / 2 * 16);
      KVSCOPE_UNROLL
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * k + kk, sizeof(pair));
        const __m512bh xp = (__m512bh)_mm512_set1_epi32(pair);
        KVSCOPE_UNROLL
        for (int b = 0; b < B; ++b) part[r][b] = _mm512_dpbf16_ps(part[r][b], w[b], xp);
      }
    }
    KVSCOPE_UNROLL
    for (int b = 0; b < B; ++b) {
      const __m512 scale = _mm512_loadu_ps(d[b] + g * 16);
      KVSCOPE_UNROLL
      for (int r = 0; r < R; ++r) acc[r][b] = _mm512_fmadd_ps(scale, part[r][b], acc[r][b]);
    }
  }
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r)
    KVSCOPE_UNROLL
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(out + r * ld + 16 * b, acc[r][b]);
}
#endif

bool q8_bf16_available() { return KVSCOPE_HAVE_AVX512_BF16 != 0; }

// Logits [rows, N] float32 = bf16(hidden) [rows, K] x the exact 8-bit weight, float32 sums.
at::Tensor q8_bf16_logits(const at::Tensor& hidden, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(q8_bf16_available(), "q8_bf16_logits needs AVX512-BF16");
  const at::Tensor xh = hidden.to(at::kBFloat16).contiguous();
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.size(2) == 16, "q8 codes [N / 16, K, 16]");
  const int64_t rows = xh.size(0), k = xh.size(1), blocks = codes.size(0), groups = k / kGroupSize;
  TORCH_CHECK(codes.size(1) == k && k % kGroupSize == 0, "q8 codes [N / 16, K, 16], K % 32 == 0");
  at::Tensor out = at::empty({rows, blocks * 16}, at::kFloat);
#if KVSCOPE_HAVE_AVX512_BF16
  const bf16* xp = xh.data_ptr<bf16>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  TORCH_CHECK(blocks % 2 == 0, "q8_bf16_logits: N % 32 == 0");
  at::parallel_for(0, blocks / 2, 8, [&](int64_t p0, int64_t p1) {  // pairs of blocks
    std::vector<int32_t> buffer(k * 16);  // two blocks' K / 2 x 16 pairs
    const int32_t* pairs[2] = {buffer.data(), buffer.data() + k / 2 * 16};
    const int64_t ld = blocks * 16;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = 2 * p;
      widen_q8_block(cp + b * k * 16, k, buffer.data());
      widen_q8_block(cp + (b + 1) * k * 16, k, buffer.data() + k / 2 * 16);
      const float* d[2] = {sp + b * groups * 16, sp + (b + 1) * groups * 16};
      float* o = op + b * 16;
      int64_t r = 0;
      for (; r + 6 <= rows; r += 6) q8_bf16_rows<6, 2>(pairs, d, xp + r * k, k, o + r * ld, ld);
      for (; r + 3 <= rows; r += 3) q8_bf16_rows<3, 2>(pairs, d, xp + r * k, k, o + r * ld, ld);
      for (; r < rows; ++r) q8_bf16_rows<1, 2>(pairs, d, xp + r * k, k, o + r * ld, ld);
    }
  });
#endif
  return out;
}

}  // namespace kvscope
