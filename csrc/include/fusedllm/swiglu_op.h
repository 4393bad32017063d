// Host-side argument checks and layout for the swiglu ops, shared by the CPU
// and CUDA implementations.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <string_view>
#include <tuple>

#include "fusedllm/activations.h"
#include "fusedllm/checks.h"

namespace fusedllm {

// The schemas of swiglu's operators, for torch.ops.fusedllm (csrc/swiglu.cpp) and the
// emulated torch.ops.fusedllm_simt (csrc/cuda/swiglu.cu).
inline void define_swiglu_ops(torch::Library& m) {
  // h = act(gate) * up with act in {"silu", "gelu_tanh"}; float32 math inside.
  m.def("swiglu(Tensor gate, Tensor up, str activation) -> Tensor");
  // The same from one [..., 2F] tensor laid out [gate | up] (one fused projection).
  m.def("swiglu_packed(Tensor gate_up, str activation) -> Tensor");
  // Backward ops recompute the activation from the inputs.
  m.def("swiglu_backward(Tensor grad_out, Tensor gate, Tensor up, str activation)"
        " -> (Tensor grad_gate, Tensor grad_up)");
  m.def("swiglu_packed_backward(Tensor grad_out, Tensor gate_up, str activation) -> Tensor");
}

// The activations: fusedllm._limits.ACTIVATIONS (tests/test_limits.py).
inline act::Activation parse_activation(std::string_view activation, const char* op) {
  if (activation == "silu") return act::Activation::kSilu;
  if (activation == "gelu_tanh") return act::Activation::kGeluTanh;
  TORCH_CHECK_VALUE(false, op, ": activation must be 'silu' or 'gelu_tanh', got '",
                    std::string(activation), "'");
}

// Operands as [rows, n] views with unit column stride (gate and up may be the
// two halves of one packed tensor), and outputs as [rows, n] views.
struct SwigluPlan {
  act::Activation activation = act::Activation::kSilu;
  int64_t rows = 0, n = 0;
  at::Tensor gate, up;
  at::Tensor out;                        // forward: [rows, n] view of the returned h
  at::Tensor grad_out, grad_gate, grad_up;  // backward: [rows, n] views

};

// Checks a packed [..., 2F] tensor laid out [gate | up]; returns F.
inline int64_t check_packed(const at::Tensor& packed, const char* op) {
  check_float_tensor(packed, op, "gate_up");
  TORCH_CHECK_VALUE(packed.dim() >= 1, op, ": gate_up must have at least one dimension");
  TORCH_CHECK_VALUE(packed.size(-1) % 2 == 0, op,
                    ": gate_up must be packed [..., 2 * F] as [gate | up]; its last dim ",
                    packed.size(-1), " is odd");
  return packed.size(-1) / 2;
}

// [rows, F] views of the gate and up halves of a non-empty packed tensor.
inline std::pair<at::Tensor, at::Tensor> split_packed(const at::Tensor& packed, int64_t f) {
  const at::Tensor rows = as_rows(packed, 2 * f);
  return {rows.narrow(1, 0, f), rows.narrow(1, f, f)};
}

inline void check_gate_up(const at::Tensor& gate, const at::Tensor& up, const char* op) {
  check_float_tensor(gate, op, "gate");
  check_same(gate, "gate", up, "up", op);
  TORCH_CHECK_VALUE(gate.sizes() == up.sizes(), op, ": gate and up must have the same shape, got ",
                    gate.sizes(), " and ", up.sizes());
  TORCH_CHECK_VALUE(gate.dim() >= 1, op, ": gate must have at least one dimension");
}

inline std::vector<int64_t> with_last(at::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> out = sizes.vec();
  out.back() = last;
  return out;
}

template <typename Impl>
struct SwigluOps {
  static SwigluPlan plan(act::Activation activation, const at::Tensor& gate_rows,
                         const at::Tensor& up_rows, at::Tensor out) {
    SwigluPlan p;
    p.activation = activation;
    p.rows = gate_rows.size(0);
    p.n = gate_rows.size(1);
    p.gate = gate_rows;
    p.up = up_rows;
    p.out = out.view({p.rows, p.n});
    return p;
  }

