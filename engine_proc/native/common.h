// Shared by the fused decode step's sources (see fused_decode.cpp).
#pragma once

// Only the parts of torch used here, not <torch/extension.h> (all of torch's C++ frontend):
// its parsing was most of the first build's time (measured on 2 cores: a module of one
// function took 28 s to compile with it, 14-18 s with these).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define KVSCOPE_HAVE_AVX512_BF16 1
#else
#define KVSCOPE_HAVE_AVX512_BF16 0
#endif
// 8-bit dot products in 512-bit registers (vpdpbusd: Ice Lake, Sapphire Rapids, Zen 4)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVSCOPE_HAVE_AVX512_VNNI 1
#else
#define KVSCOPE_HAVE_AVX512_VNNI 0
#endif
// AVX2 kernels also use FMA and F16C (every AVX2 CPU since 2013 has both)
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVSCOPE_HAVE_AVX2 1
#else
#define KVSCOPE_HAVE_AVX2 0
#endif

// Fully unrolls a loop over a compile-time count of registers (rows, columns of a block):
// without it GCC keeps arrays of vector accumulators in memory and stores every one of them on
// each pass of the loop around it (seen in the AVX2 and AVX-512 kernels' assembly).
#define KVSCOPE_UNROLL _Pragma("GCC unroll 16")

namespace kvscope {

// Every register of an R x B array of accumulators set to v (unrolled: see KVSCOPE_UNROLL).
template <typename T, int R, int B>
inline void fill_registers(T (&a)[R][B], T v) {
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r)
    KVSCOPE_UNROLL
    for (int b = 0; b < B; ++b) a[r][b] = v;
}

// Rows of a call in passes of at most Max, as even as they come (9 rows at most 6 a pass: 5 + 4,
// not 6 + 3 or 4 + 4 + 1): pass(std::integral_constant<int, R>, first row) for each, R from 1
// to Max, so a kernel templated on its row count runs every pass with its registers unrolled.
template <int Max, typename Pass, int... Rs>
void even_passes(int64_t rows, Pass&& pass, std::integer_sequence<int, Rs...>) {
  const int64_t passes = (rows + Max - 1) / Max;
  for (int64_t p = 0, r = 0; p < passes; ++p) {
    const int64_t take = (rows - r + passes - p - 1) / (passes - p);
    ((take == Rs + 1 ? (pass(std::integral_constant<int, Rs + 1>{}, r), 0) : 0), ...);
    r += take;
  }
}
template <int Max, typename Pass>
void even_passes(int64_t rows, Pass&& pass) {
  even_passes<Max>(rows, pass, std::make_integer_sequence<int, Max>{});
}

using bf16 = c10::BFloat16;
constexpr int64_t kGroupSize = 32;  // 4-bit and 8-bit weights: one scale per 32 inputs

#if defined(__AVX512F__)
// Sixteen floats from float32 or float16 values (widening is exact).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

#if KVSCOPE_HAVE_AVX2
// A running integer sum kept as one: GCC 12 (under -march=znver1 and -march=haswell alike)
// rewrote a chain of sum += product into all of a group's products first, each stored to the
// stack, then the adds (177-192 stack accesses in the 4-row 8-bit kernel, 148 in the 8-bit
// head's); an empty asm it cannot see through pins each partial sum in a register where the
// code computes it (five- to nine-row steps 1.2x faster, built for Zen 1).
inline __m256i pin(__m256i v) {
#if defined(__GNUC__)
  asm("" : "+x"(v));
#endif
  return v;
}

// Eight scales or lows from float32 or float16 values (F16C: exact widening).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A group's part of a column's product, folded: acc + scale D (+ low X where the weights have
// lows: w = code scale + low).
inline __m256 fold_group(__m256 acc, __m256 scale, __m256 d) { return _mm256_fmadd_ps(scale, d, acc); }
inline __m256 fold_group(__m256 acc, __m256 scale, __m256 low, __m256 d, float xsum) {
  return _mm256_fmadd_ps(low, _mm256_set1_ps(xsum), _mm256_fmadd_ps(scale, d, acc));
}
#endif

}  // namespace kvscope
