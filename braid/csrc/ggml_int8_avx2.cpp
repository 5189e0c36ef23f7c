// GEMMs of a few fp32 rows over Q4_K, Q6_K and Q8_0 blocks on CPUs with AVX2 but no AVX-512,
// through int8 dot products as llama.cpp's AVX2 kernels compute them: each input row is rounded
// to int8 per block of the weight's format (256 inputs for the K-quants, 32 for Q8_0), and a
// weight row's quants meet the inputs in `vpmaddubsw` (32 unsigned quants times 32 signed
// inputs, summed in pairs) without becoming floats; sub-block scales multiply the pair sums in
// `vpmaddwd`, the fp16 factors apply once a block. Decoding every weight to fp32 for an FMA
// (ggml_avx2.cpp) spends several instructions a weight, and bound decode by them, not by memory.
//
// As in ggml_int8.cpp (the AVX512-VNNI kernels), a row's result depends on that row alone, summed
// in one order whatever the row count, and differs from the product over the dequantized weight
// by the input's rounding (at most half a step of 1/127 of each block's largest input).
#include "ggml_format.h"

#if defined(BRAID_GGML_AVX2)
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace braid_ggml {
namespace {

constexpr int64_t SUPER = 256;     // inputs of a K-quant super-block
constexpr int64_t TILE_ROWS = 16;  // weight rows that stay in L1/L2 while the groups pass

// Input rows rounded to int8: q[m, k] * scale[m, k / block] stands for x[m, k]; `sums` holds
// the sums of q per `span` inputs (the K-quants' minimums and offsets multiply them; span 0:
// none, Q8_0 needs no sums).
struct RoundedInputs {
  int64_t K, block, span;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int16_t> sums;  // at most 32 * 127 each

  RoundedInputs(const float* x, int64_t M, int64_t K, int64_t block, int64_t span);

  struct Row {
    const int8_t* q;
    const float* scale;
    const int16_t* sums;
  };
  Row row(int64_t m) const {
    return {q.data() + m * K, scale.data() + m * K / block,
            span ? sums.data() + m * K / span : nullptr};
  }
};

inline float largest_of(__m256 v) {
  const __m128 four = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}

inline float sum_of(__m128 four) {
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

inline __m128 halves_added(__m256 v) {
  return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}

// n inputs (a multiple of 32) rounded to the nearest even multiple of their largest |x| / 127
// into q; the scale. NaN or inf among them: NaN, and quants 0 (the block's products NaN).
float round_block(const float* x, int64_t n, int8_t* q) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 largest = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8)
    largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  const float amax = largest_of(largest);
  if (!std::isfinite(amax)) {
    std::memset(q, 0, n);
    return std::numeric_limits<float>::quiet_NaN();
  }
  const __m256 inverse = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  // packs interleave the 128-bit halves: this puts the four vectors' bytes back in order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < n; i += 32) {
    __m256i v[4];
    for (int j = 0; j < 4; ++j)
      v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), inverse));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                             _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                        _mm256_permutevar8x32_epi32(bytes, order));
  }
  return amax / 127.f;
}

RoundedInputs::RoundedInputs(const float* x, int64_t M, int64_t K, int64_t block, int64_t span)
    : K(K), block(block), span(span), q(M * K), scale(M * K / block),
      sums(span ? M * K / span : 0) {
  for (int64_t i = 0; i < M * K; i += block) scale[i / block] = round_block(x + i, block, &q[i]);
  for (int64_t s = 0; s < int64_t(sums.size()); ++s) {
    int32_t sum = 0;
    for (int64_t i = 0; i < span; ++i) sum += q[s * span + i];
    sums[s] = int16_t(sum);
  }
}

// 32 unsigned quants times 32 signed inputs, adjacent pairs summed, each of the 16 pair sums
// times its lane's scale (int16) and adjacent ones summed again: 8 int32 lanes.
inline __m256i scaled_dot(__m256i quants, const int8_t* inputs, __m256i scales) {
  const __m256i pairs = _mm256_maddubs_epi16(
      quants, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(inputs)));
  return _mm256_madd_epi16(pairs, scales);
}

