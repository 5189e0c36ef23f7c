// Linear layers over llama.cpp's quantized weight blocks (GGML's formats), read as the GGUF file
// stores them: no dequantized copy of the weight is kept (braid.layers.ggml_weight).
//
// A weight [N, K] is N rows of K / elements blocks each. A row is decoded into fp32 exactly as
// the `gguf` package's `dequantize` computes it (scale times quant, minus the block's minimum),
// then rounded to the activation's dtype where that is bf16, so a product equals the one over
// the dequantized weight that braid loaded before. GEMMs of up to four rows (decode) decode
// each weight row in registers and multiply it there; up to FEW_ROWS (32) rows, a tile of four
// weight rows at a time goes to a buffer that stays in L1/L2 for the few-row micro-kernel
// (few_rows.h); either way memory carries the blocks' bytes only (Q4: a quarter of bf16's).
// Larger GEMMs (prefill) decode a chunk of rows at a time and hand it to ATen's GEMM, whose
// cost grows with the rows while the decoding's does not. In bf16, Q4_K, Q6_K and Q8_0 at up
// to `few_rows` rows go to ggml_int8.cpp's integer arithmetic instead (llama.cpp's). CPUs with
// AVX2 but no AVX-512 decode with ggml_avx2.cpp's 256-bit decoders (fp32: up to four rows in
// registers, up to `few_rows` over a decoded row).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "few_rows.h"
#include "ggml_format.h"

namespace {

using namespace braid_ggml;

// One block's weights into out[0, elements), per format. Each follows the block layout of
// ggml-quants.c; the arithmetic is the `gguf` package's, in fp32.
void decode_q4_0(const uint8_t* b, float* out) {  // scale d, 32 nibbles: (q - 8) d
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    out[j] = d * float((qs[j] & 15) - 8);
    out[j + 16] = d * float((qs[j] >> 4) - 8);
  }
}

void decode_q4_1(const uint8_t* b, float* out) {  // scale d, minimum m: q d + m
  const float d = half_at(b), m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    out[j] = d * float(qs[j] & 15) + m;
    out[j + 16] = d * float(qs[j] >> 4) + m;
  }
}

// The fifth bits in a 32-bit word: Q5_0 (q - 16) d, Q5_1 (MINIMUM) q d + m
template <bool MINIMUM>
void decode_q5(const uint8_t* b, float* out) {
  const float d = half_at(b), m = MINIMUM ? half_at(b + 2) : 0.f;
  const uint8_t* rest = b + (MINIMUM ? 4 : 2);
  uint32_t qh;
  std::memcpy(&qh, rest, sizeof qh);
  const uint8_t* qs = rest + 4;
  const auto value = [&](int q) { return MINIMUM ? d * float(q) + m : d * float(q - 16); };
  for (int j = 0; j < 16; ++j) {
    out[j] = value((qs[j] & 15) | (((qh >> j) & 1) << 4));
    out[j + 16] = value((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
  }
}

void decode_q8_0(const uint8_t* b, float* out) {  // scale d, 32 int8: q d
  const float d = half_at(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) out[j] = d * float(qs[j]);
}

// The 6-bit scale and minimum of sub-block j (of 8) in a K-quant's 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* q, int& scale, int& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
    min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K and Q5_K: 8 sub-blocks of 32, each (d * scale) q - (dmin * min); the nibbles of 32 bytes
// serve two sub-blocks (low, then high); Q5_K's fifth bit of sub-block i is bit i of qh[l].
template <bool FIFTH_BIT>
void decode_k(const uint8_t* b, float* out) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (FIFTH_BIT ? 48 : 16);
  for (int i = 0; i < 8; ++i) {
    int scale, min;
    scale_min_k4(i, scales, scale, min);
    const float step = d * float(scale), offset = dmin * float(min);
    const uint8_t* q = qs + 32 * (i / 2);
    const int shift = 4 * (i % 2);
    for (int l = 0; l < 32; ++l) {
      int value = (q[l] >> shift) & 15;
      if (FIFTH_BIT) value |= ((qh[l] >> i) & 1) << 4;
      out[32 * i + l] = step * float(value) - offset;
    }
  }
}

// Q6_K: low 4 bits in ql[128], high 2 in qh[64], an int8 scale per 16, d last: (d scale) (q - 32).
void decode_q6_k(const uint8_t* b, float* out) {
  const float d = half_at(b + 208);
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    const int8_t* sc = scales + 8 * h;
    float* y = out + 128 * h;
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = (d * float(sc[is])) * float(q1);
      y[l + 32] = (d * float(sc[is + 2])) * float(q2);
      y[l + 64] = (d * float(sc[is + 4])) * float(q3);
      y[l + 96] = (d * float(sc[is + 6])) * float(q4);
    }
  }
}

