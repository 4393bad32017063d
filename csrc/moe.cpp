// moe_route and moe_experts: their schemas (defined in fusedllm/moe_op.h), their CPU
// operators (the flow of fusedllm/moe_op.h with each expert's rows multiplied by
// cpu/matmul.h's products, blocks of its contiguous rows spread over threads, and
// the router and row moves of fusedllm/moe.h spread over threads by token) and
// their autograd.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <vector>

#include "cpu/matmul.h"
#include "fusedllm/activations.h"
#include "fusedllm/autograd.h"
#include "fusedllm/macros.h"
#include "fusedllm/moe.h"
#include "fusedllm/moe_op.h"

FUSEDLLM_DEFINE_OPS(fusedllm, define_moe_ops)

namespace fusedllm::cpu {
namespace {

struct Math {
  static float exp(float x) { return std::exp(x); }
  static double exp(double x) { return std::exp(x); }
};

// Rows per parallel_for task for row moves of `cols` values each.
int64_t grain(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

struct CpuMoe {
  static constexpr const char* kOps = "fusedllm";
  static constexpr int64_t kBlock = 256;  // rows of the products' blocks

  static void route(const at::Tensor& logits, const at::Tensor& bias, const moe::RouteOptions& o,
                    at::Tensor& weights, at::Tensor& indices) {
    const int64_t tokens = logits.size(0), n = o.experts, k = o.top_k;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "moe_route", [&] {
      using A = MoeAcc<scalar_t>;
      const scalar_t* z = logits.const_data_ptr<scalar_t>();
      A* w = weights.mutable_data_ptr<A>();
      int64_t* idx = indices.mutable_data_ptr<int64_t>();
      const A* b = bias.defined() ? bias.const_data_ptr<A>() : nullptr;
      at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / n), [&](int64_t t0, int64_t t1) {
        std::vector<A> work(2 * n);
        std::vector<unsigned char> taken(n);
        for (int64_t t = t0; t < t1; ++t) {
          moe::route_row<Math>(z + t * n, b, o, work.data(), taken.data(), w + t * k, idx + t * k);
        }
      });
    });
  }

