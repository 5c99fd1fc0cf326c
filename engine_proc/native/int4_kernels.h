// 4-bit products for decode-sized steps.
#pragma once

#include "common.h"
#include "tile_gemm.h"

namespace kvscope {

// ---- 4-bit products ----------------------------------------------------------------------
// torch's int4 CPU layout (checked at start-up by fused_decode.py, else kernel 0 is used):
// [N / B, K, B / 2] bytes, byte (b, k, j) = code(B b + j, k) | code(B b + B / 2 + j, k) << 4,
// with blocks of B = 64 columns where torch runs its AVX-512 code and B = 32 on AVX2 CPUs
// (the pack block, an argument of the kernels). The AVX512-BF16 kernel reads B = 64 only.
// torch's kernel reads scales_zeros [K / 32, N, 2] bfloat16, w = (code - 8) * scale + zero; ours
// also read the planes [K / 32, 2, N] (scale, low), w = code * scale + low: the 4-bit weights
// exactly (a GGUF Q4_1 block is float16 d and m, w = q d + m), where bfloat16 moves them by up
// to ~0.1 of a step. The planes are float32, or float16 when every value is one (the GGUF's:
// fused_decode.py checks), which holds the same values in a third fewer bytes per weight
// with the codes (0.625 instead of 0.75): the portable and AVX2 kernels read either, the
// AVX512-BF16 kernel float32.
//
// Activations: float32 in, float32 out. Products with bfloat16 dot products (dpbf16ps) see
// x as its bfloat16 rounding hi (fast: 2^-9 relative error, what torch's kernel does too, and
// like it the bfloat16 scales), or, precise, as hi + lo with lo = bf16(x - hi): two dot
// products per weight, 2^-18 relative, and the float32 scales. The portable kernel reads the
// float32 scales either way.
// The AVX2 kernel (kAvx2Fp32) computes float32 products folded per group, like the portable
// one: D = sum(code x) in float32 (codes converted exactly), then scale D + low X with X the
// group's sum of x: one FMA per weight, where dequantizing each weight first took two. That is
// for calls of one or two rows; wider calls dequantize into float32 tiles and sum unfolded
// (tile_gemm.h), the same products to float32 rounding. Float32 products at any width, so
// `precise` is moot.
enum Int4Kernel : int64_t { kTorch = 0, kPortable = 1, kAvx512Bf16 = 2, kAvx2Fp32 = 3 };

#if KVSCOPE_HAVE_AVX512_BF16
// The bfloat16 parts of float32 activations [rows, k]: hi = bf16(x), lo = bf16(x - hi) (left
// empty unless precise), and per row r and group g the float32 sum of what the products see
// (hi, or hi + lo), so a group contributes scale * sum(code x) + low * X.
struct Activations {
  std::vector<bf16> hi, lo;
  std::vector<float> sums;
};

// One group of 32 (hardware round-to-nearest-even, as c10's conversion): returns its sum.
inline float split_group(const float* x, bf16* hi, bf16* lo) {
  __m512 seen = _mm512_setzero_ps();
  for (int half = 0; half < 2; ++half) {
    const __m512 v = _mm512_loadu_ps(x + 16 * half);
    const __m256bh h = _mm512_cvtneps_pbh(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + 16 * half), (__m256i)h);
    __m512 part = _mm512_cvtpbh_ps(h);
    if (lo != nullptr) {
      const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, part));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + 16 * half), (__m256i)l);
      part = _mm512_add_ps(part, _mm512_cvtpbh_ps(l));
    }
    seen = _mm512_add_ps(seen, part);
  }
  return _mm512_reduce_add_ps(seen);
}

inline Activations split_activations(const float* x, int64_t rows, int64_t k, bool precise) {
  Activations a;
  a.hi.resize(rows * k);
  if (precise) a.lo.resize(rows * k);
  a.sums.resize(rows * (k / kGroupSize));
  at::parallel_for(0, rows * (k / kGroupSize), 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t * kGroupSize;  // rows * k laid end to end, k a multiple of 32
      a.sums[t] = split_group(x + i, a.hi.data() + i, precise ? a.lo.data() + i : nullptr);
    }
  });
  return a;
}
#endif