template <void (*DECODE)(const uint8_t*, float*)>
void decode_blocks(const uint8_t* row, float* out, int64_t blocks, Format f) {
  for (int64_t i = 0; i < blocks; ++i) DECODE(row + i * f.bytes, out + i * f.elements);
}

// Row `row` (K weights) of a weight of GGML type `type` into out[0, K) as fp32.
void decode_row(int64_t type, const uint8_t* row, float* out, int64_t K) {
  const Format f = format_of(type);
  const int64_t blocks = K / f.elements;
  switch (type) {
    case Q4_0: return decode_blocks<decode_q4_0>(row, out, blocks, f);
    case Q4_1: return decode_blocks<decode_q4_1>(row, out, blocks, f);
    case Q5_0: return decode_blocks<decode_q5<false>>(row, out, blocks, f);
    case Q5_1: return decode_blocks<decode_q5<true>>(row, out, blocks, f);
    case Q8_0: return decode_blocks<decode_q8_0>(row, out, blocks, f);
    case Q4_K: return decode_blocks<decode_k<false>>(row, out, blocks, f);
    case Q5_K: return decode_blocks<decode_k<true>>(row, out, blocks, f);
    case Q6_K: return decode_blocks<decode_q6_k>(row, out, blocks, f);
  }
}

// fp32 values as T (bf16: rounded to nearest even, as `Tensor.to` rounds).
void narrow_to(const float* src, float* dst, int64_t n) {
  if (src != dst) std::memcpy(dst, src, n * sizeof(float));
}

void narrow_to(const float* src, at::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = at::BFloat16(src[i]);
}

void narrow_to(const float* src, at::Half* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = at::Half(src[i]);
}

// Rows [n0, n1) of the weight, in T, into out (row stride K); `scratch` holds K floats.
template <typename T>
void decode_rows(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t K, int64_t n0,
                 int64_t n1, T* out, float* scratch) {
  for (int64_t n = n0; n < n1; ++n) {
    T* dst = out + (n - n0) * K;
    float* values = std::is_same_v<T, float> ? reinterpret_cast<float*>(dst) : scratch;
#if defined(BRAID_GGML_AVX2)
    avx2_decode_row(type, blocks + n * row_bytes, values, K);
#else
    decode_row(type, blocks + n * row_bytes, values, K);
#endif
    narrow_to(values, dst, K);
  }
}

#if defined(__AVX512F__)
// The same decoding, 32 weights at a time in two fp32 vectors, for the formats of llama.cpp's
// usual files (Q4_0, Q4_1, Q8_0, and Q4_K_M's Q4_K and Q6_K): the scalar loops above ran at a
// fifth of the memory's speed. Same operations in the same order, so the same values. Each
// decoder hands its block's weights to `emit(k, low, high)`: elements [k, k + 16) and
// [k + 16, k + 32) of the block, in order.
namespace simd {

inline __m512i bytes(const uint8_t* p) {  // 16 bytes as 16 int32 lanes
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 as_float(__m512i v) { return _mm512_cvtepi32_ps(v); }
inline __m512i low_nibbles(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi32(15)); }
inline __m512i high_nibbles(__m512i v) { return _mm512_srli_epi32(v, 4); }

template <typename Emit>
void q4_0(const uint8_t* b, Emit& emit) {
  const __m512 d = _mm512_set1_ps(half_at(b));
  const __m512i q = bytes(b + 2), eight = _mm512_set1_epi32(8);
  emit(0, _mm512_mul_ps(d, as_float(_mm512_sub_epi32(low_nibbles(q), eight))),
       _mm512_mul_ps(d, as_float(_mm512_sub_epi32(high_nibbles(q), eight))));
}

template <typename Emit>
void q4_1(const uint8_t* b, Emit& emit) {
  const __m512 d = _mm512_set1_ps(half_at(b)), m = _mm512_set1_ps(half_at(b + 2));
  const __m512i q = bytes(b + 4);
  emit(0, _mm512_add_ps(_mm512_mul_ps(d, as_float(low_nibbles(q))), m),
       _mm512_add_ps(_mm512_mul_ps(d, as_float(high_nibbles(q))), m));
}

template <typename Emit>
void q8_0(const uint8_t* b, Emit& emit) {
  const __m512 d = _mm512_set1_ps(half_at(b));
  const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
  emit(0, _mm512_mul_ps(d, as_float(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)))),
       _mm512_mul_ps(d, as_float(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)))));
}

