// 4-bit products for decode-sized steps.
#pragma once

#include "common.h"

namespace kvscope {

// ---- 4-bit products ----------------------------------------------------------------------
// torch's int4 CPU layout (checked at start-up by fused_decode.py, else kernel 0 is used):
// [N / 64, K, 32] bytes, byte (b, k, j) = code(64 b + j, k) | code(64 b + 32 + j, k) << 4;
// scales_zeros [K / 32, N, 2] bfloat16, w = (code - 8) * scale + zero.
enum Int4Kernel : int64_t { kTorch = 0, kPortable = 1, kAvx512Bf16 = 2 };

// Per row r and group g: X[r][g] = sum of the group's bfloat16 activations (float32), so a group
// contributes scale * sum((code - 8) x) + zero * X.
std::vector<float> group_sums(const bf16* x, int64_t rows, int64_t k) {
  std::vector<float> sums(rows * (k / kGroupSize));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < k / kGroupSize; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < kGroupSize; ++i) s += static_cast<float>(x[r * k + g * kGroupSize + i]);
      sums[r * (k / kGroupSize) + g] = s;
    }
  return sums;
}

// Scalar version of the same arithmetic: runs anywhere (tests check the layout with it).
void int4_block_portable(const uint8_t* w, const bf16* sz, const bf16* x, const float* xsum,
                         int64_t rows, int64_t k, int64_t n, int64_t block, bf16* out) {
  const int64_t groups = k / kGroupSize;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < 64; ++j) {
      const int64_t col = block * 64 + j;
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float d = 0.f;
        for (int64_t i = 0; i < kGroupSize; ++i) {
          const int64_t kk = g * kGroupSize + i;
          const uint8_t byte = w[(block * k + kk) * 32 + (j % 32)];
          const int code = j < 32 ? (byte & 15) : (byte >> 4);
          d += static_cast<float>(code - 8) * static_cast<float>(x[r * k + kk]);
        }
        const float scale = static_cast<float>(sz[(g * n + col) * 2]);
        const float zero = static_cast<float>(sz[(g * n + col) * 2 + 1]);
        acc += scale * d + zero * xsum[r * groups + g];
      }
      out[r * n + col] = bf16(acc);
    }
  }
}

#if KVSCOPE_HAVE_AVX512_BF16
#if defined(__AVX512VBMI__)
struct PairIndex {  // byte 4j <- 16h + j, byte 4j + 2 <- 32 + 16h + j (others masked to 0)
  alignas(64) uint8_t bytes[2][64] = {};
  constexpr PairIndex() {
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 16; ++j) {
        bytes[h][4 * j] = static_cast<uint8_t>(16 * h + j);
        bytes[h][4 * j + 2] = static_cast<uint8_t>(32 + 16 * h + j);
      }
  }
};
constexpr PairIndex kPairIndex{};
#endif

// Bytes 16h..16h+15 of inputs kk (p[0..31]) and kk + 1 (p[32..63]) as 16 lanes of 32 bits,
// (byte of kk) | (byte of kk + 1) << 16. With AVX512-VBMI one masked byte permutation of the 64
// bytes does it (1.45x faster in cache than two zero-extensions on Zen 4).
inline __m512i pair_bytes(const uint8_t* p, int h) {
#if defined(__AVX512VBMI__)
  return _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL,
                                       _mm512_load_si512(kPairIndex.bytes[h]),
                                       _mm512_loadu_si512(p));
#else
  const __m512i in0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
  const __m512i in1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * h)));
  return _mm512_or_si512(in0, _mm512_slli_epi32(in1, 16));
#endif
}

// Codes c (bits 3..6 of each 16-bit half after the shift) as bfloat16 1 + c / 16: exponent 0
// ORed in, c as the top mantissa bits. Bit operations only: a table lookup (vpermw) would be
// a shuffle, and shuffles were this kernel's bottleneck.
inline __m512i codes_as_bf16(__m512i shifted) {
  constexpr int kAndOr = 0xEA;  // vpternlogd truth table of (a & b) | c
  return _mm512_ternarylogic_epi32(shifted, _mm512_set1_epi32(0x00780078),
                                   _mm512_set1_epi32(0x3F803F80), kAndOr);
}