// Scalar version of the same arithmetic (float32 products of exact weights with what the
// dot products see): runs anywhere (tests check the layout with it).
template <typename P>
void int4_block_portable(const uint8_t* w, const P* planes, const float* x, int64_t rows,
                         int64_t k, int64_t n, int64_t block, int64_t pack_block, bool precise,
                         float* out) {
  const int64_t groups = k / kGroupSize, half = pack_block / 2;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < pack_block; ++j) {
      const int64_t col = block * pack_block + j;
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float d = 0.f, sum = 0.f;
        for (int64_t i = 0; i < kGroupSize; ++i) {
          const int64_t kk = g * kGroupSize + i;
          const uint8_t byte = w[(block * k + kk) * half + (j % half)];
          const int code = j < half ? (byte & 15) : (byte >> 4);
          const float xi = x[r * k + kk];
          const float hi = static_cast<float>(bf16(xi));
          const float seen = precise ? hi + static_cast<float>(bf16(xi - hi)) : hi;
          d += static_cast<float>(code) * seen;
          sum += seen;
        }
        acc += static_cast<float>(planes[2 * g * n + col]) * d +
               static_cast<float>(planes[(2 * g + 1) * n + col]) * sum;
      }
      out[r * n + col] = acc;
    }
  }
}

#if KVSCOPE_HAVE_AVX512_BF16
#if defined(__AVX512VBMI__)
struct PairIndex {  // byte 4j <- 16h + j, byte 4j + 2 <- 32 + 16h + j (others masked to 0)
  alignas(64) uint8_t bytes[2][64] = {};
  constexpr PairIndex() {
    KVSCOPE_UNROLL
    for (int h = 0; h < 2; ++h)
      KVSCOPE_UNROLL
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

// A group's scale and low for 16 columns from `col`: its sum(code x) scale + low X is
// 16 scale D' + (low - 16 scale) X, D' = X + sum(code x) / 16 (what dpbf16ps accumulates).
struct GroupScale {
  __m512 scale16, offset;
};

// The 4-bit matrix's scales, as the precise products read them (float32 planes, exact) or
// the fast ones (torch's bfloat16 pairs: half the bytes, and the wide steps that take them
// re-read every group's scales once per four rows).
struct Scales {
  const float* planes;  // [K / 32, 2, N] scale, low
  const bf16* sz;       // [K / 32, N, 2] scale, zero: w = (code - 8) scale + zero
};

template <bool Exact>
inline GroupScale group_scale(const Scales& sc, int64_t g, int64_t n, int64_t col) {
  if constexpr (Exact) {
    const __m512 scale16 =
        _mm512_mul_ps(_mm512_loadu_ps(sc.planes + 2 * g * n + col), _mm512_set1_ps(16.f));
    const __m512 low = _mm512_loadu_ps(sc.planes + (2 * g + 1) * n + col);
    return {scale16, _mm512_sub_ps(low, scale16)};
  } else {  // low = zero - 8 scale, so the offset is zero - 24 scale
    const __m512i pairs = _mm512_loadu_si512(sc.sz + (g * n + col) * 2);
    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(0xFFFF0000)));
    return {_mm512_mul_ps(scale, _mm512_set1_ps(16.f)),
            _mm512_fmadd_ps(scale, _mm512_set1_ps(-24.f), zero)};
  }
}

inline __m512 fold_group(const GroupScale& gs, __m512 d, float xsum, __m512 acc) {
  acc = _mm512_fmadd_ps(gs.scale16, d, acc);
  return _mm512_fmadd_ps(gs.offset, _mm512_set1_ps(xsum), acc);
}

// d += codes . (x[kk], x[kk + 1]) for the hi parts, and dl for the lo parts when Lo (a chain
// of its own: one chain taking both would wait on the dot product's latency).
template <bool Lo>
inline void dot_pair(__m512& d, __m512& dl, __m512i codes, const bf16* hi, const bf16* lo) {
  int32_t pair;
  std::memcpy(&pair, hi, sizeof(pair));
  d = _mm512_dpbf16_ps(d, (__m512bh)codes, (__m512bh)_mm512_set1_epi32(pair));
  if constexpr (Lo) {
    std::memcpy(&pair, lo, sizeof(pair));
    dl = _mm512_dpbf16_ps(dl, (__m512bh)codes, (__m512bh)_mm512_set1_epi32(pair));
  }
}

// The group's D' from its chains.
template <bool Lo>
inline __m512 chains(__m512 d, __m512 dl) {
  if constexpr (Lo) return _mm512_add_ps(d, dl);
  return d;
}

