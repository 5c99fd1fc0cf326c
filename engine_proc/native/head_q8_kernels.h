// The 8-bit output projection with 8-bit activations (wide decode steps on AVX512-VNNI CPUs,
// every step under decode_activations="int8"): llama.cpp's Q8_0 x Q8_0. The hidden state is quantized per group of 32 as the products'
// activations are (int4_q8_kernels.h: q = round(x / dx), dx = max|x| / 127), and multiplied
// with the head's exact 8-bit codes in integer dot products: vpdpbusd adds 64 products an
// instruction where dpbf16ps (head_kernels.h, bfloat16 activations) adds 32.
//
// vpdpbusd multiplies unsigned bytes by signed ones, so the weight codes are stored offset,
// u = c + 128 (1..255), in lanes of 4: codes [N / 16, K / 4, 16, 4], byte t of lane o of quad
// q = code(16 b + o, 4 q + t) + 128. Per row and group the integer sum of u q less 128 sum(q)
// is the exact sum of c q (|.| < 2^24, exact as a float32 too), then
//   acc = fma(dw dx, float(sum), acc)     per group, in group order,
// in the vector kernel and its scalar twin alike (bitwise the same results).
#pragma once

#include "common.h"
#include "int4_q8_kernels.h"

namespace kvscope {

// The head's codes [N / 16, K, 16] int8 (q8_pack) in the layout above.
inline at::Tensor q8_vnni_pack(const at::Tensor& codes) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 3 && codes.size(2) == 16,
              "q8 codes [N / 16, K, 16] int8");
  const int64_t blocks = codes.size(0), k = codes.size(1);
  TORCH_CHECK(k % kGroupSize == 0, "q8 codes: K % 32 == 0");
  at::Tensor out = at::empty({blocks, k / 4, 16, 4}, at::kByte);
  const at::Tensor dense = codes.contiguous();  // (kept alive while the loop reads it)
  const int8_t* c = dense.data_ptr<int8_t>();
  uint8_t* u = out.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t o = 0; o < 16; ++o)
          u[((b * (k / 4) + kk / 4) * 16 + o) * 4 + kk % 4] =
              static_cast<uint8_t>(c[(b * k + kk) * 16 + o] + 128);
  });
  return out;
}

// Per (row, group): the step dx and the integer sum of the codes.
struct Q8Head {
  Q8Rows a;
  std::vector<int32_t> code_sum;
};

inline Q8Head quantize_head_rows(const float* x, int64_t rows, int64_t k, bool vectorized) {
  Q8Head h{quantize_rows(x, rows, k, vectorized), std::vector<int32_t>(rows * (k / kGroupSize))};
  for (size_t t = 0; t < h.code_sum.size(); ++t) {
    int32_t s = 0;
    for (int64_t i = 0; i < kGroupSize; ++i) s += h.a.codes[t * kGroupSize + i];
    h.code_sum[t] = s;
  }
  return h;
}

// One block of 16 outputs (u: its [K / 4, 16, 4] codes, d: its [K / 32, 16] scales), one row.
inline void q8_head_block_portable(const uint8_t* u, const float* d, const Q8Head& h, int64_t row,
                                   int64_t k, float* out) {
  const int64_t groups = k / kGroupSize;
  for (int64_t o = 0; o < 16; ++o) {
    float acc = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t dot = 0;
      for (int64_t i = 0; i < kGroupSize; ++i) {
        const int64_t kk = g * kGroupSize + i;
        dot += static_cast<int32_t>(u[((kk / 4) * 16 + o) * 4 + kk % 4]) * h.a.codes[row * k + kk];
      }
      const int64_t t = row * groups + g;
      const int32_t exact = dot - 128 * h.code_sum[t];
      acc = std::fma(d[g * 16 + o] * h.a.step[t], static_cast<float>(exact), acc);
    }
    out[o] = acc;
  }
}

