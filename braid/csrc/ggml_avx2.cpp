// GGML blocks on CPUs with AVX2 and FMA but no AVX-512 (ggml_blocks.cpp's vector decoders need
// AVX-512): every format braid keeps (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) decoded eight
// weights at a time into one fp32 vector, with the same operations in the same order as the
// `gguf` package's `dequantize`, so the same values. fp32 GEMMs of up to four rows multiply
// each decoded vector in registers, so memory carries the blocks' bytes only; up to `few_rows`
// rows decode four weight rows at a time once into a cache-resident tile; larger GEMMs and
// `ggml_dequantize` decode chunks of rows (ggml_blocks.cpp).
#include "ggml_format.h"

#if defined(BRAID_GGML_AVX2)
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace braid_ggml {
namespace {

inline __m256i bytes8(const uint8_t* p) {  // 8 bytes as 8 int32 lanes
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i signed_bytes8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 as_float(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }
inline __m256i high_nibbles(__m256i v) { return _mm256_srli_epi32(v, 4); }

// Each decoder hands its block's weights to `emit(k, a, b)`: elements [k, k + 8) and
// [k + 8, k + 16) of the block, k increasing (the order `RowSums` adds them in).

template <typename Emit>
void q4_0(const uint8_t* b, Emit& emit) {  // (q - 8) d
  const __m256 d = _mm256_set1_ps(half_at(b));
  const __m256i eight = _mm256_set1_epi32(8), q[2] = {bytes8(b + 2), bytes8(b + 10)};
  const auto value = [&](__m256i v) {
    return _mm256_mul_ps(d, as_float(_mm256_sub_epi32(v, eight)));
  };
  emit(0, value(low_nibbles(q[0])), value(low_nibbles(q[1])));
  emit(16, value(high_nibbles(q[0])), value(high_nibbles(q[1])));
}

template <typename Emit>
void q4_1(const uint8_t* b, Emit& emit) {  // q d + m
  const __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
  const __m256i q[2] = {bytes8(b + 4), bytes8(b + 12)};
  const auto value = [&](__m256i v) { return _mm256_add_ps(_mm256_mul_ps(d, as_float(v)), m); };
  emit(0, value(low_nibbles(q[0])), value(low_nibbles(q[1])));
  emit(16, value(high_nibbles(q[0])), value(high_nibbles(q[1])));
}

// Fifth bit j of weight j in a 32-bit word: Q5_0 (q - 16) d, Q5_1 (MINIMUM) q d + m
template <bool MINIMUM, typename Emit>
void q5(const uint8_t* b, Emit& emit) {
  const __m256 d = _mm256_set1_ps(half_at(b));
  const __m256 m = _mm256_set1_ps(MINIMUM ? half_at(b + 2) : 0.f);
  const uint8_t* rest = b + (MINIMUM ? 4 : 2);
  uint32_t qh;
  std::memcpy(&qh, rest, sizeof qh);
  const __m256i sixteen = _mm256_set1_epi32(16), one = _mm256_set1_epi32(1);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i q[2] = {bytes8(rest + 4), bytes8(rest + 12)};
  const auto value = [&](__m256i low, int k) {  // weights k..k+7
    const __m256i shifts = _mm256_add_epi32(lanes, _mm256_set1_epi32(k));
    const __m256i bits = _mm256_srlv_epi32(_mm256_set1_epi32(int(qh)), shifts);
    const __m256i fifth = _mm256_and_si256(bits, one);
    const __m256i v = _mm256_or_si256(low, _mm256_slli_epi32(fifth, 4));
    if constexpr (MINIMUM) return _mm256_add_ps(_mm256_mul_ps(d, as_float(v)), m);
    return _mm256_mul_ps(d, as_float(_mm256_sub_epi32(v, sixteen)));
  };
  emit(0, value(low_nibbles(q[0]), 0), value(low_nibbles(q[1]), 8));
  emit(16, value(high_nibbles(q[0]), 16), value(high_nibbles(q[1]), 24));
}

template <typename Emit>
void q8_0(const uint8_t* b, Emit& emit) {  // q d
  const __m256 d = _mm256_set1_ps(half_at(b));
  const auto value = [&](int k) { return _mm256_mul_ps(d, as_float(signed_bytes8(b + 2 + k))); };
  emit(0, value(0), value(8));
  emit(16, value(16), value(24));
}

// Q4_K and Q5_K: sub-block i of 32 is (d scale_i) q - (dmin min_i); Q5_K's fifth bit of
// sub-block i is bit i of qh[l].
template <bool FIFTH_BIT, typename Emit>
void k_quant(const uint8_t* b, Emit& emit) {
  alignas(16) uint8_t unpacked[16];
  unpack_scales_k4(b + 4, unpacked);
  const __m256 d = _mm256_set1_ps(half_at(b)), dmin = _mm256_set1_ps(half_at(b + 2));
  alignas(32) float steps[8], offsets[8];
  _mm256_store_ps(steps, _mm256_mul_ps(d, as_float(bytes8(unpacked))));
  _mm256_store_ps(offsets, _mm256_mul_ps(dmin, as_float(bytes8(unpacked + 8))));
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (FIFTH_BIT ? 48 : 16);
  const __m256i one = _mm256_set1_epi32(1);
  for (int i = 0; i < 8; ++i) {  // 32 bytes serve sub-blocks 2c (low nibbles) and 2c + 1
    const uint8_t* q = qs + 32 * (i / 2);
    const __m256 step = _mm256_set1_ps(steps[i]), offset = _mm256_set1_ps(offsets[i]);
    const auto value = [&](int l) {
      __m256i v = i % 2 ? high_nibbles(bytes8(q + l)) : low_nibbles(bytes8(q + l));
      if (FIFTH_BIT) {
        const __m256i fifth = _mm256_and_si256(_mm256_srli_epi32(bytes8(qh + l), i), one);
        v = _mm256_or_si256(v, _mm256_slli_epi32(fifth, 4));
      }
      return _mm256_sub_ps(_mm256_mul_ps(step, as_float(v)), offset);
    };
    emit(32 * i, value(0), value(8));
    emit(32 * i + 16, value(16), value(24));
  }
}

template <typename Emit>
void q6_k(const uint8_t* b, Emit& emit) {  // (d scale) (q - 32), a scale per 16
  const float d = half_at(b + 208);
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const __m256i fifteen = _mm256_set1_epi32(15), three = _mm256_set1_epi32(3);
  const __m256i bias = _mm256_set1_epi32(32);
  for (int h = 0; h < 2; ++h) {  // 128 weights: quarter j's low 4 bits from ql, high 2 from qh
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    const int8_t* sc = scales + 8 * h;
    for (int j = 0; j < 4; ++j) {
      const uint8_t* low = ql + 32 * (j % 2);
      const auto value = [&](int l) {
        const __m256i bits = bytes8(low + l);
        const __m256i four = j < 2 ? _mm256_and_si256(bits, fifteen) : _mm256_srli_epi32(bits, 4);
        const __m256i two = _mm256_and_si256(_mm256_srli_epi32(bytes8(qh + l), 2 * j), three);
        return _mm256_sub_epi32(_mm256_or_si256(four, _mm256_slli_epi32(two, 4)), bias);
      };
      for (int l = 0; l < 32; l += 16) {  // a scale per 16 weights
        const __m256 step = _mm256_set1_ps(d * float(sc[l / 16 + 2 * j]));
        emit(128 * h + 32 * j + l, _mm256_mul_ps(step, as_float(value(l))),
             _mm256_mul_ps(step, as_float(value(l + 8))));
      }
    }
  }
}

// Every block of a weight row, in order, through `emit(k, a, b)` (k: the row's element).
template <typename Emit>
void decode_row_with(int64_t type, const uint8_t* row, int64_t K, Emit& emit) {
  const Format f = format_of(type);
  const auto blocks = [&](auto decode_block) {
    for (int64_t i = 0; i < K / f.elements; ++i) {
      const auto shifted = [&](int64_t k, __m256 a, __m256 b) { emit(i * f.elements + k, a, b); };
      decode_block(row + i * f.bytes, shifted);
    }
  };
  switch (type) {
    case Q4_0: return blocks([](const uint8_t* b, auto& e) { q4_0(b, e); });
    case Q4_1: return blocks([](const uint8_t* b, auto& e) { q4_1(b, e); });
    case Q5_0: return blocks([](const uint8_t* b, auto& e) { q5<false>(b, e); });
    case Q5_1: return blocks([](const uint8_t* b, auto& e) { q5<true>(b, e); });
    case Q8_0: return blocks([](const uint8_t* b, auto& e) { q8_0(b, e); });
    case Q4_K: return blocks([](const uint8_t* b, auto& e) { k_quant<false>(b, e); });
    case Q5_K: return blocks([](const uint8_t* b, auto& e) { k_quant<true>(b, e); });
    case Q6_K: return blocks([](const uint8_t* b, auto& e) { q6_k(b, e); });
  }
}

inline float sum_of(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// The sums of MR input rows against one weight row, added sixteen weights at a time in the
// row's order, into two accumulators an input row (the two vectors of eight: consecutive FMAs
// do not wait on each other). Both paths below add this way, so a row's result does not depend
// on how many rows share the GEMM (a step's row count does not change a sequence's tokens).
template <int MR>
struct RowSums {
  __m256 acc[MR][2];

  RowSums() {
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  }
  void add(const float* x, int64_t K, int64_t k, __m256 a, __m256 b) {
    for (int m = 0; m < MR; ++m) {
      acc[m][0] = _mm256_fmadd_ps(a, _mm256_loadu_ps(x + m * K + k), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(b, _mm256_loadu_ps(x + m * K + k + 8), acc[m][1]);
    }
  }
  void store(float* y, int64_t N) const {
    for (int m = 0; m < MR; ++m) y[m * N] = sum_of(_mm256_add_ps(acc[m][0], acc[m][1]));
  }
};

// Weight rows [n0, n1) against MR input rows, each weight row decoded in registers (memory
// carries the blocks' bytes only).
template <int MR>
void rows_in_registers(int64_t type, const float* x, const uint8_t* blocks, int64_t row_bytes,
                       float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    RowSums<MR> sums;
    const auto multiply = [&](int64_t k, __m256 a, __m256 b) { sums.add(x, K, k, a, b); };
    decode_row_with(type, blocks + n * row_bytes, K, multiply);
    sums.store(y + n, N);
  }
}

// NR weight rows decoded in `tile` (NR x K) against one input row, each sum added as `RowSums`
// adds it; the input is read once for all NR rows.
template <int NR>
void row_against_tile(const float* x, const float* tile, float* y, int64_t K) {
  __m256 acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m256 low = _mm256_loadu_ps(x + k), high = _mm256_loadu_ps(x + k + 8);
    for (int r = 0; r < NR; ++r) {
      acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(tile + r * K + k), low, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(tile + r * K + k + 8), high, acc[r][1]);
    }
  }
  for (int r = 0; r < NR; ++r) y[r] = sum_of(_mm256_add_ps(acc[r][0], acc[r][1]));
}

// Weight rows [n0, n1) against M input rows: TILE_ROWS weight rows at a time decoded once into
// `tile` (TILE_ROWS x K floats, cache-resident), then multiplied with every input row.
constexpr int64_t TILE_ROWS = 4;

void rows_through_tile(int64_t type, const float* x, int64_t M, const uint8_t* blocks,
                       int64_t row_bytes, float* y, int64_t N, int64_t K, int64_t n0, int64_t n1,
                       float* tile) {
  for (int64_t n = n0; n < n1; n += TILE_ROWS) {
    const int64_t rows = std::min(TILE_ROWS, n1 - n);
    for (int64_t r = 0; r < rows; ++r)
      avx2_decode_row(type, blocks + (n + r) * row_bytes, tile + r * K, K);
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float* ym = y + m * N + n;
      switch (rows) {
        case 1: row_against_tile<1>(xm, tile, ym, K); break;
        case 2: row_against_tile<2>(xm, tile, ym, K); break;
        case 3: row_against_tile<3>(xm, tile, ym, K); break;
        default: row_against_tile<4>(xm, tile, ym, K); break;
      }
    }
  }
}

}  // namespace