// The bfloat16 activations of one call: rows of k, hi and (when Lo) lo parts, group sums.
struct Bf16Rows {
  const bf16* hi;
  const bf16* lo;
  const float* sums;
  int64_t k;
  Bf16Rows from(int64_t r) const {
    return {hi + r * k, lo ? lo + r * k : nullptr, sums + r * (k / kGroupSize), k};
  }
};

// One 64-column block for up to two rows: per pair of inputs (k, k+1), the 64 columns' codes
// become four registers of 16 columns x 2 bfloat16 values 1 + c / 16 (exact), multiplied with
// the broadcast activation pair by dpbf16ps into D' = X + sum(c x) / 16 per group. A group then
// adds scale * sum(c x) + low * X = 16 scale * D' + (low - 16 scale) * X in float32.
template <int R, bool Lo>
void int4_block_avx512(const uint8_t* w, const Scales& sc, const Bf16Rows& x, int64_t n,
                       int64_t block, float* out) {
  const int64_t k = x.k, groups = k / kGroupSize;
  __m512 acc[R][4];
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r)
    KVSCOPE_UNROLL
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
  const uint8_t* wb = w + block * k * 32;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 d[R][4], dl[R][4];
    KVSCOPE_UNROLL
    for (int r = 0; r < R; ++r)
      KVSCOPE_UNROLL
      for (int i = 0; i < 4; ++i) d[r][i] = dl[r][i] = _mm512_setzero_ps();
    for (int64_t kk = g * kGroupSize; kk < (g + 1) * kGroupSize; kk += 2) {
      const uint8_t* b0 = wb + kk * 32;  // input kk: 32 bytes; input kk + 1 follows
      __m512i codes[4];
      KVSCOPE_UNROLL
      for (int h = 0; h < 2; ++h) {  // bytes 0..15 then 16..31 of each input
        // 32-bit lane j: byte j of input kk in bits 0..7, of input kk + 1 in bits 16..23
        const __m512i both = pair_bytes(b0, h);
        codes[h] = codes_as_bf16(_mm512_slli_epi32(both, 3));      // low nibbles: cols 16h..
        codes[2 + h] = codes_as_bf16(_mm512_srli_epi32(both, 1));  // high: cols 32 + 16h..
      }
      KVSCOPE_UNROLL
      for (int r = 0; r < R; ++r) {
        const bf16* lo = Lo ? x.lo + r * k + kk : nullptr;
        KVSCOPE_UNROLL
        for (int i = 0; i < 4; ++i) dot_pair<Lo>(d[r][i], dl[r][i], codes[i], x.hi + r * k + kk, lo);
      }
    }
    KVSCOPE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const GroupScale gs = group_scale<Lo>(sc, g, n, block * 64 + 16 * i);
      KVSCOPE_UNROLL
      for (int r = 0; r < R; ++r)
        acc[r][i] = fold_group(gs, chains<Lo>(d[r][i], dl[r][i]), x.sums[r * groups + g], acc[r][i]);
    }
  }
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r)
    KVSCOPE_UNROLL
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + r * n + block * 64 + 16 * i, acc[r][i]);
}

// Half h of a 64-column block, columns 16h..16h+15 (low nibbles of bytes 16h..16h+15) and
// 32+16h..32+16h+15 (their high nibbles), for R rows, with the arithmetic of the whole-block
// version above. Halves rather than whole blocks leave registers for four rows, so each
// decoded code register feeds four products instead of two (decoding the codes was this
// kernel's bottleneck at 16 rows).
template <int R, bool Lo>
void int4_half_avx512(const uint8_t* w, const Scales& sc, const Bf16Rows& x, int64_t n,
                      int64_t block, int h, float* out) {
  const int64_t k = x.k, groups = k / kGroupSize;
  const int64_t col[2] = {block * 64 + 16 * h, block * 64 + 32 + 16 * h};
  __m512 acc[R][2];
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint8_t* wb = w + block * k * 32;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 d[R][2], dl[R][2];
    KVSCOPE_UNROLL
    for (int r = 0; r < R; ++r) d[r][0] = d[r][1] = dl[r][0] = dl[r][1] = _mm512_setzero_ps();
    for (int64_t kk = g * kGroupSize; kk < (g + 1) * kGroupSize; kk += 2) {
      // 32-bit lane j: byte 16h + j of input kk in bits 0..7, of input kk + 1 in bits 16..23
      const __m512i both = pair_bytes(wb + kk * 32, h);
      const __m512i lo_cols = codes_as_bf16(_mm512_slli_epi32(both, 3));
      const __m512i hi_cols = codes_as_bf16(_mm512_srli_epi32(both, 1));
      KVSCOPE_UNROLL
      for (int r = 0; r < R; ++r) {
        const bf16* xh = x.hi + r * k + kk;
        const bf16* xl = Lo ? x.lo + r * k + kk : nullptr;
        dot_pair<Lo>(d[r][0], dl[r][0], lo_cols, xh, xl);
        dot_pair<Lo>(d[r][1], dl[r][1], hi_cols, xh, xl);
      }
    }
    KVSCOPE_UNROLL
    for (int i = 0; i < 2; ++i) {
      const GroupScale gs = group_scale<Lo>(sc, g, n, col[i]);
      KVSCOPE_UNROLL
      for (int r = 0; r < R; ++r)
        acc[r][i] = fold_group(gs, chains<Lo>(d[r][i], dl[r][i]), x.sums[r * groups + g], acc[r][i]);
    }
  }
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r)
    KVSCOPE_UNROLL
    for (int i = 0; i < 2; ++i) _mm512_storeu_ps(out + r * n + col[i], acc[r][i]);
}

