// Host-side argument checks and layout for the rms_norm ops, shared by the CPU
// and CUDA implementations so both reject the same inputs with the same words.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "fusedllm/checks.h"
#include "fusedllm/rms_norm.h"

namespace fusedllm {

// The schemas of rms_norm's operators, for torch.ops.fusedllm (csrc/rms_norm.cpp) and the
// emulated torch.ops.fusedllm_simt (csrc/cuda/rms_norm.cu).
inline void define_rms_norm_ops(torch::Library& m) {
  // y = x * rstd * (offset + weight); also returns rstd per row (float32,
  // float64 for float64 input) for the backward op.
  m.def("rms_norm(Tensor input, Tensor? weight, float eps, float offset, str casting)"
        " -> (Tensor out, Tensor rstd)");
  // h = input + residual; y = rms_norm(h). Returns y, h and rstd.
  m.def("fused_add_rms_norm(Tensor input, Tensor residual, Tensor? weight, float eps, "
        "float offset, str casting) -> (Tensor out, Tensor residual_out, Tensor rstd)");
  // Gradients of both ops in one pass: grad_input (plus grad_residual, the
  // gradient reaching fused_add_rms_norm's residual_out) and grad_weight
  // (an empty tensor unless compute_weight_grad and a weight is given).
  m.def("rms_norm_backward(Tensor grad_out, Tensor input, Tensor rstd, Tensor? weight, "
        "float offset, str casting, Tensor? grad_residual, bool compute_weight_grad)"
        " -> (Tensor grad_input, Tensor grad_weight)");
}

// The castings: fusedllm._limits.CASTINGS (tests/test_limits.py).
inline rms::Casting parse_casting(std::string_view casting, const char* op) {
  if (casting == "llama") return rms::Casting::kLlama;
  if (casting == "gemma") return rms::Casting::kGemma;
  TORCH_CHECK_VALUE(false, op, ": casting must be 'llama' or 'gemma', got '", std::string(casting),
                    "'");
}

// Checks shared by every rms_norm op; returns the hidden size.
inline int64_t check_rms_norm_args(const char* op, const at::Tensor& input,
                                   const std::optional<at::Tensor>& weight, double eps,
                                   double offset) {
  TORCH_CHECK_VALUE(input.dim() >= 1, op, ": input must have at least one dimension");
  check_float_tensor(input, op, "input");
  const int64_t n = input.size(-1);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, op, ": eps must be a finite number >= 0, got ",
                    eps);
  TORCH_CHECK_VALUE(std::isfinite(offset), op, ": offset must be finite, got ", offset);
  if (weight.has_value() && weight->defined()) {
    check_same(input, "input", *weight, "weight", op);
    TORCH_CHECK_VALUE(weight->dim() == 1 && weight->size(0) == n, op,
                      ": weight must have shape [", n, "] (the last dim of input), got ",
                      weight->sizes());
  } else {
    TORCH_CHECK_VALUE(offset == 0.0, op, ": offset=", offset,
                      " needs a weight (y = x * rstd * (offset + weight))");
  }
  return n;
}

inline std::vector<int64_t> row_shape(const at::Tensor& input) {
  auto sizes = input.sizes().vec();
  sizes.pop_back();
  return sizes;
}

// Checked, laid-out operands and freshly allocated outputs of a forward call.
// `x`, `residual` are [rows, n] with unit column stride; outputs are contiguous.
struct RmsNormForwardPlan {
  int64_t n = 0;
  rms::Casting casting = rms::Casting::kLlama;
  at::Tensor x, residual, weight;                 // residual, weight may be undefined
  at::Tensor out, residual_out, rstd;             // residual_out undefined for rms_norm
  bool empty() const { return out.numel() == 0; }
};

inline RmsNormForwardPlan plan_rms_norm_forward(const char* op, const at::Tensor& input,
                                                const std::optional<at::Tensor>& residual,
                                                const std::optional<at::Tensor>& weight,
                                                double eps, double offset,
                                                std::string_view casting) {
  RmsNormForwardPlan p;
  p.n = check_rms_norm_args(op, input, weight, eps, offset);
  p.casting = parse_casting(casting, op);
  if (residual) {
    check_same(input, "input", *residual, "residual", op);
    TORCH_CHECK_VALUE(residual->sizes() == input.sizes(), op,
                      ": residual must have the shape of input ", input.sizes(), ", got ",
                      residual->sizes());
  }
  p.out = at::empty(input.sizes(), input.options());
  if (residual) p.residual_out = at::empty(input.sizes(), input.options());
  p.rstd = at::empty(row_shape(input), input.options().dtype(accumulation_dtype(input)));
  if (input.numel() == 0) {
    if (p.n == 0) p.rstd.fill_(std::numeric_limits<double>::quiet_NaN());  // mean of nothing
    return p;
  }
  p.x = as_rows(input, p.n);
  if (residual) p.residual = as_rows(*residual, p.n);
  if (weight && weight->defined()) p.weight = weight->contiguous();
  return p;
}

