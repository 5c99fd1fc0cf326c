// Attention kernels that keep a KV head's queries' sums or outputs in registers while its keys
// and values stream past (attention.h's attend_chunk reloads and stores every head's
// accumulator for every key, and reduces every score across lanes alone): AVX-512 for heads of
// 16, 32 or 64 floats, AVX2 for any multiple of 8 (the CPUs without AVX-512, and AVX-512 CPUs'
// wider heads). The fused step runs the best that fits (pick_attend_chunk); tests call each
// (fused_decode.cpp: attend_chunk_kernel).
#pragma once

#include "attention.h"

namespace kvscope {

// The chunk-attention kernels, in the order of ATTEND_KERNELS (engine_proc/executor/fused_decode.py).
enum class AttendKernel : int64_t { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

#if defined(__AVX512F__)
// attend_chunk for heads of V x 16 floats and G query heads per KV head: a KV head's G
// queries stay in registers while its keys stream past, and its G outputs accumulate in
// registers while its values do (the generic version reloads and stores every head's
// accumulator for every key).
template <typename T, int V, int G>
void attend_chunk_regs(const StepShape& s, const float* q, const T* k_cache, const T* v_cache,
                       const int32_t* table, int64_t seq_len, int64_t first_key, int64_t b0,
                       int64_t b1, Partial* part, float* acc, std::vector<float>& scores_buf) {
  constexpr int64_t d = 16 * V;
  const int64_t bs = s.block_size, slot_stride = s.kv_heads * d;
  const int64_t j0 = b0 * bs, n = std::min(seq_len, b1 * bs) - j0;
  scores_buf.resize(s.heads * n);
  float* scores = scores_buf.data();  // [heads, n]
  for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh) {
    const int64_t h0 = kvh * G;
    __m512 qr[G][V];
    KVSCOPE_UNROLL
    for (int g = 0; g < G; ++g)
      KVSCOPE_UNROLL
      for (int v = 0; v < V; ++v) qr[g][v] = _mm512_loadu_ps(q + (h0 + g) * d + 16 * v);
    for_each_key(k_cache, table, b0, b1, n, bs, slot_stride, kvh * d, [&](const T* key, int64_t j) {
      __m512 kr[V];
      KVSCOPE_UNROLL
      for (int v = 0; v < V; ++v) kr[v] = load16(key + 16 * v);
      KVSCOPE_UNROLL
      for (int g = 0; g < G; ++g) {
        __m512 t = _mm512_mul_ps(qr[g][0], kr[0]);
        for (int v = 1; v < V; ++v) t = _mm512_fmadd_ps(qr[g][v], kr[v], t);
        scores[(h0 + g) * n + j] = _mm512_reduce_add_ps(t) * s.scale;
      }
    }, d);
  }
  mask_before(scores, s.heads, n, first_key - j0);
  softmax_states(scores, s.heads, n, part);
  for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh) {
    const int64_t h0 = kvh * G;
    __m512 a[G][V];
    fill_registers(a, _mm512_setzero_ps());
    for_each_key(v_cache, table, b0, b1, n, bs, slot_stride, kvh * d, [&](const T* value, int64_t j) {
      __m512 vr[V];
      KVSCOPE_UNROLL
      for (int v = 0; v < V; ++v) vr[v] = load16(value + 16 * v);
      KVSCOPE_UNROLL
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[(h0 + g) * n + j]);
        KVSCOPE_UNROLL
        for (int v = 0; v < V; ++v) a[g][v] = _mm512_fmadd_ps(p, vr[v], a[g][v]);
      }
    }, d);
    KVSCOPE_UNROLL
    for (int g = 0; g < G; ++g)
      KVSCOPE_UNROLL
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + (h0 + g) * d + 16 * v, a[g][v]);
  }
}
#endif


#if KVSCOPE_HAVE_AVX2
constexpr int kAvx2Keys = 4;  // keys scored together: their sums reduced across lanes at once

