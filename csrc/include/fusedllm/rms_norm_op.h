// Host-side argument checks and layout for the rms_norm ops, shared by the CPU
// and CUDA implementations so both reject the same inputs with the same words.
#pragma once

#include <ATen/ATen.h>

#include <string_view>

#include "fusedllm/rms_norm.h"

namespace fusedllm {

inline rms::Casting parse_casting(std::string_view casting) {
  if (casting == "llama") return rms::Casting::kLlama;
  if (casting == "gemma") return rms::Casting::kGemma;
  TORCH_CHECK_VALUE(false, "fusedllm.rms_norm: casting must be 'llama' or 'gemma', got '",
                    std::string(casting), "'");
}

inline void check_float_tensor(const at::Tensor& t, const char* op, const char* name) {
  auto dt = t.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
                    op, ": ", name, " must be float32, float64, bfloat16 or float16, got ", dt);
}

inline void check_same(const at::Tensor& ref, const char* ref_name, const at::Tensor& t,
                       const char* name, const char* op) {
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " has dtype ",
                    t.scalar_type(), " but ", ref_name, " has dtype ", ref.scalar_type());
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ",
                    ref_name, " is on ", ref.device());
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

// [rows, n] view of `t` with unit stride along n (a copy only when no such view exists).
inline at::Tensor as_rows(const at::Tensor& t, int64_t n) {
  at::Tensor rows = t.reshape({-1, n});
  if (n > 1 && rows.stride(1) != 1) rows = rows.contiguous();
  return rows;
}

inline at::ScalarType rstd_dtype(const at::Tensor& input) {
  return input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline std::vector<int64_t> row_shape(const at::Tensor& input) {
  auto sizes = input.sizes().vec();
  sizes.pop_back();
  return sizes;
}

}  // namespace fusedllm
