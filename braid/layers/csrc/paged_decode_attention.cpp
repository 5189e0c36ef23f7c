// Decode attention over braid's paged KV cache, for the compiled decode step on CPU
// (braid/layers/decode_kernel.py builds it on first use, for the host's ISA).
//
// Why not inductor's code for the same reductions (`traced_decode_attention`): it sums each
// score as one vector accumulator over head_dim (a chain of dependent adds), reloads the keys
// for every query head of the group, and reads the cache with no prefetch, so it runs at
// about 8 GB/s. Here the G query heads of a KV head share each key load in G registers, the
// weighted values accumulate in registers, and the next block is prefetched.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();

inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const at::BFloat16* p) {
  return at::vec::convert<float>(at::vec::Vectorized<at::BFloat16>::loadu(p, VL));
}
// int8 cache values, widened in registers (their scale is applied to the score or weight)
inline Vec load(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
      reinterpret_cast<const __m128i*>(p)))));
#else
  float wide[VL];
  for (int64_t i = 0; i < VL; ++i) wide[i] = float(p[i]);
  return Vec::loadu(wide);
#endif
}
inline void store(const Vec& x, float* p) { x.store(p); }
inline void store(const Vec& x, at::BFloat16* p) { at::vec::convert<at::BFloat16>(x).store(p, VL); }

template <typename T>
inline void prefetch(const T* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < elems * int64_t(sizeof(T)); off += 64) __builtin_prefetch(c + off);
}

// Where one (sequence, KV head) reads and writes; strides in elements. T is the queries'
// and output's type, C the cache's: T, or int8 with a float scale per (token, head).
template <typename T, typename C>
struct Task {
  const T* q;            // [G, D] at head stride qh, dims unit: this head group's queries
  const C* k;            // the KV head's keys in block 0: [D, bs] at stride kd, tokens unit
  const C* v;            // the KV head's values in block 0: [bs, D] at stride vt, dims unit
  const float* ks;       // int8 only: the KV head's key scales in block 0, [bs], tokens unit
  const float* vs;       // int8 only: the value scales, as ks
  const int64_t* table;  // the sequence's blocks
  int64_t qh, len, D, bs, k_block, kd, v_block, vt, s_block;
  T* out;                // [G, D]
};

// scores[g][t] = scale * q[g] . k[t] for the sequence's keys, block by block: the G query
// heads share each key vector (G independent accumulators), the next block is prefetched.
template <int G, typename T, typename C>
void scores_of(const Task<T, C>& a, float scale, float* qf, float* scores, int64_t L) {
  for (int g = 0; g < G; ++g)
    for (int64_t d = 0; d < a.D; ++d) qf[g * a.D + d] = float(a.q[g * a.qh + d]) * scale;
  const int64_t blocks = (a.len + a.bs - 1) / a.bs;
  for (int64_t w = 0; w < blocks; ++w) {
    if (w + 1 < blocks) prefetch(a.k + a.table[w + 1] * a.k_block, a.D * a.bs);
    prefetch(a.v + a.table[w] * a.v_block, a.bs * a.D);
    for (int64_t c = 0; c < a.bs; c += VL) {
      const C* kp = a.k + a.table[w] * a.k_block + c;
      Vec acc[G];
      for (int g = 0; g < G; ++g) acc[g] = Vec(0.f);
      for (int64_t d = 0; d < a.D; ++d) {
        const Vec x = load(kp + d * a.kd);
        for (int g = 0; g < G; ++g) acc[g] = at::vec::fmadd(Vec(qf[g * a.D + d]), x, acc[g]);
      }
      if (a.ks != nullptr) {
        const Vec scale = Vec::loadu(a.ks + a.table[w] * a.s_block + c);
        for (int g = 0; g < G; ++g) acc[g] = acc[g] * scale;
      }
      for (int g = 0; g < G; ++g) store(acc[g], scores + g * L + w * a.bs + c);
    }
  }
}