template <typename Emit>
void q4_k(const uint8_t* b, Emit& emit) {
  alignas(16) uint8_t unpacked[16];  // the scales and minimums, then multiplied by d and dmin
  unpack_scales_k4(b + 4, unpacked);
  const __m512 factors = _mm512_insertf32x8(_mm512_set1_ps(half_at(b)),
                                            _mm256_set1_ps(half_at(b + 2)), 1);
  alignas(64) float scaled[16];  // d * scale[0..7], dmin * min[0..7]
  _mm512_store_ps(scaled, _mm512_mul_ps(factors, as_float(bytes(unpacked))));
  for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 high
    const __m512i first = bytes(b + 16 + 32 * c), second = bytes(b + 32 + 32 * c);
    for (int i = 2 * c; i < 2 * c + 2; ++i) {
      const __m512 step = _mm512_set1_ps(scaled[i]), offset = _mm512_set1_ps(scaled[8 + i]);
      const auto value = [&](__m512i q) {
        const __m512i v = i % 2 ? high_nibbles(q) : low_nibbles(q);
        return _mm512_sub_ps(_mm512_mul_ps(step, as_float(v)), offset);
      };
      emit(32 * i, value(first), value(second));
    }
  }
}

// 32 16-bit lanes as two vectors of 16 fp32
inline __m512 low_half(__m512i v) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
}
inline __m512 high_half(__m512i v) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
}

template <typename Emit>
void q6_k(const uint8_t* b, Emit& emit) {
  // The quants of 32 elements at a time in 16-bit lanes (half the integer work of 32-bit ones)
  const auto widen = [](const uint8_t* p) {
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  const __m512i fifteen = _mm512_set1_epi16(15), top = _mm512_set1_epi16(0x30);
  const __m512i bias = _mm512_set1_epi16(32);
  alignas(64) float steps[16];  // d * scale, one per 16 elements
  _mm512_store_ps(steps, _mm512_mul_ps(_mm512_set1_ps(half_at(b + 208)), as_float(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))))));
  for (int h = 0; h < 2; ++h) {
    const __m512i a = widen(b + 64 * h), c = widen(b + 64 * h + 32), hi = widen(b + 128 + 32 * h);
    const __m512i quants[4] = {  // element l of quarter j; q - 32 in -32..31
        _mm512_or_si512(_mm512_and_si512(a, fifteen), _mm512_and_si512(_mm512_slli_epi16(hi, 4), top)),
        _mm512_or_si512(_mm512_and_si512(c, fifteen), _mm512_and_si512(_mm512_slli_epi16(hi, 2), top)),
        _mm512_or_si512(_mm512_srli_epi16(a, 4), _mm512_and_si512(hi, top)),
        _mm512_or_si512(_mm512_srli_epi16(c, 4), _mm512_and_si512(_mm512_srli_epi16(hi, 2), top))};
    for (int j = 0; j < 4; ++j) {
      const __m512i q = _mm512_sub_epi16(quants[j], bias);
      const float* step = steps + 8 * h + 2 * j;
      emit(128 * h + 32 * j, _mm512_mul_ps(_mm512_set1_ps(step[0]), low_half(q)),
           _mm512_mul_ps(_mm512_set1_ps(step[1]), high_half(q)));
    }
  }
}

// Whether `type` has a vector decoder here.
inline bool decodes(int64_t type) {
  return type == Q4_0 || type == Q4_1 || type == Q8_0 || type == Q4_K || type == Q6_K;
}

