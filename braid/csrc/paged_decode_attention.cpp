// Decode attention over braid's paged KV cache, for the compiled decode step on CPU
// (braid/native.py builds it once, for the host's ISA).
//
// Why not inductor's code for the same reductions (`traced_decode_attention`): it sums each
// score as one vector accumulator over head_dim (a chain of dependent adds), reloads the keys
// for every query head of the group, and reads the cache with no prefetch, so it runs at
// about 8 GB/s. Here the G query heads of a KV head share each key load in G registers, the
// weighted values accumulate in registers, and the next block is prefetched.
//
// An int8 cache on a CPU with AVX512-VNNI, and a bf16 one on a CPU with AVX512-BF16, are
// stored in pairs (braid/layers/kv_layout.py): two head dims of a key, or two tokens of a value
// dimension, side by side, so that one vpdpwssd multiplies 16 such pairs (widened to int16) by
// a pair of int16 queries or softmax weights and adds both products into int32 lanes, or one
// vdpbf16ps 16 bf16 pairs by a pair of bf16 queries or weights into fp32 lanes: under half the
// instructions of widening each element to fp32 for an FMA.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
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

// `elems` from p on into L1, or with `Locality` 2 into L2 (prefetcht1)
template <int Locality = 3, typename T>
inline void prefetch(const T* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < elems * int64_t(sizeof(T)); off += 64)
    __builtin_prefetch(c + off, 0, Locality);
}

// Where one (sequence, KV head) reads and writes; strides in elements. T is the queries'
// and output's type, C the cache's: T, or int8 with a float scale per (token, head).
// In the int8 pair layout, keys are [D/2, bs, 2] with kd the stride of a pair of dims, and
// values [bs/2, D, 2] with vt the stride of a pair of tokens.
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

// Before a task reads block `w` of its keys: keys two blocks ahead and values one ahead into
// L2, the next block's keys and this block's values into L1. With only the L1 prefetches the
// loads waited on memory (2-core Zen 4, 30 layers' caches, 32 sequences of 140 keys: 210-245
// us a layer against 280-310, 32 x 512 680 against 870).
template <typename T, typename C>
inline void prefetch_around(const Task<T, C>& a, int64_t w, int64_t blocks) {
  if (w + 2 < blocks) prefetch<2>(a.k + a.table[w + 2] * a.k_block, a.D * a.bs);
  if (w + 1 < blocks) {
    prefetch<2>(a.v + a.table[w + 1] * a.v_block, a.bs * a.D);
    prefetch(a.k + a.table[w + 1] * a.k_block, a.D * a.bs);
  }
  prefetch(a.v + a.table[w] * a.v_block, a.bs * a.D);
}

// scores[g][t] = scale * q[g] . k[t] for the sequence's keys, block by block: the G query
// heads share each key vector (G independent accumulators), blocks prefetched around.
template <int G, typename T, typename C>
void scores_of(const Task<T, C>& a, float scale, float* qf, float* scores, int64_t L) {
  for (int g = 0; g < G; ++g)
    for (int64_t d = 0; d < a.D; ++d) qf[g * a.D + d] = float(a.q[g * a.qh + d]) * scale;
  const int64_t blocks = (a.len + a.bs - 1) / a.bs;
  for (int64_t w = 0; w < blocks; ++w) {
    prefetch_around(a, w, blocks);
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

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
#define BRAID_INT8_PAIRS 1

// x[0:n] * r rounded to int16 (n a multiple of VL), saturated (only a NaN can reach it).
template <typename T>
inline void to_int16(const T* x, int64_t n, float r, int16_t* out) {
  for (int64_t i = 0; i < n; i += VL) {
    const __m512i v = _mm512_cvtps_epi32(load(x + i) * Vec(r));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtsepi32_epi16(v));
  }
}

// The step that rounds n elements (a multiple of VL) to int16 with the largest magnitude as
// 32767: 2^-16 of it at most, about a hundredth of the int8 rows' own rounding. A NaN stays
// NaN (its step is NaN), so the output carries it as the fp32 path does.
template <typename T>
inline float int16_step(const T* x, int64_t n) {
  Vec largest(0.f);
  for (int64_t i = 0; i < n; i += VL) largest = at::vec::maximum(largest, load(x + i).abs());
  const float m = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, largest);
  return m == 0.f ? 1.f : m / 32767.f;
}

