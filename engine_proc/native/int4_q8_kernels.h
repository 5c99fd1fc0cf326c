// 4-bit products with 8-bit activations for wide steps (llama.cpp's Q4_1 x Q8_1): AVX2
// (vpmaddubsw) and AVX512-VNNI (vpdpbusd) kernels, and a scalar twin for tests.
//
// Float32 FMAs do 8 multiply-adds an instruction; vpmaddubsw does 32 (unsigned 8-bit times
// signed 8-bit, pairs summed into 16 bits). So for steps wide enough that the products'
// arithmetic is the bound (above PRECISE_ROWS, where the AVX512-BF16 kernel rounds activations
// to bfloat16), each row's activations are quantized per group of 32 inputs: q = round(x / dx)
// with dx = max|x| / 127, and a column's group contributes
//   scale dx sum(code q) + low sx,   sx = dx sum(q),
// the integer sums exact (|sum| <= 16 * 15 * 127 per 16-bit lane: no saturation).
//
// Weights are read from "strips": 16 columns by 4 inputs per 32 bytes, byte 4c + t of
// (strip s, quad q) = code(16 s + c, 4 q + t) | code(16 s + 8 + c, 4 q + t) << 4, so one
// 32-byte load masked gives 8 columns' next 4 codes in the 4 bytes of each 32-bit lane, the
// layout vpmaddubsw + vpmaddwd sum along. Same bytes per weight as torch's layout (a second
// copy, built once at start-up by int4_strips).
#pragma once

#include "common.h"

namespace kvscope {

constexpr int64_t kStripCols = 16;
constexpr int kVnniRows = 8;  // rows a pass of the AVX512-VNNI kernel: 2 x 8 of its 32 registers

// The 8-bit-activation kernels, in the order of Q8_KERNELS (engine_proc/fused_decode.py).
enum class Q8Kernel : int64_t { kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2 };
inline bool is_q8_kernel(int64_t index) { return index >= 0 && index <= 2; }

inline bool q8_kernel_compiled(Q8Kernel kernel) {
  switch (kernel) {
    case Q8Kernel::kPortable: return true;
    case Q8Kernel::kAvx2: return KVSCOPE_HAVE_AVX2 != 0;
    case Q8Kernel::kAvx512Vnni: return KVSCOPE_HAVE_AVX512_VNNI != 0 && KVSCOPE_HAVE_AVX2 != 0;
  }
  return false;
}

// The fastest one compiled in.
inline Q8Kernel best_q8_kernel() {
  return q8_kernel_compiled(Q8Kernel::kAvx512Vnni) ? Q8Kernel::kAvx512Vnni
         : q8_kernel_compiled(Q8Kernel::kAvx2)     ? Q8Kernel::kAvx2
                                                   : Q8Kernel::kPortable;
}

// torch's packed 4-bit layout (see int4_kernels.h, blocks of pack_block columns) as strips
// [N / 16, K / 4, 32] bytes.
inline at::Tensor int4_strips(const at::Tensor& packed, int64_t k, int64_t n, int64_t pack_block) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == n * k / 2,
              "packed: uint8 [N, K / 2] in torch's layout");
  TORCH_CHECK(pack_block == 32 || pack_block == 64, "pack_block must be 32 or 64, got ", pack_block);
  TORCH_CHECK(n % pack_block == 0 && k % 4 == 0, "strips need N % pack_block == 0 and K % 4 == 0");
  at::Tensor strips = at::empty({n / kStripCols, k / 4, 32}, at::kByte);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  uint8_t* out = strips.data_ptr<uint8_t>();
  const int64_t half = pack_block / 2;
  const auto code = [&](int64_t col, int64_t kk) {
    const int64_t b = col / pack_block, j = col % pack_block;
    const uint8_t byte = w[(b * k + kk) * half + j % half];
    return j < half ? byte & 15 : byte >> 4;
  };
  at::parallel_for(0, n / kStripCols, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s)
      for (int64_t q = 0; q < k / 4; ++q)
        for (int64_t c = 0; c < 8; ++c)
          for (int64_t t = 0; t < 4; ++t)
            out[(s * (k / 4) + q) * 32 + 4 * c + t] = static_cast<uint8_t>(
                code(16 * s + c, 4 * q + t) | code(16 * s + 8 + c, 4 * q + t) << 4);
  });
  return strips;
}

// Rows of activations quantized per group of 32: codes [rows, K] int8, and per (row, group)
// the step dx and sx = dx sum(codes).
struct Q8Rows {
  std::vector<int8_t> codes;
  std::vector<float> step, sum;
};

