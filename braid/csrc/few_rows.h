// The few-row GEMM's micro-kernel (gemv.cpp's few_rows_linear over a row-major weight, and
// ggml_blocks.cpp's over weights dequantized a tile at a time): a tile of weight rows against
// up to MAX_GROUP input rows, each weight vector loaded once for all of them.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

namespace braid_few_rows {

#if defined(__AVX512F__)
constexpr int64_t LINE = 64;  // bytes in a cache line, and in one vector of either type
// The tile read two tiles from now is prefetched, a line per weight row for each line read:
// the hardware prefetchers, which follow each row alone, kept 2-core Intel Xeon (AMX) at
// 24 GB/s for the LM head, 49152 x 576, and at half the read bandwidth for gate_up; with this,
// 29-33 GB/s and gate_up at the speed of a plain read of its weight.
constexpr int64_t PREFETCH_TILES = 2;
constexpr int MAX_GROUP = 4;  // input rows sharing each loaded weight vector

// One vector of elements and the product-sum of two: bf16 pairs through `vdpbf16ps` (32
// elements a vector), fp32 through an FMA (16).
struct Fp32Dot {
  using T = float;
  using V = __m512;
  static constexpr int64_t CHUNK = 16;
  // The first group of input rows alone prefetches (see rows_tile)
  static constexpr bool SHARED_PREFETCH = false;
  static V load(const T* p) { return _mm512_loadu_ps(p); }
  static __m512 dot(__m512 acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
};
#if defined(__AVX512BF16__)
struct Bf16Dot {
  using T = at::BFloat16;
  using V = __m512bh;
  static constexpr int64_t CHUNK = 32;
  static constexpr bool SHARED_PREFETCH = true;
  static V load(const T* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512 dot(__m512 acc, V w, V x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

// y[m, r] for MR input rows from x (row stride ldx) and NR weight rows of K elements from
// `rows` (consecutive). Meanwhile `lines` cache lines a step are prefetched from `ahead` on.
template <typename D, int MR, int NR>
void tile(const typename D::T* x, int64_t ldx, const typename D::T* rows, typename D::T* y,
          int64_t ldy, int64_t K, const char* ahead, int lines) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += D::CHUNK, ahead += lines * LINE) {
    for (int l = 0; l < lines; ++l) _mm_prefetch(ahead + l * LINE, _MM_HINT_T0);
    typename D::V xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = D::load(x + m * ldx + k);
    for (int r = 0; r < NR; ++r) {
      const typename D::V wv = D::load(rows + r * K + k);
      for (int m = 0; m < MR; ++m) acc[m][r] = D::dot(acc[m][r], wv, xv[m]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) y[m * ldy + r] = typename D::T(_mm512_reduce_add_ps(acc[m][r]));
}

#endif  // __AVX512F__

}  // namespace braid_few_rows
