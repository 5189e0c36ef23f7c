// GEMMs of a few rows (decode, small batches, speculative verification) over GGUF blocks
// through int8 dot products (AVX512-VNNI), as llama.cpp computes them: each input row is
// rounded to int8 per 256 elements for the K-quants (like its Q8_K) and per 32 for the others
// (its Q8_0), and a weight row's quants meet the input's in `vpdpbusd` (64 unsigned quants
// times 64 signed inputs a vector) without becoming floats; sub-block scales apply to the integer
// sums, the fp16 factors once per block. Decoding floats for `vdpbf16ps` (ggml_blocks.cpp)
// spends two to three times the instructions a weight, and was bound by them, not by memory.
// Weights whose rows are a multiple of 16 come interleaved 16 rows to a group (Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K: ggml_format.h), and their kernels (`x16_*`) also take
// prefill's many rows where the caller asks (`int8_rows`); the others go row by row (Q4_K,
// Q6_K and Q8_0). bf16 and fp32 inputs are rounded alike and the outputs are written in the
// inputs' dtype (an fp32 run's products are then llama.cpp's too, as on AVX2-only CPUs).
//
// A row's result depends on that row alone, summed in one order whatever the row count, so
// decode is row-count invariant up to the few-row GEMMs' 32 rows, or at every row count where
// the groups take them (a request's tokens do not depend on its batch); it differs from the
// product over the dequantized weight by the input's rounding to int8 (at most half a step of
// 1/127 of each block's largest input).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ggml_format.h"

namespace braid_ggml {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
namespace {

constexpr int64_t BLOCK = 256;  // elements of a K-quant super-block and of its input block
constexpr int64_t PAIR = 64;    // elements of two Q8_0 blocks, one vector of quants

// Input rows rounded to int8, per block of `block` inputs: q[m, k] * scale[m, k / block] stands
// for x[m, k]. q is in the order in which the weight format's vectors meet it; `lanes` holds,
// for each `span` inputs, 16 integer sums of q that the format's offsets need, and `lane_scales`
// (Q8_0) each block's scale in the 8 lanes of its products.
struct QuantizedInput {
  int64_t K, block, span;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> lanes;
  std::vector<float> lane_scales;

  QuantizedInput(int64_t M, int64_t K, int64_t block, int64_t span)
      : K(K), block(block), span(span), q(M * K), scale(M * K / block),
        lanes(M * K / span * 16, 0) {}

  // Row m's parts, for the kernels to index with constants (no division in their loops)
  struct Row {
    const int8_t* q;            // [K]
    const float* scale;         // [K / block] (K-quants)
    const int32_t* lanes;       // [K / span, 16]
    const float* lane_scales;   // [K / span, 16] (Q8_0)
  };
  Row row(int64_t m) const {
    const int64_t spans = K / span * 16;
    return {q.data() + m * K, scale.empty() ? nullptr : scale.data() + m * K / block,
            lanes.data() + m * spans,
            lane_scales.empty() ? nullptr : lane_scales.data() + m * spans};
  }
};

inline __m512 load_floats(const at::BFloat16* p) {  // a bf16 is the top half of an fp32
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load_floats(const float* p) { return _mm512_loadu_ps(p); }

// n inputs (a multiple of 16, at most 256) rounded to the nearest even multiple of their
// largest |x| / 127, handed 16 at a time to `emit(i, rounded)` (inputs [16 i, 16 i + 16) as
// int32 lanes); the scale. NaN or inf among them: NaN, and nothing emitted (the block's quants
// stay 0, its products NaN rather than finite).
template <typename T, typename Emit>
float round_block(const T* src, int n, Emit emit) {
  __m512 values[16];
  __m512 largest = _mm512_setzero_ps();
  for (int i = 0; i < n / 16; ++i) {
    values[i] = load_floats(src + 16 * i);
    largest = _mm512_max_ps(largest, _mm512_abs_ps(values[i]));
  }
  const float amax = _mm512_reduce_max_ps(largest);
  if (!std::isfinite(amax)) return std::numeric_limits<float>::quiet_NaN();
  const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  for (int i = 0; i < n / 16; ++i) emit(i, _mm512_cvtps_epi32(_mm512_mul_ps(values[i], inverse)));
  return amax / 127.f;
}

inline void store_bytes(int8_t* p, __m512i lanes) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(lanes));
}

// Where the 32 inputs of Q4_K's sub-block j sit in a block: a vector of 64 quant bytes holds
// sub-blocks j (low nibbles) and j + 1 (high) for even j, and its two halves serve sub-blocks
// 4h + {0, 2} and 4h + {1, 3}, so the inputs go in the order 0 2 1 3 4 6 5 7.
inline int64_t q4_k_offset(int j) { return 128 * (j / 4) + 32 * ((j % 2) * 2 + (j % 4) / 2); }

// Rows of x [M, K] rounded for a K-quant per 256 inputs: Q4_K wants the sub-block order above
// and the sums per 32 in lanes 8-15 (beside its minimums); Q6_K the natural order and the sums
// per 16.
template <typename T>
QuantizedInput k_quant_input(const T* x, int64_t M, int64_t K, int64_t type) {
  QuantizedInput in(M, K, BLOCK, BLOCK);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; k += BLOCK) {
      int8_t* q = in.q.data() + m * K + k;
      int32_t* sums = in.lanes.data() + (m * K + k) / BLOCK * 16;
      in.scale[(m * K + k) / BLOCK] = round_block(x + m * K + k, BLOCK, [&](int i, __m512i r) {
        const int32_t sum = _mm512_reduce_add_epi32(r);
        if (type == Q4_K) {
          store_bytes(q + q4_k_offset(i / 2) + 16 * (i % 2), r);
          sums[8 + i / 2] += sum;
        } else {
          store_bytes(q + 16 * i, r);
          sums[i] = sum;
        }
      });
    }
  }
  return in;
}

