// The residual stream's elementwise work, one pass each (braid/layers/decode_kernel.py builds
// this file with the attention operators; `fused` calls it outside compiled graphs):
// - `rms_norm`: eagerly, ATen runs the norm as four operators (widen, norm, round, weight), and
//   its fp32 norm is itself several, each a dispatch and a pass over memory. Here the row is
//   read once, its squares summed in fp32, and the product of the normalised row and the
//   weight rounded once, as the compiled norm (`fused._rms_norm` under inductor) computes it:
//   eager rounds the normalised row to the dtype first.
// - `add_pair`: two ranks' block outputs and the residual summed in fp32 and rounded once,
//   in that order, as `(a.float() + b.float() + residual.float()).to(dtype)`.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <immintrin.h>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();
// Elements per task of `at::parallel_for`: the few rows of a decode step stay on the calling
// thread.
constexpr int64_t GRAIN_ELEMS = 1 << 15;

inline Vec load(const float* p, int64_t n) { return Vec::loadu(p, n); }
inline void store(const Vec& x, float* p, int64_t n) { x.store(p, n); }
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// A bf16 is the top half of an fp32: widened by a shift; narrowed by `vcvtneps2bf16` (round to
// nearest even). at::vec's conversions go through 32 lanes and took twice as long here.
inline __mmask16 first(int64_t n) { return n >= 16 ? 0xFFFF : __mmask16((1u << n) - 1); }
inline Vec load(const at::BFloat16* p, int64_t n) {
  const __m256i half = _mm256_maskz_loadu_epi16(first(n), p);
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
}
inline void store(const Vec& x, at::BFloat16* p, int64_t n) {
  _mm256_mask_storeu_epi16(p, first(n), (__m256i)_mm512_cvtneps_pbh(x));
}
#else
inline Vec load(const at::BFloat16* p, int64_t n) {
  return at::vec::convert<float>(at::vec::Vectorized<at::BFloat16>::loadu(p, n));
}
inline void store(const Vec& x, at::BFloat16* p, int64_t n) {
  at::vec::convert<at::BFloat16>(x).store(p, n);
}
#endif

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

// out = round(a + b + residual), summed in fp32.
template <typename T>
void add_pair_span(const T* a, const T* b, const T* residual, T* out, int64_t begin,
                   int64_t end) {
  for (int64_t i = begin; i < end; i += VL) {
    const int64_t n = std::min(VL, end - i);
    store(load(a + i, n) + load(b + i, n) + load(residual + i, n), out + i, n);
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

template <typename T>
void add_pair_all(const at::Tensor& a, const at::Tensor& b, const at::Tensor& residual,
                  at::Tensor& out) {
  at::parallel_for(0, a.numel(), GRAIN_ELEMS, [&](int64_t begin, int64_t end) {
    add_pair_span(a.data_ptr<T>(), b.data_ptr<T>(), residual.data_ptr<T>(), out.data_ptr<T>(),
                  begin, end);
  });
}

at::Tensor add_pair(const at::Tensor& a, const at::Tensor& b, const at::Tensor& residual) {
  check_rows(a, a, "a");
  check_rows(b, a, "b");
  check_rows(residual, a, "residual");
  TORCH_CHECK(a.sizes() == b.sizes() && a.sizes() == residual.sizes(),
              "a, b and residual must have one shape");
  at::Tensor out = at::empty_like(a);
  if (a.scalar_type() == at::kBFloat16) {
    add_pair_all<at::BFloat16>(a, b, residual, out);
  } else {
    add_pair_all<float>(a, b, residual, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(braid, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_pair(Tensor a, Tensor b, Tensor residual) -> Tensor");
}

TORCH_LIBRARY_IMPL(braid, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_pair", &add_pair);
}