// Each row of scores (len keys) becomes exp(score - max); returns 1 / sum.
float softmax_numerators(float* s, int64_t len) {
  Vec mv(-INFINITY);
  int64_t t = 0;
  for (; t + VL <= len; t += VL) mv = at::vec::maximum(mv, Vec::loadu(s + t));
  float m = at::vec::vec_reduce_all<float>(
      [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, mv);
  for (; t < len; ++t) m = std::max(m, s[t]);
  Vec sum(0.f);
  for (t = 0; t + VL <= len; t += VL) {
    const Vec e = (Vec::loadu(s + t) - Vec(m)).exp_u20();
    e.store(s + t);
    sum = sum + e;
  }
  float total = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum);
  for (; t < len; ++t) {
    s[t] = std::exp(s[t] - m);
    total += s[t];
  }
  return 1.f / total;
}

// out[g] = inv[g] * sum_t p[g][t] v[t], DC vectors of the head dimension at a time, held in
// registers across all of the sequence's keys.
// Folds the value scales into the softmax numerators p: p[g][t] *= vs[t].
template <int G, typename T, typename C>
void scale_by_values(const Task<T, C>& a, float* p, int64_t L) {
  const int64_t blocks = (a.len + a.bs - 1) / a.bs;
  for (int64_t w = 0; w < blocks; ++w) {
    for (int64_t c = 0; c < a.bs; c += VL) {
      const Vec scale = Vec::loadu(a.vs + a.table[w] * a.s_block + c);
      for (int g = 0; g < G; ++g) {
        float* pg = p + g * L + w * a.bs + c;
        (Vec::loadu(pg) * scale).store(pg);
      }
    }
  }
}

template <int G, int DC, typename T, typename C>
void weighted_values(const Task<T, C>& a, const float* p, const float* inv, int64_t L) {
  const int64_t blocks = (a.len + a.bs - 1) / a.bs;
  for (int64_t d0 = 0; d0 < a.D; d0 += DC * VL) {
    Vec acc[G][DC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < DC; ++c) acc[g][c] = Vec(0.f);
    for (int64_t w = 0; w < blocks; ++w) {
      const C* vp = a.v + a.table[w] * a.v_block + d0;
      const float* pw = p + w * a.bs;
      for (int64_t t = 0, n = std::min(a.bs, a.len - w * a.bs); t < n; ++t) {
        for (int c = 0; c < DC; ++c) {
          const Vec x = load(vp + t * a.vt + c * VL);
          for (int g = 0; g < G; ++g) acc[g][c] = at::vec::fmadd(Vec(pw[g * L + t]), x, acc[g][c]);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < DC; ++c) store(acc[g][c] * Vec(inv[g]), a.out + g * a.D + d0 + c * VL);
  }
}

template <int G, typename T, typename C>
void attend(const Task<T, C>& a, float scale, float* qf, float* scores, int64_t L) {
  scores_of<G>(a, scale, qf, scores, L);
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = softmax_numerators(scores + g * L, a.len);
  if (a.vs != nullptr) scale_by_values<G>(a, scores, L);
  if (a.D % (4 * VL) == 0) {
    weighted_values<G, 4>(a, scores, inv, L);
  } else {
    weighted_values<G, 1>(a, scores, inv, L);
  }
}

template <typename T, typename C>
void attend_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const c10::optional<at::Tensor>& k_scales,
                const c10::optional<at::Tensor>& v_scales, const at::Tensor& tables,
                const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hk = k_cache.size(2), G = Hq / Hk, W = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const float* ksp = k_scales ? k_scales->data_ptr<float>() : nullptr;
  const float* vsp = v_scales ? v_scales->data_ptr<float>() : nullptr;
  const int64_t s_block = k_scales ? k_scales->stride(0) : 0;
  const int64_t s_head = k_scales ? k_scales->stride(2) : 0;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), scores(G * W * bs);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hk, h = i % Hk;
      const Task<T, C> a{qp + b * q.stride(0) + h * G * q.stride(1), kp + h * k_cache.stride(2),
                         vp + h * v_cache.stride(2), ksp ? ksp + h * s_head : nullptr,
                         vsp ? vsp + h * s_head : nullptr, tp + b * W, q.stride(1), lp[b], D,
                         bs, k_cache.stride(0), k_cache.stride(3), v_cache.stride(0),
                         v_cache.stride(1), s_block, op + (b * Hq + h * G) * D};
      switch (G) {
#define BRAID_GROUP(N) case N: attend<N>(a, float(scale), qf.data(), scores.data(), W * bs); break;
        BRAID_GROUP(1) BRAID_GROUP(2) BRAID_GROUP(3) BRAID_GROUP(4)
        BRAID_GROUP(5) BRAID_GROUP(6) BRAID_GROUP(7) BRAID_GROUP(8)
#undef BRAID_GROUP
      }
    }
  });
}

