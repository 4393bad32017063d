// Argument checks and layout helpers shared by every op's CPU and CUDA
// implementations, so both reject the same inputs with the same words.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace fusedllm {

// "torch.float16", as Python users spell a dtype (c10 prints "Half").
inline std::string dtype_name(at::ScalarType dt) {
  return "torch." + std::string(c10::getDtypeNames(dt).first);
}

// What the ops compute in and return their statistics in (rstd, lse, losses,
// router weights): float64 for float64, float32 for the rest
// (fusedllm._limits.accumulation_dtype).
inline at::ScalarType accumulation_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}
inline at::ScalarType accumulation_dtype(const at::Tensor& t) { return accumulation_dtype(t.scalar_type()); }

// The dtypes every op takes: fusedllm._limits.FLOAT_DTYPES (tests/test_limits.py).
inline void check_float_tensor(const at::Tensor& t, const char* op, const char* name) {
  auto dt = t.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
                    op, ": ", name, " must be float32, float64, bfloat16 or float16, got ",
                    dtype_name(dt));
}

inline void check_same(const at::Tensor& ref, const char* ref_name, const at::Tensor& t,
                       const char* name, const char* op) {
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " has dtype ",
                    dtype_name(t.scalar_type()), " but ", ref_name, " has dtype ",
                    dtype_name(ref.scalar_type()));
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ",
                    ref_name, " is on ", ref.device());
}

// [rows, n] view of `t` with unit stride along n (a copy only when no such view exists).
inline at::Tensor as_rows(const at::Tensor& t, int64_t n) {
  at::Tensor rows = t.reshape({-1, n});
  if (n > 1 && rows.stride(1) != 1) rows = rows.contiguous();
  return rows;
}

}  // namespace fusedllm