// Index vectors for `vpshufb` that copy 16-bit scale j of a 128-bit half into all its lanes
inline __m256i scale_picker(int j) { return _mm256_set1_epi16(int16_t(0x0100 + 0x0202 * j)); }

// Q4_K block: (d scale_j) q - (dmin min_j) for sub-block j of 32, q in 0..15; 32 bytes of
// quants hold sub-block 2i in their low nibbles and 2i + 1 in their high ones.
template <int MR>
void q4_k_row(const uint8_t* row, int64_t blocks, const RoundedInputs::Row* in, float out[MR]) {
  const __m256i nibble = _mm256_set1_epi8(15);
  const __m256i pick[8] = {scale_picker(0), scale_picker(1), scale_picker(2), scale_picker(3),
                           scale_picker(4), scale_picker(5), scale_picker(6), scale_picker(7)};
  __m256 acc[MR];
  __m128 minimums[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps(), minimums[m] = _mm_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 144;
    alignas(16) uint8_t unpacked[16];  // scales 0-7, minimums 0-7
    unpack_scales_k4(block + 4, unpacked);
    const __m256i wide = _mm256_cvtepu8_epi16(_mm_load_si128(
        reinterpret_cast<const __m128i*>(unpacked)));
    const __m128i scales = _mm256_castsi256_si128(wide), mins = _mm256_extracti128_si256(wide, 1);
    const __m256i both_scales = _mm256_set_m128i(scales, scales);
    __m256i sums[MR];
    for (int m = 0; m < MR; ++m) sums[m] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * i));
      const __m256i low = _mm256_and_si256(bytes, nibble);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      const __m256i low_scale = _mm256_shuffle_epi8(both_scales, pick[2 * i]);
      const __m256i high_scale = _mm256_shuffle_epi8(both_scales, pick[2 * i + 1]);
      for (int m = 0; m < MR; ++m) {
        const int8_t* x = in[m].q + b * SUPER + 64 * i;
        sums[m] = _mm256_add_epi32(sums[m], _mm256_add_epi32(scaled_dot(low, x, low_scale),
                                                             scaled_dot(high, x + 32, high_scale)));
      }
    }
    const float d = half_at(block), dmin = half_at(block + 2);
    for (int m = 0; m < MR; ++m) {
      const float scale = in[m].scale[b];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[m]), _mm256_set1_ps(d * scale), acc[m]);
      // sum_j min_j * (sum of sub-block j's inputs), four lanes
      const __m128i offsets = _mm_madd_epi16(mins, _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(in[m].sums + 8 * b)));
      minimums[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(offsets), _mm_set1_ps(dmin * scale),
                                 minimums[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = sum_of(_mm_sub_ps(halves_added(acc[m]), minimums[m]));
}

// Q6_K block: (d scale_i) (q - 32) for sub-block i of 16; q in 0..63 from 4 low bits in ql and
// 2 high bits in qh. Each half of 128 weights: 64 ql bytes give quarters 0 and 1 (low nibbles of
// bytes 0-31 and 32-63) and 2 and 3 (their high nibbles); qh's byte l gives weight l of quarter
// j its bits 2j and 2j + 1.
template <int MR>
void q6_k_row(const uint8_t* row, int64_t blocks, const RoundedInputs::Row* in, float out[MR]) {
  const __m256i nibble = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 210;
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    __m256i sums[MR];
    for (int m = 0; m < MR; ++m) sums[m] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const auto load = [](const uint8_t* p) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      };
      const __m256i first = load(block + 64 * h), second = load(block + 64 * h + 32);
      const __m256i high = load(block + 128 + 32 * h);
      const __m256i quarters[4] = {
          _mm256_or_si256(_mm256_and_si256(first, nibble),
                          _mm256_and_si256(_mm256_slli_epi16(high, 4), top)),
          _mm256_or_si256(_mm256_and_si256(second, nibble),
                          _mm256_and_si256(_mm256_slli_epi16(high, 2), top)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(first, 4), nibble),
                          _mm256_and_si256(high, top)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(second, 4), nibble),
                          _mm256_and_si256(_mm256_srli_epi16(high, 2), top))};
      for (int j = 0; j < 4; ++j) {
        const int8_t* sc = scales + 8 * h + 2 * j;  // weights 0-15 and 16-31 of the quarter
        const __m256i lane_scales = _mm256_set_m128i(_mm_set1_epi16(sc[1]), _mm_set1_epi16(sc[0]));
        for (int m = 0; m < MR; ++m) {
          const int8_t* x = in[m].q + b * SUPER + 128 * h + 32 * j;
          sums[m] = _mm256_add_epi32(sums[m], scaled_dot(quarters[j], x, lane_scales));
        }
      }
    }
    const float d = half_at(block + 208);
    const __m256i wide_scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(scales)));
    for (int m = 0; m < MR; ++m) {
      // minus 32 * sum_i scale_i * (sum of sub-block i's inputs)
      const __m256i offsets = _mm256_madd_epi16(wide_scales, _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(in[m].sums + 16 * b)));
      const __m256i sum = _mm256_sub_epi32(sums[m], _mm256_slli_epi32(offsets, 5));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * in[m].scale[b]),
                               acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = sum_of(halves_added(acc[m]));
}