  static at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation) {
    const char* op = "fusedllm.swiglu";
    check_gate_up(gate, up, op);
    const auto a = parse_activation(activation, op);
    const int64_t n = gate.size(-1);
    at::Tensor out = at::empty(gate.sizes(), gate.options());
    if (out.numel() == 0) return out;
    Impl::forward(plan(a, as_rows(gate, n), as_rows(up, n), out));
    return out;
  }

  static at::Tensor swiglu_packed(const at::Tensor& gate_up, c10::string_view activation) {
    const char* op = "fusedllm.swiglu_packed";
    const int64_t f = check_packed(gate_up, op);
    const auto a = parse_activation(activation, op);
    at::Tensor out = at::empty(with_last(gate_up.sizes(), f), gate_up.options());
    if (out.numel() == 0) return out;
    auto [gate, up] = split_packed(gate_up, f);
    Impl::forward(plan(a, gate, up, out));
    return out;
  }

  static SwigluPlan backward_plan(act::Activation activation, const at::Tensor& grad_out,
                                  const at::Tensor& gate_rows, const at::Tensor& up_rows,
                                  const at::Tensor& grad_gate_rows, const at::Tensor& grad_up_rows) {
    SwigluPlan p;
    p.activation = activation;
    p.rows = gate_rows.size(0);
    p.n = gate_rows.size(1);
    p.grad_out = as_rows(grad_out, p.n);
    p.gate = gate_rows;
    p.up = up_rows;
    p.grad_gate = grad_gate_rows;
    p.grad_up = grad_up_rows;
    return p;
  }

  static std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_out,
                                                            const at::Tensor& gate,
                                                            const at::Tensor& up,
                                                            c10::string_view activation) {
    const char* op = "fusedllm.swiglu_backward";
    check_gate_up(gate, up, op);
    check_same(gate, "gate", grad_out, "grad_out", op);
    TORCH_CHECK_VALUE(grad_out.sizes() == gate.sizes(), op,
                      ": grad_out must have the shape of gate ", gate.sizes(), ", got ",
                      grad_out.sizes());
    const auto a = parse_activation(activation, op);
    at::Tensor grad_gate = at::empty(gate.sizes(), gate.options());
    at::Tensor grad_up = at::empty(gate.sizes(), gate.options());
    if (gate.numel() == 0) return {grad_gate, grad_up};
    const int64_t n = gate.size(-1);
    auto p = backward_plan(a, grad_out, as_rows(gate, n), as_rows(up, n), grad_gate.view({-1, n}),
                           grad_up.view({-1, n}));
    Impl::backward(p);
    return {grad_gate, grad_up};
  }

  static at::Tensor swiglu_packed_backward(const at::Tensor& grad_out, const at::Tensor& gate_up,
                                           c10::string_view activation) {
    const char* op = "fusedllm.swiglu_packed_backward";
    const int64_t f = check_packed(gate_up, op);
    check_same(gate_up, "gate_up", grad_out, "grad_out", op);
    TORCH_CHECK_VALUE(grad_out.sizes() == at::IntArrayRef(with_last(gate_up.sizes(), f)), op,
                      ": grad_out must have the shape of gate_up with half its last dim, got ",
                      grad_out.sizes());
    const auto a = parse_activation(activation, op);
    at::Tensor grad = at::empty(gate_up.sizes(), gate_up.options());
    if (grad.numel() == 0) return grad;
    auto [gate, up] = split_packed(gate_up, f);
    at::Tensor grad_rows = grad.view({-1, 2 * f});
    auto p = backward_plan(a, grad_out, gate, up, grad_rows.narrow(1, 0, f),
                           grad_rows.narrow(1, f, f));
    Impl::backward(p);
    return grad;
  }
};

}  // namespace fusedllm

// Registers the swiglu operators of one dispatch key; use inside TORCH_LIBRARY_IMPL.
#define FUSEDLLM_IMPL_SWIGLU_OPS(m, Impl)                                                    \
  do {                                                                                       \
    (m).impl("swiglu", &::fusedllm::SwigluOps<Impl>::swiglu);                                \
    (m).impl("swiglu_packed", &::fusedllm::SwigluOps<Impl>::swiglu_packed);                  \
    (m).impl("swiglu_backward", &::fusedllm::SwigluOps<Impl>::swiglu_backward);              \
    (m).impl("swiglu_packed_backward", &::fusedllm::SwigluOps<Impl>::swiglu_packed_backward); \
  } while (0)
