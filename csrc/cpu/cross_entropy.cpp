// Linear cross-entropy ops on CPU: the chunked pass of
// fusedllm/cross_entropy_op.h with the multiplies of matmul.h and the row
// kernel variant for the running CPU, in place on the logits chunk.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "cross_entropy_kernel.h"
#include "fusedllm/cross_entropy_op.h"
#include "matmul.h"

namespace fusedllm::cpu {

FUSEDLLM_DEFINE_CPU_KERNEL_TABLE(CrossEntropyRowFn, cross_entropy_row_kernels, "cross_entropy_rows");

namespace {

struct CpuCrossEntropy {
  // The logits chunk has the input dtype: each logit is rounded once to it,
  // as an eager linear layer does, and the row kernel turns it into the
  // gradient in place.
  static constexpr bool kLogitsInInputDtype = true;

  static void matmul(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                     const std::optional<at::Tensor>& bias) {
    matrix_product(out, a, b, bias);
  }

  static void rows(const CrossEntropyRows& r) {
    TORCH_INTERNAL_ASSERT(!r.grad || r.grad_logits.data_ptr() == r.logits.data_ptr());
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
