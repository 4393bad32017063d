// The fused linear cross-entropy ops, shared by the CPU and CUDA
// implementations: argument checks and the pass over token chunks. Each chunk's
// logits [rows, V] are one matrix multiply into the input dtype; the device's
// row kernel turns them into lse, losses and, when asked, the logits' gradient
// in place (float32 math, float64 for float64); two more multiplies give the
// chunk's hidden gradient and add its share of the weight gradient, or, for a
// half-precision weight over chunks too small for that to pay, a second pass
// by vocabulary slabs makes the weight gradient. Only a chunk (or a slab) of
// the [tokens, V] logits exists at a time.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <string>
#include <string_view>
#include <tuple>

#include "fusedllm/checks.h"
#include "fusedllm/cross_entropy.h"

namespace fusedllm {

// The schemas of cross_entropy's operators, for torch.ops.fusedllm (csrc/cross_entropy.cpp) and the
// emulated torch.ops.fusedllm_simt (csrc/cuda/cross_entropy.cu).
inline void define_cross_entropy_ops(torch::Library& m) {
  // Cross-entropy of the logits hidden [N, H] @ weight[V, H]^T (+ bias) against
  // target [N] (int64; ignore_index skipped), without the [N, V] logits: chunks
  // of tokens, float32 (float64) math. softcap 0 means no cap. reduction is
  // "mean" (over tokens not ignored), "sum" or "none" (per-token, 0 where
  // ignored); the result is float32 (float64 for float64 inputs).
  m.def("linear_cross_entropy(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
        "int ignore_index, str reduction, float label_smoothing, float softcap, float z_loss)"
        " -> Tensor");
  // The pass behind it: per-token losses (float32, float64 for float64) and, as
  // output_mask asks, the gradients of sum(grad_scale * loss) (grad_scale
  // absent: 1) for hidden, weight and bias, formed chunk by chunk in the same pass.
  m.def("linear_cross_entropy_pass(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
        "Tensor? grad_scale, int ignore_index, float label_smoothing, float softcap, "
        "float z_loss, bool[3] output_mask) -> (Tensor loss, Tensor grad_hidden, "
        "Tensor grad_weight, Tensor grad_bias)");
}

// Reductions: fusedllm._limits.REDUCTIONS (tests/test_limits.py).
enum class Reduction { kNone, kMean, kSum };

inline Reduction parse_reduction(std::string_view reduction, const char* op) {
  if (reduction == "mean") return Reduction::kMean;
  if (reduction == "sum") return Reduction::kSum;
  if (reduction == "none") return Reduction::kNone;
  TORCH_CHECK_VALUE(false, op, ": reduction must be 'mean', 'sum' or 'none', got '",
                    std::string(reduction), "'");
}

// One chunk's row pass, for the device's row kernel. `logits` [rows, V]
// (row-contiguous, the input dtype) holds z on entry; with `grad`, the row
// kernel writes over it the gradient of sum(scale * loss) with respect to z.
// With `slab`, `logits` holds the columns column0 .. column0 + logits.size(1) - 1
// of the rows: their lse is read (not computed), no loss is written, and only
// the gradient is (`grad` is set).
struct CrossEntropyRows {
  ce::Options options;
  int64_t ignore_index = -100;
  at::Tensor logits, target;  // target: int64 [rows]
  at::Tensor loss, lse;       // accumulation dtype [rows]
  at::Tensor scale;           // accumulation dtype [rows], or undefined: 1 for every row
  bool grad = false;
  bool slab = false;
  int64_t column0 = 0;
};

// t in dtype dt, without calling `to` when t has it already (`to` then returns
// t itself, which torch's schema checks refuse from an operator's kernel).
inline at::Tensor converted(const at::Tensor& t, at::ScalarType dt) {
  return t.scalar_type() == dt ? t : t.to(dt);
}

struct CrossEntropyArgs {
  ce::Options options;
  int64_t ignore_index;
};

inline CrossEntropyArgs check_cross_entropy(const char* op, const at::Tensor& hidden,
                                            const at::Tensor& weight,
                                            const std::optional<at::Tensor>& bias,
                                            const at::Tensor& target, int64_t ignore_index,
                                            double smoothing, double softcap, double z_loss) {
  check_float_tensor(hidden, op, "hidden");
  TORCH_CHECK_VALUE(hidden.dim() == 2, op, ": hidden must be [tokens, hidden_size], got shape ",
                    hidden.sizes());
  check_same(hidden, "hidden", weight, "weight", op);
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == hidden.size(1), op,
                    ": weight must be [vocab, ", hidden.size(1), "] (hidden's last dim), got shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(weight.size(0) >= 1, op, ": weight has an empty vocabulary (shape ",
                    weight.sizes(), ")");
  if (bias.has_value()) {
    check_same(hidden, "hidden", *bias, "bias", op);
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), op,
                      ": bias must be [", weight.size(0), "] (weight's vocabulary), got shape ",
                      bias->sizes());
  }
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong, op,
                    ": target must hold int64 class indices, got ", dtype_name(target.scalar_type()));
  TORCH_CHECK_VALUE(target.device() == hidden.device(), op, ": target is on ", target.device(),
                    " but hidden is on ", hidden.device());
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == hidden.size(0), op,
                    ": target must be [", hidden.size(0), "] (one per token of hidden), got shape ",
                    target.sizes());
  TORCH_CHECK_VALUE(std::isfinite(smoothing) && smoothing >= 0.0 && smoothing <= 1.0, op,
                    ": label_smoothing must be in [0, 1], got ", smoothing);
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0, op,
                    ": softcap must be a finite number > 0 (0: no cap), got ", softcap);
  TORCH_CHECK_VALUE(std::isfinite(z_loss) && z_loss >= 0.0, op,
                    ": z_loss must be a finite number >= 0, got ", z_loss);
  // A target out of range would index past the row: refused here where the
  // check costs no device synchronisation; the CUDA row kernel gives NaN.
  if (!target.is_cuda() && target.numel() > 0) {
    const int64_t vocab = weight.size(0);
    const at::Tensor bad = (target != ignore_index) & ((target < 0) | (target >= vocab));
    if (bad.any().item<bool>()) {
      const int64_t first = bad.nonzero()[0][0].item<int64_t>();
      TORCH_CHECK_VALUE(false, op, ": target[", first, "] = ", target[first].item<int64_t>(),
                        " is not a class index in [0, ", vocab, ") nor ignore_index (",
                        ignore_index, ")");
    }
  }
  CrossEntropyArgs a;
  a.options.smoothing = smoothing;
  a.options.softcap = softcap;
  a.options.z_loss = z_loss;
  a.options.vocab = weight.size(0);
  a.ignore_index = ignore_index;
  return a;
}

