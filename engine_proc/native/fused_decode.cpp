// One CPU decode step of a Llama-family model (with Qwen2's biases, Qwen3's q/k head norms,
// Gemma 3's sandwich norms, GELU-tanh MLP and sliding-window layers over the hybrid KV cache)
// over the paged KV cache, in a single call from
// Python: what the eager path does with ~40 torch operators per layer (each a Python dispatch
// of a few microseconds on vectors of a few hundred floats) runs here as plain loops around the
// 4-bit products (int4_kernels.h), attention (attention.h, attention_regs.h) and the output projection
// (head_kernels.h). Built at run time by engine_proc/fused_decode.py.
//
// Float32 throughout (hidden states, RMSNorm, rotary, attention over a float32 or float16 KV
// cache, SiLU-and-multiply), around 4-bit products with float32 outputs whose activations enter as
// bfloat16 (fast: the eager int4 path's arithmetic, engine_proc/models/llama.py) or as a
// bfloat16 pair hi + lo (precise: the dense float32 model's products to 2^-18; see
// int4_kernels.h). The caller picks per step. Fast steps take 8-bit activations instead in the
// products whose weights come with strips (int4_q8_kernels.h; which: fused_decode.py).

#include "attention_regs.h"
#include "common.h"
#include "head_kernels.h"
#include "head_q8_kernels.h"
#include "int4_kernels.h"
#include "int4_q8_kernels.h"

namespace kvscope {
namespace {

// Key elements (keys x query heads x head_dim) of attention below which a fork-join costs more
// than the arithmetic: a row's keys are split among threads past it, a step's rows forked.
constexpr int64_t kForkWork = int64_t{1} << 17;

struct Linear4 {
  at::Tensor packed;        // torch's int4 CPU layout
  at::Tensor scales_zeros;  // [in / 32, out, 2] bfloat16 (torch's kernel)
  at::Tensor planes;        // [in / 32, 2, out] float32 scale and low (ours)
  at::Tensor bias;          // float32 [out] or empty
  at::Tensor strips;        // [out / 16, in / 4, 32] (int4_q8_kernels.h) or empty
};

struct Layer {
  at::Tensor input_norm, post_norm;  // float32 [hidden]
  Linear4 qkv, o, gate_up, down;
  at::Tensor q_norm, k_norm;  // float32 [head_dim] (Qwen3, Gemma 3), or empty (Llama, Qwen2)
  // Gemma's sandwich: norms of the attention's and the MLP's outputs, float32 [hidden] or empty
  at::Tensor attn_out_norm, mlp_out_norm;
  int64_t window = 0;  // a sliding-window layer's window in tokens; 0: full attention
  int64_t group = 0;   // its group of the hybrid KV cache (engine_proc/core/kv_groups.py)
  int64_t slot = 0;    // its slot in the group's pages (the KV cache's first dimension)