void avx2_decode_row(int64_t type, const uint8_t* row, float* out, int64_t K) {
  const auto store = [out](int64_t k, __m256 a, __m256 b) {
    _mm256_storeu_ps(out + k, a);
    _mm256_storeu_ps(out + k + 8, b);
  };
  decode_row_with(type, row, K, store);
}

at::Tensor avx2_few_rows_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  constexpr int64_t ROWS_PER_TASK = TILE_ROWS;
  const int64_t M = x.size(0), N = blocks.size(0), K = x.size(1), row_bytes = blocks.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "avx2_few_rows_linear: fp32 inputs");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK, 1, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * ROWS_PER_TASK, n1 = std::min(N, t1 * ROWS_PER_TASK);
    switch (M) {
      case 1: return rows_in_registers<1>(type, xp, bp, row_bytes, yp, N, K, n0, n1);
      case 2: return rows_in_registers<2>(type, xp, bp, row_bytes, yp, N, K, n0, n1);
      case 3: return rows_in_registers<3>(type, xp, bp, row_bytes, yp, N, K, n0, n1);
      case 4: return rows_in_registers<4>(type, xp, bp, row_bytes, yp, N, K, n0, n1);
    }
    std::vector<float> tile(TILE_ROWS * K);
    rows_through_tile(type, xp, M, bp, row_bytes, yp, N, K, n0, n1, tile.data());
  });
  return y;
}

}  // namespace braid_ggml
#endif  // BRAID_GGML_AVX2