// Scores of N chunks of VL tokens from chunk c0 (tokens c0 * VL on), with G * N independent
// int32 accumulators: |sum| <= D/2 * 2 * 32767 * 127, within int32 for D up to 512. The keys
// N chunks on and the chunks' values and scales are prefetched.
template <int G, int N, typename T>
inline void pair_scores(const Task<T, int8_t>& a, int64_t c0, int64_t chunks,
                        const int32_t* qpairs, const float* qstep, float* scores, int64_t L) {
  const int64_t per_block = a.bs / VL;
  const int8_t* kp[N];
  for (int j = 0; j < N; ++j) {
    const int64_t c = c0 + j, w = c / per_block, t = c % per_block * VL;
    kp[j] = a.k + a.table[w] * a.k_block + 2 * t;
    if (c + N < chunks) {
      const int64_t n = c + N, nw = n / per_block, nt = n % per_block * VL;
      prefetch(a.k + a.table[nw] * a.k_block + 2 * nt, a.D * VL);
      __builtin_prefetch(a.ks + a.table[nw] * a.s_block + nt);
    }
    prefetch(a.v + a.table[w] * a.v_block + t / 2 * a.vt, VL * a.D);
    __builtin_prefetch(a.vs + a.table[w] * a.s_block + t);
  }
  __m512i acc[N][G];
  for (int j = 0; j < N; ++j)
    for (int g = 0; g < G; ++g) acc[j][g] = _mm512_setzero_si512();
  for (int64_t i = 0; i < a.D / 2; ++i) {
    __m512i x[N];
    for (int j = 0; j < N; ++j)
      x[j] = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp[j] + i * a.kd)));
    for (int g = 0; g < G; ++g) {
      const __m512i qg = _mm512_set1_epi32(qpairs[g * a.D / 2 + i]);
      for (int j = 0; j < N; ++j) acc[j][g] = _mm512_dpwssd_epi32(acc[j][g], x[j], qg);
    }
  }
  for (int j = 0; j < N; ++j) {
    const int64_t c = c0 + j, w = c / per_block, t = c % per_block * VL;
    const Vec ks = Vec::loadu(a.ks + a.table[w] * a.s_block + t);
    for (int g = 0; g < G; ++g)
      (Vec(_mm512_cvtepi32_ps(acc[j][g])) * ks * Vec(qstep[g]))
          .store(scores + g * L + w * a.bs + t);
  }
}