// One 64-column block for every row: rows in fours by halves, then the rest (at most three)
// by whole blocks in pairs, which decode each code register once for both halves' rows.
template <bool Lo>
void int4_rows_avx512(const uint8_t* w, const Scales& sc, const Bf16Rows& x, int64_t rows,
                      int64_t n, int64_t block, float* out) {
  const int64_t fours = rows / 4 * 4;
  KVSCOPE_UNROLL
  for (int h = 0; h < 2; ++h)
    for (int64_t r = 0; r < fours; r += 4)
      int4_half_avx512<4, Lo>(w, sc, x.from(r), n, block, h, out + r * n);
  int64_t r = fours;
  for (; r + 2 <= rows; r += 2) int4_block_avx512<2, Lo>(w, sc, x.from(r), n, block, out + r * n);
  if (r < rows) int4_block_avx512<1, Lo>(w, sc, x.from(r), n, block, out + r * n);
}
#endif

#if KVSCOPE_HAVE_AVX2
// Chunk c of a block: columns 16c..16c+15 and B/2+16c..B/2+16c+15 (the low and high nibbles of
// bytes 16c..16c+15 of each input's row), where the AVX2 kernels work 32 columns at a time.
struct Chunk32 {
  const uint8_t* bytes;  // input 0's 16 bytes; input kk's are kk * B / 2 further
  int64_t half;          // B / 2
  int64_t col[4];        // the first of each 8 columns, in the order of codes_cols32
};

inline Chunk32 chunk32(const uint8_t* w, int64_t k, int64_t block, int64_t pack_block,
                       int64_t chunk) {
  const int64_t half = pack_block / 2, c0 = block * pack_block + 16 * chunk;
  return {w + block * k * half + 16 * chunk, half, {c0, c0 + 8, c0 + half, c0 + half + 8}};
}