  static void route_backward(const at::Tensor& grad_weights, const at::Tensor& logits,
                             const at::Tensor& indices, const moe::RouteOptions& o,
                             at::Tensor& grad) {
    const int64_t tokens = logits.size(0), n = o.experts, k = o.top_k;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "moe_route_backward", [&] {
      using A = MoeAcc<scalar_t>;
      const at::Tensor g = grad_weights.scalar_type() == logits.scalar_type() ||
                                   grad_weights.scalar_type() == c10::CppTypeToScalarType<A>::value
                               ? grad_weights
                               : grad_weights.to(c10::CppTypeToScalarType<A>::value);
      const scalar_t* z = logits.const_data_ptr<scalar_t>();
      const int64_t* idx = indices.const_data_ptr<int64_t>();
      scalar_t* dz = grad.mutable_data_ptr<scalar_t>();
      const auto run = [&](const auto* gw) {
        at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / n), [&](int64_t t0, int64_t t1) {
          std::vector<A> s(n);
          for (int64_t t = t0; t < t1; ++t) {
            moe::route_row_backward<Math, A>(z + t * n, idx + t * k, gw + t * k, o, s.data(),
                                             dz + t * n);
          }
        });
      };
      if (g.scalar_type() == logits.scalar_type()) {
        run(g.const_data_ptr<scalar_t>());
      } else {
        run(g.const_data_ptr<A>());
      }
    });
  }

  // A stable counting sort of the (token, choice) pairs by expert.
  static void sort(const at::Tensor& flat, int64_t experts, at::Tensor& order, at::Tensor& position,
                   at::Tensor& offsets) {
    const int64_t pairs = flat.numel();
    const int64_t* e = flat.const_data_ptr<int64_t>();
    int64_t* off = offsets.mutable_data_ptr<int64_t>();
    int64_t* ord = order.mutable_data_ptr<int64_t>();
    int64_t* pos = position.mutable_data_ptr<int64_t>();
    std::vector<int64_t> next(experts + 1, 0);
    for (int64_t i = 0; i < pairs; ++i) ++next[e[i] + 1];
    for (int64_t x = 0; x < experts; ++x) next[x + 1] += next[x];
    for (int64_t x = 0; x <= experts; ++x) off[x] = next[x];
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t p = next[e[i]]++;
      ord[p] = i;
      pos[i] = p;
    }
  }

  static void gather(at::Tensor& dst, const at::Tensor& src, const at::Tensor& order, int64_t k,
                     const at::Tensor& weights) {
    const int64_t rows = dst.size(0), cols = dst.size(1);
    const int64_t* ord = order.const_data_ptr<int64_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "moe_gather", [&] {
      using A = MoeAcc<scalar_t>;
      scalar_t* d = dst.mutable_data_ptr<scalar_t>();
      const scalar_t* s = src.const_data_ptr<scalar_t>();
      with_moe_weights<scalar_t>(weights, [&](const auto* w) {
        at::parallel_for(0, rows, grain(cols), [&](int64_t p0, int64_t p1) {
          for (int64_t p = p0; p < p1; ++p) {
            moe::gather_row<A>(d + p * cols, s + (ord[p] / k) * cols, w ? w + ord[p] : w, cols, 0, 1);
          }
        });
      });
    });
  }

  static void combine(at::Tensor& dst, const at::Tensor& src, const at::Tensor& position, int64_t k,
                      const at::Tensor& weights) {
    const int64_t tokens = dst.size(0), cols = dst.size(1);
    const int64_t* pos = position.const_data_ptr<int64_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "moe_combine", [&] {
      using A = MoeAcc<scalar_t>;
      scalar_t* d = dst.mutable_data_ptr<scalar_t>();
      const scalar_t* s = src.const_data_ptr<scalar_t>();
      with_moe_weights<scalar_t>(weights, [&](const auto* w) {
        at::parallel_for(0, tokens, grain(cols * k), [&](int64_t t0, int64_t t1) {
          for (int64_t t = t0; t < t1; ++t) {
            moe::combine_row<A>(d + t * cols, s, cols, pos + t * k, w ? w + t * k : w, k, cols, 0, 1);
          }
        });
      });
    });
  }

  static void weights_grad(at::Tensor& grad, const at::Tensor& grad_out, const at::Tensor& src,
                           const at::Tensor& position) {
    const int64_t tokens = grad.size(0), k = grad.size(1), cols = grad_out.size(1);
    const int64_t* pos = position.const_data_ptr<int64_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "moe_weights_grad", [&] {
      using A = MoeAcc<scalar_t>;
      A* g = grad.mutable_data_ptr<A>();
      const scalar_t* go = grad_out.const_data_ptr<scalar_t>();
      const scalar_t* s = src.const_data_ptr<scalar_t>();
      at::parallel_for(0, tokens, grain(cols * k), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          for (int64_t j = 0; j < k; ++j) {
            const scalar_t* row = s + pos[t * k + j] * cols;
            A acc = A(0);
            for (int64_t h = 0; h < cols; ++h) acc += static_cast<A>(go[t * cols + h]) * static_cast<A>(row[h]);
            g[t * k + j] = acc;
          }
        }
      });
    });
  }

  // The blocks of kBlock rows of each expert's rows, largest first (a shared
  // counter then hands them to torch's threads: experts get unequal rows, so
  // equal shares of blocks would leave threads idle).
  struct Block {
    int64_t expert, first, rows;
  };

  static std::vector<Block> blocks(const int64_t* off, int64_t experts, int64_t block, bool of_output,
                                   int64_t output_rows) {
    std::vector<Block> list;
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t n = of_output ? output_rows : off[e + 1] - off[e];
      if (of_output && off[e + 1] == off[e]) continue;
      for (int64_t r = 0; r < n; r += block) list.push_back({e, r, std::min(block, n - r)});
    }
    // A block's work: its rows times the reduction's length (the expert's
    // rows for an output block of a weight gradient).
    const auto work = [&](const Block& b) { return b.rows * (of_output ? off[b.expert + 1] - off[b.expert] : 1); };
    std::stable_sort(list.begin(), list.end(), [&](const Block& x, const Block& y) { return work(x) > work(y); });
    return list;
  }

  // fn(block) for every block, on torch's threads, below autograd (worker
  // threads do not inherit the caller's dispatch state).
  template <typename Fn>
  static void for_blocks(const std::vector<Block>& list, Fn&& fn) {
    const int64_t count = static_cast<int64_t>(list.size());
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min<int64_t>(count, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      at::AutoDispatchBelowADInplaceOrView guard;
      for (int64_t i = next++; i < count; i = next++) fn(list[i]);
    });
  }

  // One task per block of an expert's rows: gather, gate/up product, gated
  // activation, down product, one single-threaded BLAS call each, so all the
  // blocks of the layer keep the threads busy while only a block's rows,
  // gate/up rows and activation exist per thread (`rows` is not needed).
  static void expert_mlp(at::Tensor& expert_out, at::Tensor& gate_up, const at::Tensor& hidden,
                         const at::Tensor& order, const at::Tensor& offsets, int64_t k,
                         const MoeExpertWeights& w, int64_t /*rows*/) {
    const int64_t* off = offsets.const_data_ptr<int64_t>();
    const int64_t* ord = order.const_data_ptr<int64_t>();
    const bool keep = gate_up.size(0) > 0;
    const std::vector<Block> list = blocks(off, offsets.numel() - 1, kBlock, false, 0);
    for_blocks(list, [&](const Block& b) {
      const int64_t p0 = off[b.expert] + b.first;
      at::Tensor y = expert_out.narrow(0, p0, b.rows);
      block_mlp(hidden, ord, p0, b.rows, k, b.expert, w,
                keep ? gate_up.narrow(0, p0, b.rows) : at::Tensor(), &y);
    });
  }

  // out = a @ weight (+ bias), weight [K, N] (a view), bias [N] or undefined.
  static void product(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight,
                      const at::Tensor& bias) {
    matrix_product(out, a, weight,
                   bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
  }

  // Expert e's gate/up (down) weight as the [K, N] right operand of a row product.
  static at::Tensor right_operand(const at::Tensor& weight, int64_t e, bool transposed) {
    return transposed ? weight[e] : weight[e].t();
  }

  static at::Tensor bias_of(const at::Tensor& bias, int64_t e) {
    return bias.defined() ? bias[e] : at::Tensor();
  }

  // Rows p0 .. p0 + n of expert e (all in one expert): gathered, gate/up
  // product (into gate_up when given), gated activation, down product (into
  // *out when given, else a new tensor, returned).
  static at::Tensor block_mlp(const at::Tensor& hidden, const int64_t* ord, int64_t p0, int64_t n,
                              int64_t k, int64_t e, const MoeExpertWeights& w, at::Tensor gate_up,
                              at::Tensor* out = nullptr) {
    const int64_t cols = hidden.size(1);
    at::Tensor rows = at::empty({n, cols}, hidden.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "moe_gather", [&] {
      scalar_t* d = rows.mutable_data_ptr<scalar_t>();
      const scalar_t* src = hidden.const_data_ptr<scalar_t>();
      for (int64_t p = 0; p < n; ++p) {
        moe::gather_row<MoeAcc<scalar_t>>(d + p * cols, src + (ord[p0 + p] / k) * cols,
                                          static_cast<const scalar_t*>(nullptr), cols, 0, 1);
      }
    });
    const int64_t two_inter = w.transposed ? w.gate_up_proj.size(2) : w.gate_up_proj.size(1);
    if (!gate_up.defined()) gate_up = at::empty({n, two_inter}, hidden.options());
    product(gate_up, rows, right_operand(w.gate_up_proj, e, w.transposed), bias_of(w.gate_up_bias, e));
    const at::Tensor acted = MoeOps<CpuMoe>::gated(gate_up, w);
    at::Tensor y = out != nullptr ? *out : at::empty({n, cols}, hidden.options());
    product(y, acted, right_operand(w.down_proj, e, w.transposed), bias_of(w.down_bias, e));
    return y;
  }

  // Without backward to feed: the experts one after another, each expert's
  // blocks on torch's threads, each block's output rows added at once into
  // a float32 (float64) sum per token. A token meets an expert at most once,
  // so no two blocks of an expert touch the same token, and each token's
  // outputs are added in expert order whatever the threads do. Only a block's
  // intermediates exist per thread, and the sum is out itself for float32
  // and float64 (a [T, H] float32 buffer for half types).
  static void expert_mlp_combined(at::Tensor& out, const at::Tensor& hidden, const at::Tensor& order,
                                  const at::Tensor& /*position*/, const at::Tensor& offsets, int64_t k,
                                  const at::Tensor& weights, const MoeExpertWeights& mw,
                                  int64_t /*rows*/) {
    const int64_t* off = offsets.const_data_ptr<int64_t>();
    const int64_t* ord = order.const_data_ptr<int64_t>();
    const int64_t experts = offsets.numel() - 1, cols = hidden.size(1);
    const at::ScalarType acc_dtype = accumulation_dtype(hidden.scalar_type());
    at::Tensor sum = out.scalar_type() == acc_dtype ? out : at::empty(out.sizes(), out.options().dtype(acc_dtype));
    sum.zero_();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "moe_experts", [&] {
      using A = MoeAcc<scalar_t>;
      A* total = sum.mutable_data_ptr<A>();
      with_moe_weights<scalar_t>(weights, [&](const auto* w) {
        for (int64_t e = 0; e < experts; ++e) {
          const int64_t blocks_of_e = (off[e + 1] - off[e] + kBlock - 1) / kBlock;
          std::vector<Block> list;
          for (int64_t i = 0; i < blocks_of_e; ++i) {
            list.push_back({e, i * kBlock, std::min(kBlock, off[e + 1] - off[e] - i * kBlock)});
          }
          for_blocks(list, [&](const Block& b) {
            const int64_t p0 = off[e] + b.first, n = b.rows;
            const at::Tensor y = block_mlp(hidden, ord, p0, n, k, e, mw, at::Tensor());
            const scalar_t* yd = y.const_data_ptr<scalar_t>();
            for (int64_t p = 0; p < n; ++p) {
              const int64_t pair = ord[p0 + p];
              const A wp = static_cast<A>(w[pair]);
              A* dst = total + (pair / k) * cols;
              const scalar_t* src = yd + p * cols;
              for (int64_t h = 0; h < cols; ++h) dst[h] += wp * static_cast<A>(src[h]);
            }
          });
        }
      });
    });
    if (!sum.is_same(out)) out.copy_(sum);
  }

  // The gated activations the swiglu ops do not compute (interleaved
  // gate/up, gpt-oss's), row by row on torch's threads.
  static void gated(at::Tensor& out, const at::Tensor& gate_up, const moe::Gating& o) {
    const int64_t rows = out.size(0), inter = out.size(1);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "moe_gated", [&] {
      using A = MoeAcc<scalar_t>;
      scalar_t* d = out.mutable_data_ptr<scalar_t>();
      const scalar_t* gu = gate_up.const_data_ptr<scalar_t>();
      at::parallel_for(0, rows, grain(2 * inter), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          moe::gated_row<act::ScalarMath, A>(o, d + r * inter, gu + r * 2 * inter, inter, 0, 1);
        }
      });
    });
  }

  static void gated_backward(at::Tensor& grad_gate_up, const at::Tensor& grad, const at::Tensor& gate_up,
                             const moe::Gating& o) {
    const int64_t rows = grad.size(0), inter = grad.size(1);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "moe_gated_backward", [&] {
      using A = MoeAcc<scalar_t>;
      scalar_t* d = grad_gate_up.mutable_data_ptr<scalar_t>();
      const scalar_t* g = grad.const_data_ptr<scalar_t>();
      const scalar_t* gu = gate_up.const_data_ptr<scalar_t>();
      at::parallel_for(0, rows, grain(3 * inter), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          moe::gated_row_backward<act::ScalarMath, A>(o, d + r * 2 * inter, g + r * inter,
                                                      gu + r * 2 * inter, inter, 0, 1);
        }
      });
    });
  }

  // out[e] = the sum of group e's rows of src, in A, row after row (one
  // order whatever the thread count); experts spread over threads.
  static void group_sum(at::Tensor& out, const at::Tensor& src, const at::Tensor& offsets) {
    const int64_t* off = offsets.const_data_ptr<int64_t>();
    const int64_t experts = out.size(0), cols = out.size(1);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "moe_group_sum", [&] {
      using A = MoeAcc<scalar_t>;
      scalar_t* d = out.mutable_data_ptr<scalar_t>();
      const scalar_t* x = src.const_data_ptr<scalar_t>();
      at::parallel_for(0, experts, 1, [&](int64_t e0, int64_t e1) {
        std::vector<A> acc(cols);
        for (int64_t e = e0; e < e1; ++e) {
          std::fill(acc.begin(), acc.end(), A(0));
          for (int64_t r = off[e]; r < off[e + 1]; ++r) {
            for (int64_t c = 0; c < cols; ++c) acc[c] += static_cast<A>(x[r * cols + c]);
          }
          for (int64_t c = 0; c < cols; ++c) d[e * cols + c] = static_cast<scalar_t>(acc[c]);
        }
      });
    });
  }

  // Each expert's product in blocks of rows (output rows for the weight
  // gradient, each over all of the expert's rows), one single-threaded BLAS
  // call each. The blocks depend on the shapes only, so every element comes
  // from the same call whatever the thread count: the results do not change
  // with it. Torch's threads take the blocks, largest first, from a shared
  // counter (experts get unequal rows, so equal shares of blocks would leave
  // threads idle). Experts without rows cost nothing (a weight gradient's is
  // zeros).
  static void grouped_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                         const at::Tensor& offsets, GroupedProduct kind, const at::Tensor& bias) {
    const int64_t* off = offsets.const_data_ptr<int64_t>();
    const int64_t experts = offsets.numel() - 1;
    const bool weight_grad = kind == GroupedProduct::kWeightGradient;
    if (weight_grad) {
      for (int64_t e = 0; e < experts; ++e) {
        if (off[e + 1] == off[e]) out[e].zero_();
      }
    }
    for_blocks(blocks(off, experts, kBlock, weight_grad, weight_grad ? out.size(1) : 0), [&](const Block& t) {
      const int64_t first = off[t.expert], n = off[t.expert + 1] - first;
      if (weight_grad) {
        at::Tensor o = out[t.expert].narrow(0, t.first, t.rows);
        matrix_product(o, a.narrow(0, first, n).narrow(1, t.first, t.rows).t(),
                       b.narrow(0, first, n), std::nullopt);
      } else {
        at::Tensor o = out.narrow(0, first + t.first, t.rows);
        const at::Tensor w = kind == GroupedProduct::kRowsTimesWeightT ? b[t.expert].t() : b[t.expert];
        product(o, a.narrow(0, first + t.first, t.rows), w, bias_of(bias, t.expert));
      }
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, CPU, m) { FUSEDLLM_IMPL_MOE_OPS(m, CpuMoe); }

}  // namespace fusedllm::cpu

// --- autograd, for every device (fusedllm/autograd.h) ----------------------------------------

namespace fusedllm::autograd {
namespace {

// The router's gradient flows to its logits only (the correction bias steers the choice).
struct MoeRouteFunction : torch::autograd::Function<MoeRouteFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, int64_t top_k,
                               c10::string_view scoring, bool normalize, const OptTensor& bias,
                               int64_t groups, int64_t top_groups, double scaling) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<decltype(MoeOps<void>::route)>("fusedllm::moe_route");
    auto [weights, indices] =
        fn.call(logits, top_k, scoring, normalize, bias, groups, top_groups, scaling);
    ctx->save_for_backward({logits, indices});
    ctx->saved_data["scoring"] = std::string(scoring);
    ctx->saved_data["normalize"] = normalize;
    ctx->saved_data["scaling"] = scaling;
    ctx->mark_non_differentiable({indices});
    return {weights, indices};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto fn = op<decltype(MoeOps<void>::route_backward)>("fusedllm::moe_route_backward");
    const auto s = ctx->get_saved_variables();
    variable_list out(8);
    if (ctx->needs_input_grad(0) && grads[0].defined()) {
      out[0] = fn.call(grads[0], s[0], s[1], ctx->saved_data["scoring"].toStringRef(),
                       ctx->saved_data["normalize"].toBool(), ctx->saved_data["scaling"].toDouble());
    }
    return out;
  }
};