// Every block of a weight row, in order, through `emit(k, low, high)` (k: the row's element);
// `type` one that `decodes`.
template <typename Emit>
void decode_row(int64_t type, const uint8_t* row, int64_t K, Emit& emit) {
  const Format f = format_of(type);
  const auto blocks = [&](auto decode_block) {
    for (int64_t i = 0; i < K / f.elements; ++i) {
      const auto shifted = [&](int64_t k, __m512 low, __m512 high) {
        emit(i * f.elements + k, low, high);
      };
      decode_block(row + i * f.bytes, shifted);
    }
  };
  switch (type) {
    case Q4_0: return blocks([](const uint8_t* b, auto& e) { q4_0(b, e); });
    case Q4_1: return blocks([](const uint8_t* b, auto& e) { q4_1(b, e); });
    case Q8_0: return blocks([](const uint8_t* b, auto& e) { q8_0(b, e); });
    case Q4_K: return blocks([](const uint8_t* b, auto& e) { q4_k(b, e); });
    case Q6_K: return blocks([](const uint8_t* b, auto& e) { q6_k(b, e); });
  }
}

inline void store(float* p, __m512 low, __m512 high) {
  _mm512_storeu_ps(p, low);
  _mm512_storeu_ps(p + 16, high);
}
#if defined(__AVX512BF16__)
inline __m512bh pair(__m512 low, __m512 high) { return _mm512_cvtne2ps_pbh(high, low); }
inline void store(at::BFloat16* p, __m512 low, __m512 high) {
  _mm512_storeu_si512(p, (__m512i)pair(low, high));
}
#endif

}  // namespace simd
#endif

// Rows [n0, n1) into `out` as T through the vector decoders where they serve `type` and T.
template <typename T>
void decode_rows_fast(int64_t type, const uint8_t* blocks, int64_t row_bytes, int64_t K,
                      int64_t n0, int64_t n1, T* out, float* scratch) {
#if defined(__AVX512F__)
  constexpr bool vector_store = std::is_same_v<T, float>
#if defined(__AVX512BF16__)
                                || std::is_same_v<T, at::BFloat16>
#endif
      ;
  if constexpr (vector_store) {
    if (simd::decodes(type)) {
      for (int64_t n = n0; n < n1; ++n) {
        T* row = out + (n - n0) * K;
        const auto store = [row](int64_t k, __m512 low, __m512 high) {
          simd::store(row + k, low, high);
        };
        simd::decode_row(type, blocks + n * row_bytes, K, store);
      }
      return;
    }
  }
#endif
  decode_rows(type, blocks, row_bytes, K, n0, n1, out, scratch);
}

void check_blocks(const char* op, const at::Tensor& blocks, int64_t type, int64_t K) {
  const Format f = format_of(is_x16(type) ? type - X16 : type);
  const int64_t rows = is_x16(type) ? X16_ROWS : 1;  // weight rows in a row of the tensor
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              op, ": the blocks as a contiguous uint8 tensor [rows, bytes], got ",
              blocks.scalar_type(), " ", blocks.sizes());
  TORCH_CHECK(K % f.elements == 0 && blocks.size(1) == rows * K / f.elements * f.bytes, op,
              ": ", K, " columns in blocks of ", f.elements, " take ",
              rows * K / f.elements * f.bytes, " bytes a row, the blocks have ", blocks.size(1));
}

// The weight rows a tensor of blocks of `type` holds
int64_t weight_rows(const at::Tensor& blocks, int64_t type) {
  return blocks.size(0) * (is_x16(type) ? X16_ROWS : 1);
}

