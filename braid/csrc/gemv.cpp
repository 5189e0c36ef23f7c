// y = x W^T for a few rows x (decode at small batch, speculative verification) and a row-major
// weight W, bf16 or fp32: the GEMMs of decode steps (braid/native.py builds this file with the
// attention operator).
//
// At a few rows a linear layer is a stream of its weight. Here each thread takes a contiguous
// range of output rows (one sequential stream), a tile of them at a time; each 64-byte chunk of
// the tile's weight rows is loaded once and multiplied with the same chunk of every input row
// (one AVX512-BF16 dot-product instruction per pair for bf16, an FMA for fp32), so the weight is
// read from memory once whatever the row count, and from L1/L2 again for input rows past the
// first four.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/silu.h>
#include <ATen/TensorOperators.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "few_rows.h"

#include <algorithm>
#include <string>
#include <vector>

namespace {

#if defined(__AVX512F__)
using namespace braid_few_rows;

// Every input row against weight rows [n, n + NR): groups of up to MAX_GROUP input rows, the
// first streaming the weight, the others reading it back from cache. In bf16 each group
// prefetches its share of the tile PREFETCH_TILES ahead, so the memory streams while later
// groups compute (with the first group alone prefetching, 8-16 rows waited on memory and
// compute in turn: 1.2-1.5x slower); in fp32, whose later groups are bound by reading the
// input rows back from L2, sharing made 16-row steps slower, so the first group prefetches.
template <typename D, int NR>
void rows_tile(const typename D::T* x, int64_t M, const typename D::T* w, typename D::T* y,
               int64_t N, int64_t K, int64_t n) {
  const int64_t groups = (M + MAX_GROUP - 1) / MAX_GROUP;
  const int64_t sharing = D::SHARED_PREFETCH ? groups : 1;
  const int lines = int((NR + sharing - 1) / sharing);  // a step's lines, per sharing group
  const char* ahead = reinterpret_cast<const char*>(w + (n + PREFETCH_TILES * NR) * K);
  const int64_t share = lines * (K / D::CHUNK) * LINE;  // bytes of the tile a group prefetches
  const typename D::T* rows = w + n * K;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t m = g * MAX_GROUP;
    const typename D::T* xm = x + m * K;
    typename D::T* ym = y + m * N;
    const char* mine = ahead + g * share;
    const int my_lines = g < sharing ? lines : 0;
    switch (std::min<int64_t>(M - m, MAX_GROUP)) {
      case 1: tile<D, 1, NR>(xm, K, rows, ym + n, N, K, mine, my_lines); break;
      case 2: tile<D, 2, NR>(xm, K, rows, ym + n, N, K, mine, my_lines); break;
      case 3: tile<D, 3, NR>(xm, K, rows, ym + n, N, K, mine, my_lines); break;
      default: tile<D, 4, NR>(xm, K, rows, ym + n, N, K, mine, my_lines); break;
    }
  }
}

// Weight rows [n0, n1): NR at a time (eight for one or two input rows, four for more: the
// accumulators must fit the 32 vector registers), then the rest one by one.
template <typename D>
void few_rows(const typename D::T* x, int64_t M, const typename D::T* w, typename D::T* y,
              int64_t N, int64_t K, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (M <= 2) {
    for (; n + 8 <= n1; n += 8) rows_tile<D, 8>(x, M, w, y, N, K, n);
  } else {
    for (; n + 4 <= n1; n += 4) rows_tile<D, 4>(x, M, w, y, N, K, n);
  }
  for (; n < n1; ++n) rows_tile<D, 1>(x, M, w, y, N, K, n);
}

template <typename D>
at::Tensor few_rows_gemm(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xp = xc.data_ptr<typename D::T>();
  const auto* wp = weight.data_ptr<typename D::T>();
  auto* yp = y.data_ptr<typename D::T>();
  const int64_t tile_rows = M <= 2 ? 8 : 4;
  const int64_t tiles = (N + tile_rows - 1) / tile_rows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    few_rows<D>(xp, M, wp, yp, N, K, t0 * tile_rows, std::min(N, t1 * tile_rows));
  });
  return y;
}
#endif

// x [M, K] @ weight^T for a row-major weight [N, K] of x's dtype (bf16 on a CPU with
// AVX512-BF16, or fp32), K a multiple of a vector's elements: fast for a few rows.
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "few_rows_linear: an input [M, K] and a weight [N, K], got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && weight.is_contiguous(),
              "few_rows_linear: a row-major weight of the input's dtype, got ",
              weight.scalar_type(), " for ", x.scalar_type());
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK(x.size(1) % Fp32Dot::CHUNK == 0, "few_rows_linear: K a multiple of ",
                Fp32Dot::CHUNK, ", got ", x.size(1));
    return few_rows_gemm<Fp32Dot>(x, weight);
  }
#endif
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(x.size(1) % Bf16Dot::CHUNK == 0, "few_rows_linear: K a multiple of ",
                Bf16Dot::CHUNK, ", got ", x.size(1));
    return few_rows_gemm<Bf16Dot>(x, weight);
  }
#endif
  TORCH_CHECK(false, "few_rows_linear: not built for ", x.scalar_type(), " on this CPU");
}

// silu(gate) * up of a merged [gate | up] product [M, 2I].
at::Tensor silu_times_up(const at::Tensor& merged) {
  const int64_t half = merged.size(1) / 2;
  return at::silu(merged.narrow(1, 0, half)) * merged.narrow(1, half, half);
}

// A linear layer's product by row count, decided here because a compiled graph's row count is
// a symbol (a branch in Python would be traced once): up to `few_rows` rows through
// few_rows_linear over the row-major `weight`; more through the oneDNN-packed weight numbered
// `packed` where there is one and the rows are at most `packed_rows` (-1: any count), else
// at::linear. With `swiglu` the weight is a merged [gate | up] projection, `packed` (where
// given) numbers its two halves, and the result is silu(gate) * up.
at::Tensor linear_by_rows(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& packed, int64_t few_rows,
                          int64_t packed_rows, bool swiglu) {
  const int64_t M = x.size(0);
  if (M <= few_rows) {
    const at::Tensor y = few_rows_linear(x, weight);
    return swiglu ? silu_times_up(y) : y;
  }
  if (packed.has_value() && (packed_rows < 0 || M <= packed_rows)) {
    static auto packed_linear =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("braid::packed_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                              const std::optional<at::Tensor>&, const std::string&,
                              const std::optional<at::Tensor>&)>();
    if (!swiglu) return packed_linear.call(x, *packed, weight.size(0), {}, "none", {});
    const int64_t half = weight.size(0) / 2;
    const at::Tensor gate = packed_linear.call(x, packed->narrow(0, 0, 1), half, {}, "swish", {});
    return packed_linear.call(x, packed->narrow(0, 1, 1), half, {}, "mul", gate);
  }
  const at::Tensor y = at::linear(x, weight);
  return swiglu ? silu_times_up(y) : y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(braid, m) {
  m.def("few_rows_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("linear_by_rows(Tensor x, Tensor weight, Tensor? packed, int few_rows, int packed_rows, "
        "bool swiglu) -> Tensor");
}

TORCH_LIBRARY_IMPL(braid, CPU, m) {
  m.impl("few_rows_linear", &few_rows_linear);
  m.impl("linear_by_rows", &linear_by_rows);
}
