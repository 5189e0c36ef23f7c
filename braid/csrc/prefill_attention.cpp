// Causal prefill attention in bf16 on CPUs with AMX, through oneDNN's batch-reduce GEMM
// (at::native::cpublas::brgemm, which ATen's flash attention calls too); built with the
// decode operators (braid/native.py). Registered on every CPU; where the
// compiler does not target AVX512-BF16 it raises instead of computing.
//
// Why not SDPA's CPU kernel: for bf16 it runs a GEMM per block of 64 queries against up to
// 512 keys, so at 512 tokens the causal mask saves nothing (one key block), and each
// query head reads its KV head's keys again. Here the keys and values of each (sequence, KV
// head) are packed once into the VNNI layout AMX reads, the query rows of a KV head's whole
// group share every key block (M = group x query block), key blocks past the diagonal are
// skipped, and the softmax's exponential is a short polynomial (its weights are rounded to
// bf16 for the second GEMM anyway).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include <immintrin.h>

namespace {
#if defined(__AVX512BF16__)

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;

// Query tokens per work item (times the group's heads: the GEMMs' rows) and keys per GEMM
// (the causal skip's grain). 2-core Xeon with AMX, SmolLM2's heads, time against SDPA's in
// the same run at 8 x 512 / 1 x 512 / 1 x 2048 tokens: 128 and 128 0.65 / 0.55 / 0.66, 64 and
// 128 0.69 / 0.52 / 0.70, 64 and 64 0.70 / 0.54 / 0.83, 256 and 128 0.64 / 0.68 / 0.73, 128
// and 64 0.58 / 0.60 / 0.72, 128 and 256 0.59 / 0.61 / 0.68.
constexpr int64_t QUERY_BLOCK = 128;
constexpr int64_t KEY_BLOCK = 128;

// Key block `keys` [n, D] (token stride `ld`) as the VNNI B operand of q @ k.T: [D / 2, N, 2]
// (pairs of head dims of one key side by side), zero past `n` up to KEY_BLOCK: a transpose of
// 32-bit pairs, done 16 keys x 16 pairs at a time.
void pack_keys(const BFloat16* keys, int64_t n, int64_t ld, int64_t dim, BFloat16* out) {
  auto* dst = reinterpret_cast<uint32_t*>(out);
  for (int64_t t0 = 0; t0 < KEY_BLOCK; t0 += 16) {
    for (int64_t p0 = 0; p0 < dim / 2; p0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = t0 + i < n ? _mm512_loadu_si512(keys + (t0 + i) * ld + 2 * p0)
                          : _mm512_setzero_si512();
      }
      // Pairs of rows, then quads, then 128-bit lanes: the classic 16 x 16 transpose.
      __m512i a[16], c[16];
      for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
      }
      for (int i = 0; i < 16; i += 4) {
        c[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
        c[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
        c[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
        c[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
      }
      for (int i = 0; i < 4; ++i) {
        a[i] = _mm512_shuffle_i32x4(c[i], c[i + 4], 0x88);
        a[i + 4] = _mm512_shuffle_i32x4(c[i + 8], c[i + 12], 0x88);
        a[i + 8] = _mm512_shuffle_i32x4(c[i], c[i + 4], 0xdd);
        a[i + 12] = _mm512_shuffle_i32x4(c[i + 8], c[i + 12], 0xdd);
      }
      for (int i = 0; i < 4; ++i) {
        r[i] = _mm512_shuffle_i32x4(a[i], a[i + 4], 0x88);
        r[i + 4] = _mm512_shuffle_i32x4(a[i + 8], a[i + 12], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(a[i], a[i + 4], 0xdd);
        r[i + 12] = _mm512_shuffle_i32x4(a[i + 8], a[i + 12], 0xdd);
      }
      for (int i = 0; i < 16; ++i) {
        _mm512_storeu_si512(dst + (p0 + i) * KEY_BLOCK + t0, r[i]);
      }
    }
  }
}

// Value block `values` [n, D] as the VNNI B operand of p @ v: [KEY_BLOCK / 2, D, 2] (the same
// head dim of two consecutive keys side by side), zero past `n`.
void pack_values(const BFloat16* values, int64_t n, int64_t ld, int64_t dim, BFloat16* out) {
  // Lane i of the interleave of `even` (lanes 0-31) and `odd` (32-63): even[i / 2] or
  // odd[i / 2], for the first 16 dims (`lo`) and the next 16 (`hi`).
  alignas(64) static const uint16_t interleave[32] = {
      0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(interleave);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t t = 0; t < KEY_BLOCK; t += 2) {
    BFloat16* dst = out + t * dim;
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512i even =
          t < n ? _mm512_loadu_si512(values + t * ld + d) : _mm512_setzero_si512();
      const __m512i odd =
          t + 1 < n ? _mm512_loadu_si512(values + (t + 1) * ld + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(even, lo, odd));
      _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(even, hi, odd));
    }
  }
}

// 2^x for x <= MAX_GROWTH, to about 6e-6 relative (the weights are rounded to bf16, 4e-3): a
// degree-4 polynomial in x's fraction, scaled by its integer part. Half the instructions of
// at::vec's exp, the softmax's largest cost.
inline __m512 exp2_fast(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 whole = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, whole);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.01334154f), f, _mm512_set1_ps(0.05235283f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24124981f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69304348f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, whole);
}