#if KVSCOPE_HAVE_AVX512_VNNI
// B blocks of 16 outputs for R rows from row0: the integer sums of a group in R x B registers
// (each code load feeds R rows, each broadcast activation quad B blocks), folded once a group.
template <int R, int B>
void q8_head_rows_vnni(const uint8_t* const* u, const float* const* d, const Q8Head& h,
                       int64_t row0, int64_t k, float* out, int64_t ld) {
  const int64_t groups = k / kGroupSize;
  __m512 acc[R][B];
  fill_registers(acc, _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sums[R][B];
    fill_registers(sums, _mm512_setzero_si512());
    KVSCOPE_UNROLL
    for (int q = 0; q < 8; ++q) {
      __m512i w[B];
      KVSCOPE_UNROLL
      for (int b = 0; b < B; ++b) w[b] = _mm512_loadu_si512(u[b] + (8 * g + q) * 64);
      KVSCOPE_UNROLL
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, h.a.codes.data() + (row0 + r) * k + g * kGroupSize + 4 * q, 4);
        const __m512i x = _mm512_set1_epi32(quad);
        KVSCOPE_UNROLL
        for (int b = 0; b < B; ++b) sums[r][b] = _mm512_dpbusd_epi32(sums[r][b], w[b], x);
      }
    }
    KVSCOPE_UNROLL
    for (int r = 0; r < R; ++r) {
      const int64_t t = (row0 + r) * groups + g;
      const __m512i offset = _mm512_set1_epi32(128 * h.code_sum[t]);
      const __m512 dx = _mm512_set1_ps(h.a.step[t]);
      KVSCOPE_UNROLL
      for (int b = 0; b < B; ++b) {
        const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r][b], offset));
        const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(d[b] + g * 16), dx);
        acc[r][b] = _mm512_fmadd_ps(scale, exact, acc[r][b]);
      }
    }
  }
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r)
    KVSCOPE_UNROLL
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(out + (row0 + r) * ld + 16 * b, acc[r][b]);
}
#endif

#if KVSCOPE_HAVE_AVX2
// q8_head_rows_vnni on AVX2 (the 8-bit decode arithmetic's logits on CPUs without VNNI):
// vpmaddubsw multiplies unsigned by signed bytes into 16-bit pair sums, which u = c + 128
// would overflow (2 * 255 * 127), so the codes come back as c = u ^ 128 and the sign moves to
// them (llama.cpp's Q8_0 x Q8_0 on AVX2): |q| times sign(c, q), pairs at most 2 * 128 * 127,
// then vpmaddwd sums each lane's four. The same exact integer sums per group (no offset to
// take off), folded the same way: bitwise the scalar twin's results.
template <int R, int B>
void q8_head_rows_avx2(const uint8_t* const* u, const float* const* d, const Q8Head& h,
                       int64_t row0, int64_t k, float* out, int64_t ld) {
  const int64_t groups = k / kGroupSize;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2 * B];
  fill_registers(acc, _mm256_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    __m256i sums[R][2 * B];
    fill_registers(sums, _mm256_setzero_si256());
    KVSCOPE_UNROLL
    for (int q = 0; q < 8; ++q) {
      __m256i w[2 * B];
      KVSCOPE_UNROLL
      for (int i = 0; i < 2 * B; ++i)
        w[i] = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u[i / 2] + (8 * g + q) * 64 + 32 * (i % 2))),
            flip);
      KVSCOPE_UNROLL
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, h.a.codes.data() + (row0 + r) * k + g * kGroupSize + 4 * q, 4);
        const __m256i x = _mm256_set1_epi32(quad), ax = _mm256_abs_epi8(x);
        KVSCOPE_UNROLL
        for (int i = 0; i < 2 * B; ++i)
          sums[r][i] = pin(_mm256_add_epi32(
              sums[r][i], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w[i], x)), ones)));
      }
    }
    KVSCOPE_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(h.a.step[(row0 + r) * groups + g]);
      KVSCOPE_UNROLL
      for (int i = 0; i < 2 * B; ++i) {
        const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(d[i / 2] + g * 16 + 8 * (i % 2)), dx);
        acc[r][i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums[r][i]), acc[r][i]);
      }
    }
  }
  KVSCOPE_UNROLL
  for (int r = 0; r < R; ++r)
    KVSCOPE_UNROLL
    for (int i = 0; i < 2 * B; ++i) _mm256_storeu_ps(out + (row0 + r) * ld + 8 * i, acc[r][i]);
}
#endif

#if KVSCOPE_HAVE_AVX512_VNNI || KVSCOPE_HAVE_AVX2
// Every row over one pair of 16-output blocks, by the vector kernel compiled in.
inline void q8_head_pair_rows(const uint8_t* const* w, const float* const* d, const Q8Head& h,
                              int64_t rows, int64_t k, float* o, int64_t ld) {
#if KVSCOPE_HAVE_AVX512_VNNI
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6) q8_head_rows_vnni<6, 2>(w, d, h, r, k, o, ld);
  for (; r + 3 <= rows; r += 3) q8_head_rows_vnni<3, 2>(w, d, h, r, k, o, ld);
  // the last one or two rows one block a pass: a pair's two streams of codes at once made a
  // one-row pass 1.05-1.2x slower (Zen 4; bitwise the same sums)
  if (r < rows)
    for (int64_t half = 0; half < 2; ++half) {
      const uint8_t* wb[1] = {w[half]};
      const float* db[1] = {d[half]};
      if (rows - r == 2)
        q8_head_rows_vnni<2, 1>(wb, db, h, r, k, o + 16 * half, ld);
      else
        q8_head_rows_vnni<1, 1>(wb, db, h, r, k, o + 16 * half, ld);
    }