// Rows of x [M, K] rounded for Q8_0 per 32 inputs (as llama.cpp rounds them for Q8_0
// weights). Each vector of products covers two blocks, 8 lanes each: the first lane of each
// gets -128 times its inputs' sum (the quants enter the products offset by 128, unsigned) and
// the 8 lanes the block's scale.
template <typename T>
QuantizedInput q8_0_input(const T* x, int64_t M, int64_t K) {
  QuantizedInput in(M, K, 32, PAIR);
  in.scale.clear();  // the kernel reads each block's scale from its lanes instead
  in.lane_scales.resize(in.lanes.size());
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; k += 32) {
      const int64_t lane = (m * K + k) / PAIR * 16 + 8 * (k % PAIR / 32);
      const float scale = round_block(x + m * K + k, 32, [&](int i, __m512i r) {
        store_bytes(in.q.data() + m * K + k + 16 * i, r);
        in.lanes[lane] -= 128 * _mm512_reduce_add_epi32(r);
      });
      std::fill_n(in.lane_scales.begin() + lane, 8, scale);
    }
  }
  return in;
}

// The int8 products of 64 weight quants (unsigned) and 64 inputs, 4 to a lane, times each
// lane's scale.
inline __m512i scaled_dot(__m512i weights, const int8_t* inputs, __m512i scales) {
  const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), weights,
                                          _mm512_loadu_si512(inputs));
  return _mm512_mullo_epi32(dot, scales);
}

// A K-quant block's four vectors of quants against its 256 inputs, each lane scaled
inline __m512i block_sum(const __m512i quants[4], const __m512i lane_scales[4],
                         const int8_t* inputs) {
  __m512i sum = scaled_dot(quants[0], inputs, lane_scales[0]);
  for (int k = 1; k < 4; ++k)
    sum = _mm512_add_epi32(sum, scaled_dot(quants[k], inputs + 64 * k, lane_scales[k]));
  return sum;
}

// Lane l of index vector k picks sub-block `first(k) + l / per` of a block's scales.
inline __m512i lanes_index(int first, int per) {
  alignas(64) int32_t index[16];
  for (int l = 0; l < 16; ++l) index[l] = first + l / per;
  return _mm512_load_si512(index);
}

// Q4_K block: (d scale_j) q - (dmin min_j) for sub-block j of 32; q in 0..15.
template <int MR>
void q4_k_row(const uint8_t* row, int64_t blocks, const QuantizedInput::Row* in, float out[MR]) {
  // Sub-blocks of vectors 0-3 (see q4_k_offset): {0, 2}, {1, 3}, {4, 6}, {5, 7}, 8 lanes each
  static const __m512i pick[4] = {
      _mm512_mask_set1_epi32(_mm512_set1_epi32(0), 0xFF00, 2),
      _mm512_mask_set1_epi32(_mm512_set1_epi32(1), 0xFF00, 3),
      _mm512_mask_set1_epi32(_mm512_set1_epi32(4), 0xFF00, 6),
      _mm512_mask_set1_epi32(_mm512_set1_epi32(5), 0xFF00, 7)};
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512 acc[MR], minimums[MR];
  for (int m = 0; m < MR; ++m) acc[m] = minimums[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 144;
    const float d = half_at(block), dmin = half_at(block + 2);
    alignas(16) uint8_t unpacked[16];
    unpack_scales_k4(block + 4, unpacked);
    // scale_0..7 in lanes 0-7, min_0..7 in lanes 8-15
    const __m512i scales = _mm512_cvtepu8_epi32(_mm_load_si128(
        reinterpret_cast<const __m128i*>(unpacked)));
    const __m512i first = _mm512_loadu_si512(block + 16), second = _mm512_loadu_si512(block + 80);
    const __m512i quants[4] = {
        _mm512_and_si512(first, nibble), _mm512_and_si512(_mm512_srli_epi16(first, 4), nibble),
        _mm512_and_si512(second, nibble), _mm512_and_si512(_mm512_srli_epi16(second, 4), nibble)};
    __m512i lane_scales[4];
    for (int k = 0; k < 4; ++k) lane_scales[k] = _mm512_permutexvar_epi32(pick[k], scales);
    for (int m = 0; m < MR; ++m) {
      __m512i sum = block_sum(quants, lane_scales, in[m].q + b * BLOCK);
      const float scale = in[m].scale[b];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * scale), acc[m]);
      // sum_j min_j * (sum of sub-block j's inputs), in lanes 8-15 (the sums' lanes 0-7 are 0)
      const __m512i offsets = _mm512_mullo_epi32(
          scales, _mm512_loadu_si512(in[m].lanes + 16 * b));
      minimums[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(offsets), _mm512_set1_ps(dmin * scale),
                                    minimums[m]);
    }
  }
  for (int m = 0; m < MR; ++m)
    out[m] = _mm512_reduce_add_ps(acc[m]) - _mm512_reduce_add_ps(minimums[m]);
}