// out[g] = inv[g] * sum_t p[g][t] v[t] with p (softmax numerators times the value scales)
// rounded to int16 per head, pairs of tokens at a time. The int32 sums are moved to fp32
// every 512 tokens, before they could overflow (256 pairs of 2 * 32767 * 127).
template <int G, int DC, typename T>
void pair_values(const Task<T, int8_t>& a, float* p, const float* inv, int16_t* p16,
                 int64_t L) {
  const int64_t padded = (a.len + VL - 1) / VL * VL;
  float pstep[G];
  for (int g = 0; g < G; ++g) {
    float* pg = p + g * L;
    std::fill(pg + a.len, pg + padded, 0.f);  // the last pair's second token may be past len
    pstep[g] = int16_step(pg, padded);
    to_int16(pg, padded, 1.f / pstep[g], p16 + g * L);
    pstep[g] *= inv[g];
  }
  const int32_t* ppairs = reinterpret_cast<const int32_t*>(p16);
  const int64_t blocks = (a.len + a.bs - 1) / a.bs, flush = std::max<int64_t>(1, 512 / a.bs);
  for (int64_t d0 = 0; d0 < a.D; d0 += DC * VL) {
    Vec sum[G][DC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < DC; ++c) sum[g][c] = Vec(0.f);
    for (int64_t w0 = 0; w0 < blocks; w0 += flush) {
      __m512i acc[G][DC];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_setzero_si512();
      for (int64_t w = w0; w < std::min(blocks, w0 + flush); ++w) {
        const int8_t* vp = a.v + a.table[w] * a.v_block + 2 * d0;
        const int32_t* pw = ppairs + w * a.bs / 2;
        const int64_t pairs = (std::min(a.bs, a.len - w * a.bs) + 1) / 2;
        for (int64_t j = 0; j < pairs; ++j) {
          for (int c = 0; c < DC; ++c) {
            const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(vp + j * a.vt + c * 2 * VL)));
            for (int g = 0; g < G; ++g) {
              const __m512i pg = _mm512_set1_epi32(pw[g * L / 2 + j]);
              acc[g][c] = _mm512_dpwssd_epi32(acc[g][c], x, pg);
            }
          }
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < DC; ++c) sum[g][c] = sum[g][c] + Vec(_mm512_cvtepi32_ps(acc[g][c]));
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < DC; ++c) store(sum[g][c] * Vec(pstep[g]), a.out + g * a.D + d0 + c * VL);
  }
}