#else
  // one block of 16 outputs a pass, four rows at a time: both blocks of the pair at once (8
  // registers of sums and 8 of outputs a row pair) spilled to memory in the quads' loop where
  // AVX2 has 16 registers (the 1-row head took 1.8x the time, built for Zen 1)
  for (int64_t half = 0; half < 2; ++half) {
    const uint8_t* wb[1] = {w[half]};
    const float* db[1] = {d[half]};
    float* ob = o + 16 * half;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) q8_head_rows_avx2<4, 1>(wb, db, h, r, k, ob, ld);
    switch (rows - r) {
      case 3: q8_head_rows_avx2<3, 1>(wb, db, h, r, k, ob, ld); break;
      case 2: q8_head_rows_avx2<2, 1>(wb, db, h, r, k, ob, ld); break;
      case 1: q8_head_rows_avx2<1, 1>(wb, db, h, r, k, ob, ld); break;
      default: break;
    }
  }
#endif
}
#endif

inline bool q8_head_vnni_available() { return KVSCOPE_HAVE_AVX512_VNNI != 0; }
// a vector kernel for q8_q8_logits: VNNI, else AVX2
inline bool q8_head_vector_available() { return KVSCOPE_HAVE_AVX512_VNNI != 0 || KVSCOPE_HAVE_AVX2 != 0; }

// Logits [rows, N] float32 = 8-bit(hidden) [rows, K] x the exact 8-bit weight (u: q8_vnni_pack,
// scales: q8_pack's), integer sums per group. vectorized: the VNNI kernel where compiled in,
// else the AVX2 one; not: the scalar twin (tests).
inline at::Tensor q8_q8_logits(const at::Tensor& hidden, const at::Tensor& u,
                               const at::Tensor& scales, bool vectorized) {
  TORCH_CHECK(!vectorized || q8_head_vector_available(), "q8_q8_logits: no vector kernel compiled in");
  TORCH_CHECK(hidden.dim() == 2, "hidden [rows, K]");
  const at::Tensor x = hidden.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), k = x.size(1), blocks = u.size(0), groups = k / kGroupSize;
  TORCH_CHECK(u.scalar_type() == at::kByte && u.dim() == 4 && u.is_contiguous() &&
                  u.size(1) * 4 == k && u.size(2) == 16 && u.size(3) == 4 && k % kGroupSize == 0,
              "codes: contiguous [N / 16, K / 4, 16, 4] uint8 (q8_vnni_pack), K % 32 == 0");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 &&
                  scales.size(0) == blocks && scales.size(1) == groups && scales.size(2) == 16,
              "scales: [N / 16, K / 32, 16] float32");
  at::Tensor out = at::empty({rows, blocks * 16}, at::kFloat);
  if (rows == 0) return out;
  const Q8Head h = quantize_head_rows(x.data_ptr<float>(), rows, k, vectorized);
  const uint8_t* up = u.data_ptr<uint8_t>();
  const at::Tensor dense_scales = scales.contiguous();
  const float* sp = dense_scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ld = blocks * 16;
  if (!vectorized) {
    at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t r = 0; r < rows; ++r)
          q8_head_block_portable(up + b * k * 16, sp + b * groups * 16, h, r, k,
                                 op + r * ld + b * 16);
    });
    return out;
  }
#if KVSCOPE_HAVE_AVX512_VNNI || KVSCOPE_HAVE_AVX2
  TORCH_CHECK(blocks % 2 == 0, "q8_q8_logits: N % 32 == 0");
  at::parallel_for(0, blocks / 2, 8, [&](int64_t p0, int64_t p1) {  // pairs of blocks
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = 2 * p;
      const uint8_t* w[2] = {up + b * k * 16, up + (b + 1) * k * 16};
      const float* d[2] = {sp + b * groups * 16, sp + (b + 1) * groups * 16};
      q8_head_pair_rows(w, d, h, rows, k, op + b * 16, ld);
    }
  });
#endif
  return out;
}

}  // namespace kvscope
