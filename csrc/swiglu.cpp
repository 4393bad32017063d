// swiglu and swiglu_packed: their schemas (defined in fusedllm/swiglu_op.h), their
// CPU operators (checked plans handed to the kernel variant for the running CPU,
// cpu/swiglu_kernel.cpp) and their autograd.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "fusedllm/autograd.h"
#include "fusedllm/macros.h"
#include "fusedllm/swiglu.h"
#include "fusedllm/swiglu_op.h"

FUSEDLLM_DEFINE_OPS(fusedllm, define_swiglu_ops)

namespace fusedllm::cpu {

FUSEDLLM_DEFINE_CPU_KERNEL_TABLE(SwigluFn, swiglu_forward_kernels, "swiglu_forward");
FUSEDLLM_DEFINE_CPU_KERNEL_TABLE(SwigluFn, swiglu_backward_kernels, "swiglu_backward");

namespace {

SwigluArgs operands(const SwigluPlan& p) {
  SwigluArgs a{};
  a.dtype = p.gate.scalar_type();
  a.activation = p.activation;
  a.rows = p.rows;
  a.n = p.n;
  a.gate = p.gate.data_ptr();
  a.gate_stride = p.gate.stride(0);
  a.up = p.up.data_ptr();
  a.up_stride = p.up.stride(0);
  return a;
}

struct CpuSwiglu {
  static void forward(const SwigluPlan& p) {
    SwigluArgs a = operands(p);
    a.out = p.out.data_ptr();
    a.out_stride = p.out.stride(0);
    swiglu_forward_kernels.get()(a);
  }

  static void backward(const SwigluPlan& p) {
    SwigluArgs a = operands(p);
    a.grad_out = p.grad_out.data_ptr();
    a.grad_out_stride = p.grad_out.stride(0);
    a.grad_gate = p.grad_gate.data_ptr();
    a.grad_gate_stride = p.grad_gate.stride(0);
    a.grad_up = p.grad_up.data_ptr();
    a.grad_up_stride = p.grad_up.stride(0);
    swiglu_backward_kernels.get()(a);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, CPU, m) { FUSEDLLM_IMPL_SWIGLU_OPS(m, CpuSwiglu); }

}  // namespace fusedllm::cpu

// --- autograd, for every device (fusedllm/autograd.h) ----------------------------------------

namespace fusedllm::autograd {
namespace {

// Only the inputs are saved: backward recomputes the activation.
struct SwigluFunction : torch::autograd::Function<SwigluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up,
                            c10::string_view activation) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<decltype(SwigluOps<void>::swiglu)>("fusedllm::swiglu");
    ctx->save_for_backward({gate, up});
    ctx->saved_data["activation"] = std::string(activation);
    return fn.call(gate, up, activation);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto fn = op<decltype(SwigluOps<void>::swiglu_backward)>("fusedllm::swiglu_backward");
    const auto saved = ctx->get_saved_variables();
    auto [grad_gate, grad_up] =
        fn.call(grads[0], saved[0], saved[1], ctx->saved_data["activation"].toStringRef());
    return {grad_gate, grad_up, at::Tensor()};
  }
};

struct SwigluPackedFunction : torch::autograd::Function<SwigluPackedFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up, c10::string_view activation) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<decltype(SwigluOps<void>::swiglu_packed)>("fusedllm::swiglu_packed");
    ctx->save_for_backward({gate_up});
    ctx->saved_data["activation"] = std::string(activation);
    return fn.call(gate_up, activation);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto fn = op<decltype(SwigluOps<void>::swiglu_packed_backward)>("fusedllm::swiglu_packed_backward");
    const auto saved = ctx->get_saved_variables();
    return {fn.call(grads[0], saved[0], ctx->saved_data["activation"].toStringRef()), at::Tensor()};
  }
};

at::Tensor swiglu_autograd(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation) {
  return SwigluFunction::apply(gate, up, activation);
}

at::Tensor swiglu_packed_autograd(const at::Tensor& gate_up, c10::string_view activation) {
  return SwigluPackedFunction::apply(gate_up, activation);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, Autograd, m) {
  refuse_second_derivative(m, "swiglu_backward");
  refuse_second_derivative(m, "swiglu_packed_backward");
  m.impl("swiglu", &swiglu_autograd);
  m.impl("swiglu_packed", &swiglu_packed_autograd);
}

}  // namespace fusedllm::autograd