// `attend` for an int8 cache in the pair layout; `halves` holds G * max(D, L) int16.
template <int G, typename T>
void attend_pairs(const Task<T, int8_t>& a, float scale, int16_t* halves, float* scores,
                  int64_t L) {
  float qstep[G];
  for (int g = 0; g < G; ++g) {
    qstep[g] = int16_step(a.q + g * a.qh, a.D);
    to_int16(a.q + g * a.qh, a.D, 1.f / qstep[g], halves + g * a.D);
    qstep[g] *= scale;
  }
  const int32_t* qpairs = reinterpret_cast<const int32_t*>(halves);
  // 4 chunks at a time (G * 4 accumulators) where that leaves registers for the keys
  constexpr int N = G <= 6 ? 4 : 2;
  const int64_t chunks = (a.len + VL - 1) / VL;
  int64_t c = 0;
  for (; c + N <= chunks; c += N) pair_scores<G, N>(a, c, chunks, qpairs, qstep, scores, L);
  for (; c < chunks; ++c) pair_scores<G, 1>(a, c, chunks, qpairs, qstep, scores, L);
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = softmax_numerators(scores + g * L, a.len);
  scale_by_values<G>(a, scores, L);
  if (a.D % (4 * VL) == 0) {
    pair_values<G, 4>(a, scores, inv, halves, L);
  } else {
    pair_values<G, 1>(a, scores, inv, halves, L);
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define BRAID_BF16_PAIRS 1

// Weighted values of a bf16 cache in the pair layout: one vdpbf16ps takes a pair of tokens'
// values by the pair of their softmax numerators, rounded to bf16 (`weights`, G rows of L).
template <int G, int DC>
void bf16_pair_values(const Task<at::BFloat16, at::BFloat16>& a, const int16_t* weights,
                      const float* inv, int64_t L) {
  const int64_t blocks = (a.len + a.bs - 1) / a.bs;
  const auto* ppairs = reinterpret_cast<const int32_t*>(weights);
  for (int64_t d0 = 0; d0 < a.D; d0 += DC * VL) {
    __m512 acc[G][DC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t w = 0; w < blocks; ++w) {
      const at::BFloat16* vp = a.v + a.table[w] * a.v_block + 2 * d0;
      const int32_t* pw = ppairs + w * a.bs / 2;
      const int64_t pairs = (std::min(a.bs, a.len - w * a.bs) + 1) / 2;
      for (int64_t j = 0; j < pairs; ++j) {
        for (int c = 0; c < DC; ++c) {
          const __m512bh x = (__m512bh)_mm512_loadu_si512(vp + j * a.vt + c * 2 * VL);
          for (int g = 0; g < G; ++g)
            acc[g][c] = _mm512_dpbf16_ps(acc[g][c], x,
                                         (__m512bh)_mm512_set1_epi32(pw[g * L / 2 + j]));
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < DC; ++c)
        store(Vec(acc[g][c]) * Vec(inv[g]), a.out + g * a.D + d0 + c * VL);
  }
}

// `attend` for a bf16 cache in the pair layout: one vdpbf16ps multiplies 16 tokens' pairs of
// head dims by a pair of query dims (the queries are bf16 already) and adds both products in
// fp32; the values' pairs of tokens take the softmax numerators rounded to bf16 (as
// transformers' bf16 attention rounds its weights). Half the instructions of widening each
// bf16 to fp32 for an FMA, and no widening. `halves` holds G * L bf16 weights.
template <int G>
void attend_bf16_pairs(const Task<at::BFloat16, at::BFloat16>& a, float scale, int16_t* halves,
                       float* scores, int64_t L) {
  const int64_t blocks = (a.len + a.bs - 1) / a.bs, pairs_of_dims = a.D / 2;
  int32_t qpairs[G * 256];  // each head's pairs of query dims (D <= 512: `geometry_of`)
  for (int g = 0; g < G; ++g) std::memcpy(qpairs + g * pairs_of_dims, a.q + g * a.qh, 2 * a.D);
  for (int64_t w = 0; w < blocks; ++w) {
    prefetch_around(a, w, blocks);
    for (int64_t c = 0; c < a.bs; c += VL) {
      const at::BFloat16* kp = a.k + a.table[w] * a.k_block + 2 * c;
      __m512 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (int64_t i = 0; i < pairs_of_dims; ++i) {
        const __m512bh x = (__m512bh)_mm512_loadu_si512(kp + i * a.kd);
        for (int g = 0; g < G; ++g)
          acc[g] = _mm512_dpbf16_ps(acc[g], x,
                                    (__m512bh)_mm512_set1_epi32(qpairs[g * pairs_of_dims + i]));
      }
      for (int g = 0; g < G; ++g) (Vec(acc[g]) * Vec(scale)).store(scores + g * L + w * a.bs + c);
    }
  }
  const int64_t padded = (a.len + VL - 1) / VL * VL;
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* pg = scores + g * L;
    inv[g] = softmax_numerators(pg, a.len);
    std::fill(pg + a.len, pg + padded, 0.f);  // the last pair's second token may be past len
    for (int64_t t = 0; t < padded; t += VL)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(halves + g * L + t),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(pg + t)));
  }
  if (a.D % (4 * VL) == 0) {
    bf16_pair_values<G, 4>(a, halves, inv, L);
  } else {
    bf16_pair_values<G, 1>(a, halves, inv, L);
  }
}
#endif

// Where a layer's cache keeps its blocks, heads and rows (strides in elements), in the
// tokens-innermost layout or the pair layout (int8 or bf16).
struct Geometry {
  int64_t bs, Hk, D, k_block, k_head, kd, v_block, v_head, vt;
  bool pairs;
};

// The task's G query heads of one KV head, by the layout.
template <int G, typename T, typename C>
void attend_task(const Task<T, C>& a, bool pairs, float scale, float* qf, int16_t* halves,
                 float* scores, int64_t L) {
#ifdef BRAID_INT8_PAIRS
  if constexpr (std::is_same_v<C, int8_t>) {
    if (pairs) return attend_pairs<G>(a, scale, halves, scores, L);
  }
#endif
#ifdef BRAID_BF16_PAIRS
  if constexpr (std::is_same_v<C, at::BFloat16> && std::is_same_v<T, at::BFloat16>) {
    if (pairs) return attend_bf16_pairs<G>(a, scale, halves, scores, L);
  }
#endif
  attend<G>(a, scale, qf, scores, L);
}

// Which (row, KV head) pairs a call attends: all of them, or, for a KV head that several
// ranks hold (`kv_parts` [Hk, 2]: this rank's part and the number of parts), only the rows
// whose part is this rank's. A row's part is a hash of its own length and input token, so that
// every rank computes the same from the same step, each row is attended by exactly one of them
// (the others' outputs for it are zeros, which the row-parallel output projection's sum
// ignores), and a sequence's row goes to the same rank whatever else the step holds: its sums,
// cut between the ranks by that choice, are then the same in any batch.
class RowShares {
 public:
  RowShares(const c10::optional<at::Tensor>& kv_parts, const int64_t* lens,
            const int64_t* tokens)
      : parts_(kv_parts ? kv_parts->data_ptr<int64_t>() : nullptr), lens_(lens),
        tokens_(tokens) {}
  bool attends(int64_t b, int64_t h) const {
    if (parts_ == nullptr || parts_[2 * h + 1] == 1) return true;
    uint64_t x = uint64_t(lens_[b]) * 0x9E3779B97F4A7C15ull ^ uint64_t(tokens_[b]);
    x ^= x >> 31;  // a splitmix64 finalizer: nearby lengths and tokens land apart
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return int64_t(x % uint64_t(parts_[2 * h + 1])) == parts_[2 * h];
  }

 private:
  const int64_t* parts_;
  const int64_t* lens_;
  const int64_t* tokens_;  // each row's input token
};

template <typename T, typename C>
void attend_all(const at::Tensor& q, const Geometry& geo, const C* kp, const C* vp,
                const c10::optional<at::Tensor>& k_scales,
                const c10::optional<at::Tensor>& v_scales, const at::Tensor& tables,
                const at::Tensor& seq_lens, const RowShares& shares, double scale,
                at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = geo.D, Hk = geo.Hk, bs = geo.bs;
  const int64_t G = Hq / Hk, W = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const float* ksp = k_scales ? k_scales->data_ptr<float>() : nullptr;
  const float* vsp = v_scales ? v_scales->data_ptr<float>() : nullptr;
  const int64_t s_block = k_scales ? k_scales->stride(0) : 0;
  const int64_t s_head = k_scales ? k_scales->stride(2) : 0;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), scores(G * W * bs);
    std::vector<int16_t> halves(geo.pairs ? G * std::max(D, W * bs) : 0);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hk, h = i % Hk;
      if (!shares.attends(b, h)) {
        std::fill_n(op + (b * Hq + h * G) * D, G * D, T(0));
        continue;
      }
      const Task<T, C> a{qp + b * q.stride(0) + h * G * q.stride(1), kp + h * geo.k_head,
                         vp + h * geo.v_head, ksp ? ksp + h * s_head : nullptr,
                         vsp ? vsp + h * s_head : nullptr, tp + b * W, q.stride(1), lp[b], D,
                         bs, geo.k_block, geo.kd, geo.v_block, geo.vt, s_block,
                         op + (b * Hq + h * G) * D};
      const int64_t next_b = (i + 1) / Hk, next_h = (i + 1) % Hk;
      if (i + 1 < end && shares.attends(next_b, next_h)) {
        // the next task's first two blocks into L2, ahead of its own prefetches
        for (int64_t w = 0; w < std::min<int64_t>(2, (lp[next_b] + bs - 1) / bs); ++w) {
          const int64_t block = tp[next_b * W + w];
          prefetch<2>(kp + next_h * geo.k_head + block * geo.k_block, D * bs);
          prefetch<2>(vp + next_h * geo.v_head + block * geo.v_block, D * bs);
        }
      }
      switch (G) {
#define BRAID_GROUP(N)                                                                  \
  case N:                                                                               \
    attend_task<N>(a, geo.pairs, float(scale), qf.data(), halves.data(), scores.data(), \
                   W * bs);                                                             \
    break;
        BRAID_GROUP(1) BRAID_GROUP(2) BRAID_GROUP(3) BRAID_GROUP(4)
        BRAID_GROUP(5) BRAID_GROUP(6) BRAID_GROUP(7) BRAID_GROUP(8)
#undef BRAID_GROUP
      }
    }
  });
}