// Q6_K block: (d scale_i) (q - 32) for sub-block i of 16; q in 0..63 from 4 low bits in ql and
// 2 high bits in qh. A vector of 64 ql bytes holds elements 0-63 of its half in the low
// nibbles and 64-127 in the high ones, and qh's 32 bytes give each of the four quarters 2 bits.
template <int MR>
void q6_k_row(const uint8_t* row, int64_t blocks, const QuantizedInput::Row* in, float out[MR]) {
  static const __m512i pick[4] = {lanes_index(0, 4), lanes_index(4, 4), lanes_index(8, 4),
                                  lanes_index(12, 4)};
  // qh's bits 0-1 and 2-3 to bits 4-5 for the low quarters, bits 4-5 and 6-7 for the high
  const __m512i to_low = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i to_high = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
  const __m512i nibble = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 210;
    const float d = half_at(block + 208);
    const __m512i scales = _mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(block + 192)));
    __m512i quants[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i low = _mm512_loadu_si512(block + 64 * h);
      const __m256i high_bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          block + 128 + 32 * h));
      const __m512i high = _mm512_inserti64x4(_mm512_castsi256_si512(high_bits), high_bits, 1);
      quants[2 * h] = _mm512_or_si512(_mm512_and_si512(low, nibble),
                                      _mm512_and_si512(_mm512_sllv_epi16(high, to_low), top));
      quants[2 * h + 1] = _mm512_or_si512(
          _mm512_and_si512(_mm512_srli_epi16(low, 4), nibble),
          _mm512_and_si512(_mm512_srlv_epi16(high, to_high), top));
    }
    __m512i lane_scales[4];
    for (int k = 0; k < 4; ++k) lane_scales[k] = _mm512_permutexvar_epi32(pick[k], scales);
    for (int m = 0; m < MR; ++m) {
      __m512i sum = block_sum(quants, lane_scales, in[m].q + b * BLOCK);
      // minus 32 * sum_i scale_i * (sum of sub-block i's inputs)
      const __m512i offsets = _mm512_mullo_epi32(
          scales, _mm512_loadu_si512(in[m].lanes + 16 * b));
      sum = _mm512_sub_epi32(sum, _mm512_slli_epi32(offsets, 5));
      const float scale = in[m].scale[b];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * scale), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// Q8_0 block: d q for 32 signed quants. `vpdpbusd` wants one operand unsigned: the quants
// enter as q + 128 (their top bit flipped) and each block's sums start from -128 times its
// inputs' sum (QuantizedInput's lanes), so the integer sums are exactly sum q x. NR weight rows
// share each load of the inputs; each row's products are summed as they are alone.
template <int MR, int NR>
void q8_0_rows(const uint8_t* row, int64_t row_bytes, int64_t K, const QuantizedInput::Row* in,
               float out[NR][4]) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += PAIR) {
    __m512 d[NR];
    __m512i quants[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* first = row + r * row_bytes + k / 32 * 34;
      const uint8_t* second = first + 34;
      d[r] = _mm512_insertf32x8(_mm512_set1_ps(half_at(first)),
                                _mm256_set1_ps(half_at(second)), 1);
      const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + 2));
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + 2));
      quants[r] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1),
                                   flip);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i offsets = _mm512_loadu_si512(in[m].lanes + k / 4);
      const __m512i inputs = _mm512_loadu_si512(in[m].q + k);
      const __m512 input_scales = _mm512_loadu_ps(in[m].lane_scales + k / 4);
      for (int r = 0; r < NR; ++r) {
        const __m512i sum = _mm512_dpbusd_epi32(offsets, quants[r], inputs);
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d[r], input_scales),
                                    acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) out[r][m] = _mm512_reduce_add_ps(acc[r][m]);
}

// Weight rows [n, n + NR) times input rows [m, m + MR) (MR at most over_tiles_of_rows' group of
// four): out[r][i] for row n + r, input m + i. Q8_0's rows share the inputs' loads; the
// K-quants go row by row (two rows' unpacked quants and lane scales take 16 registers, and
// sharing did not pay: docs/kernel-choices.md).
template <int MR, int NR>
void rows_times_inputs(int64_t type, const uint8_t* row, int64_t row_bytes, int64_t K,
                       const QuantizedInput::Row* in, float out[NR][4]) {
  if (type == Q8_0) return q8_0_rows<MR, NR>(row, row_bytes, K, in, out);
  for (int r = 0; r < NR; ++r) {
    if (type == Q4_K) q4_k_row<MR>(row + r * row_bytes, K / BLOCK, in, out[r]);
    else q6_k_row<MR>(row + r * row_bytes, K / BLOCK, in, out[r]);
  }
}

// Input rows rounded for the interleaved formats, per 32 inputs (llama.cpp's Q8_0 and Q8_1
// inputs, for the formats of 32-element blocks) or per 256 (its Q8_K, for the K-quants):
// quants in natural order, each rounding block's scale, and the quants' sum per `span` (32, or
// Q6_K's sub-blocks of 16: for Q8_0's offset of 128, Q4_0's of 8, Q5_0's of 16, Q6_K's of 32
// and the minimums of Q4_1, Q5_1, Q4_K and Q5_K).
struct BlockInput {
  int64_t K, blocks;  // blocks: spans of inputs, each with its sum
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;

