// y = x W^T for one bf16 row x and a row-major weight W, bf16 or int8 with a scale per output
// row: the compiled decode step's GEMMs at batch 1 (braid/native.py builds this
// file with the attention operator).
//
// At one row a linear layer is a stream of its weight. Here each thread takes a contiguous
// range of output rows (one sequential stream), eight rows at a time, the input chunk loaded
// once for the eight; a bf16 chunk of 32 is summed with one AVX512-BF16 dot-product
// instruction per row, an int8 chunk of 16 is widened to fp32 and multiplied with the input
// in fp32 (as `aten._weight_int8pack_mm` computes it).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t CHUNK = 32;  // bf16 elements in a 512-bit register
constexpr int ROWS = 8;        // output rows summed together, sharing each input chunk
constexpr int64_t LINE = 64;   // bytes in a cache line
// The tile of ROWS rows read two tiles from now is prefetched, a line per row for each line
// of each row read: the hardware prefetchers, which follow each row alone, kept 2-core Intel
// Xeon (AMX) at 24 GB/s for the LM head, 49152 x 576, and at half the read bandwidth for
// gate_up; with this, 29-33 GB/s and gate_up at the speed of a plain read of its weight.
constexpr int64_t PREFETCH_TILES = 2;

// y[n] for n in [n0, n1): ROWS rows at a time, then the rest one by one.
void gemv_rows(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t K,
               int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + ROWS <= n1; n += ROWS) {
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
    const at::BFloat16* rows = w + n * K;
    const char* ahead = reinterpret_cast<const char*>(rows + PREFETCH_TILES * ROWS * K);
    for (int64_t k = 0; k < K; k += CHUNK, ahead += ROWS * LINE) {
      for (int r = 0; r < ROWS; ++r) _mm_prefetch(ahead + r * LINE, _MM_HINT_T0);
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
      for (int r = 0; r < ROWS; ++r) {
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(rows + r * K + k), xv);
      }
    }
    for (int r = 0; r < ROWS; ++r) y[n + r] = at::BFloat16(_mm512_reduce_add_ps(acc[r]));
  }
  for (; n < n1; ++n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += CHUNK) {
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + n * K + k),
                             (__m512bh)_mm512_loadu_si512(x + k));
    }
    y[n] = at::BFloat16(_mm512_reduce_add_ps(acc));
  }
}

constexpr int64_t INT8_CHUNK = 16;  // int8 elements widened to one register of fp32

inline __m512 widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

// y[n] = scale[n] * (x . w[n]) for n in [n0, n1), x in fp32.
void gemv_int8_rows(const float* x, const int8_t* w, const at::BFloat16* scales,
                    at::BFloat16* y, int64_t K, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + ROWS <= n1; n += ROWS) {
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
    const int8_t* rows = w + n * K;
    const char* ahead = reinterpret_cast<const char*>(rows + PREFETCH_TILES * ROWS * K);
    int64_t k = 0;
    // A cache line of each row at a time: 1.1-1.2x faster than a chunk of each row at a time
    // for SmolLM2's gate_up and down (2-core Zen 5).
    for (; k + LINE <= K; k += LINE, ahead += ROWS * LINE) {
      for (int r = 0; r < ROWS; ++r) _mm_prefetch(ahead + r * LINE, _MM_HINT_T0);
      __m512 xv[LINE / INT8_CHUNK];
      for (int j = 0; j < LINE / INT8_CHUNK; ++j) xv[j] = _mm512_loadu_ps(x + k + j * INT8_CHUNK);
      for (int r = 0; r < ROWS; ++r) {
        for (int j = 0; j < LINE / INT8_CHUNK; ++j) {
          acc[r] = _mm512_fmadd_ps(widen(rows + r * K + k + j * INT8_CHUNK), xv[j], acc[r]);
        }
      }
    }
    for (; k < K; k += INT8_CHUNK) {
      const __m512 xv = _mm512_loadu_ps(x + k);
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(widen(rows + r * K + k), xv, acc[r]);
    }
    for (int r = 0; r < ROWS; ++r) {
      y[n + r] = at::BFloat16(_mm512_reduce_add_ps(acc[r]) * float(scales[n + r]));
    }
  }
  for (; n < n1; ++n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += INT8_CHUNK) {
      acc = _mm512_fmadd_ps(widen(w + n * K + k), _mm512_loadu_ps(x + k), acc);
    }
    y[n] = at::BFloat16(_mm512_reduce_add_ps(acc) * float(scales[n]));
  }
}
#endif

void check_shapes(const char* op, const at::Tensor& x, const at::Tensor& weight, int64_t chunk) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, op, ": a bf16 input");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && weight.dim() == 2 &&
                  x.size(1) == weight.size(1),
              op, ": one input row [1, K] and a weight [N, K], got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(weight.is_contiguous() && weight.size(1) % chunk == 0,
              op, ": a row-major weight with K a multiple of ", chunk);
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& weight) {
#if defined(__AVX512BF16__)
  check_shapes("gemv_bf16", x, weight, CHUNK);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "gemv_bf16: a bf16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({1, N}, x.options());
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t tiles = (N + ROWS - 1) / ROWS;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    gemv_rows(xp, wp, yp, K, t0 * ROWS, std::min(N, t1 * ROWS));
  });
  return y;
#else
  TORCH_CHECK(false, "gemv_bf16: built for a CPU without AVX512-BF16");
#endif
}

at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales) {
#if defined(__AVX512BF16__)
  check_shapes("gemv_int8", x, values, INT8_CHUNK);
  TORCH_CHECK(values.scalar_type() == at::kChar && scales.scalar_type() == at::kBFloat16 &&
                  scales.numel() == values.size(0),
              "gemv_int8: int8 values and a bf16 scale per output row");
  const int64_t N = values.size(0), K = values.size(1);
  const at::Tensor xc = x.contiguous(), sc = scales.contiguous();
  at::Tensor y = at::empty({1, N}, x.options());
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const int8_t* wp = values.data_ptr<int8_t>();
  const at::BFloat16* sp = sc.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t tiles = (N + ROWS - 1) / ROWS;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    // The input row in fp32, converted by each thread for itself: as a tensor op
    // (`x.to(kFloat)`) it cost a few us a call, 121 calls a step.
    std::vector<float> xf(xp, xp + K);
    gemv_int8_rows(xf.data(), wp, sp, yp, K, t0 * ROWS, std::min(N, t1 * ROWS));
  });
  return y;
#else
  TORCH_CHECK(false, "gemv_int8: built for a CPU without AVX512-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(braid, m) {
  m.def("gemv_bf16(Tensor x, Tensor weight) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor values, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(braid, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_int8", &gemv_int8);
}
