// rms_norm ops on CPU: checked plans (fusedllm/rms_norm_op.h) handed to the
// kernel variant for the running CPU.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "fusedllm/rms_norm_op.h"
#include "rms_norm_kernel.h"

namespace fusedllm::cpu {

FUSEDLLM_DEFINE_CPU_KERNEL_TABLE(RmsNormForwardFn, rms_norm_forward_kernels, "rms_norm_forward");
FUSEDLLM_DEFINE_CPU_KERNEL_TABLE(RmsNormBackwardFn, rms_norm_backward_kernels, "rms_norm_backward");

namespace {

const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
int64_t row_stride_or_zero(const at::Tensor& t) { return t.defined() ? t.stride(0) : 0; }

struct CpuRmsNorm {
  static void forward(const RmsNormForwardPlan& p, double eps, double offset) {
    RmsNormForwardArgs a{};
    a.dtype = p.x.scalar_type();
    a.rows = p.x.size(0);
    a.n = p.n;
    a.input = p.x.data_ptr();
    a.input_stride = p.x.stride(0);
    a.residual = data_or_null(p.residual);
    a.residual_stride = row_stride_or_zero(p.residual);
    a.weight = data_or_null(p.weight);
    a.out = p.out.data_ptr();
    a.residual_out = p.residual_out.defined() ? p.residual_out.data_ptr() : nullptr;
    a.rstd = p.rstd.data_ptr();
    a.eps = eps;
    a.offset = offset;
    a.casting = p.casting;
    rms_norm_forward_kernels.get()(a);
  }

  static void backward(const RmsNormBackwardPlan& p, double offset) {
    RmsNormBackwardArgs a{};
    a.dtype = p.x.scalar_type();
    a.rows = p.x.size(0);
    a.n = p.n;
    a.grad_out = p.grad_out.data_ptr();
    a.grad_out_stride = p.grad_out.stride(0);
    a.input = p.x.data_ptr();
    a.input_stride = p.x.stride(0);
    a.rstd = p.rstd.data_ptr();
    a.weight = data_or_null(p.weight);
    a.grad_residual = data_or_null(p.grad_residual);
    a.grad_residual_stride = row_stride_or_zero(p.grad_residual);
    a.grad_input = p.grad_input.data_ptr();
    a.grad_weight = p.want_weight_grad ? p.grad_weight.data_ptr() : nullptr;
    a.offset = offset;
    a.casting = p.casting;
    rms_norm_backward_kernels.get()(a);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, CPU, m) { FUSEDLLM_IMPL_RMS_NORM_OPS(m, CpuRmsNorm); }

}  // namespace fusedllm::cpu
