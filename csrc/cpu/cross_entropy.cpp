// Linear cross-entropy ops on CPU: the chunked pass of
// fusedllm/cross_entropy_op.h with the multiplies of matmul.h and the row
// kernel variant for the running CPU, in place on the logits chunk.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <optional>

#include "cross_entropy_kernel.h"
#include "fusedllm/cross_entropy_op.h"
#include "matmul.h"

namespace fusedllm::cpu {

FUSEDLLM_DEFINE_CPU_KERNEL_TABLE(CrossEntropyRowFn, cross_entropy_row_kernels, "cross_entropy_rows");

namespace {

struct CpuCrossEntropy {
  // A half-precision weight's gradient over several chunks is always made by
  // slabs: one rounding, at the cost of a fourth multiply.
  static constexpr int64_t kHalfWeightSumFromRows = std::numeric_limits<int64_t>::max();

  static void matmul(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                     const std::optional<at::Tensor>& bias) {
    matrix_product(out, a, b, bias);
  }

  // Only float32 / float64 weights' gradients are summed over chunks here.
  static void matmul_add(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
    out.addmm_(a, b);
  }

  static void rows(const CrossEntropyRows& r) {
    CrossEntropyRowArgs a{};
    a.dtype = r.logits.scalar_type();
    a.options = r.options;
    a.ignore_index = r.ignore_index;
    a.rows = r.logits.size(0);
    a.vocab = r.logits.size(1);
    a.logits = r.logits.data_ptr();
    a.logits_stride = r.logits.stride(0);
    a.target = r.target.const_data_ptr<int64_t>();
    a.loss = r.loss.data_ptr();
    a.lse = r.lse.data_ptr();
    a.scale = r.scale.defined() ? r.scale.const_data_ptr() : nullptr;
    a.grad = r.grad;
    a.slab = r.slab;
    a.column0 = r.column0;
    cross_entropy_row_kernels.get()(a);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, CPU, m) { FUSEDLLM_IMPL_CROSS_ENTROPY_OPS(m, CpuCrossEntropy); }

}  // namespace fusedllm::cpu