template <typename T>
void attend_all_of_cache(const at::Tensor& q, const Geometry& geo, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scales,
                         const c10::optional<at::Tensor>& v_scales, const at::Tensor& tables,
                         const at::Tensor& seq_lens, const RowShares& shares, double scale,
                         at::Tensor& out) {
  if (k_cache.scalar_type() == at::kChar) {
    attend_all<T, int8_t>(q, geo, k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
                          k_scales, v_scales, tables, seq_lens, shares, scale, out);
  } else {
    attend_all<T, T>(q, geo, k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), k_scales, v_scales,
                     tables, seq_lens, shares, scale, out);
  }
}

// The caches' geometry, checked: [blocks, bs, Hk, D] views laid out tokens innermost, or
// the int8 pair layout's keys [blocks, bs/2, 2, Hk, D/2, 2] and values [blocks, bs/2, 2, Hk,
// D] (braid/layers/kv_layout.py).
Geometry geometry_of(const at::Tensor& k, const at::Tensor& v) {
  if (k.dim() == 4) {
    TORCH_CHECK(v.sizes() == k.sizes(),
                "paged_decode_attention: caches [blocks, bs, Hk, D] of one shape");
    TORCH_CHECK(k.stride(1) == 1 && v.stride(3) == 1,
                "paged_decode_attention: caches must be laid out tokens innermost");
    return {k.size(1), k.size(2), k.size(3), k.stride(0), k.stride(2), k.stride(3),
            v.stride(0), v.stride(2), v.stride(1), false};
  }
  constexpr const char* shapes =
      "paged_decode_attention: caches [blocks, bs, Hk, D], or the pair layout's keys "
      "[blocks, bs/2, 2, Hk, D/2, 2] and values [blocks, bs/2, 2, Hk, D] (int8 or bf16)";
  const bool int8 = k.scalar_type() == at::kChar;
  TORCH_CHECK(k.dim() == 6 && v.dim() == 5 && (int8 || k.scalar_type() == at::kBFloat16),
              shapes);
  const int64_t bs = 2 * k.size(1), Hk = k.size(3), D = 2 * k.size(4);
  TORCH_CHECK(k.size(2) == 2 && k.size(5) == 2 &&
                  v.sizes() == at::IntArrayRef({k.size(0), bs / 2, 2, Hk, D}), shapes);
  TORCH_CHECK(k.stride(5) == 1 && k.stride(2) == 2 && k.stride(1) == 4 &&
                  v.stride(2) == 1 && v.stride(4) == 2,
              "paged_decode_attention: the pair layout's tokens and pairs innermost");
  TORCH_CHECK(D <= 512, "paged_decode_attention: the pair layout's head_dim is at most 512 "
              "(int8: its int32 sums)");
  if (int8) {
#ifndef BRAID_INT8_PAIRS
    TORCH_CHECK(false, "paged_decode_attention: the int8 pair layout needs AVX512-VNNI");
#endif
  } else {
#ifndef BRAID_BF16_PAIRS
    TORCH_CHECK(false, "paged_decode_attention: the bf16 pair layout needs AVX512-BF16");
#endif
  }
  return {bs, Hk, D, k.stride(0), k.stride(3), k.stride(4), v.stride(0), v.stride(3),
          v.stride(1), true};
}

