// rms_norm ops on CPU: checked plans (fusedllm/rms_norm_op.h) handed to the
// kernel variant for the running CPU.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "fusedllm/rms_norm_op.h"
#include "rms_norm_kernel.h"

namespace fusedllm::cpu {

KernelTable<RmsNormForwardFn> rms_norm_forward_kernels{};
KernelTable<RmsNormBackwardFn> rms_norm_backward_kernels{};

namespace {

const void* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
void* mut_ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
int64_t row_stride_or_zero(const at::Tensor& t) { return t.defined() ? t.stride(0) : 0; }

void run_forward(const RmsNormForwardPlan& p, double eps, double offset) {
  if (p.empty()) return;
  RmsNormForwardArgs a{};
  a.dtype = p.x.scalar_type();
  a.rows = p.x.size(0);
  a.n = p.n;
  a.input = p.x.data_ptr();
  a.input_stride = p.x.stride(0);
  a.residual = ptr_or_null(p.residual);
  a.residual_stride = row_stride_or_zero(p.residual);
  a.weight = ptr_or_null(p.weight);
  a.out = p.out.data_ptr();
  a.residual_out = mut_ptr_or_null(p.residual_out);
  a.rstd = p.rstd.data_ptr();
  a.eps = eps;
  a.offset = offset;
  a.casting = p.casting;
  rms_norm_forward_kernels.get()(a);
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& input,
                                            const std::optional<at::Tensor>& weight, double eps,
                                            double offset, c10::string_view casting) {
  auto p = plan_rms_norm_forward("fusedllm.rms_norm", input, std::nullopt, weight, eps, offset,
                                 casting);
  run_forward(p, eps, offset);
  return {p.out, p.rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm(
    const at::Tensor& input, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    double eps, double offset, c10::string_view casting) {
  auto p = plan_rms_norm_forward("fusedllm.fused_add_rms_norm", input, residual, weight, eps,
                                 offset, casting);
  run_forward(p, eps, offset);
  return {p.out, p.residual_out, p.rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, double offset, c10::string_view casting,
    const std::optional<at::Tensor>& grad_residual, bool compute_weight_grad) {
  auto p = plan_rms_norm_backward(grad_out, input, rstd, weight, offset, casting, grad_residual,
                                  compute_weight_grad);
  if (p.empty()) return {p.grad_input, p.grad_weight};
  RmsNormBackwardArgs a{};
  a.dtype = p.x.scalar_type();
  a.rows = p.x.size(0);
  a.n = p.n;
  a.grad_out = p.grad_out.data_ptr();
  a.grad_out_stride = p.grad_out.stride(0);
  a.input = p.x.data_ptr();
  a.input_stride = p.x.stride(0);
  a.rstd = p.rstd.data_ptr();
  a.weight = ptr_or_null(p.weight);
  a.grad_residual = ptr_or_null(p.grad_residual);
  a.grad_residual_stride = row_stride_or_zero(p.grad_residual);
  a.grad_input = p.grad_input.data_ptr();
  a.grad_weight = p.want_weight_grad ? p.grad_weight.data_ptr() : nullptr;
  a.offset = offset;
  a.casting = p.casting;
  rms_norm_backward_kernels.get()(a);
  return {p.grad_input, p.grad_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rms_norm_backward", &rms_norm_backward);
}

}  // namespace fusedllm::cpu
