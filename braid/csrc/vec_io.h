// Loads and stores of float32, bf16 and fp16 elements as float32 vectors (at::vec), n at a time
// (n <= the vector length), for the one-pass elementwise operators (rms_norm.cpp, shm_ring.cpp).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

namespace braid_vec {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();

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
inline Vec load(const at::Half* p, int64_t n) {
  return at::vec::convert<float>(at::vec::Vectorized<at::Half>::loadu(p, n));
}
inline void store(const Vec& x, at::Half* p, int64_t n) {
  at::vec::convert<at::Half>(x).store(p, n);
}

}  // namespace braid_vec