// Lanes of the vector at `j` that hold one of a row's first `visible` keys.
inline __mmask16 visible_lanes(int64_t j, int64_t visible) {
  const int64_t n = std::clamp<int64_t>(visible - j, 0, 16);
  return static_cast<__mmask16>((1u << n) - 1);
}

// The largest of a row's first `visible` raw scores (-inf when none).
float row_max_raw(const float* scores, int64_t visible) {
  __m512 max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < visible; j += 16) {
    max = _mm512_mask_max_ps(max, visible_lanes(j, visible), max, _mm512_loadu_ps(scores + j));
  }
  return _mm512_reduce_max_ps(max);
}

// How far (in powers of two) a row's scores may rise above its recorded max before the max is
// raised: the weights then reach 2^8 at most, far from fp32's range and exact in bf16's, and
// most key blocks need neither a pass for their max nor a rescale of the row's sums.
constexpr float MAX_GROWTH = 8.0f;

// weights = 2^(score * log2_scale - max) for a row's first `visible` keys, 0 past them, in
// bf16, their sum added lane-wise into `sum` (a row's sum is reduced across lanes once, at the
// end); false, with `sum` untouched, where a score exceeds max + MAX_GROWTH. Vectors past the
// visible keys (half of a diagonal block's, on average) are only zeroed.
bool exp2_row(const float* scores, int64_t visible, float log2_scale, float max,
              BFloat16* weights, float* sum) {
  __m512 total = _mm512_setzero_ps();
  __mmask16 over = 0;
  const __m512 c = _mm512_set1_ps(log2_scale), m = _mm512_set1_ps(max);
  int64_t j = 0;
  for (; j < visible; j += 16) {
    const __mmask16 lanes = visible_lanes(j, visible);
    const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(scores + j), c, m);
    over |= _mm512_mask_cmp_ps_mask(lanes, x, _mm512_set1_ps(MAX_GROWTH), _CMP_GT_OQ);
    const __m512 e = _mm512_maskz_mov_ps(lanes, exp2_fast(x));
    total = _mm512_add_ps(total, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + j),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  for (; j < KEY_BLOCK; j += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + j), _mm256_setzero_si256());
  }
  if (over) return false;
  _mm512_storeu_ps(sum, _mm512_add_ps(_mm512_loadu_ps(sum), total));
  return true;
}

// A row of `dim` bf16 (a multiple of 32), as whole vectors.
inline void copy_row(const BFloat16* src, BFloat16* dst, int64_t dim) {
  for (int64_t d = 0; d < dim; d += 32) {
    _mm512_storeu_si512(dst + d, _mm512_loadu_si512(src + d));
  }
}