// The 32 codes of input kk as float32 (exact): columns col[0].., col[1].., col[2].., col[3]...
inline void codes_cols32(const Chunk32& ch, int64_t kk, __m256 (&c)[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ch.bytes + kk * ch.half));
  const __m256i b0 = _mm256_cvtepu8_epi32(bytes), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
  const __m256i nibble = _mm256_set1_epi32(15);
  c[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, nibble));
  c[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, nibble));
  c[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
  c[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
}

// One chunk for R rows (xsums: R rows of K / 32 group sums), codes converted in registers.
// Per group, D = sum(code x) over its 32 inputs (one float32 chain per column and row, k in
// order), folded as acc + scale D + low X (fold_group): one FMA per weight, where dequantizing
// each weight first took two (one-row products 1.20x in a same-process A/B).
template <int R, typename P>
void int4_cols32_avx2(const Chunk32& ch, const P* planes, const float* x, const float* xsums,
                      int64_t k, int64_t n, float* out) {
  const int64_t groups = k / kGroupSize;
  __m256 acc[R][4];
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r)
    KVSCOPE_UNROLL
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // the next group's scales and lows are requested a group ahead
    if (g + 1 < groups) {
      KVSCOPE_UNROLL
      for (int i = 0; i < 4; i += 2) {
        _mm_prefetch(reinterpret_cast<const char*>(planes + 2 * (g + 1) * n + ch.col[i]), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(planes + (2 * (g + 1) + 1) * n + ch.col[i]), _MM_HINT_T0);
      }
    }
    __m256 d[R][4];
    KVSCOPE_UNROLL
    for (int r = 0; r < R; ++r)
      KVSCOPE_UNROLL
      for (int i = 0; i < 4; ++i) d[r][i] = _mm256_setzero_ps();
    for (int64_t kk = g * kGroupSize; kk < (g + 1) * kGroupSize; ++kk) {
      // the codes ~24 inputs ahead, requested before they are needed (1.06-1.15x, one row)
      _mm_prefetch(reinterpret_cast<const char*>(ch.bytes + (kk + 24) * ch.half), _MM_HINT_T0);
      __m256 c[4];
      codes_cols32(ch, kk, c);
      KVSCOPE_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * k + kk);
        KVSCOPE_UNROLL
        for (int i = 0; i < 4; ++i) d[r][i] = _mm256_fmadd_ps(c[i], xb, d[r][i]);
      }
    }
    KVSCOPE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const __m256 scale = load8(planes + 2 * g * n + ch.col[i]);
      const __m256 low = load8(planes + (2 * g + 1) * n + ch.col[i]);
      KVSCOPE_UNROLL
      for (int r = 0; r < R; ++r) acc[r][i] = fold_group(acc[r][i], scale, low, d[r][i], xsums[r * groups + g]);
    }
  }
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r)
    KVSCOPE_UNROLL
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + r * n + ch.col[i], acc[r][i]);
}

// One chunk's weights as two float32 tiles [K, 16], code * scale + low: tiles[0] the
// low-nibble columns, tiles[1] (K * 16 floats further) the high-nibble ones.
template <typename P>
inline void int4_chunk_tiles_avx2(const Chunk32& ch, const P* planes, int64_t k, int64_t n,
                                  float* tiles) {
  for (int64_t g = 0; g < k / kGroupSize; ++g) {
    __m256 scale[4], low[4];
    KVSCOPE_UNROLL
    for (int i = 0; i < 4; ++i) {
      scale[i] = load8(planes + 2 * g * n + ch.col[i]);
      low[i] = load8(planes + (2 * g + 1) * n + ch.col[i]);
    }
    for (int64_t kk = g * kGroupSize; kk < (g + 1) * kGroupSize; ++kk) {
      __m256 c[4];
      codes_cols32(ch, kk, c);
      KVSCOPE_UNROLL
      for (int i = 0; i < 4; ++i)
        _mm256_storeu_ps(tiles + (i / 2) * k * kTileCols + kk * kTileCols + 8 * (i % 2),
                         _mm256_fmadd_ps(c[i], scale[i], low[i]));
    }
  }
}

// One block for every row: calls of up to two rows convert the codes in registers per input
// and fold per group; wider ones dequantize each chunk once into two tiles every row reuses
// (tile_gemm.h: unfolded sums, the same products to float32 rounding). Within each, a row's
// products do not depend on the rows beside it.
template <typename P>
void int4_chunk_rows_avx2(const uint8_t* w, const P* planes, const float* x, const float* xsums,
                          int64_t rows, int64_t k, int64_t n, int64_t block, int64_t pack_block,
                          int64_t chunk, float* out) {
  const Chunk32 ch = chunk32(w, k, block, pack_block, chunk);
  if (rows >= kAvx2TileRows) {
    float* tiles = tile_buffer(2 * k);
    int4_chunk_tiles_avx2(ch, planes, k, n, tiles);
    for (int t = 0; t < 2; ++t) {
      const int64_t col = ch.col[2 * t];
      tile_all_rows(tiles + t * k * kTileCols, x, rows, k, out + col, n);
    }
  } else if (rows == 2) {
    int4_cols32_avx2<2>(ch, planes, x, xsums, k, n, out);
  } else {
    int4_cols32_avx2<1>(ch, planes, x, xsums, k, n, out);
  }
}
#endif

// Per row and group of 32 inputs, the float32 sum of x in k order (the AVX2 kernel's X).
inline std::vector<float> group_sums(const float* x, int64_t rows, int64_t k) {
  std::vector<float> sums(rows * (k / kGroupSize));
  for (size_t t = 0; t < sums.size(); ++t) {
    float sum = 0.f;
    for (int64_t i = 0; i < kGroupSize; ++i) sum += x[t * kGroupSize + i];
    sums[t] = sum;
  }
  return sums;
}

