// What the ops' autograd (csrc/autograd/<op>.cpp) shares. Autograd is in C++
// rather than Python so that a call costs a few microseconds above the kernel.
// Each forward calls the op below autograd; each backward calls the matching
// backward op. The backward ops have no derivatives of their own: building a
// graph through them (double backward) is an error rather than a silent zero.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/jit/runtime/operator.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

namespace fusedllm::autograd {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

// Operator `name` called as the C++ function type Fn: the device template's
// static of that op (`decltype(XOps<void>::x)`, a declaration only), whose
// signature c10 checks against the schema when the kernels register.
template <typename Fn>
auto op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

inline at::Tensor value_or_undefined(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }
inline OptTensor as_optional(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// The one refusal of a second derivative, after the operator's name.
constexpr const char* kNoSecondDerivative =
    " has no derivative: a second derivative (create_graph=True, double backward) through "
    "fusedllm's ops is not supported";

// Autograd kernel of the backward ops: runs them, unless a graph would be built
// through them.
inline void refuse_double_backward(const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
                                   torch::jit::Stack* stack) {
  const auto& schema = handle.schema();
  if (at::GradMode::is_enabled()) {
    for (const auto& arg : torch::jit::last(*stack, schema.arguments().size())) {
      TORCH_CHECK(!(arg.isTensor() && arg.toTensor().requires_grad()), schema.name(),
                  kNoSecondDerivative);
    }
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  handle.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

// Registers refuse_double_backward as backward op `name`'s autograd kernel;
// inside TORCH_LIBRARY_IMPL(fusedllm, Autograd, m).
inline void refuse_second_derivative(torch::Library& m, const char* name) {
  m.impl(name, torch::CppFunction::makeFromBoxedFunction<&refuse_double_backward>());
}

}  // namespace fusedllm::autograd