  HeadNorms head_norms(float eps) const {
    if (q_norm.numel() == 0) return {};
    return {q_norm.data_ptr<float>(), k_norm.data_ptr<float>(), eps};
  }
};

// RMSNorm of each row of h [rows, n], float32.
void rms_norm(const float* h, const float* w, int64_t rows, int64_t n, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = h + r * n;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[r * n + i] = x[i] * inv * w[i];
  }
}

// h += y, float32.
void add_into(float* h, const at::Tensor& y) {
  const float* yp = y.data_ptr<float>();
  for (int64_t i = 0, count = y.numel(); i < count; ++i) h[i] += yp[i];
}

class FusedDecoder {
 public:
  // local_cos / local_sin: the sliding layers' rotary tables (Gemma 3), empty: the global
  // ones. embed_scale 0: none; attn_scale: the attention's; gelu: GELU-tanh, else SiLU.
  // layer_windows, layer_groups, layer_slots: per layer (see Layer).
  FusedDecoder(const std::vector<at::Tensor>& tensors, at::Tensor embed, at::Tensor cos,
               at::Tensor sin, at::Tensor local_cos, at::Tensor local_sin, int64_t heads,
               int64_t kv_heads, int64_t head_dim, double eps, int64_t int4_kernel,
               int64_t pack_block, int64_t attention_chunks, int64_t attention_kernel,
               double embed_scale,
               double attn_scale, bool gelu, const std::vector<int64_t>& layer_windows,
               const std::vector<int64_t>& layer_groups, const std::vector<int64_t>& layer_slots)
      : embed_(std::move(embed)), cos_(std::move(cos)), sin_(std::move(sin)),
        local_cos_(local_cos.numel() > 0 ? std::move(local_cos) : cos_),
        local_sin_(local_sin.numel() > 0 ? std::move(local_sin) : sin_), heads_(heads),
        kv_heads_(kv_heads), head_dim_(head_dim), eps_(static_cast<float>(eps)),
        int4_kernel_(int4_kernel), pack_block_(pack_block), attention_chunks_(attention_chunks),
        attention_kernel_(attention_kernel),
        embed_scale_(static_cast<float>(embed_scale)), attn_scale_(static_cast<float>(attn_scale)),
        gelu_(gelu) {
    constexpr size_t kPerLayer = 26;  // see fused_decode.py: layer_tensors
    TORCH_CHECK(tensors.size() % kPerLayer == 0, "expected 26 tensors per layer");
    const size_t num_layers = tensors.size() / kPerLayer;
    TORCH_CHECK(layer_windows.size() == num_layers && layer_groups.size() == num_layers &&
                    layer_slots.size() == num_layers, "a window, group and slot per layer");
    for (size_t i = 0; i < tensors.size(); i += kPerLayer) {
      const at::Tensor* t = &tensors[i];
      const size_t li = i / kPerLayer;
      layers_.push_back(Layer{t[0], t[1],
                              {t[2], t[3], t[4], t[5], t[6]}, {t[7], t[8], t[9], t[10], t[11]},
                              {t[12], t[13], t[14], t[15], t[16]}, {t[17], t[18], t[19], t[20], t[21]},
                              t[22], t[23], t[24], t[25], layer_windows[li], layer_groups[li],
                              layer_slots[li]});
      const Layer& L = layers_.back();
      num_groups_ = std::max(num_groups_, L.group + 1);
      num_slots_ = std::max(num_slots_, L.slot + 1);
      TORCH_CHECK(L.q_norm.numel() == L.k_norm.numel() &&
                      (L.q_norm.numel() == 0 || L.q_norm.numel() == head_dim_),
                  "q/k norms: both empty or both float32 [head_dim]");
    }
    TORCH_CHECK(cos_.is_contiguous() && cos_.scalar_type() == at::kFloat, "cos: float32");
    TORCH_CHECK(local_cos_.is_contiguous() && local_cos_.scalar_type() == at::kFloat &&
                    local_cos_.sizes() == cos_.sizes(), "local cos: float32, as cos");
    TORCH_CHECK(head_dim_ <= kMaxHeadDim, "head_dim up to ", kMaxHeadDim, ", got ", head_dim_);
    TORCH_CHECK(attention_kernel_ >= -1 && attention_kernel_ <= 2,
                "attention_kernel must be -1 (the best that fits), 0, 1 or 2, got ", attention_kernel_);
    const StepShape shape{heads_, kv_heads_, head_dim_, 1, 1, 1.f};
    TORCH_CHECK(attention_kernel_ < 0 ||
                    attend_chunk_for<float>(static_cast<AttendKernel>(attention_kernel_), shape),
                "attention kernel ", attention_kernel_, " is not compiled in or does not fit heads of ",
                head_dim_, " x ", heads_ / kv_heads_, " per KV head");
  }