  template <typename T>
  BlockInput(const T* x, int64_t M, int64_t K, int64_t rounding, int64_t span)
      : K(K), blocks(K / span), q(M * K), scale(M * K / rounding), sum(M * blocks, 0) {
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        for (int64_t k = 0; k < K; k += rounding) {
          int32_t* sums = sum.data() + (m * K + k) / span;
          scale[(m * K + k) / rounding] = round_block(x + m * K + k, rounding,
                                                     [&](int i, __m512i r) {
            store_bytes(q.data() + m * K + k + 16 * i, r);
            sums[16 * i / span] += _mm512_reduce_add_epi32(r);
          });
        }
      }
    });
  }
};

inline __m512 halves_at(const uint8_t* p) {  // 16 fp16 numbers
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i broadcast_four(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  return _mm512_set1_epi32(four);
}

// A group's blocks are read as several streams (quants, factors, scales) that restart every
// group, which the hardware prefetchers follow badly from memory: without help a matrix
// larger than the caches read at a third to half of the row-by-row kernel's rate, its
// factors and scales missing at every block. So while block b of a group computes, its share
// of the bytes a few groups ahead is fetched into L2, every line of them, in `parts` calls
// spread over the block's work (one call where the work is short). Prefetches never fault:
// past the last group they fetch nothing useful and cost little.
constexpr int64_t PREFETCH_GROUPS = 3;
struct PrefetchAhead {
  const char* ahead;
  int64_t lines;
  PrefetchAhead(const uint8_t* group, int64_t group_bytes, int64_t blocks, int64_t b)
      : ahead(reinterpret_cast<const char*>(group) + PREFETCH_GROUPS * group_bytes +
              group_bytes / blocks * b),
        lines((group_bytes / blocks + 63) / 64) {}
  void part(int64_t i, int64_t parts) const {
    for (int64_t l = lines * i / parts; l < lines * (i + 1) / parts; ++l)
      _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
  }
};

#if defined(__AVX512VBMI__)
// `vpmultishiftqb` offsets that bring bit `first + t` of each 32-bit half of a qword to bit 4
// of its byte t (t = 0..3): a qword holds two rows' qh words, whose bits it rotates.
inline __m512i fifth_bits(int first) {
  int64_t offsets = 0;
  for (int t = 0; t < 8; ++t)
    offsets |= int64_t((first + t % 4 + 32 * (t / 4) - 4) & 63) << (8 * t);
  return _mm512_set1_epi64(offsets);
}
#endif

// One group (16 weight rows) of an interleaved format BASE times input rows [m, m + MR):
// out[i] holds the 16 rows' products with input m + i, lane r for row r. A block's integer
// sums start from its offset (Q8_0's quants enter as q + 128, Q4_0's as q + 8, Q5_0's as
// q + 16: minus that times the inputs' sum), then `vpdpbusd` adds 4 quants of all 16 rows
// times 4 inputs (broadcast); one FMA applies the 16 rows' scales, and for Q4_1 and Q5_1 a
// second their minimums times the inputs' sum. A row's sum runs over the blocks in order,
// whatever MR is, so its bits do not depend on the rows beside it.
template <int64_t BASE, int MR>
void x16_group(const uint8_t* group, const BlockInput& in, int64_t m, __m512 out[MR]) {
  constexpr bool FIFTH_BIT = BASE == Q5_0 || BASE == Q5_1;  // a qh vector before the nibbles
  constexpr bool MINIMUM = BASE == Q4_1 || BASE == Q5_1;
  constexpr int64_t QUANT_BYTES = (BASE == Q8_0 ? 32 : FIFTH_BIT ? 20 : 16) * X16_ROWS;
  const int64_t blocks = in.blocks, K = in.K;
  const uint8_t* scales = group + blocks * QUANT_BYTES;
  const __m512i nibble = _mm512_set1_epi8(15), bit_four = _mm512_set1_epi8(0x10);
  const int64_t group_bytes = blocks * (QUANT_BYTES + 32 * (MINIMUM ? 2 : 1));
#if defined(__AVX512VBMI__)
  __m512i fifth_low[4], fifth_high[4];  // vector j's offsets (`fifth_bits`)
  for (int j = 0; j < 4; ++j) {
    fifth_low[j] = fifth_bits(4 * j);
    fifth_high[j] = fifth_bits(16 + 4 * j);
  }
#endif
  for (int i = 0; i < MR; ++i) out[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    PrefetchAhead(group, group_bytes, blocks, b).part(0, 1);
    const __m512 d = halves_at(scales + 32 * b);
    const uint8_t* quants = group + QUANT_BYTES * b + (FIFTH_BIT ? 64 : 0);
    const int8_t* x = in.q.data() + m * K + 32 * b;
    __m512i sum[MR];
    for (int i = 0; i < MR; ++i) {
      const int32_t total = in.sum[(m + i) * blocks + b];
      const int32_t offset = BASE == Q8_0 ? 128 : BASE == Q4_0 ? 8 : BASE == Q5_0 ? 16 : 0;
      sum[i] = _mm512_set1_epi32(-offset * total);
    }
    if constexpr (BASE == Q8_0) {
      for (int j = 0; j < 8; ++j) {
        const __m512i weights = _mm512_loadu_si512(quants + 64 * j);
        for (int i = 0; i < MR; ++i)
          sum[i] = _mm512_dpbusd_epi32(sum[i], weights, broadcast_four(x + i * K + 4 * j));
      }
    } else {  // byte t of vector j: quants 4 j + t (low nibble) and 16 + 4 j + t (high)
      for (int j = 0; j < 4; ++j) {
        const __m512i both = _mm512_loadu_si512(quants + 64 * j);
        __m512i low = _mm512_and_si512(both, nibble);
        __m512i high = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
#if defined(__AVX512VBMI__)  // (instantiated for the 5-bit formats only with VBMI)
        if constexpr (FIFTH_BIT) {
          // Byte t of lane r gets bit 4 j + t (low) or 16 + 4 j + t (high) of row r's qh at
          // bit 4: each byte of a qword takes the 8 bits from its own offset (rotating)
          const __m512i qh = _mm512_loadu_si512(quants - 64);
          low = _mm512_ternarylogic_epi32(
              low, _mm512_multishift_epi64_epi8(fifth_low[j], qh), bit_four, 0xF8);
          high = _mm512_ternarylogic_epi32(
              high, _mm512_multishift_epi64_epi8(fifth_high[j], qh), bit_four, 0xF8);
        }
#endif
        for (int i = 0; i < MR; ++i) {
          sum[i] = _mm512_dpbusd_epi32(sum[i], low, broadcast_four(x + i * K + 4 * j));
          sum[i] = _mm512_dpbusd_epi32(sum[i], high, broadcast_four(x + i * K + 16 + 4 * j));
        }
      }
    }
    for (int i = 0; i < MR; ++i) {
      const float dx = in.scale[(m + i) * blocks + b];
      out[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]), _mm512_mul_ps(d, _mm512_set1_ps(dx)),
                               out[i]);
    }
    if constexpr (MINIMUM) {
      const __m512 minimums = halves_at(scales + 32 * (blocks + b));
      for (int i = 0; i < MR; ++i) {
        const float dx = in.scale[(m + i) * blocks + b];
        out[i] = _mm512_fmadd_ps(minimums,
                                 _mm512_set1_ps(dx * float(in.sum[(m + i) * blocks + b])), out[i]);
      }
    }
  }
}

