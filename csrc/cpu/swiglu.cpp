// swiglu ops on CPU: checked plans (fusedllm/swiglu_op.h) handed to the kernel
// variant for the running CPU.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "fusedllm/swiglu_op.h"
#include "swiglu_kernel.h"

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