// The biases follow down_proj so that the tensor inputs present number the
// edges: hidden 0, indices 1, weights 2, gate_up_proj 3, down_proj 4, then
// gate_up_bias and down_bias where given.
struct MoeExpertsFunction : torch::autograd::Function<MoeExpertsFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden,
                               const at::Tensor& indices, const at::Tensor& weights,
                               const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                               const OptTensor& gate_up_bias, const OptTensor& down_bias,
                               c10::string_view activation, bool save_for_backward,
                               bool transposed, bool interleaved, double alpha, double limit) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<decltype(MoeOps<void>::experts)>("fusedllm::moe_experts");
    auto [out, order, position, offsets, gate_up, expert_out] =
        fn.call(hidden, indices, weights, gate_up_proj, down_proj, activation, save_for_backward,
                gate_up_bias, down_bias, transposed, interleaved, alpha, limit);
    ctx->save_for_backward({hidden, indices, weights, gate_up_proj, down_proj, order, position,
                            offsets, gate_up, expert_out, value_or_undefined(gate_up_bias),
                            value_or_undefined(down_bias)});
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["transposed"] = transposed;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["limit"] = limit;
    ctx->mark_non_differentiable({order, position, offsets, gate_up, expert_out});
    return {out, order, position, offsets, gate_up, expert_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto fn = op<decltype(MoeOps<void>::experts_backward)>("fusedllm::moe_experts_backward");
    const auto s = ctx->get_saved_variables();
    const at::Tensor& gate_up_bias = s[10];
    const at::Tensor& down_bias = s[11];
    variable_list out(13);
    const std::array<bool, 4> mask = {ctx->needs_input_grad(0), ctx->needs_input_grad(2),
                                      ctx->needs_input_grad(3), ctx->needs_input_grad(4)};
    const size_t down_bias_edge = gate_up_bias.defined() ? 6 : 5;
    const std::array<bool, 2> bias_mask = {
        gate_up_bias.defined() && ctx->needs_input_grad(5),
        down_bias.defined() && ctx->needs_input_grad(down_bias_edge)};
    if (!grads[0].defined() || !(mask[0] || mask[1] || mask[2] || mask[3] || bias_mask[0] ||
                                 bias_mask[1])) {
      return out;
    }
    auto [grad_hidden, grad_weights, grad_gate_up, grad_down, grad_gu_bias, grad_down_bias] =
        fn.call(grads[0], s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9],
                ctx->saved_data["activation"].toStringRef(), mask, as_optional(gate_up_bias),
                as_optional(down_bias), ctx->saved_data["transposed"].toBool(),
                ctx->saved_data["interleaved"].toBool(), ctx->saved_data["alpha"].toDouble(),
                ctx->saved_data["limit"].toDouble(), bias_mask);
    if (mask[0]) out[0] = grad_hidden;
    if (mask[1]) out[2] = grad_weights;
    if (mask[2]) out[3] = grad_gate_up;
    if (mask[3]) out[4] = grad_down;
    if (bias_mask[0]) out[5] = grad_gu_bias;
    if (bias_mask[1]) out[6] = grad_down_bias;
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> moe_route_autograd(const at::Tensor& logits, int64_t top_k,
                                                      c10::string_view scoring, bool normalize,
                                                      const OptTensor& bias, int64_t groups,
                                                      int64_t top_groups, double scaling) {
  auto r = MoeRouteFunction::apply(logits, top_k, scoring, normalize, bias, groups, top_groups,
                                   scaling);
  return {r[0], r[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
moe_experts_autograd(const at::Tensor& hidden, const at::Tensor& indices, const at::Tensor& weights,
                     const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                     c10::string_view activation, bool save_for_backward,
                     const OptTensor& gate_up_bias, const OptTensor& down_bias, bool transposed,
                     bool interleaved, double alpha, double limit) {
  // Backward needs the gate/up rows whenever a gradient will be asked for.
  const auto wants = [](const OptTensor& t) { return t.has_value() && t->requires_grad(); };
  const bool grads = at::GradMode::is_enabled() &&
                     (hidden.requires_grad() || weights.requires_grad() ||
                      gate_up_proj.requires_grad() || down_proj.requires_grad() ||
                      wants(gate_up_bias) || wants(down_bias));
  auto r = MoeExpertsFunction::apply(hidden, indices, weights, gate_up_proj, down_proj,
                                     gate_up_bias, down_bias, activation,
                                     save_for_backward || grads, transposed, interleaved, alpha,
                                     limit);
  return {r[0], r[1], r[2], r[3], r[4], r[5]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, Autograd, m) {
  refuse_second_derivative(m, "moe_route_backward");
  refuse_second_derivative(m, "moe_experts_backward");
  m.impl("moe_route", &moe_route_autograd);
  m.impl("moe_experts", &moe_experts_autograd);
}

}  // namespace fusedllm::autograd
