// A linear layer's GEMM over its oneDNN-packed bf16 weight (braid/layers/quant.py), with an
// optional activation or product in oneDNN's epilogue, eager and inside compiled graphs.
//
// Packed weights are oneDNN's opaque tensors (the mkldnn layout), which a compiled graph can
// neither take as an input (dynamo cannot serialize their guards) nor as a constant without
// inductor's freezing (whose graphs cannot be saved and reloaded: braid/engine/compiled_step.py).
// So each is registered here once and the graph passes its number, as a one-element int64
// tensor: an input like any other, so one graph serves every layer's weight.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <mutex>
#include <string>
#include <vector>

namespace {

std::mutex registry_mutex;
std::vector<at::Tensor> registry;  // by number; forgotten ones undefined

int64_t register_packed_weight(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.push_back(weight);
  return int64_t(registry.size()) - 1;
}

void forget_packed_weights(at::IntArrayRef ids) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (int64_t id : ids) {
    if (id >= 0 && id < int64_t(registry.size())) registry[id] = at::Tensor();
  }
}

at::Tensor packed_weight(const at::Tensor& id_tensor) {
  const int64_t id = id_tensor.item<int64_t>();
  std::lock_guard<std::mutex> lock(registry_mutex);
  TORCH_CHECK(id >= 0 && id < int64_t(registry.size()) && registry[id].defined(),
              "no packed weight is registered as number ", id);
  return registry[id];
}

// x [rows, K] @ weight^T (+ bias), then `activation`: "none" or "swish" (SiLU); with `other`
// given, the epilogue instead applies the binary `activation` ("mul") with `other` [rows, N].
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, int64_t out_features,
                         const std::optional<at::Tensor>& bias, const std::string& activation,
                         const std::optional<at::Tensor>& other) {
  const at::Tensor w = packed_weight(weight);
  TORCH_CHECK(w.size(0) == out_features, "packed weight ", weight.item<int64_t>(), " has ",
              w.size(0), " output features, not ", out_features);
  if (other.has_value()) {
    static auto binary = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const std::optional<at::Tensor>&,
                                               c10::string_view)>();
    return binary.call(x, *other, w, bias, activation);
  }
  static auto unary =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<c10::Scalar>>,
                            std::optional<c10::string_view>)>();
  return unary.call(x, w, bias, activation, c10::List<std::optional<c10::Scalar>>(), "");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(braid, m) {
  m.def("register_packed_weight(Tensor weight) -> int");
  m.def("forget_packed_weights(int[] ids) -> ()");
  m.def("packed_linear(Tensor x, Tensor weight, int out_features, Tensor? bias, str activation, "
        "Tensor? other) -> Tensor");
}

TORCH_LIBRARY_IMPL(braid, CPU, m) { m.impl("packed_linear", &packed_linear); }

TORCH_LIBRARY_IMPL(braid, CompositeExplicitAutograd, m) {
  m.impl("register_packed_weight", &register_packed_weight);
  m.impl("forget_packed_weights", &forget_packed_weights);
}