// fp32 lanes as bf16, rounded to nearest even as `Tensor.to` rounds finite values
inline void store_bf16(at::BFloat16* p, __m512 values) {
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
inline void store_outputs(at::BFloat16* p, __m512 values) { store_bf16(p, values); }
inline void store_outputs(float* p, __m512 values) { _mm512_storeu_ps(p, values); }

// Byte b of each 32-bit lane, widened to the lane
inline __m512i byte_of(__m512i words, int b) {
  return _mm512_and_si512(_mm512_srli_epi32(words, 8 * b), _mm512_set1_epi32(0xff));
}

// One group of interleaved Q4_K or Q5_K (16 weight rows) times input rows [m, m + MR), as
// x16_group: per super-block of 256 columns, each sub-block j of 32 gets its integer sums from
// 8 `vpdpbusd` (16 rows by 4 inputs each), times the 16 rows' 6-bit scale_j in integers; the
// minimums' term is min_j times the inputs' sum over sub-block j, also in integers; then
// d (and dmin) times the inputs' scale apply once a super-block, llama.cpp's Q4_K x Q8_K
// arithmetic. The 16 rows' packed scales unpack as get_scale_min_k4 does, for all rows at once.
// Q5_K (FIFTH_BIT) is Q4_K with a fifth bit a quant: its 8 vectors of qh bytes come before the
// nibbles, byte t of vector v holding bit j of the quants of sub-block j's column 4 v + t.
template <int MR, bool FIFTH_BIT>
void x16_q4_k_group(const uint8_t* group, const BlockInput& in, int64_t m, __m512 out[MR]) {
  constexpr int64_t HIGH_BYTES = FIFTH_BIT ? 32 * X16_ROWS : 0;  // Q5_K's qh vectors
  constexpr int64_t QUANT_BYTES = HIGH_BYTES + 128 * X16_ROWS;
  const int64_t blocks = in.K / 256, K = in.K;
  const uint8_t* factors = group + blocks * QUANT_BYTES;
  const uint8_t* scale_words = factors + 2 * 32 * blocks;
  const __m512i nibble = _mm512_set1_epi8(15), six_bits = _mm512_set1_epi8(0x3f);
  const __m512i low_four = _mm512_set1_epi8(0x0f), top_two = _mm512_set1_epi8(0x30);
  const __m512i bit_four = _mm512_set1_epi8(0x10);
  const int64_t group_bytes = blocks * (QUANT_BYTES + 2 * 32 + 192);
  for (int i = 0; i < MR; ++i) out[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    PrefetchAhead(group, group_bytes, blocks, b).part(0, 1);
    const __m512 d = halves_at(factors + 32 * b), dmin = halves_at(factors + 32 * (blocks + b));
    const uint8_t* words = scale_words + 192 * b;
    const __m512i w0 = _mm512_loadu_si512(words), w1 = _mm512_loadu_si512(words + 64),
                  w2 = _mm512_loadu_si512(words + 128);
    // Per lane: scales 0-3, scales 4-7, minimums 0-3, minimums 4-7, a byte each
    const __m512i unpacked[4] = {
        _mm512_and_si512(w0, six_bits),
        _mm512_or_si512(_mm512_and_si512(w2, low_four),
                        _mm512_and_si512(_mm512_srli_epi32(w0, 2), top_two)),
        _mm512_and_si512(w1, six_bits),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), low_four),
                        _mm512_and_si512(_mm512_srli_epi32(w1, 2), top_two))};
    const uint8_t* high_bits = group + QUANT_BYTES * b;
    const uint8_t* quants = high_bits + HIGH_BYTES;
    const int8_t* x = in.q.data() + m * K + 256 * b;
    __m512i sum[MR], minimums[MR];
    for (int i = 0; i < MR; ++i) sum[i] = minimums[i] = _mm512_setzero_si512();
    const auto sub_block = [&](int j) {  // the low nibbles of pair j / 2, or the high
      const int pair = j / 2, shift = 4 * (j % 2);
      __m512i dot[MR];
      for (int i = 0; i < MR; ++i) dot[i] = _mm512_setzero_si512();
      for (int v = 0; v < 8; ++v) {
        const __m512i both = _mm512_loadu_si512(quants + 64 * (8 * pair + v));
        __m512i q = _mm512_and_si512(_mm512_srli_epi16(both, shift), nibble);
        if constexpr (FIFTH_BIT) {  // bit j of the qh bytes to bit 4, or'ed in: q | (h & 16)
          const __m512i h = _mm512_loadu_si512(high_bits + 64 * v);
          const __m512i moved =
              j < 4 ? _mm512_slli_epi16(h, 4 - j) : _mm512_srli_epi16(h, j - 4);
          q = _mm512_ternarylogic_epi32(q, moved, bit_four, 0xF8);
        }
        for (int i = 0; i < MR; ++i)
          dot[i] = _mm512_dpbusd_epi32(dot[i], q, broadcast_four(x + i * K + 32 * j + 4 * v));
      }
      const __m512i scale = byte_of(unpacked[j / 4], j % 4);
      const __m512i minimum = byte_of(unpacked[2 + j / 4], j % 4);
      for (int i = 0; i < MR; ++i) {
        sum[i] = _mm512_add_epi32(sum[i], _mm512_mullo_epi32(dot[i], scale));
        const __m512i inputs = _mm512_set1_epi32(in.sum[(m + i) * in.blocks + 8 * b + j]);
        minimums[i] = _mm512_add_epi32(minimums[i], _mm512_mullo_epi32(minimum, inputs));
      }
    };
    // One input row's sub-blocks unrolled, so that j picks registers and shifts (see
    // x16_q6_k_group: 1.3x at one row); more rows measured a few percent slower so
    if constexpr (MR == 1) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) sub_block(j);
    } else {
      for (int j = 0; j < 8; ++j) sub_block(j);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 dx = _mm512_set1_ps(in.scale[(m + i) * blocks + b]);
      out[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]), _mm512_mul_ps(d, dx), out[i]);
      out[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(minimums[i]), _mm512_mul_ps(dmin, dx), out[i]);
    }
  }
}