  // token ids [rows] -> final-norm hidden states [rows, hidden], float32. slots and
  // block_tables: one per KV group (the hybrid cache's; one group without sliding layers).
  // precise: the 4-bit products' activations as bfloat16 pairs (see the top of this file).
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, at::Tensor kv_cache,
                     const std::vector<at::Tensor>& slots,
                     const std::vector<at::Tensor>& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& final_norm, bool precise) {
    const bool half_kv = kv_cache.scalar_type() == at::kHalf;
    TORCH_CHECK(half_kv || kv_cache.scalar_type() == at::kFloat, "float32 or float16 KV cache");
    TORCH_CHECK(kv_cache.is_contiguous(), "contiguous KV cache");
    TORCH_CHECK(kv_cache.size(0) == num_slots_, "KV cache slots per page: ", num_slots_);
    TORCH_CHECK(static_cast<int64_t>(slots.size()) == num_groups_ &&
                    static_cast<int64_t>(block_tables.size()) == num_groups_,
                "slots and block tables of ", num_groups_, " KV groups");
    for (int64_t g = 0; g < num_groups_; ++g)
      TORCH_CHECK(slots[g].scalar_type() == at::kLong && block_tables[g].scalar_type() == at::kInt &&
                      block_tables[g].is_contiguous(),
                  "int64 slots, contiguous int32 block tables");
    TORCH_CHECK(positions.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kInt,
                "int64 positions, int32 sequence lengths");
    TORCH_CHECK(input_ids.scalar_type() == at::kLong, "int64 token ids");
    at::Tensor h = embed_.index_select(0, input_ids);
    if (embed_scale_ != 0.f) h.mul_(embed_scale_);  // Gemma: the eager path's float32 product
    const int64_t rows = h.size(0), n = h.size(1);
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    at::Tensor x = at::empty({rows, n}, at::kFloat);
    at::Tensor attn = at::empty({rows, heads_ * head_dim_}, at::kFloat);
    float* hp = h.data_ptr<float>();
    const int64_t layer_stride = kv_cache.stride(0);  // one slot of a page
    const int64_t kv_half = kv_cache.stride(1);
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& L = layers_[li];
      rms_norm(hp, L.input_norm.data_ptr<float>(), rows, n, eps_, x.data_ptr<float>());
      at::Tensor qkv = int4_mm(x, L.qkv, precise);
      add_bias(qkv, L.qkv.bias);
      const HeadNorms norms = L.head_norms(eps_);
      const at::Tensor& table = block_tables[L.group];
      const StepShape s{heads_, kv_heads_, head_dim_, kv_cache.size(3), table.size(1), attn_scale_};
      const at::Tensor& cos = L.window > 0 ? local_cos_ : cos_;
      const at::Tensor& sin = L.window > 0 ? local_sin_ : sin_;
      const Rows r{pos, slots[L.group].data_ptr<int64_t>(), table.data_ptr<int32_t>(), lens,
                   L.window, cos.data_ptr<float>(), sin.data_ptr<float>()};
      if (half_kv) {
        at::Half* k_cache = kv_cache.data_ptr<at::Half>() + L.slot * layer_stride;
        attention(s, qkv, r, k_cache, k_cache + kv_half, norms, attn);
      } else {
        float* k_cache = kv_cache.data_ptr<float>() + L.slot * layer_stride;
        attention(s, qkv, r, k_cache, k_cache + kv_half, norms, attn);
      }
      add_output(hp, int4_mm(attn, L.o, precise), L.attn_out_norm);
      rms_norm(hp, L.post_norm.data_ptr<float>(), rows, n, eps_, x.data_ptr<float>());
      at::Tensor gu = int4_mm(x, L.gate_up, precise);
      add_output(hp, int4_mm(gelu_ ? gelu_tanh_mul(gu) : silu_mul(gu), L.down, precise),
                 L.mlp_out_norm);
    }
    at::Tensor out = at::empty_like(h);
    rms_norm(hp, final_norm.data_ptr<float>(), rows, n, eps_, out.data_ptr<float>());
    return out;
  }

 private:
  // y [rows, m] += bias [m] (none when empty), float32.
  static void add_bias(at::Tensor& y, const at::Tensor& bias) {
    if (!bias.defined() || bias.numel() == 0) return;
    const int64_t rows = y.size(0), m = y.size(1);
    float* yp = y.data_ptr<float>();
    const float* b = bias.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < m; ++i) yp[r * m + i] += b[i];
  }

  // silu(gate) * up from the [rows, 2I] gate/up product, float32.
  static at::Tensor silu_mul(const at::Tensor& gu) {
    const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
    at::Tensor out = at::empty({rows, inter}, gu.options());
    const float* g = gu.data_ptr<float>();
    float* o = out.data_ptr<float>();
    std::vector<float> a(inter), e(inter);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < inter; ++i) a[i] = -g[r * 2 * inter + i];
      exp_into(a.data(), e.data(), inter);
      for (int64_t i = 0; i < inter; ++i) o[r * inter + i] = -a[i] / (1.f + e[i]) * g[r * 2 * inter + inter + i];
    }
    return out;
  }

  // gelu_tanh(gate) * up from the [rows, 2I] gate/up product, float32 (Gemma's MLP):
  // 0.5 g (1 + tanh(z)), z = sqrt(2/pi) (g + 0.044715 g^3), tanh(z) = 1 - 2 / (1 + exp(2z)).
  static at::Tensor gelu_tanh_mul(const at::Tensor& gu) {
    const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
    at::Tensor out = at::empty({rows, inter}, gu.options());
    const float* g = gu.data_ptr<float>();
    float* o = out.data_ptr<float>();
    std::vector<float> a(inter), e(inter);
    constexpr float k = 0.7978845608028654f;  // sqrt(2 / pi)
    for (int64_t r = 0; r < rows; ++r) {
      const float* gr = g + r * 2 * inter;
      for (int64_t i = 0; i < inter; ++i) a[i] = 2.f * k * (gr[i] + 0.044715f * gr[i] * gr[i] * gr[i]);
      exp_into(a.data(), e.data(), inter);
      for (int64_t i = 0; i < inter; ++i)
        o[r * inter + i] = 0.5f * gr[i] * (2.f - 2.f / (1.f + e[i])) * gr[inter + i];
    }
    return out;
  }

  // h += y, with y RMS-normalised first where `norm` has weights (Gemma's sandwich).
  void add_output(float* h, at::Tensor y, const at::Tensor& norm) const {
    if (norm.numel() > 0) {
      float* yp = y.data_ptr<float>();
      rms_norm(yp, norm.data_ptr<float>(), y.size(0), y.size(1), eps_, yp);  // row by row: in place is safe
    }
    add_into(h, y);
  }

  // What attention reads per row: position, K/V slot, block table [rows, max_blocks] and
  // sequence length; the layer's window (0: full) and rotary tables [positions, head_dim].
  struct Rows {
    const int64_t* pos;
    const int64_t* slot;
    const int32_t* tables;
    const int32_t* lens;
    int64_t window;
    const float* cos;
    const float* sin;

    // The row's first key: a sliding layer's query sees itself and the window - 1 before it.
    int64_t first_key(int64_t r) const {
      return window > 0 ? std::max<int64_t>(0, lens[r] - window) : 0;
    }
  };

  // Rotary (after the q/k head norms, where the layer has them) and the K/V write for every
  // row, then attention over (row, chunk of its blocks) tasks: one chunk for a row of short
  // context (a fork-join costs more than the arithmetic), one per thread for a long one. A row's
  // chunks follow from its own context alone, never from the rows beside it, so a row computes
  // the same bits in any step: a speculative step's verification rows what the decode steps
  // without drafts would (greedy replies equal), a sequence decoding beside others what it
  // would alone. A sliding layer's rows visit only the blocks of their window (released ones
  // lie before it).
  template <typename T>
  void attention(const StepShape& s, const at::Tensor& qkv_f, const Rows& in, T* k_cache,
                 T* v_cache, const HeadNorms& norms, at::Tensor& attn) const {
    const int64_t rows = qkv_f.size(0), width = qkv_f.size(1), d = s.head_dim, hd = s.heads * d;
    const float* qkv = qkv_f.data_ptr<float>();
    const int32_t* lens = in.lens;
    std::vector<float> q(rows * hd);
    const int64_t threads = at::get_num_threads();
    std::vector<int64_t> row_chunks(rows);
    int64_t chunks = 1;  // the most any row takes: the tasks' layout
    int64_t total = 0;   // the step's work: whether forking pays at all
    for (int64_t r = 0; r < rows; ++r) {
      rope_and_write(s, qkv + r * width, in.cos + in.pos[r] * d, in.sin + in.pos[r] * d, k_cache,
                     v_cache, in.slot[r], &q[r * hd], norms);
      const int64_t work = (lens[r] - in.first_key(r)) * hd;
      row_chunks[r] = attention_chunks_ > 0 ? attention_chunks_ : work < kForkWork ? 1 : threads;
      chunks = std::max(chunks, row_chunks[r]);
      total += work;
    }
    // tasks to threads: all on this one for a small step, else one at a time (a task's
    // arithmetic does not depend on which thread runs it)
    const int64_t grain = total < kForkWork && chunks == 1 ? rows : 1;
    std::vector<Partial> part(rows * chunks * s.heads);
    std::vector<float> acc(rows * chunks * hd);
    const auto attend = attention_kernel_ < 0
                            ? pick_attend_chunk<T>(s)
                            : attend_chunk_for<T>(static_cast<AttendKernel>(attention_kernel_), s);
    at::parallel_for(0, rows * chunks, grain, [&](int64_t t0, int64_t t1) {
      std::vector<float> scores;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r = t / chunks, c = t % chunks, first = in.first_key(r);
        const int64_t mine = row_chunks[r];
        if (c >= mine) continue;  // an empty chunk: merge_chunks skips it
        const int64_t b_first = first / s.block_size;
        const int64_t blocks = (lens[r] + s.block_size - 1) / s.block_size - b_first;
        const int64_t per = (blocks + mine - 1) / mine;
        const int64_t b0 = b_first + c * per, b1 = std::min(b_first + blocks, b0 + per);
        if (b0 < b1)
          attend(s, &q[r * hd], k_cache, v_cache, in.tables + r * s.max_blocks, lens[r], first,
                 b0, b1, &part[t * s.heads], &acc[t * hd], scores);
      }
    });
    float* out = attn.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      merge_chunks(s, &part[r * chunks * s.heads], &acc[r * chunks * hd], chunks, out + r * hd);
  }

  std::vector<Layer> layers_;
  at::Tensor embed_;  // float32 [vocab, hidden]
  at::Tensor cos_, sin_;
  at::Tensor local_cos_, local_sin_;  // sliding layers' (the global ones where they share them)
  int64_t heads_, kv_heads_, head_dim_;
  float eps_;
  int64_t int4_kernel_;
  int64_t pack_block_;        // columns per block of torch's packed 4-bit layout (64 or 32)
  int64_t attention_chunks_;  // key chunks per row; 0: by context length and threads
  int64_t attention_kernel_;  // an AttendKernel; -1: the fastest that fits (tests pick others)
  float embed_scale_;         // Gemma's sqrt(hidden); 0: none
  float attn_scale_;          // 1/sqrt(head_dim), or Gemma's query_pre_attn_scalar's
  bool gelu_;                 // GELU-tanh MLP (Gemma), else SiLU
  int64_t num_groups_ = 0, num_slots_ = 0;  // KV groups; layers per page

  // Fast steps read 8-bit activations where the weight has strips (the fastest kernel of
  // int4_q8_kernels.h compiled in), else the 4-bit kernel picked.
  at::Tensor int4_mm(const at::Tensor& x, const Linear4& w, bool precise) const {
    if (!precise && w.strips.numel() > 0)
      return int4_mm_q8(x, w.strips, w.planes, static_cast<int64_t>(best_q8_kernel()));
    return int4_mm_kernel(x, w.packed, w.scales_zeros, w.planes, int4_kernel_, precise, pack_block_);
  }
};