#if defined(__AVX512F__)
// One group of an interleaved format (ggml_format.h) back into the 16 rows of blocks it was
// made from (`ggml_weight.interleave_rows` undone; `out` holds 16 rows of `row_bytes`): per
// block, lane r of its quant vectors j are row r's bytes 4 j to 4 j + 3, a transpose of
// 4 x 16 words at a time (each 128-bit lane of the result: one row); the K-quants' scale
// words, and the last word of the 5-bit formats' 20 quant bytes, a word at a time.
void ungroup(const uint8_t* group, int64_t base, int64_t blocks, uint8_t* out,
             int64_t row_bytes) {
  const Format f = format_of(base);
  const X16Layout layout = x16_layout(base);
  const int64_t halves = layout.factors, quant_bytes = layout.quant_bytes;
  const uint8_t* factors = group + blocks * X16_ROWS * quant_bytes;
  const uint8_t* scale_words = factors + halves * blocks * X16_ROWS * 2;
  const __m512i flip = _mm512_set1_epi8(base == Q8_0 ? static_cast<char>(0x80) : 0);
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* first = out + b * f.bytes;
    for (int64_t h = 0; h < halves; ++h)
      for (int64_t r = 0; r < X16_ROWS; ++r)
        std::memcpy(first + r * row_bytes + layout.factors_at + 2 * h,
                    factors + ((h * blocks + b) * X16_ROWS + r) * 2, 2);
    for (int64_t w = 0; w < layout.scale_bytes / 4; ++w)
      for (int64_t r = 0; r < X16_ROWS; ++r)
        std::memcpy(first + r * row_bytes + layout.scales_at + 4 * w,
                    scale_words + ((b * layout.scale_bytes / 4 + w) * X16_ROWS + r) * 4, 4);
    const uint8_t* vectors = group + b * X16_ROWS * quant_bytes;
    for (int64_t part = 0; part < quant_bytes / 16; ++part) {  // 16 bytes of each row
      __m512i v[4];
      for (int j = 0; j < 4; ++j)
        v[j] = _mm512_xor_si512(_mm512_loadu_si512(vectors + 64 * (4 * part + j)), flip);
      const __m512i low01 = _mm512_unpacklo_epi32(v[0], v[1]);
      const __m512i high01 = _mm512_unpackhi_epi32(v[0], v[1]);
      const __m512i low23 = _mm512_unpacklo_epi32(v[2], v[3]);
      const __m512i high23 = _mm512_unpackhi_epi32(v[2], v[3]);
      // rows 4 i + k in 128-bit lane i of rows[k]
      const __m512i rows[4] = {
          _mm512_unpacklo_epi64(low01, low23), _mm512_unpackhi_epi64(low01, low23),
          _mm512_unpacklo_epi64(high01, high23), _mm512_unpackhi_epi64(high01, high23)};
      uint8_t* quants = first + layout.quants_at + 16 * part;
      for (int k = 0; k < 4; ++k) {
        alignas(64) uint8_t lanes[64];
        _mm512_store_si512(lanes, rows[k]);
        for (int i = 0; i < 4; ++i)
          std::memcpy(quants + (4 * i + k) * row_bytes, lanes + 16 * i, 16);
      }
    }
    // (The 5-bit formats' 20 bytes: a last word of each row, which no format flips)
    for (int64_t w = quant_bytes / 16 * 4; w < quant_bytes / 4; ++w)
      for (int64_t r = 0; r < X16_ROWS; ++r)
        std::memcpy(first + r * row_bytes + layout.quants_at + 4 * w,
                    vectors + (w * X16_ROWS + r) * 4, 4);
  }
}

// Interleaved groups [G, 16 row_bytes] decoded to the weight [16 G, K] in T, a group at a
// time through its blocks in a buffer of the thread's (so that past 32 rows and in lookups
// they compute exactly as the blocks they were made from).
template <typename T>
void decode_groups(const uint8_t* groups, int64_t type, int64_t K, int64_t G, T* out) {
  const int64_t base = type - X16, blocks = K / format_of(base).elements;
  const int64_t row_bytes = blocks * format_of(base).bytes;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> rows(X16_ROWS * row_bytes);
    std::vector<float> scratch(K);
    for (int64_t g = g0; g < g1; ++g) {
      ungroup(groups + g * X16_ROWS * row_bytes, base, blocks, rows.data(), row_bytes);
      decode_rows_fast(base, rows.data(), row_bytes, K, 0, X16_ROWS, out + g * X16_ROWS * K,
                       scratch.data());
    }
  });
}
#endif

// The weight [N, K] the blocks stand for, in `dtype`.
at::Tensor ggml_dequantize(const at::Tensor& blocks, int64_t type, int64_t columns,
                           at::ScalarType dtype) {
  check_blocks("ggml_dequantize", blocks, type, columns);
  const int64_t N = weight_rows(blocks, type), K = columns;
  at::Tensor out = at::empty({N, K}, blocks.options().dtype(dtype));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  const auto decode = [&](auto* op) {
    if (is_x16(type)) {
#if defined(__AVX512F__)
      return decode_groups(bp, type, K, blocks.size(0), op);
#endif
      TORCH_CHECK(false, "interleaved weights: this build has no AVX-512");
    }
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      std::vector<float> scratch(K);
      decode_rows_fast(type, bp, row_bytes, K, n0, n1, op + n0 * K, scratch.data());
    });
  };
  switch (dtype) {
    case at::kFloat: decode(out.data_ptr<float>()); break;
    case at::kBFloat16: decode(out.data_ptr<at::BFloat16>()); break;
    case at::kHalf: decode(out.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "ggml_dequantize: weights as float32, bfloat16 or float16, not ",
                         dtype);
  }
  return out;
}