// Chunk rows and slab columns of 128 or more are multiples of 128: a
// [4096, 1333] bfloat16 slab sent cuBLAS to pre-Hopper kernels, 3x slower on an
// H200, and 524-row float32 chunks were 13% slower than 512-row ones.
constexpr int64_t kChunkStep = 128;

// n rounded down to a multiple of kChunkStep where it has one, else kept.
inline int64_t chunk_step_floor(int64_t n) { return n >= kChunkStep ? n / kChunkStep * kChunkStep : n; }

// Bytes of logits a chunk (or a slab) may hold: about as many values as the
// hidden states hold, in rows = tokens / ceil(vocab / hidden) rounded up to a
// power of two, so that the op's memory is the gradients' and one buffer of
// about the hidden states' size; at least 4 MiB, so that small inputs take
// one chunk. A float32 / float64 weight's gradient is summed in place over
// the chunks, each reading and writing it whole: there the budget is at least
// a quarter of the weight's bytes (2048 tokens x 2048 -> 128256: 261-row
// chunks took 4-14% longer than 1024-row ones).
inline int64_t logits_budget(int64_t tokens, int64_t vocab, int64_t hidden, int64_t logit_bytes,
                             bool full_weight_sum) {
  const int64_t per_feature = (vocab + hidden - 1) / std::max<int64_t>(hidden, 1);
  const int64_t rows_wanted = (tokens + per_feature - 1) / per_feature;
  int64_t rows = 1;
  while (rows < rows_wanted) rows *= 2;
  int64_t budget = std::max<int64_t>(rows * vocab * logit_bytes, int64_t{4} << 20);
  if (full_weight_sum) budget = std::max(budget, vocab * hidden * logit_bytes / 4);
  return budget;
}