// Scores of GS query heads q [GS, d] against m keys (key j at keys + j * stride), times
// scale, into out[g * out_stride + j]. Four keys at a time: each 8-float piece of a key widened
// once for all GS queries, their 4 x GS sums in registers, then three hadds per query reduce
// four keys' sums at once (attend_chunk: a horizontal sum per key and query). The reductions
// never mix keys, so a key's score is the same bits wherever it falls in a group of four: the
// last group repeats a key to fill.
template <typename T, int GS>
inline void scores_avx2(const float* q, int64_t d, const T* keys, int64_t stride, int64_t m,
                        float scale, float* out, int64_t out_stride) {
  const __m128 sc = _mm_set1_ps(scale);
  for (int64_t j = 0; j < m; j += kAvx2Keys) {
    const T* key[kAvx2Keys];
    KVSCOPE_UNROLL
    for (int i = 0; i < kAvx2Keys; ++i) key[i] = keys + std::min<int64_t>(j + i, m - 1) * stride;
    __m256 acc[GS][kAvx2Keys];
    fill_registers(acc, _mm256_setzero_ps());
    for (int64_t e = 0; e < d; e += 8) {
      __m256 k[kAvx2Keys];
      KVSCOPE_UNROLL
      for (int i = 0; i < kAvx2Keys; ++i) k[i] = load8(key[i] + e);
      KVSCOPE_UNROLL
      for (int g = 0; g < GS; ++g) {
        const __m256 qv = _mm256_loadu_ps(q + g * d + e);
        KVSCOPE_UNROLL
        for (int i = 0; i < kAvx2Keys; ++i) acc[g][i] = _mm256_fmadd_ps(qv, k[i], acc[g][i]);
      }
    }
    const int64_t valid = std::min<int64_t>(kAvx2Keys, m - j);
    KVSCOPE_UNROLL
    for (int g = 0; g < GS; ++g) {
      // lane halves: [k0 k1 k2 k3] sums of elements 0-3 | of 4-7 of each 8
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]),
                                      _mm256_hadd_ps(acc[g][2], acc[g][3]));
      const __m128 s4 =
          _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), sc);
      alignas(16) float four[kAvx2Keys];
      _mm_store_ps(four, s4);
      std::copy(four, four + valid, out + g * out_stride + j);
    }
  }
}

// acc [GS, d] += sum over m values of p[g * p_stride + j] * value j (at values + j * stride):
// a pass per VP x 8 floats of the head, its GS x VP sums in registers while the values stream.
template <typename T, int GS, int VP>
inline void weigh_values_avx2(const float* p, int64_t p_stride, const T* values, int64_t stride,
                              int64_t m, int64_t d, float* acc) {
  for (int64_t e0 = 0; e0 < d; e0 += 8 * VP) {
    __m256 a[GS][VP];
    KVSCOPE_UNROLL
    for (int g = 0; g < GS; ++g)
      KVSCOPE_UNROLL
      for (int v = 0; v < VP; ++v) a[g][v] = _mm256_loadu_ps(acc + g * d + e0 + 8 * v);
    for (int64_t j = 0; j < m; ++j) {
      __m256 w[GS];
      KVSCOPE_UNROLL
      for (int g = 0; g < GS; ++g) w[g] = _mm256_set1_ps(p[g * p_stride + j]);
      KVSCOPE_UNROLL
      for (int v = 0; v < VP; ++v) {
        const __m256 x = load8(values + j * stride + e0 + 8 * v);
        KVSCOPE_UNROLL
        for (int g = 0; g < GS; ++g) a[g][v] = _mm256_fmadd_ps(w[g], x, a[g][v]);
      }
    }
    KVSCOPE_UNROLL
    for (int g = 0; g < GS; ++g)
      KVSCOPE_UNROLL
      for (int v = 0; v < VP; ++v) _mm256_storeu_ps(acc + g * d + e0 + 8 * v, a[g][v]);
  }
}

// weigh_values_avx2 for `heads` (1-3) query heads: four registers of each head's output a pass
// where the head is a multiple of 32 floats, else one.
template <typename T>
inline void weigh_heads_values_avx2(int64_t heads, const float* p, int64_t p_stride, const T* values,
                              int64_t stride, int64_t m, int64_t d, float* acc) {
  const bool wide = d % 32 == 0;
  switch (heads) {
    case 3: return wide ? weigh_values_avx2<T, 3, 4>(p, p_stride, values, stride, m, d, acc)
                        : weigh_values_avx2<T, 3, 1>(p, p_stride, values, stride, m, d, acc);
    case 2: return wide ? weigh_values_avx2<T, 2, 4>(p, p_stride, values, stride, m, d, acc)
                        : weigh_values_avx2<T, 2, 1>(p, p_stride, values, stride, m, d, acc);
    default: return wide ? weigh_values_avx2<T, 1, 4>(p, p_stride, values, stride, m, d, acc)
                         : weigh_values_avx2<T, 1, 1>(p, p_stride, values, stride, m, d, acc);
  }
}