#if defined(__AVX512F__)
using namespace braid_few_rows;

// Every input row against weight rows [n0, n1), NR decoded at a time into `tile_rows` (NR x K of
// T, L1/L2-resident) and multiplied with groups of up to MAX_GROUP input rows.
template <typename D, int NR>
void decoded_tiles(int64_t type, const typename D::T* x, int64_t M, const uint8_t* blocks,
                   int64_t row_bytes, typename D::T* y, int64_t N, int64_t K, int64_t n0,
                   int64_t n1, typename D::T* tile_rows, float* scratch) {
  for (int64_t n = n0; n + NR <= n1; n += NR) {
    decode_rows_fast(type, blocks, row_bytes, K, n, n + NR, tile_rows, scratch);
    for (int64_t m = 0; m < M; m += MAX_GROUP) {
      const typename D::T* xm = x + m * K;
      typename D::T* ym = y + m * N + n;
      switch (std::min<int64_t>(M - m, MAX_GROUP)) {
        case 1: tile<D, 1, NR>(xm, K, tile_rows, ym, N, K, nullptr, 0); break;
        case 2: tile<D, 2, NR>(xm, K, tile_rows, ym, N, K, nullptr, 0); break;
        case 3: tile<D, 3, NR>(xm, K, tile_rows, ym, N, K, nullptr, 0); break;
        default: tile<D, 4, NR>(xm, K, tile_rows, ym, N, K, nullptr, 0); break;
      }
    }
  }
}

// Up to MAX_GROUP input rows: each weight row decoded in registers, 32 weights at a time, and
// multiplied with every input row there (no tile written and read back: at one row, 1.3-2x
// the decoded tiles' speed). Each output sums the same products in the same order as the
// decoded tiles and the dense few-row kernel, so all three give the same bits.
template <typename D, int MR>
void rows_in_registers(int64_t type, const typename D::T* x, const uint8_t* blocks,
                       int64_t row_bytes, typename D::T* y, int64_t N, int64_t K, int64_t n0,
                       int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
    const auto multiply = [&](int64_t k, __m512 low, __m512 high) {
      if constexpr (std::is_same_v<typename D::T, float>) {
        for (int m = 0; m < MR; ++m) {
          acc[m] = D::dot(acc[m], low, D::load(x + m * K + k));
          acc[m] = D::dot(acc[m], high, D::load(x + m * K + k + 16));
        }
      } else {
#if defined(__AVX512BF16__)
        const __m512bh weights = simd::pair(low, high);
        for (int m = 0; m < MR; ++m) acc[m] = D::dot(acc[m], weights, D::load(x + m * K + k));
#endif
      }
    };
    simd::decode_row(type, blocks + n * row_bytes, K, multiply);
    for (int m = 0; m < MR; ++m) y[m * N + n] = typename D::T(_mm512_reduce_add_ps(acc[m]));
  }
}

// Input rows up to which fp32 GEMMs decode each weight row in registers once for every
// MAX_GROUP of them, rather than once into a tile for all: fp32's tile micro-kernel loses to
// the repeated decoding up to 16 rows (a speculative verification's; the K-quants lose from
// 32 on), bf16's wins from 5 rows on (docs/kernel-choices.md).
constexpr int64_t FP32_REGISTER_ROWS = 16;