// The products of units [c0, c1) of columns for every row, with the kernel picked (not
// kTorch): 32-column chunks for the AVX2 kernel (a 576-column product is 18 of them, 9 per
// thread of two, where 9 blocks of 64 split 5 and 4), blocks for the portable one.
template <typename P>
void int4_rows(const uint8_t* w, const P* planes, const float* x, const float* xsums,
               int64_t rows, int64_t k, int64_t n, int64_t pack_block, int64_t kernel,
               bool precise, int64_t c0, int64_t c1, float* out) {
#if KVSCOPE_HAVE_AVX2
  if (kernel == kAvx2Fp32) {
    const int64_t per_block = pack_block / 32;
    for (int64_t c = c0; c < c1; ++c)
      int4_chunk_rows_avx2(w, planes, x, xsums, rows, k, n, c / per_block, pack_block, c % per_block, out);
    return;
  }
#endif
  (void)kernel, (void)xsums;
  for (int64_t b = c0; b < c1; ++b) int4_block_portable(w, planes, x, rows, k, n, b, pack_block, precise, out);
}

// x [rows, K] float32 times a 4-bit weight -> float32 [rows, N]. precise: see the top of
// this file (torch's kernel, kTorch, has bfloat16 activations and output either way).
// pack_block: the columns of one block of torch's packed layout (64 or 32, see the top).
at::Tensor int4_mm_kernel(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                          const at::Tensor& planes, int64_t kernel, bool precise,
                          int64_t pack_block) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "float32 contiguous activations");
  if (kernel == kTorch)
    return at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), packed, kGroupSize, sz).to(at::kFloat);
  const int64_t rows = x.size(0), k = x.size(1), n = planes.size(2);
  TORCH_CHECK(pack_block == 32 || pack_block == 64, "pack_block must be 32 or 64, got ", pack_block);
  TORCH_CHECK(n % 64 == 0 && k % kGroupSize == 0, "4-bit kernel needs N % 64 == 0, K % 32 == 0");
  TORCH_CHECK((planes.scalar_type() == at::kFloat || planes.scalar_type() == at::kHalf) &&
                  planes.size(0) == k / kGroupSize && planes.size(1) == 2 && planes.is_contiguous(),
              "planes: float32 or float16 [K / 32, 2, N]");
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;  // the row kernels assume at least one row
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
#if KVSCOPE_HAVE_AVX512_BF16
  if (kernel == kAvx512Bf16) {
    TORCH_CHECK(pack_block == 64, "the AVX512-BF16 4-bit kernel reads blocks of 64 columns");
    TORCH_CHECK(planes.scalar_type() == at::kFloat, "the AVX512-BF16 4-bit kernel reads float32 planes");
    const Activations a = split_activations(xp, rows, k, precise);
    const Bf16Rows xr{a.hi.data(), precise ? a.lo.data() : nullptr, a.sums.data(), k};
    const Scales sc{planes.data_ptr<float>(), sz.data_ptr<bf16>()};
    at::parallel_for(0, n / 64, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        if (precise)
          int4_rows_avx512<true>(w, sc, xr, rows, n, b, op);
        else
          int4_rows_avx512<false>(w, sc, xr, rows, n, b, op);
      }
    });
    return out;
  }
#endif
  TORCH_CHECK(kernel == kPortable || (kernel == kAvx2Fp32 && KVSCOPE_HAVE_AVX2), "4-bit kernel ",
              kernel, " is not compiled in");
  const bool half = planes.scalar_type() == at::kHalf;
  const at::Half* ph = half ? planes.data_ptr<at::Half>() : nullptr;
  const float* pf = half ? nullptr : planes.data_ptr<float>();
  // the narrow AVX2 path's group sums of x (the tiles and the portable kernel need none)
  const std::vector<float> xsums =
      kernel == kAvx2Fp32 && rows < kAvx2TileRows ? group_sums(xp, rows, k) : std::vector<float>{};
  const int64_t units = kernel == kAvx2Fp32 ? n / 32 : n / pack_block;  // chunks or blocks
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    if (half)
      int4_rows(w, ph, xp, xsums.data(), rows, k, n, pack_block, kernel, precise, u0, u1, op);
    else
      int4_rows(w, pf, xp, xsums.data(), rows, k, n, pack_block, kernel, precise, u0, u1, op);
  });
  return out;
}

}  // namespace kvscope
