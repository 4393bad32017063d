// Host-side checks and layout for quantize_kv, shared by the CPU and CUDA
// implementations.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <initializer_list>
#include <utility>

#include "fusedllm/checks.h"
#include "fusedllm/kv_quant.h"

namespace fusedllm {

// The schemas of kv_quant's operators, for torch.ops.fusedllm (csrc/kv_quant.cpp) and the
// emulated torch.ops.fusedllm_simt (csrc/cuda/kv_quant.cu).
inline void define_kv_quant_ops(torch::Library& m) {
  // Symmetric quantization of key / value rows, written into a cache: each
  // row x of the last dim (one position of one kv head) gets scale =
  // max|x| / L and values round_half_even(x / scale): int8 in [-127, 127]
  // (L = 127) or float8_e4m3fn (L = 448), as values' dtype says (a row with
  // a non-finite entry: scale NaN). x [..., D] (up to 4-D), values of x's
  // shape and scales float32 [...], any strides.
  m.def("quantize_kv(Tensor x, Tensor(a!) values, Tensor(b!) scales) -> ()");
}

// x, values [B, H, S, D] and scales [B, H, S] views (leading size-1 dims
// added), any strides; rows = B * H * S.
struct QuantizeKvPlan {
  at::Tensor x, values, scales;
  int64_t rows = 0, head_dim = 0;
  kvq::Code code = kvq::Code::kInt8;  // from values' dtype
};

// The code a quantized cache's dtype stores: int8 or float8_e4m3fn; false for any other dtype.
inline bool kv_code(at::ScalarType dt, kvq::Code& code) {
  if (dt == at::kChar) code = kvq::Code::kInt8;
  else if (dt == at::kFloat8_e4m3fn) code = kvq::Code::kFloat8;
  else return false;
  return true;
}

inline QuantizeKvPlan plan_quantize_kv(const at::Tensor& x, const at::Tensor& values,
                                       const at::Tensor& scales) {
  const char* op = "fusedllm.quantize_kv";
  check_float_tensor(x, op, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.dim() <= 4, op, ": x must have 1 to 4 dims [..., head_dim], got shape ",
                    x.sizes());
  kvq::Code code;
  TORCH_CHECK_VALUE(kv_code(values.scalar_type(), code), op, ": values must be int8 or float8_e4m3fn, got ",
                    dtype_name(values.scalar_type()));
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat, op, ": scales must be float32, got ",
                    dtype_name(scales.scalar_type()));
  TORCH_CHECK_VALUE(values.sizes() == x.sizes(), op, ": values must have x's shape ", x.sizes(), ", got ",
                    values.sizes());
  const auto rows_shape = x.sizes().slice(0, x.dim() - 1);
  TORCH_CHECK_VALUE(scales.sizes() == rows_shape, op, ": scales must be x's shape without its last dim ",
                    rows_shape, ", got ", scales.sizes());
  // The list's type spelled out: nvcc 12.4's front end deduces none from a braced list whose
  // later elements are braced lists themselves ("cannot deduce type of range").
  for (const auto& [t, name] :
       std::initializer_list<std::pair<const at::Tensor&, const char*>>{{values, "values"}, {scales, "scales"}}) {
    TORCH_CHECK_VALUE(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but x is on ",
                      x.device());
    TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": ", name,
                      " has elements that share memory (an expanded view): it is written to");
  }
  QuantizeKvPlan p{x, values, scales, scales.numel(), x.size(-1), code};
  while (p.x.dim() < 4) {
    p.x = p.x.unsqueeze(0);
    p.values = p.values.unsqueeze(0);
  }
  while (p.scales.dim() < 3) p.scales = p.scales.unsqueeze(0);
  return p;
}

template <typename Impl>
struct QuantizeKvOps {
  static void quantize_kv(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales) {
    const QuantizeKvPlan p = plan_quantize_kv(x, values, scales);
    if (p.rows > 0) Impl::run(p);
  }
};

}  // namespace fusedllm

// Registers quantize_kv for one dispatch key; use inside TORCH_LIBRARY_IMPL.
#define FUSEDLLM_IMPL_QUANTIZE_KV_OPS(m, Impl) \
  (m).impl("quantize_kv", &::fusedllm::QuantizeKvOps<Impl>::quantize_kv)
