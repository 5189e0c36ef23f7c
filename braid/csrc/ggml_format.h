// GGML's block formats as a GGUF file stores them (ggml-quants.c's layouts), for the kernels
// that read them: ggml_blocks.cpp (decoding to floats) and ggml_int8.cpp (int8 dot products).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <c10/util/Half.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace braid_ggml {

// GGML's type numbers (ggml.h, `gguf.GGMLQuantizationType`) of the formats read here
enum GgmlType : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14
};

// braid's own forms of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K (no GGUF file holds
// them; `ggml_weight.interleave_rows` makes them at load where `int8_dot_serves` them), numbered
// X16 + the GGML type: 16 weight rows to a group, and per block the group's quants as vectors
// of 64 bytes, vector v holding bytes 4 v to 4 v + 3 of each of the 16 rows' quants (lane r:
// row r), so that one `vpdpbusd` multiplies 16 rows by 4 inputs. Q8_0: 8 vectors, byte t of
// vector j row r's quant 4 j + t plus 128 (unsigned); Q4_0 and Q4_1: 4 vectors, byte t of
// vector j row r's quants 4 j + t (low nibble) and 16 + 4 j + t (high), as its block's byte
// 4 j + t holds them; Q5_0 and Q5_1: the same 4 after a vector of their qh words (lane r: row
// r's 32 fifth bits); Q4_K: 32 vectors, vector 8 p + j the quants of columns 64 p + 4 j + t
// (low nibbles) and 64 p + 32 + 4 j + t (high); Q5_K: 40, its qh bytes (8 vectors, vector j
// the fifth bits of columns 4 j + t of every sub-block) then its nibbles as Q4_K's; Q6_K: 48,
// its ql bytes (32 vectors) then its qh bytes (16). The group's fp16 factors follow all its
// blocks' quants, 16 a block (its scales d, then Q4_1's and Q5_1's minimums or the K-quants'
// dmin), then the K-quants' sub-block scales, as vectors of 4-byte words too (Q4_K's and
// Q5_K's 12 packed bytes: 3 vectors; Q6_K's 16 int8: 4).
// A tensor of a format is [rows / 16, 16 x the row's bytes]: the blocks' bytes.
constexpr int64_t X16 = 1000;
constexpr int64_t X16_ROWS = 16;
inline bool is_x16(int64_t type) {
  return type == X16 + Q4_0 || type == X16 + Q4_1 || type == X16 + Q5_0 || type == X16 + Q5_1 ||
         type == X16 + Q8_0 || type == X16 + Q4_K || type == X16 + Q5_K || type == X16 + Q6_K;
}
// An interleaved base format's block: its fp16 factors, `scale_bytes` of sub-block scales and
// its quants, where in the block each starts
struct X16Layout {
  int64_t factors, scale_bytes, quant_bytes;
  int64_t factors_at, scales_at, quants_at;
};
inline X16Layout x16_layout(int64_t base) {
  switch (base) {
    case Q4_0: return {1, 0, 16, 0, 2, 2};
    case Q4_1: return {2, 0, 16, 0, 4, 4};
    case Q5_0: return {1, 0, 20, 0, 2, 2};  // qh, then qs: the quants
    case Q5_1: return {2, 0, 20, 0, 4, 4};
    case Q8_0: return {1, 0, 32, 0, 2, 2};
    case Q4_K: return {2, 12, 128, 0, 4, 16};
    case Q5_K: return {2, 12, 160, 0, 4, 16};  // qh, then qs: the quants
    case Q6_K: return {1, 16, 192, 208, 192, 0};  // ql, qh, scales, d
  }
  TORCH_CHECK(false, "GGML type ", base, " has no interleaved form");
}

struct Format {
  int64_t elements;  // weights per block
  int64_t bytes;     // bytes per block
};

inline Format format_of(int64_t type) {
  switch (type) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
  }
  TORCH_CHECK(false, "GGML type ", type, " has no block decoder here");
}

