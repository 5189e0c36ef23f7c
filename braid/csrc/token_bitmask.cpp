// Grammar masks on logits: the tokens a row's bitmask excludes become -inf, in place.
// Bit t of a row's int32 words (least significant first) allows token t, as llguidance and
// xgrammar fill them. ATen's masked_fill over an unpacked mask was several times slower
// (docs/performance.md, "Structured outputs"); whole words of allowed
// tokens (inside a JSON string, most of them) are skipped here, and words of excluded ones
// (outside strings, most of them) filled whole.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

void apply_token_bitmask(at::Tensor logits, const at::Tensor& rows, const at::Tensor& mask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be contiguous float32 [rows, vocab]");
  TORCH_CHECK(mask.dim() == 2 && mask.scalar_type() == at::kInt && mask.is_contiguous(),
              "mask must be contiguous int32 [masked rows, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  rows.size(0) == mask.size(0),
              "rows must be int64 [masked rows]");
  const int64_t num_rows = logits.size(0), vocab = logits.size(1), words = mask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "mask of ", words, " words for a vocabulary of ", vocab);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t g = 0; g < rows.size(0); ++g) {
    TORCH_CHECK(0 <= row_ids[g] && row_ids[g] < num_rows, "row ", row_ids[g], " out of range");
  }
  float* out = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>());
  const float excluded = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      float* row = out + row_ids[g] * vocab;
      const uint32_t* row_bits = bits + g * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = row_bits[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t base = w * 32, count = std::min<int64_t>(32, vocab - base);
        if (word == 0) {  // outside strings, most words: nothing allowed
          std::fill(row + base, row + base + count, excluded);
          continue;
        }
#ifdef __AVX512F__
        if (count == 32) {  // a masked store of -inf over the excluded lanes, 16 at a time
          const __m512 fill = _mm512_set1_ps(excluded);
          _mm512_mask_storeu_ps(row + base, static_cast<__mmask16>(~word & 0xFFFFu), fill);
          _mm512_mask_storeu_ps(row + base + 16, static_cast<__mmask16>(~word >> 16), fill);
          continue;
        }
#endif
        for (int64_t b = 0; b < count; ++b) {
          row[base + b] = ((word >> b) & 1u) ? row[base + b] : excluded;
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(braid, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor rows, Tensor mask) -> ()");
}

TORCH_LIBRARY_IMPL(braid, CPU, m) { m.impl("apply_token_bitmask", &apply_token_bitmask); }
