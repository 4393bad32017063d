// rms_norm ops on CPU: argument checks, output allocation, kernel choice.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>

#include "fusedllm/rms_norm_op.h"
#include "rms_norm_kernel.h"

namespace fusedllm::cpu {

KernelTable<RmsNormForwardFn> rms_norm_forward_kernels{};
KernelTable<RmsNormBackwardFn> rms_norm_backward_kernels{};

namespace {

const void* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr() : nullptr;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_impl(
    const char* op, const at::Tensor& input, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight_in, double eps, double offset,
    c10::string_view casting) {
  const int64_t n = check_rms_norm_args(op, input, weight_in, eps, offset);
  const rms::Casting cast = parse_casting(casting);
  at::Tensor out = at::empty(input.sizes(), input.options());
  at::Tensor residual_out = residual ? at::empty(input.sizes(), input.options()) : at::Tensor();
  at::Tensor rstd = at::empty(row_shape(input), input.options().dtype(rstd_dtype(input)));
  if (input.numel() == 0) {
    if (n == 0) rstd.fill_(std::numeric_limits<double>::quiet_NaN());  // mean of nothing
    return {out, residual_out, rstd};
  }
  at::Tensor x = as_rows(input, n);
  at::Tensor res = residual ? as_rows(*residual, n) : at::Tensor();
  std::optional<at::Tensor> weight;
  if (weight_in && weight_in->defined()) weight = weight_in->contiguous();

  RmsNormForwardArgs a{};
  a.dtype = input.scalar_type();
  a.rows = x.size(0);
  a.n = n;
  a.input = x.data_ptr();
  a.input_stride = x.stride(0);
  a.residual = residual ? res.data_ptr() : nullptr;
  a.residual_stride = residual ? res.stride(0) : 0;
  a.weight = ptr_or_null(weight);
  a.out = out.data_ptr();
  a.residual_out = residual ? residual_out.data_ptr() : nullptr;
  a.rstd = rstd.data_ptr();
  a.eps = eps;
  a.offset = offset;
  a.casting = cast;
  rms_norm_forward_kernels.get()(a);
  return {out, residual_out, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& input,
                                            const std::optional<at::Tensor>& weight, double eps,
                                            double offset, c10::string_view casting) {
  auto [out, unused, rstd] =
      forward_impl("fusedllm.rms_norm", input, std::nullopt, weight, eps, offset, casting);
  return {out, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm(
    const at::Tensor& input, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    double eps, double offset, c10::string_view casting) {
  const char* op = "fusedllm.fused_add_rms_norm";
  check_float_tensor(input, op, "input");
  check_same(input, "input", residual, "residual", op);
  TORCH_CHECK_VALUE(residual.sizes() == input.sizes(), op, ": residual must have the shape of input ",
                    input.sizes(), ", got ", residual.sizes());
  return forward_impl(op, input, residual, weight, eps, offset, casting);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight_in, double offset, c10::string_view casting,
    const std::optional<at::Tensor>& grad_residual, bool compute_weight_grad) {
  const char* op = "fusedllm.rms_norm_backward";
  const int64_t n = check_rms_norm_args(op, input, weight_in, 0.0, offset);
  check_same(input, "input", grad_out, "grad_out", op);
  TORCH_CHECK_VALUE(grad_out.sizes() == input.sizes(), op, ": grad_out must have the shape of input");
  TORCH_CHECK_VALUE(rstd.scalar_type() == rstd_dtype(input) && rstd.numel() * n == input.numel(),
                    op, ": rstd must be the per-row statistic returned by the forward op");
  if (grad_residual) {
    check_same(input, "input", *grad_residual, "grad_residual", op);
    TORCH_CHECK_VALUE(grad_residual->sizes() == input.sizes(), op,
                      ": grad_residual must have the shape of input");
  }
  const rms::Casting cast = parse_casting(casting);
  const bool has_weight = weight_in.has_value() && weight_in->defined();
  const bool want_dw = has_weight && compute_weight_grad;

  at::Tensor grad_input = at::empty(input.sizes(), input.options());
  at::Tensor grad_weight = want_dw ? at::zeros({n}, input.options()) : at::empty({0}, input.options());
  if (input.numel() == 0) return {grad_input, grad_weight};

  at::Tensor g = as_rows(grad_out, n);
  at::Tensor x = as_rows(input, n);
  at::Tensor gr = grad_residual ? as_rows(*grad_residual, n) : at::Tensor();
  at::Tensor rs = rstd.contiguous();
  std::optional<at::Tensor> weight;
  if (has_weight) weight = weight_in->contiguous();

  RmsNormBackwardArgs a{};
  a.dtype = input.scalar_type();
  a.rows = x.size(0);
  a.n = n;
  a.grad_out = g.data_ptr();
  a.grad_out_stride = g.stride(0);
  a.input = x.data_ptr();
  a.input_stride = x.stride(0);
  a.rstd = rs.data_ptr();
  a.weight = ptr_or_null(weight);
  a.grad_residual = grad_residual ? gr.data_ptr() : nullptr;
  a.grad_residual_stride = grad_residual ? gr.stride(0) : 0;
  a.grad_input = grad_input.data_ptr();
  a.grad_weight = want_dw ? grad_weight.data_ptr() : nullptr;
  a.offset = offset;
  a.casting = cast;
  rms_norm_backward_kernels.get()(a);
  return {grad_input, grad_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rms_norm_backward", &rms_norm_backward);
}

}  // namespace fusedllm::cpu
