// Argument checks and layout helpers shared by every op's CPU and CUDA
// implementations, so both reject the same inputs with the same words.
#pragma once

#include <ATen/ATen.h>

namespace fusedllm {

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

// [rows, n] view of `t` with unit stride along n (a copy only when no such view exists).
inline at::Tensor as_rows(const at::Tensor& t, int64_t n) {
  at::Tensor rows = t.reshape({-1, n});
  if (n > 1 && rows.stride(1) != 1) rows = rows.contiguous();
  return rows;
}

}  // namespace fusedllm