// Byte b of each 32-bit lane, sign-extended to the lane
inline __m512i signed_byte_of(__m512i words, int b) {
  return _mm512_srai_epi32(_mm512_slli_epi32(words, 24 - 8 * b), 24);
}

// Q6_K's 6-bit quants (0..63) of quarter k of a half, put together from its ql vector (bytes
// l, quarters 0 and 2, or l + 32, quarters 1 and 3: low nibbles, then high) and qh vector
// (bit pair k) as ggml's dequantize_row_q6_K does
inline __m512i q6_k_quants(__m512i low, __m512i high, int k) {
  const __m512i nibble = _mm512_set1_epi8(15), high_pair = _mm512_set1_epi8(0x30);
  const __m512i low_bits = k < 2 ? _mm512_and_si512(low, nibble)
                                 : _mm512_and_si512(_mm512_srli_epi16(low, 4), nibble);
  const __m512i pair = k == 0   ? _mm512_slli_epi16(high, 4)  // qh's pair k to bits 4-5
                       : k == 1 ? _mm512_slli_epi16(high, 2)
                       : k == 2 ? high
                                : _mm512_srli_epi16(high, 2);
  return _mm512_or_si512(low_bits, _mm512_and_si512(pair, high_pair));
}

// One group of interleaved Q6_K (16 weight rows) times input rows [m, m + MR), as x16_group:
// per super-block of 256 columns, each sub-block s of 16 gets its integer sums from 4
// `vpdpbusd` over the 6-bit quants, times the 16 rows' int8 scale_s; the quants' offset of 32
// comes off as 32 scale_s times the inputs' sum over s; d times the inputs' scale applies
// once a super-block (llama.cpp's Q6_K x Q8_K arithmetic). One input row takes a half's four
// quarters together (3 vectors read make 4 of quants, 16 sub-blocks' sums in registers);
// more rows take one sub-block at a time, folding its sums in before the next (sharing the
// quarters measured slower from 2 rows on). Either way a row's sums add up in one order.
template <int MR>
void x16_q6_k_group(const uint8_t* group, const BlockInput& in, int64_t m, __m512 out[MR]) {
  constexpr int64_t QUANT_BYTES = 192 * X16_ROWS;
  const int64_t blocks = in.K / 256, K = in.K;
  const uint8_t* factors = group + blocks * QUANT_BYTES;
  const uint8_t* scale_words = factors + 32 * blocks;
  const int64_t group_bytes = blocks * (QUANT_BYTES + 32 + 256);
  for (int i = 0; i < MR; ++i) out[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* words = scale_words + 256 * b;
    const uint8_t* quants = group + QUANT_BYTES * b;
    const PrefetchAhead prefetch(group, group_bytes, blocks, b);
    if constexpr (MR > 1) prefetch.part(0, 1);
    const int8_t* x = in.q.data() + m * K + 256 * b;
    // Sub-block s = 8 h + 2 k + part: quarter k of half h, its columns 16 part to 16 part + 15;
    // dot(s, v, q, i) adds quants q (4 columns v of s's quarter) times input row m + i
    const auto dot = [&](int s, int v, __m512i q, int i, __m512i acc) {
      const int h = s / 8, k = s % 8 / 2;
      return _mm512_dpbusd_epi32(acc, q, broadcast_four(x + i * K + 128 * h + 32 * k + 4 * v));
    };
    const auto scale_of = [&](int s) {
      return signed_byte_of(_mm512_loadu_si512(words + 64 * (s / 4)), s % 4);
    };
    __m512i sum[MR], offsets[MR];
    for (int i = 0; i < MR; ++i) sum[i] = offsets[i] = _mm512_setzero_si512();
    const auto fold = [&](int s, const __m512i dots[MR]) {
      const __m512i scale = scale_of(s);
      for (int i = 0; i < MR; ++i) {
        sum[i] = _mm512_add_epi32(sum[i], _mm512_mullo_epi32(dots[i], scale));
        const __m512i inputs = _mm512_set1_epi32(in.sum[(m + i) * in.blocks + 16 * b + s]);
        offsets[i] = _mm512_add_epi32(offsets[i], _mm512_mullo_epi32(scale, inputs));
      }
    };
    if constexpr (MR == 1) {
      __m512i dots[16];
      for (int s = 0; s < 16; ++s) dots[s] = _mm512_setzero_si512();
      // Unrolled, so that the sums stay in registers: indexed by loop counters, GCC kept them
      // on the stack, a store and a load a product and more address arithmetic than vectors
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h)
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) {
          prefetch.part(8 * h + v, 16);
          const __m512i first = _mm512_loadu_si512(quants + 64 * (16 * h + v));
          const __m512i second = _mm512_loadu_si512(quants + 64 * (16 * h + 8 + v));
          const __m512i high = _mm512_loadu_si512(quants + 64 * (32 + 8 * h + v));
          for (int k = 0; k < 4; ++k) {
            const int s = 8 * h + 2 * k + v / 4;
            dots[s] = dot(s, v, q6_k_quants(k % 2 ? second : first, high, k), 0, dots[s]);
          }
        }
      for (int s = 0; s < 16; ++s) fold(s, &dots[s]);
    } else {
      for (int s = 0; s < 16; ++s) {
        const int h = s / 8, k = s % 8 / 2, part = s % 2;
        __m512i dots[MR];
        for (int i = 0; i < MR; ++i) dots[i] = _mm512_setzero_si512();
        for (int v = 4 * part; v < 4 * part + 4; ++v) {
          const __m512i low = _mm512_loadu_si512(quants + 64 * (16 * h + 8 * (k % 2) + v));
          const __m512i high = _mm512_loadu_si512(quants + 64 * (32 + 8 * h + v));
          const __m512i q = q6_k_quants(low, high, k);
          for (int i = 0; i < MR; ++i) dots[i] = dot(s, v, q, i, dots[i]);
        }
        fold(s, dots);
      }
    }
    const __m512 d = halves_at(factors + 32 * b);
    for (int i = 0; i < MR; ++i) {
      const __m512i exact = _mm512_sub_epi32(sum[i], _mm512_slli_epi32(offsets[i], 5));
      const __m512 dx = _mm512_set1_ps(in.scale[(m + i) * blocks + b]);
      out[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(d, dx), out[i]);
    }
  }
}