// q: [B, T, Hq, D]; k, v: [B, L, Hk, D] (L >= T; query t sits at position L - T + t and sees
// keys up to it), bf16, last dim contiguous -> [B, T, Hq, D].
at::Tensor causal_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "causal_prefill_attention: bf16 q, k and v");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(),
              "causal_prefill_attention: q [B, T, Hq, D], k and v [B, L, Hk, D]");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "causal_prefill_attention: head dims contiguous");
  const int64_t batch = q.size(0), tokens = q.size(1), heads = q.size(2), dim = q.size(3);
  const int64_t keys = k.size(1), kv_heads = k.size(2);
  TORCH_CHECK(k.size(0) == batch && k.size(3) == dim && keys >= tokens && heads % kv_heads == 0,
              "causal_prefill_attention: mismatched shapes");
  TORCH_CHECK(dim % 32 == 0, "causal_prefill_attention: head dim a multiple of 32");
  const int64_t group = heads / kv_heads;
  const int64_t prefix = keys - tokens;
  const int64_t key_blocks = (keys + KEY_BLOCK - 1) / KEY_BLOCK;
  const int64_t query_slices = (tokens + QUERY_BLOCK - 1) / QUERY_BLOCK;

  // Packed keys and values, [B, Hk, key_blocks, KEY_BLOCK * D] each.
  const int64_t block_elems = KEY_BLOCK * dim;
  auto packed_k = at::empty({batch * kv_heads * key_blocks * block_elems}, k.options());
  auto packed_v = at::empty_like(packed_k);
  BFloat16* k_packs = packed_k.data_ptr<BFloat16>();
  BFloat16* v_packs = packed_v.data_ptr<BFloat16>();
  const auto* k_data = k.const_data_ptr<BFloat16>();
  const auto* v_data = v.const_data_ptr<BFloat16>();
  at::parallel_for(0, batch * kv_heads * key_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (kv_heads * key_blocks), h = item / key_blocks % kv_heads;
      const int64_t start = item % key_blocks * KEY_BLOCK;
      const int64_t n = std::min(KEY_BLOCK, keys - start);
      pack_keys(k_data + b * k.stride(0) + start * k.stride(1) + h * k.stride(2), n,
                k.stride(1), dim, k_packs + item * block_elems);
      pack_values(v_data + b * v.stride(0) + start * v.stride(1) + h * v.stride(2), n,
                  v.stride(1), dim, v_packs + item * block_elems);
    }
  });

  auto out = at::empty({batch, tokens, heads, dim}, q.options());
  const auto* q_data = q.const_data_ptr<BFloat16>();
  auto* out_data = out.data_ptr<BFloat16>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t rows_max = QUERY_BLOCK * group;
  const float log2_scale = static_cast<float>(scale * M_LOG2E);

  // Work items (sequence, KV head, query slice) taken in turn by whichever thread is free,
  // the longest (last slices, most key blocks) first, so that the threads end together
  // (2-core VMs do not give both cores the same speed).
  const int64_t items = batch * kv_heads * query_slices;
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    // Per thread: the group's queries (rows ordered token-major, then head), scores, softmax
    // weights in bf16, fp32 output sums, running max and sum per row.
    std::vector<BFloat16> queries(rows_max * dim), weights(rows_max * KEY_BLOCK);
    std::vector<float> scores(rows_max * KEY_BLOCK), sums(rows_max * dim);
    std::vector<float> row_max(rows_max), row_sum(rows_max * 16);
    for (int64_t item = next_item++; item < items; item = next_item++) {
      const int64_t b = item % (batch * kv_heads) / kv_heads, h = item % kv_heads;
      const int64_t first = (query_slices - 1 - item / (batch * kv_heads)) * QUERY_BLOCK;
      const int64_t count = std::min(QUERY_BLOCK, tokens - first);
      const int64_t rows = count * group;
      for (int64_t t = 0; t < count; ++t) {
        for (int64_t g = 0; g < group; ++g) {
          copy_row(q_data + b * q.stride(0) + (first + t) * q.stride(1) +
                       (h * group + g) * q.stride(2),
                   queries.data() + (t * group + g) * dim, dim);
        }
      }
      std::fill_n(row_max.begin(), rows, neg_inf);
      std::fill_n(row_sum.begin(), rows * 16, 0.0f);
      // Keys [0, last] are visible to the block's last query.
      const int64_t last = prefix + first + count - 1;
      const BFloat16* kv_k = k_packs + (b * kv_heads + h) * key_blocks * block_elems;
      const BFloat16* kv_v = v_packs + (b * kv_heads + h) * key_blocks * block_elems;
      for (int64_t block = 0; block * KEY_BLOCK <= last; ++block) {
        const int64_t start = block * KEY_BLOCK;
        const int64_t n = std::min(KEY_BLOCK, keys - start);
        at::native::cpublas::brgemm(rows, KEY_BLOCK, dim, dim, KEY_BLOCK, KEY_BLOCK, false,
                                    queries.data(), kv_k + block * block_elems, scores.data());
        // Masked only where some query of the block sees less than the whole key block.
        const bool partial = start + n - 1 > prefix + first || n < KEY_BLOCK;
        for (int64_t r = 0; r < rows; ++r) {
          float* s = scores.data() + r * KEY_BLOCK;
          const int64_t visible =
              partial ? std::clamp<int64_t>(prefix + first + r / group - start + 1, 0, n)
                      : KEY_BLOCK;
          // Maxima and sums in units of log2 (the scale and log2(e) folded into one factor).
          BFloat16* w = weights.data() + r * KEY_BLOCK;
          float* sum = row_sum.data() + r * 16;
          if (row_max[r] != neg_inf && exp2_row(s, visible, log2_scale, row_max[r], w, sum)) {
            continue;
          }
          // The row's first keys, or scores beyond MAX_GROWTH: its max from this block.
          const float new_max = std::max(row_max[r], row_max_raw(s, visible) * log2_scale);
          if (new_max == neg_inf) {  // sees no key yet (a later block's first queries)
            std::fill_n(w, KEY_BLOCK, BFloat16(0.0f));
            continue;
          }
          if (row_max[r] != neg_inf) {  // earlier blocks' sums, rescaled to the new max
            const float correction = std::exp2(row_max[r] - new_max);
            float* o = sums.data() + r * dim;
            at::vec::map<float>([correction](Vec x) { return x * Vec(correction); }, o, o, dim);
            at::vec::map<float>([correction](Vec x) { return x * Vec(correction); }, sum, sum, 16);
          }
          row_max[r] = new_max;
          exp2_row(s, visible, log2_scale, new_max, w, sum);
        }
        at::native::cpublas::brgemm(rows, dim, KEY_BLOCK, KEY_BLOCK, dim, dim, block > 0,
                                    weights.data(), kv_v + block * block_elems, sums.data());
      }
      // Each row divided by its sum, written as whole vectors (at::vec::map took 3x as long for
      // these 64-dim rows).
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = first + r / group, g = r % group;
        const __m512 inverse = _mm512_set1_ps(
            1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(row_sum.data() + r * 16)));
        BFloat16* dst = out_data + ((b * tokens + t) * heads + h * group + g) * dim;
        const float* src = sums.data() + r * dim;
        for (int64_t d = 0; d < dim; d += 16) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), reinterpret_cast<__m256i>(
              _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + d), inverse))));
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}

#else
at::Tensor causal_prefill_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    double) {
  TORCH_CHECK(false, "causal_prefill_attention: built for a CPU without AVX512-BF16");
}
#endif  // __AVX512BF16__
}  // namespace

TORCH_LIBRARY_FRAGMENT(braid, m) {
  m.def("causal_prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(braid, CPU, m) {
  m.impl("causal_prefill_attention", &causal_prefill_attention);
}
