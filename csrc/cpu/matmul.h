// Matrix products of the CPU ops that call torch's BLAS (linear cross-entropy,
// the mixture-of-experts products).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace fusedllm::cpu {

// out = a @ b (+ bias, a row broadcast over out's rows), summed in float32
// (float64 for float64) and rounded once to out's dtype. a and b are 2-D in
// one dtype; out is 2-D in theirs. Torch's multiply, except for half-precision
// operands where torch's have no matrix instructions (bfloat16 without AVX-512;
// float16 always): there they are made from float32 blocks.
void matrix_product(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                    const std::optional<at::Tensor>& bias);

}  // namespace fusedllm::cpu
