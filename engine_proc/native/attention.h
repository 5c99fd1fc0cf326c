// Attention of one decode token per sequence over the paged KV cache, read in place through
// the block table (no gathered copy of the context): float32 arithmetic over a float32 or
// float16 cache (T, the pool's element type: float16 halves the bytes the wide steps read,
// llama.cpp's default KV type; values widen exactly as they load).
//
// Keys are visited block by block, every KV head of a block before the next block: a block's
// slots are contiguous, so the reads stream (one head at a time across the whole context
// strides through memory and waits on it). Long contexts are split into chunks of blocks
// attended on different threads, each with its own softmax maximum and sum, merged at the end.
#pragma once

#include "common.h"

namespace kvscope {

struct StepShape {
  int64_t heads, kv_heads, head_dim, block_size, max_blocks;
  float scale;
};

// Rotary (rotate_half layout) of one head: out = x * cos + rotate_half(x) * sin.
inline void rope(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

#if defined(__AVX512F__)
// exp(x): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (relative
// error < 2e-7), times 2^n by scalef (which saturates to 0 and infinity).
inline __m512 exp_approx(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // below this exp is 0 in float32 anyway
  x = _mm512_min_ps(x, _mm512_set1_ps(104.f));  // above, infinity
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2, split in two
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#endif

#if KVSCOPE_HAVE_AVX2
// exp_approx on 8 floats, 2^n built in the exponent bits (AVX2 has no scalef): x is clamped
// to [-87, 88] so n + 127 stays a normal exponent (below, exp underflows to ~1e-38 instead of
// 0, which a softmax weight cannot tell apart).
inline __m256 exp_approx8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// out[i] = exp(x[i])
inline void exp_into(const float* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, exp_approx(_mm512_loadu_ps(x + i)));
#elif KVSCOPE_HAVE_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, exp_approx8(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) out[i] = std::exp(x[i]);
}

// In place: sc[j] = exp(sc[j] - m); returns their sum.
inline float exp_sum(float* sc, int64_t n, float m) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) sc[j] -= m;
  exp_into(sc, sc, n);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < n; ++j) total += sc[j];
  return total;
}

inline float to_float(float x) { return x; }
inline float to_float(at::Half x) { return static_cast<float>(x); }

// A row of d floats stored as T (float16: rounded to nearest even, as torch's .half()).
inline void store_row(const float* x, float* out, int64_t d) { std::copy(x, x + d, out); }
inline void store_row(const float* x, at::Half* out, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<at::Half>(x[i]);
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif KVSCOPE_HAVE_AVX2
  if (n % 16 == 0) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), a1);
    }
    return hsum8(_mm256_add_ps(a0, a1));
  }
#endif
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * to_float(b[i]);
  return s;
}

// acc[i] += p * v[i]
inline void axpy(float p, const float* v, float* acc, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += p * v[i];
}
inline void axpy(float p, const at::Half* v, float* acc, int64_t n) {
  int64_t i = 0;
#if KVSCOPE_HAVE_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, load8(v + i), _mm256_loadu_ps(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += p * to_float(v[i]);
}

// Softmax state of one query head over a chunk of keys: exp(score - max) summed, and those
// weights times the values.
struct Partial {
  float max = -INFINITY, sum = 0.f;
};

// fn(slot, j) for keys j = 0..n-1 of the blocks [b0, b1) of a table: slot points `offset`
// elements into key j's slot of `cache`, keys visited in cache order.
// width > 0: while a block is visited, the `width` elements from `offset` of each slot of the
// next block are prefetched (blocks are scattered, so the hardware prefetcher stops at each
// block's end and the first keys of the next would wait on memory).
template <typename T, typename Fn>
inline void for_each_key(const T* cache, const int32_t* table, int64_t b0, int64_t b1,
                         int64_t n, int64_t block_size, int64_t slot_stride, int64_t offset,
                         Fn&& fn, int64_t width = 0) {
  const int64_t block_elems = block_size * slot_stride;
  constexpr int64_t line = 64 / sizeof(T);
  for (int64_t b = b0, j = 0; b < b1 && j < n; ++b) {
    const T* block = cache + static_cast<int64_t>(table[b]) * block_elems + offset;
    const int64_t m = std::min(block_size, n - j);
    if (width > 0 && b + 1 < b1 && j + m < n) {
      const char* next = reinterpret_cast<const char*>(
          cache + static_cast<int64_t>(table[b + 1]) * block_elems + offset);
      const int64_t next_m = std::min(block_size, n - j - m);
      for (int64_t o = 0; o < next_m; ++o)
        for (int64_t f = 0; f < width; f += line)
          __builtin_prefetch(next + (o * slot_stride + f) * sizeof(T), 0, 3);
    }
    for (int64_t o = 0; o < m; ++o) fn(block + o * slot_stride, j + o);
    j += m;
  }
}

// Per head, scores [heads, n] become exp(score - max) in place; their max and sum into part.
inline void softmax_states(float* scores, int64_t heads, int64_t n, Partial* part) {
  for (int64_t h = 0; h < heads; ++h) {
    float* sc = scores + h * n;
    part[h].max = *std::max_element(sc, sc + n);
    part[h].sum = exp_sum(sc, n, part[h].max);
  }
}