// The fp16 number at p (blocks keep their scales as fp16, unaligned): one instruction with
// F16C, where c10::Half's portable conversion spends a dozen in the kernels' inner loops.
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return float(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// A K-quant's eight 6-bit scales (first 8 bytes) and minimums (last 8) from its 12 packed bytes,
// as ggml-quants.c's get_scale_min_k4 unpacks them, four at a time.
inline void unpack_scales_k4(const uint8_t* packed, uint8_t out[16]) {
  uint32_t w[3];
  std::memcpy(w, packed, sizeof w);
  const uint32_t unpacked[4] = {
      w[0] & 0x3f3f3f3f, (w[2] & 0x0f0f0f0f) | ((w[0] >> 2) & 0x30303030),
      w[1] & 0x3f3f3f3f, ((w[2] >> 4) & 0x0f0f0f0f) | ((w[1] >> 2) & 0x30303030)};
  std::memcpy(out, unpacked, sizeof unpacked);
}

// The int8 kernels' loop over a GEMM of M input rows and N weight rows: weight rows in tiles of
// `tile_rows` (their blocks stay in L1/L2 while every group of up to four input rows passes over
// them), tiles in parallel, WEIGHT_ROWS weight rows at a time within a tile (one for its last
// rows where they do not divide it). `multiply(std::integral_constant<int, G>(),
// std::integral_constant<int, R>(), n, m, out)` puts the products of weight rows [n, n + R)
// with input rows [m, m + G) in out[0, R)[0, G); `store(m, n, value)` keeps one.
template <int WEIGHT_ROWS, typename Multiply, typename Store>
void over_tiles_of_rows(int64_t M, int64_t N, int64_t tile_rows, Multiply multiply,
                        Store store) {
  constexpr int64_t GROUP = 4;
  at::parallel_for(0, N, tile_rows, [&](int64_t n0, int64_t n1) {
    for (int64_t tile = n0; tile < n1; tile += tile_rows) {
      const int64_t tile_end = std::min(n1, tile + tile_rows);
      for (int64_t m = 0; m < M; m += GROUP) {
        const int64_t group = std::min(M - m, GROUP);
        for (int64_t n = tile; n < tile_end;) {
          float out[WEIGHT_ROWS][GROUP];
          const auto rows_of = [&](auto weight_rows) {
            switch (group) {
              case 1: multiply(std::integral_constant<int, 1>(), weight_rows, n, m, out); break;
              case 2: multiply(std::integral_constant<int, 2>(), weight_rows, n, m, out); break;
              case 3: multiply(std::integral_constant<int, 3>(), weight_rows, n, m, out); break;
              default: multiply(std::integral_constant<int, 4>(), weight_rows, n, m, out); break;
            }
            for (int64_t r = 0; r < decltype(weight_rows)::value; ++r)
              for (int64_t i = 0; i < group; ++i) store(m + i, n + r, out[r][i]);
            n += decltype(weight_rows)::value;
          };
          if (n + WEIGHT_ROWS <= tile_end) rows_of(std::integral_constant<int, WEIGHT_ROWS>());
          else rows_of(std::integral_constant<int, 1>());
        }
      }
    }
  });
}

// CPUs with AVX2 and FMA but not AVX-512 decode the usual formats with 256-bit vectors
// (ggml_avx2.cpp); AVX-512 ones with ggml_blocks.cpp's own decoders.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define BRAID_GGML_AVX2 1
// A weight row of K weights in blocks of `type` into out[0, K) as fp32.
void avx2_decode_row(int64_t type, const uint8_t* row, float* out, int64_t K);
// x [M, K] (fp32, a few rows: each weight row is decoded once per call) @ W^T over W's blocks
// of `type`.
at::Tensor avx2_few_rows_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type);
// Whether ggml_int8_avx2.cpp's int8 dot products serve blocks of `type` with K columns, and
// x [M, K] (fp32) @ W^T through them.
bool avx2_int8_serves(int64_t type, int64_t K);
at::Tensor avx2_int8_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type);
#endif

// Whether ggml_int8.cpp computes the few-row GEMMs over blocks of `type` with `dtype` inputs
// of K columns on this CPU.
bool int8_dot_serves(int64_t type, at::ScalarType dtype, int64_t K);
// x [M, K] @ W^T over W's blocks of `type`, with x rounded to int8 per block of inputs (as
// llama.cpp computes); `int8_dot_serves` must hold.
at::Tensor int8_dot_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type);

}  // namespace braid_ggml