// q: [B, Hq, D]; k_cache, v_cache: [blocks, bs, Hk, D] views whose keys are stored
// [Hk, blocks, D, bs] and values [Hk, blocks, bs, D] (kv_layout.allocate, tokens_innermost:
// heads outermost, so that a sequence's blocks in order are one stream per head; blocks and
// heads are read through their strides), of q's dtype or int8, or int8 or bf16 in the pair
// layout (`geometry_of`); k_scales, v_scales (int8 caches only): [blocks, bs, Hk] float views
// stored [Hk, blocks, bs], one per token and head (a value is its int8 times its scale);
// block_tables: [B, W]; seq_lens: [B], each 1 to W * bs; kv_parts and row_tokens ([B] int64,
// each row's input token): see `RowShares`.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache,
                                  const c10::optional<at::Tensor>& k_scales,
                                  const c10::optional<at::Tensor>& v_scales,
                                  const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale,
                                  const c10::optional<at::Tensor>& kv_parts,
                                  const c10::optional<at::Tensor>& row_tokens) {
  TORCH_CHECK(q.dim() == 3, "paged_decode_attention: q [B, Hq, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: key and value caches of one dtype");
  const Geometry geo = geometry_of(k_cache, v_cache);
  TORCH_CHECK(q.size(2) == geo.D && q.size(1) % geo.Hk == 0 && q.size(1) / geo.Hk <= 8,
              "paged_decode_attention: head_dim must match and Hq be Hk times 1 to 8");
  TORCH_CHECK(geo.bs % VL == 0 && geo.D % VL == 0,
              "paged_decode_attention: block size and head_dim must be multiples of ", VL);
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || q.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: caches of q's dtype, or int8");
  TORCH_CHECK(int8 == (k_scales.has_value() && v_scales.has_value()),
              "paged_decode_attention: int8 caches come with their scales, others without");
  if (int8) {
    for (const at::Tensor& s : {*k_scales, *v_scales}) {
      TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 3 && s.size(0) == k_cache.size(0)
                      && s.size(1) == geo.bs && s.size(2) == geo.Hk && s.stride(1) == 1 &&
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
  const int64_t* ids = tables.data_ptr<int64_t>();
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= tables.size(1) * geo.bs,
                "paged_decode_attention: sequence ", b, " has ", lp[b],
                " keys, outside 1 to its block table's ", tables.size(1) * geo.bs);
    // The blocks its keys are read from: a bad id would read outside the cache
    for (int64_t i = 0; i < (lp[b] + geo.bs - 1) / geo.bs; ++i) {
      const int64_t id = ids[b * tables.size(1) + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode_attention: sequence ", b,
                  " reads block ", id, " (entry ", i, " of its table), outside the cache's ",
                  num_blocks, " blocks");
    }
  }
  if (kv_parts) {
    TORCH_CHECK(kv_parts->scalar_type() == at::kLong && kv_parts->is_contiguous() &&
                    kv_parts->sizes() == at::IntArrayRef({geo.Hk, 2}),
                "paged_decode_attention: kv_parts int64 [Hk, 2]");
    const int64_t* pp = kv_parts->data_ptr<int64_t>();
    for (int64_t h = 0; h < geo.Hk; ++h) {
      TORCH_CHECK(pp[2 * h + 1] >= 1 && pp[2 * h] >= 0 && pp[2 * h] < pp[2 * h + 1],
                  "paged_decode_attention: KV head ", h, "'s part ", pp[2 * h], " of ",
                  pp[2 * h + 1]);
    }
  }
  TORCH_CHECK(kv_parts.has_value() == row_tokens.has_value(),
              "paged_decode_attention: kv_parts come with row_tokens");
  at::Tensor tokens;
  if (row_tokens) {
    TORCH_CHECK(row_tokens->scalar_type() == at::kLong && row_tokens->numel() == q.size(0),
                "paged_decode_attention: row_tokens int64 [B]");
    tokens = row_tokens->contiguous();
  }
  const RowShares shares(kv_parts, lp, row_tokens ? tokens.data_ptr<int64_t>() : nullptr);
  at::Tensor out = at::empty(qv.sizes(), qv.options());
  if (q.scalar_type() == at::kBFloat16) {
    attend_all_of_cache<at::BFloat16>(qv, geo, k_cache, v_cache, k_scales, v_scales, tables,
                                      lens, shares, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_decode_attention: bf16 or fp32");
    attend_all_of_cache<float>(qv, geo, k_cache, v_cache, k_scales, v_scales, tables, lens,
                               shares, scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(braid, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scales, "
        "Tensor? v_scales, Tensor block_tables, Tensor seq_lens, float scale, "
        "Tensor? kv_parts=None, Tensor? row_tokens=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(braid, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
