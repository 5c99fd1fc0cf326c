// Float32 products of many rows on AVX2 CPUs, through dequantized tiles.
//
// Where a CPU has no bfloat16 dot products, a wide step's products of 4-bit or 8-bit weights
// are float32 FMAs, and converting a code to a float32 weight costs about as much as using it.
// So each strip of 16 output columns is dequantized once per call into a [K, 16] float32 tile
// (in L1/L2: 36 KB at K = 576), and every row then runs over the tile with nothing but loads,
// broadcasts and FMAs, six rows at a time (12 accumulators of the 16 registers).
//
// A row's sums are one float32 chain per column over k in order, whatever the number of rows
// beside it (3 or more; calls of one or two rows fold their sums per group instead, see
// int4_kernels.h: the same products to float32 rounding). Folding here too was measured: six
// rows' 12 group chains leave no registers for 12 accumulators, 0.84-0.89x at 64 rows.
#pragma once

#include "common.h"

namespace kvscope {

constexpr int64_t kTileCols = 16;
// Calls of this many rows or more go through tiles; narrower ones work in registers.
constexpr int64_t kAvx2TileRows = 3;

#if KVSCOPE_HAVE_AVX2
// out[r, 0..15] = sum_k x[r, k] tile[k, 0..15] for R rows (x rows of stride k, out rows of
// stride ldo).
template <int R>
inline void tile_rows(const float* tile, const float* x, int64_t k, float* out, int64_t ldo) {
  __m256 acc[R][2];
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_loadu_ps(tile + i * kTileCols);
    const __m256 w1 = _mm256_loadu_ps(tile + i * kTileCols + 8);
    KVSCOPE_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * k + i);
      acc[r][0] = _mm256_fmadd_ps(w0, xb, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xb, acc[r][1]);
    }
  }
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * ldo, acc[r][0]);
    _mm256_storeu_ps(out + r * ldo + 8, acc[r][1]);
  }
}

// Every row of x [rows, k] over one tile into out (rows of stride ldo).
inline void tile_all_rows(const float* tile, const float* x, int64_t rows, int64_t k, float* out,
                          int64_t ldo) {
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6) tile_rows<6>(tile, x + r * k, k, out + r * ldo, ldo);
  const float* xr = x + r * k;
  float* o = out + r * ldo;
  switch (rows - r) {
    case 5: tile_rows<5>(tile, xr, k, o, ldo); break;
    case 4: tile_rows<4>(tile, xr, k, o, ldo); break;
    case 3: tile_rows<3>(tile, xr, k, o, ldo); break;
    case 2: tile_rows<2>(tile, xr, k, o, ldo); break;
    case 1: tile_rows<1>(tile, xr, k, o, ldo); break;
    default: break;
  }
}

// Per-thread tile storage, grown to the largest K seen.
inline float* tile_buffer(int64_t k) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < k * kTileCols) buffer.resize(k * kTileCols);
  return buffer.data();
}
#endif

}  // namespace kvscope