// x [M, K] @ W^T for M <= FEW_ROWS: four weight rows a task, decoded in registers (formats
// with a vector decoder: up to MAX_GROUP input rows, or FP32_REGISTER_ROWS in passes of
// MAX_GROUP), else into a tile.
template <typename D>
at::Tensor few_rows_over(const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  constexpr int64_t NR = 4;  // weight rows a decoded tile holds
  const int64_t M = x.size(0), N = blocks.size(0), K = x.size(1), row_bytes = blocks.size(1);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xp = xc.data_ptr<typename D::T>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  auto* yp = y.data_ptr<typename D::T>();
  const int64_t register_rows =
      std::is_same_v<typename D::T, float> ? FP32_REGISTER_ROWS : int64_t(MAX_GROUP);
  const bool in_registers = M <= register_rows && simd::decodes(type);
  at::parallel_for(0, (N + NR - 1) / NR, 1, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * NR, n1 = std::min(N, t1 * NR);
    if (in_registers) {
      for (int64_t m = 0; m < M; m += MAX_GROUP) {
        const auto* xm = xp + m * K;
        auto* ym = yp + m * N;
        switch (std::min<int64_t>(M - m, MAX_GROUP)) {
          case 1: rows_in_registers<D, 1>(type, xm, bp, row_bytes, ym, N, K, n0, n1); break;
          case 2: rows_in_registers<D, 2>(type, xm, bp, row_bytes, ym, N, K, n0, n1); break;
          case 3: rows_in_registers<D, 3>(type, xm, bp, row_bytes, ym, N, K, n0, n1); break;
          default: rows_in_registers<D, 4>(type, xm, bp, row_bytes, ym, N, K, n0, n1); break;
        }
      }
      return;
    }
    std::vector<typename D::T> tile_rows(NR * K);
    std::vector<float> scratch(K);
    const int64_t whole = n0 + (n1 - n0) / NR * NR;
    decoded_tiles<D, NR>(type, xp, M, bp, row_bytes, yp, N, K, n0, whole, tile_rows.data(),
                         scratch.data());
    decoded_tiles<D, 1>(type, xp, M, bp, row_bytes, yp, N, K, whole, n1, tile_rows.data(),
                        scratch.data());
  });
  return y;
}
#endif

// Whether the few-row kernel serves x's dtype on this CPU (K a multiple of its vector).
bool few_rows_serve(const at::Tensor& x) {
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) return x.size(1) % Fp32Dot::CHUNK == 0;
#endif
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) return x.size(1) % Bf16Dot::CHUNK == 0;
#endif
  return false;
}

// Bytes of decoded weight handed to one GEMM of many rows: large enough for the GEMM to run at
// speed, small enough to stay in L2/L3 while it does.
constexpr int64_t CHUNK_BYTES = 4 << 20;

// x [M, K] @ W^T for the weight W [N, K] in GGML blocks of `type`, in x's dtype: up to
// `int8_rows` rows through the int8 kernels (where they serve), else up to `few_rows` through
// the few-row kernel over decoded tiles, more through ATen's GEMM over decoded chunks of rows.
at::Tensor ggml_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                       int64_t few_rows, int64_t int8_rows) {
  TORCH_CHECK(x.dim() == 2, "ggml_linear: an input [M, K], got ", x.sizes());
  check_blocks("ggml_linear", blocks, type, x.size(1));
  const int64_t M = x.size(0), N = weight_rows(blocks, type), K = x.size(1);
  if (M <= int8_rows && int8_dot_serves(type, x.scalar_type(), K))
    return int8_dot_linear(x, blocks, type);
  // (Interleaved groups past `int8_rows` take the chunks below whatever the rows: float inputs
  // are not what they are made for.)
#if defined(__AVX512F__)
  if (M <= few_rows && few_rows_serve(x) && !is_x16(type)) {
    if (x.scalar_type() == at::kFloat) return few_rows_over<Fp32Dot>(x, blocks, type);
#if defined(__AVX512BF16__)
    return few_rows_over<Bf16Dot>(x, blocks, type);
#endif
  }
#endif
#if defined(BRAID_GGML_AVX2)
  if (M <= few_rows && x.scalar_type() == at::kFloat)
    return avx2_few_rows_linear(x, blocks, type);
#endif
  at::Tensor y = at::empty({M, N}, x.options());
  const int64_t per_row = is_x16(type) ? X16_ROWS : 1;  // weight rows in a row of `blocks`
  const int64_t chunk = std::max<int64_t>(16, CHUNK_BYTES / (K * x.element_size())) / per_row;
  for (int64_t n = 0; n < blocks.size(0); n += chunk) {
    const int64_t rows = std::min(chunk, blocks.size(0) - n);
    const at::Tensor weight = ggml_dequantize(blocks.narrow(0, n, rows), type, K,
                                              x.scalar_type());
    y.narrow(1, n * per_row, rows * per_row).copy_(at::linear(x, weight));
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(braid, m) {
  m.def("ggml_dequantize(Tensor blocks, int type, int columns, ScalarType dtype) -> Tensor");
  m.def("ggml_linear(Tensor x, Tensor blocks, int type, int few_rows, int int8_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(braid, CPU, m) {
  m.impl("ggml_dequantize", &ggml_dequantize);
  m.impl("ggml_linear", &ggml_linear);
}