// Checked, laid-out operands and outputs of a backward call.
struct RmsNormBackwardPlan {
  int64_t n = 0;
  rms::Casting casting = rms::Casting::kLlama;
  at::Tensor grad_out, x, rstd, weight, grad_residual;  // weight, grad_residual may be undefined
  at::Tensor grad_input, grad_weight;  // grad_weight is [0] unless wanted
  bool want_weight_grad = false;
  bool empty() const { return grad_input.numel() == 0; }
};

inline RmsNormBackwardPlan plan_rms_norm_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, double offset, std::string_view casting,
    const std::optional<at::Tensor>& grad_residual, bool compute_weight_grad) {
  const char* op = "fusedllm.rms_norm_backward";
  RmsNormBackwardPlan p;
  p.n = check_rms_norm_args(op, input, weight, 0.0, offset);
  p.casting = parse_casting(casting, op);
  check_same(input, "input", grad_out, "grad_out", op);
  TORCH_CHECK_VALUE(grad_out.sizes() == input.sizes(), op, ": grad_out must have the shape of input");
  TORCH_CHECK_VALUE(rstd.scalar_type() == accumulation_dtype(input) && rstd.device() == input.device() &&
                        rstd.numel() * p.n == input.numel(),
                    op, ": rstd must be the per-row statistic returned by the forward op");
  if (grad_residual) {
    check_same(input, "input", *grad_residual, "grad_residual", op);
    TORCH_CHECK_VALUE(grad_residual->sizes() == input.sizes(), op,
                      ": grad_residual must have the shape of input");
  }
  const bool has_weight = weight.has_value() && weight->defined();
  p.want_weight_grad = has_weight && compute_weight_grad;
  p.grad_input = at::empty(input.sizes(), input.options());
  // Every device's kernels write each element of the weight gradient; zeros
  // only where no kernel runs (no rows), which saves a fill per call.
  p.grad_weight = !p.want_weight_grad ? at::empty({0}, input.options())
                  : input.numel() == 0 ? at::zeros({p.n}, input.options())
                                       : at::empty({p.n}, input.options());
  if (input.numel() == 0) return p;
  p.grad_out = as_rows(grad_out, p.n);
  p.x = as_rows(input, p.n);
  p.rstd = rstd.contiguous();
  if (has_weight) p.weight = weight->contiguous();
  if (grad_residual) p.grad_residual = as_rows(*grad_residual, p.n);
  return p;
}

// The three operators for one device. `Impl` provides
//   static void forward(const RmsNormForwardPlan&, double eps, double offset);
//   static void backward(const RmsNormBackwardPlan&, double offset);
// which run the kernels on non-empty plans.
template <typename Impl>
struct RmsNormOps {
  static std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& input,
                                                     const std::optional<at::Tensor>& weight,
                                                     double eps, double offset,
                                                     c10::string_view casting) {
    auto p = plan_rms_norm_forward("fusedllm.rms_norm", input, std::nullopt, weight, eps, offset,
                                   casting);
    if (!p.empty()) Impl::forward(p, eps, offset);
    return {p.out, p.rstd};
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm(
      const at::Tensor& input, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
      double eps, double offset, c10::string_view casting) {
    auto p = plan_rms_norm_forward("fusedllm.fused_add_rms_norm", input, residual, weight, eps,
                                   offset, casting);
    if (!p.empty()) Impl::forward(p, eps, offset);
    return {p.out, p.residual_out, p.rstd};
  }

  static std::tuple<at::Tensor, at::Tensor> rms_norm_backward(
      const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& rstd,
      const std::optional<at::Tensor>& weight, double offset, c10::string_view casting,
      const std::optional<at::Tensor>& grad_residual, bool compute_weight_grad) {
    auto p = plan_rms_norm_backward(grad_out, input, rstd, weight, offset, casting, grad_residual,
                                    compute_weight_grad);
    if (!p.empty()) Impl::backward(p, offset);
    return {p.grad_input, p.grad_weight};
  }
};

}  // namespace fusedllm

// Registers the rms_norm operators of one dispatch key; use inside TORCH_LIBRARY_IMPL.
#define FUSEDLLM_IMPL_RMS_NORM_OPS(m, Impl)                                           \
  do {                                                                                \
    (m).impl("rms_norm", &::fusedllm::RmsNormOps<Impl>::rms_norm);                    \
    (m).impl("fused_add_rms_norm", &::fusedllm::RmsNormOps<Impl>::fused_add_rms_norm); \
    (m).impl("rms_norm_backward", &::fusedllm::RmsNormOps<Impl>::rms_norm_backward);  \
  } while (0)
