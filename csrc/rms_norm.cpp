// rms_norm and fused_add_rms_norm: their schemas (defined in fusedllm/rms_norm_op.h),
// their CPU operators (checked plans handed to the kernel variant for the running
// CPU, cpu/rms_norm_kernel.cpp) and their autograd.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "fusedllm/autograd.h"
#include "fusedllm/macros.h"
#include "fusedllm/rms_norm.h"
#include "fusedllm/rms_norm_op.h"

FUSEDLLM_DEFINE_OPS(fusedllm, define_rms_norm_ops)

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

// --- autograd, for every device (fusedllm/autograd.h) ----------------------------------------

namespace fusedllm::autograd {
namespace {

// Shared by both norms: `x` is the normalized input (h for the fused add), and
// the weight's gradient is computed only when asked for.
std::tuple<at::Tensor, at::Tensor> rms_norm_grads(AutogradContext* ctx, const at::Tensor& grad_out,
                                                  const at::Tensor& grad_residual,
                                                  size_t weight_edge) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& x = saved[0];
  const at::Tensor& weight = saved[1];
  const at::Tensor& rstd = saved[2];
  const bool want_dw = weight.defined() && ctx->needs_input_grad(weight_edge);
  static auto backward = op<decltype(RmsNormOps<void>::rms_norm_backward)>("fusedllm::rms_norm_backward");
  auto [grad_input, grad_weight] =
      backward.call(grad_out, x, rstd, as_optional(weight), ctx->saved_data["offset"].toDouble(),
                    ctx->saved_data["casting"].toStringRef(), as_optional(grad_residual), want_dw);
  return {grad_input, want_dw ? grad_weight : at::Tensor()};
}

struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const OptTensor& weight,
                               double eps, double offset, c10::string_view casting) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<decltype(RmsNormOps<void>::rms_norm)>("fusedllm::rms_norm");
    auto [out, rstd] = fn.call(input, weight, eps, offset, casting);
    ctx->save_for_backward({input, value_or_undefined(weight), rstd});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["casting"] = std::string(casting);
    ctx->mark_non_differentiable({rstd});
    return {out, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto [grad_input, grad_weight] = rms_norm_grads(ctx, grads[0], at::Tensor(), 1);
    return {grad_input, grad_weight, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct FusedAddRmsNormFunction : torch::autograd::Function<FusedAddRmsNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& residual,
                               const OptTensor& weight, double eps, double offset,
                               c10::string_view casting) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<decltype(RmsNormOps<void>::fused_add_rms_norm)>("fusedllm::fused_add_rms_norm");
    auto [out, residual_out, rstd] = fn.call(input, residual, weight, eps, offset, casting);
    ctx->save_for_backward({residual_out, value_or_undefined(weight), rstd});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["casting"] = std::string(casting);
    ctx->mark_non_differentiable({rstd});
    return {out, residual_out, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // h = input + residual: both receive the gradient that reaches h.
    auto [grad_h, grad_weight] = rms_norm_grads(ctx, grads[0], grads[1], 2);
    return {grad_h, grad_h, grad_weight, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> rms_norm_autograd(const at::Tensor& input, const OptTensor& weight,
                                                     double eps, double offset, c10::string_view casting) {
  auto r = RmsNormFunction::apply(input, weight, eps, offset, casting);
  return {r[0], r[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_autograd(
    const at::Tensor& input, const at::Tensor& residual, const OptTensor& weight, double eps,
    double offset, c10::string_view casting) {
  auto r = FusedAddRmsNormFunction::apply(input, residual, weight, eps, offset, casting);
  return {r[0], r[1], r[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, Autograd, m) {
  refuse_second_derivative(m, "rms_norm_backward");
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_autograd);
}

}  // namespace fusedllm::autograd