// A group's scale and zero for 16 columns from `col`: its sum((c - 8) x) scale + zero X is
// 16 scale D' + (zero - 24 scale) X, D' = X + sum(c x) / 16 (what dpbf16ps accumulates).
struct GroupScale {
  __m512 scale16, offset;
};

inline GroupScale group_scale(const bf16* sz, int64_t g, int64_t n, int64_t col) {
  const __m512i pairs = _mm512_loadu_si512(sz + (g * n + col) * 2);
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
  const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(0xFFFF0000)));
  return {_mm512_mul_ps(scale, _mm512_set1_ps(16.f)),
          _mm512_fmadd_ps(scale, _mm512_set1_ps(-24.f), zero)};
}

inline __m512 fold_group(const GroupScale& gs, __m512 d, float xsum, __m512 acc) {
  acc = _mm512_fmadd_ps(gs.scale16, d, acc);
  return _mm512_fmadd_ps(gs.offset, _mm512_set1_ps(xsum), acc);
}

inline void store_bf16(bf16* out, __m512 acc) {  // rounded to bfloat16 as torch's kernel does
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(acc));
}

// One 64-column block for up to two rows: per pair of inputs (k, k+1), the 64 columns' codes
// become four registers of 16 columns x 2 bfloat16 values 1 + c / 16 (exact), multiplied with
// the broadcast activation pair by dpbf16ps into D' = X + sum(c x) / 16 per group. A group then
// adds scale * sum((c - 8) x) + zero * X = 16 scale * D' + (zero - 24 scale) * X in float32.
template <int R>
void int4_block_avx512(const uint8_t* w, const bf16* sz, const bf16* x, const float* xsum,
                       int64_t k, int64_t n, int64_t block, bf16* out) {
  const int64_t groups = k / kGroupSize;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
  const uint8_t* wb = w + block * k * 32;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 d[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) d[r][i] = _mm512_setzero_ps();
    for (int64_t kk = g * kGroupSize; kk < (g + 1) * kGroupSize; kk += 2) {
      const uint8_t* b0 = wb + kk * 32;  // input kk: 32 bytes; input kk + 1 follows
      __m512i codes[4];
      for (int h = 0; h < 2; ++h) {  // bytes 0..15 then 16..31 of each input
        // 32-bit lane j: byte j of input kk in bits 0..7, of input kk + 1 in bits 16..23
        const __m512i both = pair_bytes(b0, h);
        codes[h] = codes_as_bf16(_mm512_slli_epi32(both, 3));      // low nibbles: cols 16h..
        codes[2 + h] = codes_as_bf16(_mm512_srli_epi32(both, 1));  // high: cols 32 + 16h..
      }
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * k + kk, sizeof(pair));
        const __m512bh xp = (__m512bh)_mm512_set1_epi32(pair);
        for (int i = 0; i < 4; ++i) d[r][i] = _mm512_dpbf16_ps(d[r][i], (__m512bh)codes[i], xp);
      }
    }
    for (int i = 0; i < 4; ++i) {
      const GroupScale gs = group_scale(sz, g, n, block * 64 + 16 * i);
      for (int r = 0; r < R; ++r) acc[r][i] = fold_group(gs, d[r][i], xsum[r * groups + g], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) store_bf16(out + r * n + block * 64 + 16 * i, acc[r][i]);
}