// Tokens per chunk: as many as fit in `budget` bytes of logits.
// FUSEDLLM_CE_CHUNK_ROWS sets it (the tests use it to cross chunk boundaries
// at small sizes).
inline int64_t chunk_rows(int64_t tokens, int64_t vocab, int64_t logit_bytes, int64_t budget) {
  int64_t rows = chunk_step_floor(budget / (vocab * logit_bytes));
  if (const char* forced = std::getenv("FUSEDLLM_CE_CHUNK_ROWS")) rows = std::atoll(forced);
  return std::clamp<int64_t>(rows, 1, std::max<int64_t>(tokens, 1));
}

// Vocabulary columns per slab of the weight gradient's pass: as many as fit in
// `budget` bytes of [tokens, columns] logits. FUSEDLLM_CE_SLAB_COLUMNS sets it (tests).
inline int64_t slab_columns(int64_t tokens, int64_t vocab, int64_t logit_bytes, int64_t budget) {
  int64_t columns = chunk_step_floor(budget / (tokens * logit_bytes));
  if (const char* forced = std::getenv("FUSEDLLM_CE_SLAB_COLUMNS")) columns = std::atoll(forced);
  return std::clamp<int64_t>(columns, 1, vocab);
}

// What cross_entropy's reduction makes of per-token losses: the mean is over
// the tokens not ignored (NaN when all are).
inline at::Tensor reduce_losses(const at::Tensor& per_token, const at::Tensor& target,
                                int64_t ignore_index, Reduction r) {
  if (r == Reduction::kNone) return per_token;
  at::Tensor total = per_token.sum();
  if (r == Reduction::kSum) return total;
  return total / (target != ignore_index).sum().to(per_token.scalar_type());
}

// Impl provides:
//   matmul(out, a, b, bias): out = a @ b (+ bias, a row broadcast over out's
//     rows), a and b 2-D in the input dtype with one unit stride each, out
//     row-contiguous in it; float32 accumulation (float64 for float64), one
//     rounding to out's dtype;
//   matmul_add(out, a, b): out += a @ b, likewise summed and rounded once;
//   kHalfWeightSumFromRows: chunk rows from which a half-precision weight's
//     gradient is summed over the chunks in its own dtype (one rounding per
//     chunk) rather than made by vocabulary slabs (a fourth multiply, one
//     rounding);
//   rows(const CrossEntropyRows&): the row kernel.
// The operands of one pass, row-contiguous for the multiplies (a copy only
// where not already), and what its loops write: per-token losses and lse.
struct CrossEntropyPass {
  at::Tensor hidden, weight, target, scale;  // scale: undefined for 1 on every token
  std::optional<at::Tensor> bias;
  at::Tensor loss, lse;
  CrossEntropyArgs args;
  bool grad = false;

  // The row kernel's arguments for logits z of tokens [r0, r0 + n).
  CrossEntropyRows rows(const at::Tensor& z, int64_t r0, int64_t n) const {
    CrossEntropyRows r;
    r.options = args.options;
    r.ignore_index = args.ignore_index;
    r.logits = z;
    r.target = target.narrow(0, r0, n);
    r.loss = loss.narrow(0, r0, n);
    r.lse = lse.narrow(0, r0, n);
    if (scale.defined()) r.scale = scale.narrow(0, r0, n);
    r.grad = grad;
    return r;
  }
};

// [rows, columns] row-contiguous view of storage's first elements.
inline at::Tensor logits_view(const at::Tensor& storage, int64_t rows, int64_t columns) {
  return storage.narrow(0, 0, rows * columns).view({rows, columns});
}