// Scores [heads, n] of the keys before `count` (a sliding window's older keys in its first
// block) set to -inf: they get no weight.
inline void mask_before(float* scores, int64_t heads, int64_t n, int64_t count) {
  if (count <= 0) return;
  count = std::min(count, n);
  for (int64_t h = 0; h < heads; ++h) std::fill(scores + h * n, scores + h * n + count, -INFINITY);
}

// Attention of all heads of one row over the blocks [b0, b1) of its table (keys from first_key
// up to seq_len: first_key > 0 in a sliding-window layer): per head, max, sum and the
// unnormalised output into acc [heads, d].
template <typename T>
void attend_chunk(const StepShape& s, const float* q, const T* k_cache, const T* v_cache,
                  const int32_t* table, int64_t seq_len, int64_t first_key, int64_t b0,
                  int64_t b1, Partial* part, float* acc, std::vector<float>& scores_buf) {
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads, bs = s.block_size;
  const int64_t slot_stride = s.kv_heads * d;  // elements per cache slot
  const int64_t j0 = b0 * bs, n = std::min(seq_len, b1 * bs) - j0;
  scores_buf.resize(s.heads * n);
  float* scores = scores_buf.data();  // [heads, n]
  // slot by slot, every head: the block's bytes in order
  for_each_key(k_cache, table, b0, b1, n, bs, slot_stride, 0, [&](const T* key, int64_t j) {
    for (int64_t h = 0; h < s.heads; ++h)
      scores[h * n + j] = dot(q + h * d, key + (h / group) * d, d) * s.scale;
  });
  mask_before(scores, s.heads, n, first_key - j0);
  softmax_states(scores, s.heads, n, part);
  std::fill(acc, acc + s.heads * d, 0.f);
  for_each_key(v_cache, table, b0, b1, n, bs, slot_stride, 0, [&](const T* value, int64_t j) {
    for (int64_t h = 0; h < s.heads; ++h)
      axpy(scores[h * n + j], value + (h / group) * d, acc + h * d, d);
  });
}

constexpr int64_t kMaxHeadDim = 512;  // the float16 key's rotation goes through a stack row

// The rotated key x into its cache slot: in place for float32, rounded from a row for float16.
inline void rope_store(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  rope(x, cos, sin, d, out);
}
inline void rope_store(const float* x, const float* cos, const float* sin, int64_t d,
                       at::Half* out) {
  float row[kMaxHeadDim];
  rope(x, cos, sin, d, row);
  store_row(row, out, d);
}

// Qwen3's and Gemma 3's RMSNorm of every q and k head before rotary (weights [head_dim]);
// q == nullptr: none (Llama, Qwen2).
struct HeadNorms {
  const float* q = nullptr;
  const float* k = nullptr;
  float eps = 0.f;
};

// x [d] RMS-normalised times w into out (the eager path's F.rms_norm over one head).
inline void head_rms_norm(const float* x, const float* w, int64_t d, float eps, float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = x[i] * inv * w[i];
}

// Rotary on the row's query heads and keys (each normalised first where `norms` has weights);
// the new K/V written at its slot (if any).
template <typename T>
void rope_and_write(const StepShape& s, const float* qkv_row, const float* cos, const float* sin,
                    T* k_cache, T* v_cache, int64_t slot, float* q, const HeadNorms& norms) {
  const int64_t d = s.head_dim, slot_stride = s.kv_heads * d;
  float normed[kMaxHeadDim];
  for (int64_t h = 0; h < s.heads; ++h) {
    const float* x = qkv_row + h * d;
    if (norms.q != nullptr) x = (head_rms_norm(x, norms.q, d, norms.eps, normed), normed);
    rope(x, cos, sin, d, q + h * d);
  }
  if (slot < 0) return;
  for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh) {
    const float* k_in = qkv_row + (s.heads + kvh) * d;
    const float* v_in = qkv_row + (s.heads + s.kv_heads + kvh) * d;
    if (norms.k != nullptr) k_in = (head_rms_norm(k_in, norms.k, d, norms.eps, normed), normed);
    rope_store(k_in, cos, sin, d, k_cache + slot * slot_stride + kvh * d);
    store_row(v_in, v_cache + slot * slot_stride + kvh * d, d);
  }
}

// The chunks' softmax states merged (each rescaled to the overall maximum), normalised, into
// out [heads, d].
inline void merge_chunks(const StepShape& s, const Partial* part, const float* acc,
                         int64_t chunks, float* out) {
  const int64_t d = s.head_dim;
  for (int64_t h = 0; h < s.heads; ++h) {
    float m = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) m = std::max(m, part[c * s.heads + h].max);
    std::vector<float> o(d, 0.f);
    float total = 0.f;
    for (int64_t c = 0; c < chunks; ++c) {
      const Partial& p = part[c * s.heads + h];
      if (p.sum == 0.f) continue;  // an empty chunk
      const float w = std::exp(p.max - m);
      total += w * p.sum;
      axpy(w, acc + (c * s.heads + h) * d, o.data(), d);
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;  // no keys (a padding row): zeros
    for (int64_t i = 0; i < d; ++i) out[h * d + i] = o[i] * inv;
  }
}

}  // namespace kvscope