template <int64_t BASE, typename T>
at::Tensor x16_linear(const at::Tensor& x, const at::Tensor& groups) {
  constexpr int64_t MR = 8;  // input rows a pass over a group's blocks takes
  constexpr int64_t M_TILE = 64;
  const int64_t M = x.size(0), G = groups.size(0), N = G * X16_ROWS, K = x.size(1);
  const at::Tensor xc = x.contiguous();
  const bool k_quant = BASE == Q4_K || BASE == Q5_K || BASE == Q6_K;
  const BlockInput in(xc.data_ptr<T>(), M, K, k_quant ? BLOCK : 32, BASE == Q6_K ? 16 : 32);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* gp = groups.data_ptr<uint8_t>();
  T* yp = y.data_ptr<T>();
  const int64_t group_bytes = groups.size(1);
  // Tiles of input rows, each passed over every group while its int8 rows stay in L1/L2
  for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
    at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* group = gp + g * group_bytes;
        for (int64_t m = m0; m < std::min(M, m0 + M_TILE); m += MR) {
          __m512 out[MR];
          const auto pass = [&](auto rows) {
            constexpr int R = decltype(rows)::value;
            if constexpr (BASE == Q4_K || BASE == Q5_K)
              x16_q4_k_group<R, BASE == Q5_K>(group, in, m, out);
            else if constexpr (BASE == Q6_K) x16_q6_k_group<R>(group, in, m, out);
            else x16_group<BASE, R>(group, in, m, out);
            for (int i = 0; i < R; ++i) store_outputs(yp + (m + i) * N + g * X16_ROWS, out[i]);
          };
          switch (std::min(M - m, MR)) {
            case 1: pass(std::integral_constant<int, 1>()); break;
            case 2: pass(std::integral_constant<int, 2>()); break;
            case 3: pass(std::integral_constant<int, 3>()); break;
            case 4: pass(std::integral_constant<int, 4>()); break;
            case 5: pass(std::integral_constant<int, 5>()); break;
            case 6: pass(std::integral_constant<int, 6>()); break;
            case 7: pass(std::integral_constant<int, 7>()); break;
            default: pass(std::integral_constant<int, 8>()); break;
          }
        }
      }
    });
  }
  return y;
}