// One group of 32: its codes, and returns (step, step * sum of codes).
inline std::pair<float, float> quantize_group(const float* x, int8_t* codes) {
  float amax = 0.f;
  for (int64_t i = 0; i < kGroupSize; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float dx = amax / 127.f, inv = dx != 0.f ? 1.f / dx : 0.f;
  int sum = 0;
  for (int64_t i = 0; i < kGroupSize; ++i) {
    // nearest, ties to even (what cvtps2dq does under the default rounding mode)
    const int q = static_cast<int>(std::nearbyint(x[i] * inv));
    codes[i] = static_cast<int8_t>(q);
    sum += q;
  }
  return {dx, dx * static_cast<float>(sum)};
}

#if KVSCOPE_HAVE_AVX2
// quantize_group in registers: the same codes and sums.
inline std::pair<float, float> quantize_group_avx2(const float* x, int8_t* codes) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  KVSCOPE_UNROLL
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float dx = _mm_cvtss_f32(m) / 127.f, inv = dx != 0.f ? 1.f / dx : 0.f;
  __m256i q[4], sum = _mm256_setzero_si256();
  KVSCOPE_UNROLL
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
    sum = _mm256_add_epi32(sum, q[i]);
  }
  // packs work within 128-bit lanes: the 32 bytes come out as 0-3 8-11 16-19 24-27 4-7 ...
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return {dx, dx * static_cast<float>(_mm_cvtsi128_si32(s))};
}
#endif

inline Q8Rows quantize_rows(const float* x, int64_t rows, int64_t k, bool vectorized) {
  const int64_t groups = rows * (k / kGroupSize);
  Q8Rows a{std::vector<int8_t>(rows * k), std::vector<float>(groups), std::vector<float>(groups)};
  // rows * k laid end to end, k a multiple of 32; a fork only where there is work for it
  at::parallel_for(0, groups, 512, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xg = x + t * kGroupSize;
      int8_t* codes = a.codes.data() + t * kGroupSize;
#if KVSCOPE_HAVE_AVX2
      if (vectorized) {
        std::tie(a.step[t], a.sum[t]) = quantize_group_avx2(xg, codes);
        continue;
      }
#endif
      std::tie(a.step[t], a.sum[t]) = quantize_group(xg, codes);
    }
  });
  return a;
}

#if KVSCOPE_HAVE_AVX2
// One strip (16 columns from col) for R rows of a: per group, the integer sums in 16 bits
// over its 8 quads, then widened, converted and scaled once into float32 sums kept in memory
// (L1): the registers hold the R x 2 integer sums and the codes.
template <int R, typename P>
void int4_strip_q8(const uint8_t* strip, const P* planes, const Q8Rows& a, int64_t row0,
                   int64_t k, int64_t n, int64_t col, float* out, bool prefetch) {
  const int64_t groups = k / kGroupSize;
  const int64_t next_col = col + kStripCols;
  prefetch = prefetch && next_col < n;
  const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  alignas(32) float acc[R][16] = {};
  for (int64_t g = 0; g < groups; ++g) {
    if (prefetch) {  // the next strip's codes and planes (as the VNNI kernel does)
      const char* next = reinterpret_cast<const char*>(strip + (k / 4 + 8 * g) * 32);
      KVSCOPE_UNROLL
      for (int line = 0; line < 4; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(planes + 2 * g * n + next_col), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(planes + (2 * g + 1) * n + next_col), _MM_HINT_T0);
    }
    __m256i sums[R][2];
    KVSCOPE_UNROLL
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    KVSCOPE_UNROLL
    for (int q = 0; q < 8; ++q) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(strip + (8 * g + q) * 32));
      const __m256i lo = _mm256_and_si256(w, nibble);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
      KVSCOPE_UNROLL
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, a.codes.data() + (row0 + r) * k + g * kGroupSize + 4 * q, 4);
        const __m256i xb = _mm256_set1_epi32(quad);
        sums[r][0] = pin(_mm256_add_epi16(sums[r][0], _mm256_maddubs_epi16(lo, xb)));
        sums[r][1] = pin(_mm256_add_epi16(sums[r][1], _mm256_maddubs_epi16(hi, xb)));
      }
    }
    const __m256 scale[2] = {load8(planes + 2 * g * n + col), load8(planes + 2 * g * n + col + 8)};
    const __m256 low[2] = {load8(planes + (2 * g + 1) * n + col), load8(planes + (2 * g + 1) * n + col + 8)};
    KVSCOPE_UNROLL
    for (int r = 0; r < R; ++r) {
      const int64_t t = (row0 + r) * groups + g;
      const __m256 dx = _mm256_set1_ps(a.step[t]), sx = _mm256_set1_ps(a.sum[t]);
      KVSCOPE_UNROLL
      for (int i = 0; i < 2; ++i) {
        const __m256 d = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r][i], ones));
        const __m256 prev = _mm256_load_ps(acc[r] + 8 * i);
        _mm256_store_ps(acc[r] + 8 * i,
                        _mm256_fmadd_ps(low[i], sx, _mm256_fmadd_ps(_mm256_mul_ps(scale[i], dx), d, prev)));
      }
    }
  }
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r) std::memcpy(out + (row0 + r) * n + col, acc[r], sizeof(acc[r]));
}