bool has_avx512_bf16() { return KVSCOPE_HAVE_AVX512_BF16 != 0; }
bool has_avx2() { return KVSCOPE_HAVE_AVX2 != 0; }
int64_t best_q8_kernel_index() { return static_cast<int64_t>(best_q8_kernel()); }
bool q8_kernel_index_compiled(int64_t index) {
  return is_q8_kernel(index) && q8_kernel_compiled(static_cast<Q8Kernel>(index));
}

}  // namespace
}  // namespace kvscope

using namespace kvscope;  // NOLINT: the bindings below

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<FusedDecoder>(m, "FusedDecoder")
      .def(pybind11::init<const std::vector<at::Tensor>&, at::Tensor, at::Tensor, at::Tensor,
                          at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double, int64_t,
                          int64_t, int64_t, int64_t, double, double, bool, const std::vector<int64_t>&,
                          const std::vector<int64_t>&, const std::vector<int64_t>&>())
      .def("forward", &FusedDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("bf16_logits", &bf16_logits, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("has_avx512_bf16", &has_avx512_bf16);
  m.def("has_avx2", &has_avx2);
  m.def("attend_chunk_kernel", &attend_chunk_kernel, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("best_q8_kernel", &best_q8_kernel_index);
  m.def("q8_kernel_compiled", &q8_kernel_index_compiled);
  m.def("int4_mm", &int4_mm_kernel, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int4_strips", &int4_strips, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int4_mm_q8", &int4_mm_q8, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q8_pack", &q8_pack, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q8_logits", &q8_logits, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q8_bf16_available", &q8_bf16_available);
  m.def("q8_bf16_logits", &q8_bf16_logits, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q8_vnni_pack", &q8_vnni_pack, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q8_head_vnni_available", &q8_head_vnni_available);
  m.def("q8_head_vector_available", &q8_head_vector_available);
  m.def("q8_q8_logits", &q8_q8_logits, pybind11::call_guard<pybind11::gil_scoped_release>());
}
