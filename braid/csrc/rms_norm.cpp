// RMSNorm in one pass (braid/native.py builds this file with the other operators; `fused`
// calls it outside compiled graphs). Eagerly, ATen runs the norm as four operators (widen,
// norm, round, weight), and its fp32 norm is itself several, each a dispatch and a pass over
// memory. Here the row is read once, its squares summed in fp32, and the product of the
// normalised row and the weight rounded once, as the compiled norm (`fused._rms_norm` under
// inductor) computes it: eager rounds the normalised row to the dtype first.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "vec_io.h"

namespace {

using braid_vec::load;
using braid_vec::store;
using braid_vec::Vec;
using braid_vec::VL;
// Elements per task of `at::parallel_for`: the few rows of a decode step stay on the calling
// thread.
constexpr int64_t GRAIN_ELEMS = 1 << 15;

// out = round(weight * x / rms(x)), in fp32 until the one rounding.
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t H, float eps, int64_t r0,
                   int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = x + r * H;
    Vec squares(0.f);
    for (int64_t d = 0; d < H; d += VL) {
      const Vec v = load(row + d, std::min(VL, H - d));
      squares = at::vec::fmadd(v, v, squares);
    }
    const float sum = at::vec::vec_reduce_all<float>(
        [](Vec& a, Vec& b) { return a + b; }, squares);
    const Vec inv(1.f / std::sqrt(sum / float(H) + eps));
    for (int64_t d = 0; d < H; d += VL) {
      const int64_t n = std::min(VL, H - d);
      store(load(weight + d, n) * (load(row + d, n) * inv), out + r * H + d, n);
    }
  }
}

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), what, " must have the input's dtype");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
              " must be float32 or bfloat16");
}

template <typename T>
void rms_norm_all(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, float eps) {
  const int64_t H = x.size(-1);
  const int64_t grain = std::max<int64_t>(1, GRAIN_ELEMS / std::max<int64_t>(H, 1));
  at::parallel_for(0, H ? x.numel() / H : 0, grain, [&](int64_t r0, int64_t r1) {
    rms_norm_rows(x.data_ptr<T>(), weight.data_ptr<T>(), out.data_ptr<T>(), H, eps, r0, r1);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, x, "x");
  check_rows(weight, x, "weight");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must be [",
              x.size(-1), "]");
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_all<at::BFloat16>(x, weight, out, float(eps));
  } else {
    rms_norm_all<float>(x, weight, out, float(eps));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(braid, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(braid, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}