// Weight rows whose blocks stay in L1/L2 while every group of input rows passes over them
constexpr int64_t TILE_ROWS = 16;

template <typename T>
at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  const int64_t M = x.size(0), N = blocks.size(0), K = x.size(1), row_bytes = blocks.size(1);
  const at::Tensor xc = x.contiguous();
  const T* xp = xc.data_ptr<T>();
  const QuantizedInput in = type == Q8_0 ? q8_0_input(xp, M, K) : k_quant_input(xp, M, K, type);
  std::vector<QuantizedInput::Row> rows(M);
  for (int64_t m = 0; m < M; ++m) rows[m] = in.row(m);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  T* yp = y.data_ptr<T>();
  const auto multiply = [&](auto group, auto weight_rows, int64_t n, int64_t m,
                            float (*out)[4]) {
    rows_times_inputs<decltype(group)::value, decltype(weight_rows)::value>(
        type, bp + n * row_bytes, row_bytes, K, rows.data() + m, out);
  };
  over_tiles_of_rows<2>(M, N, TILE_ROWS, multiply,
                     [&](int64_t m, int64_t n, float value) { yp[m * N + n] = T(value); });
  return y;
}

// The int8 kernel of `type` over inputs (and outputs) of type T
template <typename T>
at::Tensor int8_dot_linear_of(const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  switch (type) {
    case X16 + Q4_0: return x16_linear<Q4_0, T>(x, blocks);
    case X16 + Q4_1: return x16_linear<Q4_1, T>(x, blocks);
#if defined(__AVX512VBMI__)
    case X16 + Q5_0: return x16_linear<Q5_0, T>(x, blocks);
    case X16 + Q5_1: return x16_linear<Q5_1, T>(x, blocks);
#endif
    case X16 + Q8_0: return x16_linear<Q8_0, T>(x, blocks);
    case X16 + Q4_K: return x16_linear<Q4_K, T>(x, blocks);
    case X16 + Q5_K: return x16_linear<Q5_K, T>(x, blocks);
    case X16 + Q6_K: return x16_linear<Q6_K, T>(x, blocks);
  }
  return linear<T>(x, blocks, type);
}

}  // namespace
#endif

bool int8_dot_serves(int64_t type, at::ScalarType dtype, int64_t K) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // bf16 or fp32 inputs: rounded alike, the products summed in fp32 either way
  if (dtype != at::kBFloat16 && dtype != at::kFloat) return false;
#if !defined(__AVX512VBMI__)
  // Q5_0's and Q5_1's fifth bits come out of their qh words through `vpmultishiftqb`
  if (type == X16 + Q5_0 || type == X16 + Q5_1) return false;
#endif
  return ((type == Q4_K || type == Q6_K) && K % BLOCK == 0) || (type == Q8_0 && K % PAIR == 0)
         || (is_x16(type) && K % (type - X16 >= Q4_K ? BLOCK : 32) == 0);
#elif defined(BRAID_GGML_AVX2)
  // fp32, the dtype these CPUs compute natively (bf16 runs there dequantize at load)
  return dtype == at::kFloat && avx2_int8_serves(type, K);
#else
  return false;
#endif
}

at::Tensor int8_dot_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(int8_dot_serves(type, x.scalar_type(), x.size(1)),
              "int8_dot_linear: no int8 kernel for GGML type ", type, " and ", x.scalar_type(),
              " inputs of ", x.size(1), " columns on this CPU");
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kFloat) return int8_dot_linear_of<float>(x, blocks, type);
  return int8_dot_linear_of<at::BFloat16>(x, blocks, type);
#elif defined(BRAID_GGML_AVX2)
  return avx2_int8_linear(x, blocks, type);
#else
  return at::Tensor();  // (not reached: nothing is served without VNNI or AVX2)
#endif
}

}  // namespace braid_ggml

TORCH_LIBRARY_FRAGMENT(braid, m) {
  m.def("ggml_int8_serves(int type, ScalarType dtype, int columns) -> bool",
        &braid_ggml::int8_dot_serves);
}