// Every row over one strip, in passes of at most kAvx2Rows rows as even as they come (9 rows
// 5 + 4, not 4 + 4 + 1: a pass of one row reloads and unpacks the strip's codes for little).
// Six fit AVX2's 16 registers once the sums are pinned (12 sums, the codes' halves, the
// broadcast activations); whole steps built for Zen 1, best of 9, 1 thread: 5 rows 14.5 ms as
// 3 + 2, 12.2-12.5 in one pass; 6 rows 15.8-16.7 as 3 + 3, 14.0 in one; 9 rows 22.6 as 3 + 3 +
// 3, 20.3-20.5 as 5 + 4.
constexpr int kAvx2Rows = 6;

template <typename P>
void int4_strip_rows_q8(const uint8_t* strip, const P* planes, const Q8Rows& a, int64_t rows,
                        int64_t k, int64_t n, int64_t col, float* out) {
  even_passes<kAvx2Rows>(rows, [&](auto pass_rows, int64_t r) {
    int4_strip_q8<decltype(pass_rows)::value>(strip, planes, a, r, k, n, col, out, r == 0);
  });
}
#endif

#if KVSCOPE_HAVE_AVX512_VNNI

// int4_strip_q8 with vpdpbusd: a strip's 32 bytes become the 16 columns' 4 codes in the 4
// bytes of each 32-bit lane (low nibbles the first 8 columns, high nibbles the last 8), so one
// instruction adds 64 products into 32-bit sums (the 256-bit kernel's two vpmaddubsw, its add
// and its vpmaddwd), and the float fold runs once per 16 columns. The same integer sums, then
// the same float operations in the same order: bitwise the AVX2 kernel's results.
//
// prefetch: the next strip's codes and planes are fetched while this one computes (first pass
// of rows only). Without it a 16-row step cost twice an 8-row one: each strip's first pass
// waited on memory (the planes' lines are strided, out of the hardware prefetcher's reach),
// then its second computed with memory idle.
template <int R, typename P>
void int4_strip_q8_vnni(const uint8_t* strip, const P* planes, const Q8Rows& a, int64_t row0,
                        int64_t k, int64_t n, int64_t col, float* out, bool prefetch) {
  const int64_t groups = k / kGroupSize;
  const int64_t next_col = col + kStripCols;
  prefetch = prefetch && next_col < n;
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512 acc[R];
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    if (prefetch) {
      const char* next = reinterpret_cast<const char*>(strip + (k / 4 + 8 * g) * 32);
      KVSCOPE_UNROLL
      for (int line = 0; line < 4; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(planes + 2 * g * n + next_col), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(planes + (2 * g + 1) * n + next_col), _MM_HINT_T0);
    }
    __m512i sums[R];
    KVSCOPE_UNROLL
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
    KVSCOPE_UNROLL
    for (int q = 0; q < 8; ++q) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(strip + (8 * g + q) * 32));
      const __m512i codes = _mm512_and_si512(
          _mm512_inserti64x4(_mm512_castsi256_si512(w), _mm256_srli_epi16(w, 4), 1), nibble);
      KVSCOPE_UNROLL
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, a.codes.data() + (row0 + r) * k + g * kGroupSize + 4 * q, 4);
        sums[r] = _mm512_dpbusd_epi32(sums[r], codes, _mm512_set1_epi32(quad));
      }
    }
    const __m512 scale = load16(planes + 2 * g * n + col), low = load16(planes + (2 * g + 1) * n + col);
    KVSCOPE_UNROLL
    for (int r = 0; r < R; ++r) {
      const int64_t t = (row0 + r) * groups + g;
      const __m512 d = _mm512_cvtepi32_ps(sums[r]);
      acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(a.sum[t]),
                               _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(a.step[t])), d, acc[r]));
    }
  }
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (row0 + r) * n + col, acc[r]);
}