// Every line of a block of the cache (the next one, while this one is computed): blocks are
// scattered, so the hardware prefetcher stops at each block's end, and walking a block's KV
// heads one at a time reads its lines out of order (from memory it took 1.04-1.10x the time
// of the generic kernel, which reads a block's slots in order; with this 0.94-0.97x).
template <typename T>
inline void prefetch_slots(const T* cache, int32_t block, int64_t block_elems) {
  const char* p = reinterpret_cast<const char*>(cache + static_cast<int64_t>(block) * block_elems);
  for (int64_t off = 0, bytes = block_elems * static_cast<int64_t>(sizeof(T)); off < bytes; off += 64)
    _mm_prefetch(p + off, _MM_HINT_T0);
}

// Up to three query heads of a KV head at a time: 12 accumulators and the operands fill the
// 16 registers AVX2 has.
constexpr int64_t kAvx2Heads = 3;

// fn(slots, m, j, h, heads) for each block of [b0, b1) of a table (keys j.. j + m - 1 of the
// n from b0's first) and each run of up to kAvx2Heads query heads h.. h + heads - 1 of a KV
// head, `slots` at that KV head in the block's first slot (slot i: slots + i * kv_heads * d);
// the next block's lines prefetched while one is visited.
template <typename T, typename Fn>
inline void for_each_block_heads(const StepShape& s, const T* cache, const int32_t* table,
                                 int64_t b0, int64_t b1, int64_t n, Fn&& fn) {
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads, bs = s.block_size;
  const int64_t block_elems = bs * s.kv_heads * d;
  for (int64_t b = b0, j = 0; b < b1 && j < n; ++b, j += bs) {
    const T* block = cache + static_cast<int64_t>(table[b]) * block_elems;
    const int64_t m = std::min(bs, n - j);
    if (b + 1 < b1 && j + m < n) prefetch_slots(cache, table[b + 1], block_elems);
    for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh)
      for (int64_t g = 0; g < group; g += kAvx2Heads)
        fn(block + kvh * d, m, j, kvh * group + g, std::min(kAvx2Heads, group - g));
  }
}

// attend_chunk on AVX2 for heads of a multiple of 8 floats (any number of query heads per KV
// head): keys block by block, every KV head of a block before the next (the next block's lines
// fetched meanwhile), each KV head's queries three at a time.
template <typename T>
void attend_chunk_avx2(const StepShape& s, const float* q, const T* k_cache, const T* v_cache,
                       const int32_t* table, int64_t seq_len, int64_t first_key, int64_t b0,
                       int64_t b1, Partial* part, float* acc, std::vector<float>& scores_buf) {
  const int64_t d = s.head_dim, slot_stride = s.kv_heads * d;
  const int64_t j0 = b0 * s.block_size, n = std::min(seq_len, b1 * s.block_size) - j0;
  scores_buf.resize(s.heads * n);
  float* scores = scores_buf.data();  // [heads, n]
  const auto score = [&](const T* keys, int64_t m, int64_t j, int64_t h, int64_t heads) {
    float* out = scores + h * n + j;
    switch (heads) {
      case 3: return scores_avx2<T, 3>(q + h * d, d, keys, slot_stride, m, s.scale, out, n);
      case 2: return scores_avx2<T, 2>(q + h * d, d, keys, slot_stride, m, s.scale, out, n);
      default: return scores_avx2<T, 1>(q + h * d, d, keys, slot_stride, m, s.scale, out, n);
    }
  };
  for_each_block_heads(s, k_cache, table, b0, b1, n, score);
  mask_before(scores, s.heads, n, first_key - j0);
  softmax_states(scores, s.heads, n, part);
  std::fill(acc, acc + s.heads * d, 0.f);
  const auto weigh = [&](const T* values, int64_t m, int64_t j, int64_t h, int64_t heads) {
    weigh_heads_values_avx2(heads, scores + h * n + j, n, values, slot_stride, m, d, acc + h * d);
  };
  for_each_block_heads(s, v_cache, table, b0, b1, n, weigh);
}

#endif

template <typename T>
using AttendChunk = void (*)(const StepShape&, const float*, const T*, const T*, const int32_t*,
                             int64_t, int64_t, int64_t, int64_t, Partial*, float*,
                             std::vector<float>&);