// Impl provides:
//   matmul(out, a, b, bias): out = a @ b (+ bias, a row broadcast over out's
//     rows), a and b 2-D in the input dtype with one unit stride each, out
//     row-contiguous in it; float32 accumulation (float64 for float64), one
//     rounding to out's dtype;
//   matmul_add(out, a, b): out += a @ b, likewise summed and rounded once;
//   kHalfWeightSumFromRows: chunk rows from which a half-precision weight's
//     gradient is summed over the chunks in its own dtype (one rounding per
//     chunk) rather than made by vocabulary slabs (a fourth multiply, one
//     rounding);
//   rows(const CrossEntropyRows&): the row kernel.
template <typename Impl>
struct CrossEntropyOps {
  // Per-token losses (accumulation dtype, 0 for ignored tokens) and, as
  // output_mask asks, the gradients of sum(grad_scale * loss) (grad_scale
  // absent: 1 for every token) for hidden, weight and bias; empty tensors for
  // those not asked.
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pass(
      const at::Tensor& hidden_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias,
      const at::Tensor& target_in, const std::optional<at::Tensor>& grad_scale,
      int64_t ignore_index, double smoothing, double softcap, double z_loss,
      std::array<bool, 3> output_mask) {
    const char* op = "fusedllm.linear_cross_entropy";
    const CrossEntropyArgs args = check_cross_entropy(op, hidden_in, weight_in, bias, target_in,
                                                      ignore_index, smoothing, softcap, z_loss);
    const int64_t tokens = hidden_in.size(0), hidden_size = hidden_in.size(1);
    const int64_t vocab = weight_in.size(0);
    const at::ScalarType dtype = hidden_in.scalar_type();
    const at::ScalarType acc = accumulation_dtype(dtype);
    const auto acc_opts = hidden_in.options().dtype(acc);
    if (grad_scale.has_value()) {
      TORCH_CHECK_VALUE(grad_scale->device() == hidden_in.device() &&
                            grad_scale->sizes() == at::IntArrayRef({tokens}),
                        op, ": grad_scale must be [", tokens, "] on ", hidden_in.device(),
                        ", got shape ", grad_scale->sizes(), " on ", grad_scale->device());
    }
    const auto [want_hidden, want_weight, want_bias_in] = output_mask;
    const bool want_bias = want_bias_in && bias.has_value();

    at::Tensor loss = at::empty({tokens}, acc_opts);
    at::Tensor grad_hidden = want_hidden ? at::empty_like(hidden_in, at::MemoryFormat::Contiguous)
                                         : hidden_in.new_empty({0});
    // The logits have the input dtype, each rounded once as an eager linear
    // layer rounds it, and the row kernel writes their gradient over them.
    const int64_t logit_bytes = c10::elementSize(dtype);
    const bool half = dtype != acc;
    const int64_t budget =
        logits_budget(tokens, vocab, hidden_size, logit_bytes, want_weight && !half);
    const int64_t chunk = chunk_rows(tokens, vocab, logit_bytes, budget);
    // A half-precision weight's gradient over several chunks: a float32 sum of
    // it would be twice the weight's size (most of the op's memory). Summed in
    // its own dtype, each chunk reads and writes it whole; where chunks are
    // small that traffic costs more than a fourth multiply, and the gradient
    // is made by vocabulary slabs instead: after the chunks (logits, lse,
    // loss, hidden gradient), each slab's logits for all tokens are made again
    // from the known lse, and its rows of the weight gradient are one multiply
    // over all tokens (one rounding).
    const bool by_slabs =
        want_weight && half && chunk < tokens && chunk < Impl::kHalfWeightSumFromRows;
    const int64_t slab = by_slabs ? slab_columns(tokens, vocab, logit_bytes, budget) : 0;
    at::Tensor grad_weight = want_weight ? at::empty_like(weight_in, at::MemoryFormat::Contiguous)
                                         : hidden_in.new_empty({0});
    at::Tensor grad_bias = hidden_in.new_empty({0});
    if (tokens == 0) {
      if (want_weight) grad_weight.zero_();
      if (want_bias) grad_bias = at::zeros({vocab}, hidden_in.options());
      return {loss, grad_hidden, grad_weight, grad_bias};
    }

    CrossEntropyPass p;
    p.hidden = hidden_in.stride(1) == 1 ? hidden_in : hidden_in.contiguous();
    p.weight = weight_in.stride(1) == 1 ? weight_in : weight_in.contiguous();
    p.target = target_in.contiguous();
    if (grad_scale.has_value()) p.scale = converted(*grad_scale, acc).contiguous();
    p.bias = bias;
    p.loss = loss;
    p.lse = at::empty({tokens}, acc_opts);
    p.args = args;
    p.grad = want_hidden || want_weight || want_bias;
    // One buffer for the chunks' logits, then the slabs'; the gradients go in place.
    const at::Tensor buffer = at::empty({std::max(chunk * vocab, tokens * slab)}, p.hidden.options());
    at::Tensor grad_bias_acc = want_bias ? at::zeros({vocab}, acc_opts) : at::Tensor();
    by_chunks(p, buffer, chunk, want_hidden ? grad_hidden : at::Tensor(),
              want_weight && !by_slabs ? grad_weight : at::Tensor(), grad_bias_acc);
    if (by_slabs) weight_grad_by_slabs(p, buffer, slab, grad_weight);
    if (want_bias) grad_bias = converted(grad_bias_acc, dtype);
    return {loss, grad_hidden, grad_weight, grad_bias};
  }

