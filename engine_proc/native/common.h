// Shared by the fused decode step's sources (see fused_decode.cpp).
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define KVSCOPE_HAVE_AVX512_BF16 1
#else
#define KVSCOPE_HAVE_AVX512_BF16 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define KVSCOPE_HAVE_AVX2 1
#else
#define KVSCOPE_HAVE_AVX2 0
#endif

// Fully unrolls a loop over a compile-time count of registers (rows, columns of a block):
// without it GCC keeps arrays of vector accumulators in memory and stores every one of them on
// each pass of the loop around it (seen in the AVX2 and AVX-512 kernels' assembly).
#define KVSCOPE_UNROLL _Pragma("GCC unroll 16")

namespace kvscope {

using bf16 = c10::BFloat16;
constexpr int64_t kGroupSize = 32;  // 4-bit and 8-bit weights: one scale per 32 inputs

}  // namespace kvscope