// `kernel` for this shape, nullptr where it is not compiled in or does not fit it: AVX-512 for
// heads of 16, 32 or 64 floats and up to 4 query heads per KV head (its G x V accumulators in
// registers), AVX2 for heads of a multiple of 8 floats.
template <typename T>
AttendChunk<T> attend_chunk_for(AttendKernel kernel, const StepShape& s) {
  const int64_t group = s.heads / s.kv_heads;
  switch (kernel) {
    case AttendKernel::kGeneric: return attend_chunk<T>;
    case AttendKernel::kAvx2:
#if KVSCOPE_HAVE_AVX2
      if (s.head_dim % 8 == 0) return attend_chunk_avx2<T>;
#endif
      return nullptr;
    case AttendKernel::kAvx512: {
#if defined(__AVX512F__)
      constexpr AttendChunk<T> table[3][4] = {
          {attend_chunk_regs<T, 1, 1>, attend_chunk_regs<T, 1, 2>, attend_chunk_regs<T, 1, 3>, attend_chunk_regs<T, 1, 4>},
          {attend_chunk_regs<T, 2, 1>, attend_chunk_regs<T, 2, 2>, attend_chunk_regs<T, 2, 3>, attend_chunk_regs<T, 2, 4>},
          {attend_chunk_regs<T, 4, 1>, attend_chunk_regs<T, 4, 2>, attend_chunk_regs<T, 4, 3>, attend_chunk_regs<T, 4, 4>}};
      const int row = s.head_dim == 16 ? 0 : s.head_dim == 32 ? 1 : s.head_dim == 64 ? 2 : -1;
      if (row >= 0 && group >= 1 && group <= 4) return table[row][group - 1];
#endif
      return nullptr;
    }
  }
  return nullptr;
}

// The fastest kernel that runs this shape: AVX-512's, else AVX2's, else the generic one.
template <typename T>
AttendChunk<T> pick_attend_chunk(const StepShape& s) {
  for (const auto kernel : {AttendKernel::kAvx512, AttendKernel::kAvx2})
    if (const auto attend = attend_chunk_for<T>(kernel, s)) return attend;
  return attend_chunk<T>;
}

// One chunk of one row's attention by `kernel` (an AttendKernel index) for tests: q [heads, d]
// float32, caches [blocks, block_size, kv_heads, d] float32 or float16, table int32; returns
// each head's softmax max and sum and its unnormalised output [heads, d].
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> attend_chunk_kernel(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& table, int64_t seq_len, int64_t first_key, int64_t b0, int64_t b1,
    double scale, int64_t kernel) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 2, "q: float32 [heads, d]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type() && v_cache.is_contiguous(),
              "caches: [blocks, block_size, kv_heads, d], both alike");
  TORCH_CHECK(table.scalar_type() == at::kInt && table.is_contiguous(), "table: int32");
  TORCH_CHECK(kernel >= 0 && kernel <= 2, "kernel must be 0 (generic), 1 (avx2) or 2 (avx512), got ", kernel);
  const StepShape s{q.size(0), k_cache.size(2), q.size(1), k_cache.size(1), table.numel(),
                    static_cast<float>(scale)};
  TORCH_CHECK(k_cache.size(3) == s.head_dim && s.heads % s.kv_heads == 0, "q and caches' heads");
  TORCH_CHECK(0 <= b0 && b0 < b1 && b1 <= s.max_blocks && seq_len > b0 * s.block_size &&
                  seq_len <= s.max_blocks * s.block_size, "blocks [b0, b1) of the table, up to seq_len");
  at::Tensor max = at::empty({s.heads}, q.options()), sum = at::empty({s.heads}, q.options());
  at::Tensor acc = at::empty({s.heads, s.head_dim}, q.options());
  std::vector<Partial> part(s.heads);
  std::vector<float> scores;
  const auto run = [&](const auto* k, const auto* v) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(k)>>;
    const auto attend = attend_chunk_for<T>(static_cast<AttendKernel>(kernel), s);
    TORCH_CHECK(attend != nullptr, "attention kernel ", kernel, " is not compiled in or does not fit heads of ",
                s.head_dim, " x ", s.heads / s.kv_heads, " per KV head");
    attend(s, q.data_ptr<float>(), k, v, table.data_ptr<int32_t>(), seq_len, first_key, b0, b1,
           part.data(), acc.data_ptr<float>(), scores);
  };
  if (k_cache.scalar_type() == at::kHalf)
    run(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
  else
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  for (int64_t h = 0; h < s.heads; ++h) {
    max.data_ptr<float>()[h] = part[h].max;
    sum.data_ptr<float>()[h] = part[h].sum;
  }
  return {max, sum, acc};
}

}  // namespace kvscope