  // z = h @ weight[v0 : v0 + columns]^T (+ bias[v0 : v0 + columns]).
  static void logits(at::Tensor& z, const CrossEntropyPass& p, const at::Tensor& h, int64_t v0,
                     int64_t columns) {
    std::optional<at::Tensor> b;
    if (p.bias.has_value()) b = p.bias->narrow(0, v0, columns);
    Impl::matmul(z, h, p.weight.narrow(0, v0, columns).t(), b);
  }

  // Chunks of `chunk` tokens: logits, the row kernel (loss, lse and, with
  // p.grad, the logits' gradient in place), then the gradients asked for from
  // it (an undefined tensor: not asked).
  static void by_chunks(const CrossEntropyPass& p, const at::Tensor& buffer, int64_t chunk,
                        const at::Tensor& grad_hidden, const at::Tensor& grad_weight,
                        const at::Tensor& grad_bias_acc) {
    const int64_t tokens = p.hidden.size(0), vocab = p.weight.size(0);
    for (int64_t r0 = 0; r0 < tokens; r0 += chunk) {
      const int64_t n = std::min(chunk, tokens - r0);
      const at::Tensor h = p.hidden.narrow(0, r0, n);
      at::Tensor z = logits_view(buffer, n, vocab);
      logits(z, p, h, 0, vocab);
      Impl::rows(p.rows(z, r0, n));
      if (!p.grad) continue;
      if (grad_hidden.defined()) {
        at::Tensor dh = grad_hidden.narrow(0, r0, n);
        Impl::matmul(dh, z, p.weight, std::nullopt);
      }
      if (grad_weight.defined()) {
        at::Tensor dw = grad_weight;
        if (r0 == 0) {
          Impl::matmul(dw, z.t(), h, std::nullopt);
        } else {
          Impl::matmul_add(dw, z.t(), h);
        }
      }
      if (grad_bias_acc.defined()) {
        at::Tensor(grad_bias_acc).add_(at::sum(z, 0, false, grad_bias_acc.scalar_type()));
      }
    }
  }

  // The weight gradient by vocabulary slabs of `slab` columns, after the
  // chunks: each slab's logits for every token again, their gradient from the
  // known lse, one multiply over all tokens.
  static void weight_grad_by_slabs(const CrossEntropyPass& p, const at::Tensor& buffer, int64_t slab,
                                   at::Tensor& grad_weight) {
    const int64_t tokens = p.hidden.size(0), vocab = p.weight.size(0);
    for (int64_t v0 = 0; v0 < vocab; v0 += slab) {
      const int64_t columns = std::min(slab, vocab - v0);
      at::Tensor z = logits_view(buffer, tokens, columns);
      logits(z, p, p.hidden, v0, columns);
      CrossEntropyRows rows = p.rows(z, 0, tokens);
      rows.slab = true;
      rows.column0 = v0;
      Impl::rows(rows);
      at::Tensor dw = grad_weight.narrow(0, v0, columns);
      Impl::matmul(dw, z.t(), p.hidden, std::nullopt);
    }
  }

  // The reduced loss (or per-token losses) in the accumulation dtype; no gradients.
  static at::Tensor loss(const at::Tensor& hidden, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, const at::Tensor& target,
                         int64_t ignore_index, c10::string_view reduction, double smoothing,
                         double softcap, double z_loss) {
    const Reduction r = parse_reduction(reduction, "fusedllm.linear_cross_entropy");
    auto per_token = std::get<0>(pass(hidden, weight, bias, target, std::nullopt, ignore_index,
                                      smoothing, softcap, z_loss, {false, false, false}));
    return reduce_losses(per_token, target, ignore_index, r);
  }
};

}  // namespace fusedllm

// Registers the linear cross-entropy operators of one dispatch key; use inside TORCH_LIBRARY_IMPL.
#define FUSEDLLM_IMPL_CROSS_ENTROPY_OPS(m, Impl)                                         \
  do {                                                                                   \
    (m).impl("linear_cross_entropy", &::fusedllm::CrossEntropyOps<Impl>::loss);          \
    (m).impl("linear_cross_entropy_pass", &::fusedllm::CrossEntropyOps<Impl>::pass);     \
  } while (0)