// Q8_0 block: d q for 32 signed quants. `vpmaddubsw` wants one operand unsigned: |q| meets the
// inputs with q's sign (llama.cpp's way; |-128| is 128 as an unsigned byte).
template <int MR>
void q8_0_row(const uint8_t* row, int64_t K, const RoundedInputs::Row* in, float out[MR]) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const uint8_t* block = row + k / 32 * 34;
    const float d = half_at(block);
    const __m256i quants = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    const __m256i magnitudes = _mm256_sign_epi8(quants, quants);
    for (int m = 0; m < MR; ++m) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in[m].q + k));
      const __m256i pairs = _mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(x, quants));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)),
                               _mm256_set1_ps(d * in[m].scale[k / 32]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = sum_of(halves_added(acc[m]));
}

template <int MR>
void row_times_inputs(int64_t type, const uint8_t* row, int64_t K,
                      const RoundedInputs::Row* in, float out[MR]) {
  switch (type) {
    case Q4_K: return q4_k_row<MR>(row, K / SUPER, in, out);
    case Q6_K: return q6_k_row<MR>(row, K / SUPER, in, out);
    default: return q8_0_row<MR>(row, K, in, out);
  }
}

RoundedInputs rounded(const float* x, int64_t M, int64_t K, int64_t type) {
  switch (type) {
    case Q4_K: return RoundedInputs(x, M, K, SUPER, 32);
    case Q6_K: return RoundedInputs(x, M, K, SUPER, 16);
    default: return RoundedInputs(x, M, K, 32, 0);
  }
}

}  // namespace

bool avx2_int8_serves(int64_t type, int64_t K) {
  return ((type == Q4_K || type == Q6_K) && K % SUPER == 0) || (type == Q8_0 && K % 32 == 0);
}

at::Tensor avx2_int8_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && avx2_int8_serves(type, x.size(1)),
              "avx2_int8_linear: fp32 inputs over Q4_K, Q6_K or Q8_0 blocks");
  const int64_t M = x.size(0), N = blocks.size(0), K = x.size(1), row_bytes = blocks.size(1);
  const at::Tensor xc = x.contiguous();
  const RoundedInputs in = rounded(xc.data_ptr<float>(), M, K, type);
  std::vector<RoundedInputs::Row> rows(M);
  for (int64_t m = 0; m < M; ++m) rows[m] = in.row(m);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const auto multiply = [&](auto group, auto /* one weight row */, int64_t n, int64_t m,
                            float (*out)[4]) {
    row_times_inputs<decltype(group)::value>(type, bp + n * row_bytes, K, rows.data() + m,
                                             out[0]);
  };
  over_tiles_of_rows<1>(M, N, TILE_ROWS, multiply,
                     [&](int64_t m, int64_t n, float value) { yp[m * N + n] = value; });
  return y;
}

}  // namespace braid_ggml
#endif  // BRAID_GGML_AVX2