template <typename T>
void attend_all_of_cache(const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scales,
                         const c10::optional<at::Tensor>& v_scales, const at::Tensor& tables,
                         const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  if (k_cache.scalar_type() == at::kChar) {
    attend_all<T, int8_t>(q, k_cache, v_cache, k_scales, v_scales, tables, seq_lens, scale, out);
  } else {
    attend_all<T, T>(q, k_cache, v_cache, k_scales, v_scales, tables, seq_lens, scale, out);
  }
}

// q: [B, Hq, D]; k_cache, v_cache: [blocks, bs, Hk, D] views whose keys are stored
// [blocks, Hk, D, bs] and values [blocks, Hk, bs, D] (PagedAttention.allocate_cache,
// tokens_innermost), of q's dtype or int8; k_scales, v_scales (int8 caches only): [blocks,
// bs, Hk] float views stored [blocks, Hk, bs], one per token and head (a value is its int8
// times its scale); block_tables: [B, W]; seq_lens: [B], each 1 to W * bs.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache,
                                  const c10::optional<at::Tensor>& k_scales,
                                  const c10::optional<at::Tensor>& v_scales,
                                  const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q [B, Hq, D], caches [blocks, bs, Hk, D]");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0 &&
                  q.size(1) / k_cache.size(2) <= 8,
              "paged_decode_attention: head_dim must match and Hq be Hk times 1 to 8");
  TORCH_CHECK(k_cache.stride(1) == 1 && v_cache.stride(3) == 1,
              "paged_decode_attention: caches must be laid out tokens innermost");
  TORCH_CHECK(k_cache.size(1) % VL == 0 && q.size(2) % VL == 0,
              "paged_decode_attention: block size and head_dim must be multiples of ", VL);
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: key and value caches of one dtype");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || q.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: caches of q's dtype, or int8");
  TORCH_CHECK(int8 == (k_scales.has_value() && v_scales.has_value()),
              "paged_decode_attention: int8 caches come with their scales, others without");
  if (int8) {
    for (const at::Tensor& s : {*k_scales, *v_scales}) {
      TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 3 &&
                      s.sizes() == k_cache.sizes().slice(0, 3) && s.stride(1) == 1 &&
                      s.strides() == k_scales->strides(),
                  "paged_decode_attention: scales float [blocks, bs, Hk], tokens innermost");
    }
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode_attention: int64 block tables and lengths");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  seq_lens.numel() == q.size(0),
              "paged_decode_attention: a block table row and a length per sequence");
  // q is read through its strides: in the compiled step it is a view of the rotated queries
  // and keys (a contiguous copy cost 14 us a layer at batch 32).
  const at::Tensor qv = q.stride(2) == 1 ? q : q.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= tables.size(1) * k_cache.size(1),
                "paged_decode_attention: sequence ", b, " has ", lp[b],
                " keys, outside 1 to its block table's ", tables.size(1) * k_cache.size(1));
  }
  at::Tensor out = at::empty(qv.sizes(), qv.options());
  if (q.scalar_type() == at::kBFloat16) {
    attend_all_of_cache<at::BFloat16>(qv, k_cache, v_cache, k_scales, v_scales, tables, lens,
                                      scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_decode_attention: bf16 or fp32");
    attend_all_of_cache<float>(qv, k_cache, v_cache, k_scales, v_scales, tables, lens, scale,
                               out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(braid, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scales, "
        "Tensor? v_scales, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(braid, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