// Half h of a 64-column block, columns 16h..16h+15 (low nibbles of bytes 16h..16h+15) and
// 32+16h..32+16h+15 (their high nibbles), for R rows: per pair of inputs (k, k+1) the 32
// columns' codes become two registers of 16 columns x 2 bfloat16 values 1 + c / 16 (exact),
// multiplied with each row's broadcast activation pair by dpbf16ps into D' = X + sum(c x) / 16
// per group. A group then adds scale * sum((c - 8) x) + zero * X = 16 scale * D' +
// (zero - 24 scale) * X in float32. Halves rather than whole blocks leave registers for four
// rows, so each decoded code register feeds four products instead of two (decoding the codes
// was this kernel's bottleneck at 16 rows).
template <int R>
void int4_half_avx512(const uint8_t* w, const bf16* sz, const bf16* x, const float* xsum,
                      int64_t k, int64_t n, int64_t block, int h, bf16* out) {
  const int64_t groups = k / kGroupSize;
  const int64_t col[2] = {block * 64 + 16 * h, block * 64 + 32 + 16 * h};
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint8_t* wb = w + block * k * 32;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 d[R][2];
    for (int r = 0; r < R; ++r) d[r][0] = d[r][1] = _mm512_setzero_ps();
    for (int64_t kk = g * kGroupSize; kk < (g + 1) * kGroupSize; kk += 2) {
      // 32-bit lane j: byte 16h + j of input kk in bits 0..7, of input kk + 1 in bits 16..23
      const __m512i both = pair_bytes(wb + kk * 32, h);
      const __m512i lo = codes_as_bf16(_mm512_slli_epi32(both, 3));
      const __m512i hi = codes_as_bf16(_mm512_srli_epi32(both, 1));
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * k + kk, sizeof(pair));
        const __m512bh xp = (__m512bh)_mm512_set1_epi32(pair);
        d[r][0] = _mm512_dpbf16_ps(d[r][0], (__m512bh)lo, xp);
        d[r][1] = _mm512_dpbf16_ps(d[r][1], (__m512bh)hi, xp);
      }
    }
    for (int i = 0; i < 2; ++i) {
      const GroupScale gs = group_scale(sz, g, n, col[i]);
      for (int r = 0; r < R; ++r) acc[r][i] = fold_group(gs, d[r][i], xsum[r * groups + g], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2; ++i) store_bf16(out + r * n + col[i], acc[r][i]);
}

// One 64-column block for every row: rows in fours by halves, then the rest (at most three)
// by whole blocks in pairs, which decode each code register once for both halves' rows.
void int4_rows_avx512(const uint8_t* w, const bf16* sz, const bf16* x, const float* xsum,
                      int64_t rows, int64_t k, int64_t n, int64_t block, bf16* out) {
  const int64_t groups = k / kGroupSize;
  const int64_t fours = rows / 4 * 4;
  for (int h = 0; h < 2; ++h)
    for (int64_t r = 0; r < fours; r += 4)
      int4_half_avx512<4>(w, sz, x + r * k, xsum + r * groups, k, n, block, h, out + r * n);
  int64_t r = fours;
  for (; r + 2 <= rows; r += 2)
    int4_block_avx512<2>(w, sz, x + r * k, xsum + r * groups, k, n, block, out + r * n);
  if (r < rows) int4_block_avx512<1>(w, sz, x + r * k, xsum + r * groups, k, n, block, out + r * n);
}
#endif

at::Tensor int4_mm_kernel(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                          int64_t kernel) {
  if (kernel == kTorch) return at::_weight_int4pack_mm_for_cpu(x, packed, kGroupSize, sz);
  const int64_t rows = x.size(0), k = x.size(1), n = sz.size(1);
  TORCH_CHECK(n % 64 == 0 && k % kGroupSize == 0, "4-bit kernel needs N % 64 == 0, K % 32 == 0");
  at::Tensor out = at::empty({rows, n}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const bf16* s = sz.data_ptr<bf16>();
  const bf16* xp = x.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const std::vector<float> xsum = group_sums(xp, rows, k);
  at::parallel_for(0, n / 64, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
#if KVSCOPE_HAVE_AVX512_BF16
      if (kernel == kAvx512Bf16) {
        int4_rows_avx512(w, s, xp, xsum.data(), rows, k, n, b, op);
        continue;
      }
#endif
      TORCH_CHECK(kernel == kPortable, "4-bit kernel ", kernel, " is not compiled in");
      int4_block_portable(w, s, xp, xsum.data(), rows, k, n, b, op);
    }
  });
  return out;
}

}  // namespace kvscope