template <typename P>
void int4_strip_rows_q8_vnni(const uint8_t* strip, const P* planes, const Q8Rows& a, int64_t rows,
                             int64_t k, int64_t n, int64_t col, float* out) {
  even_passes<kVnniRows>(rows, [&](auto pass_rows, int64_t r) {
    int4_strip_q8_vnni<decltype(pass_rows)::value>(strip, planes, a, r, k, n, col, out, r == 0);
  });
}
#endif

// Scalar version of the same arithmetic (tests check the vector ones and the layout with it).
template <typename P>
void int4_strip_rows_q8_portable(const uint8_t* strip, const P* planes, const Q8Rows& a,
                                 int64_t rows, int64_t k, int64_t n, int64_t col, float* out) {
  const int64_t groups = k / kGroupSize;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < kStripCols; ++c) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t d = 0;
        for (int64_t i = 0; i < kGroupSize; ++i) {
          const int64_t kk = g * kGroupSize + i;
          const uint8_t byte = strip[(kk / 4) * 32 + 4 * (c % 8) + kk % 4];
          d += (c < 8 ? byte & 15 : byte >> 4) * a.codes[r * k + kk];
        }
        const int64_t t = r * groups + g;
        const float scale = static_cast<float>(planes[2 * g * n + col + c]);
        const float low = static_cast<float>(planes[(2 * g + 1) * n + col + c]);
        acc = std::fma(low, a.sum[t], std::fma(scale * a.step[t], static_cast<float>(d), acc));
      }
      out[r * n + col + c] = acc;
    }
}

// x [rows, K] float32 times a 4-bit weight held as strips (int4_strips) and planes [K / 32, 2,
// N] (float32 or float16), activations quantized to 8 bits per group -> float32 [rows, N].
// kernel: a Q8Kernel compiled in (the activations are quantized by the AVX2 code for both
// vector kernels: the same codes as the scalar quantizer's).
inline at::Tensor int4_mm_q8(const at::Tensor& x, const at::Tensor& strips, const at::Tensor& planes,
                             int64_t kernel_index) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2,
              "x: float32 contiguous [rows, K]");
  const int64_t rows = x.size(0), k = x.size(1), n = planes.size(2);
  TORCH_CHECK(k % kGroupSize == 0 && n % kStripCols == 0, "K % 32 == 0 and N % 16 == 0");
  TORCH_CHECK(strips.scalar_type() == at::kByte && strips.is_contiguous() &&
                  strips.numel() == n * k / 2 && strips.size(0) == n / kStripCols,
              "strips: uint8 [N / 16, K / 4, 32]");
  TORCH_CHECK((planes.scalar_type() == at::kFloat || planes.scalar_type() == at::kHalf) &&
                  planes.size(0) == k / kGroupSize && planes.size(1) == 2 && planes.is_contiguous(),
              "planes: float32 or float16 [K / 32, 2, N]");
  TORCH_CHECK(is_q8_kernel(kernel_index), "kernel must be 0 (portable), 1 (avx2) or 2 (avx512_vnni), got ",
              kernel_index);
  const auto kernel = static_cast<Q8Kernel>(kernel_index);
  TORCH_CHECK(q8_kernel_compiled(kernel), "8-bit-activation kernel ", kernel_index, " is not compiled in");
  const bool vectorized = kernel != Q8Kernel::kPortable;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const Q8Rows a = quantize_rows(x.data_ptr<float>(), rows, k, vectorized);
  const uint8_t* w = strips.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const auto run = [&](const auto* p) {
    at::parallel_for(0, n / kStripCols, 1, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        const uint8_t* strip = w + s * k / 4 * 32;
#if KVSCOPE_HAVE_AVX512_VNNI
        if (kernel == Q8Kernel::kAvx512Vnni) {
          int4_strip_rows_q8_vnni(strip, p, a, rows, k, n, s * kStripCols, op);
          continue;
        }
#endif
#if KVSCOPE_HAVE_AVX2
        if (vectorized) {
          int4_strip_rows_q8(strip, p, a, rows, k, n, s * kStripCols, op);
          continue;
        }
#endif
        int4_strip_rows_q8_portable(strip, p, a, rows, k, n, s * kStripCols, op);
      }
    });
  };
  if (planes.scalar_type() == at::kHalf)
    run(planes.data_ptr<at::Half>());
  else
    run(planes.data_ptr<float>());
  return out;
}

}  // namespace kvscope
