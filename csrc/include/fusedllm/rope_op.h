// Host-side argument checks and layout for the rope ops, shared by the CPU and
// CUDA implementations.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "fusedllm/checks.h"

namespace fusedllm {

// The schemas of rope's operators, for torch.ops.fusedllm (csrc/rope.cpp) and the
// emulated torch.ops.fusedllm_simt (csrc/cuda/rope.cu).
inline void define_rope_ops(torch::Library& m) {
  // Rotates q [B, Hq, S, D] and k [B, Hkv, S, D] by the angles of cos/sin tables
  // ([positions, rotary_dim / 2] looked up at position_ids or offset + s, or
  // per-token [B, S, rotary_dim / 2]); the first rotary_dim features rotate.
  // inverse=True rotates back (the backward pass).
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids, int offset, "
        "bool interleaved, int rotary_dim, bool inverse) -> (Tensor q_out, Tensor k_out)");
  // The same, writing into q and k.
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, Tensor? position_ids, "
        "int offset, bool interleaved, int rotary_dim, bool inverse) -> ()");
}

// One rotated tensor: [B, H, S, D] input and output with unit stride along D
// (in place: the same tensor).
struct RopeOperand {
  at::Tensor in, out;
};

struct RopePlan {
  int64_t batch = 0, seq = 0, head_dim = 0, rotary_dim = 0;
  bool interleaved = false, inverse = false;
  RopeOperand q, k;
  // [B, P, rotary_dim / 2] in the accumulation dtype, contiguous but for a
  // batch stride of 0 when one table serves every batch; cos and sin share strides.
  at::Tensor cos, sin;
  // int64 [Bp, S] (Bp 1 with stride 0, or B), or undefined: position offset + s.
  at::Tensor positions;
  int64_t offset = 0;
  const char* op = "";
  bool empty() const { return batch * seq * head_dim == 0 || (q.in.size(1) + k.in.size(1)) == 0; }
};

// Every position of a host tensor inside the table: run by the CPU ops before
// any row is written (rope_ works in place) and whether or not a row reads it;
// a CUDA kernel asserts on the device instead.
inline void check_positions(const RopePlan& p) {
  if (!p.positions.defined()) return;
  const int64_t rows = p.cos.size(1), stride = p.positions.stride(0);
  const int64_t* v = p.positions.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t s = 0; s < p.seq; ++s) {
      const int64_t pos = v[b * stride + s];
      TORCH_CHECK_VALUE(pos >= 0 && pos < rows, p.op, ": position ", pos, " is outside the cos/sin table of ",
                        rows, " positions");
    }
  }
}

inline RopePlan plan_rope(const char* op, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& cos, const at::Tensor& sin,
                          const std::optional<at::Tensor>& position_ids, int64_t offset,
                          bool interleaved, int64_t rotary_dim, bool inverse, bool in_place) {
  check_float_tensor(q, op, "q");
  check_same(q, "q", k, "k", op);
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4, op, ": q and k must be [B, H, S, D], got ",
                    q.sizes(), " and ", k.sizes());
  TORCH_CHECK_VALUE(q.size(0) == k.size(0) && q.size(2) == k.size(2), op,
                    ": q and k must have the same batch and sequence sizes, got ", q.sizes(),
                    " and ", k.sizes());
  TORCH_CHECK_VALUE(q.size(3) == k.size(3), op, ": q and k must have the same head dim, got ",
                    q.size(3), " and ", k.size(3));
  RopePlan p;
  p.op = op;
  p.batch = q.size(0);
  p.seq = q.size(2);
  p.head_dim = q.size(3);
  // -1 means the whole head. The rule, and its words, are those of
  // fusedllm._limits.check_rotary_dim (tests/test_limits.py).
  p.rotary_dim = rotary_dim == -1 ? p.head_dim : rotary_dim;
  p.interleaved = interleaved;
  p.inverse = inverse;
  TORCH_CHECK_VALUE(p.rotary_dim > 0 && p.rotary_dim <= p.head_dim && p.rotary_dim % 2 == 0, op,
                    ": rotary_dim must be a positive even number at most the head dim ",
                    p.head_dim, ", got ", p.rotary_dim);
  TORCH_CHECK_VALUE(offset >= 0, op, ": offset must be >= 0, got ", offset);

  // Tables.
  TORCH_CHECK_VALUE(cos.sizes() == sin.sizes(), op, ": cos and sin must have the same shape, got ",
                    cos.sizes(), " and ", sin.sizes());
  check_float_tensor(cos, op, "cos");
  TORCH_CHECK_VALUE(cos.device() == q.device() && sin.device() == q.device(), op,
                    ": cos and sin must be on ", q.device(), " like q");
  TORCH_CHECK_VALUE(sin.scalar_type() == cos.scalar_type(), op,
                    ": cos and sin must have the same dtype");
  TORCH_CHECK_VALUE(cos.dim() == 2 || cos.dim() == 3, op,
                    ": cos and sin must be [positions, rotary_dim / 2] or [B, S, rotary_dim / 2], got ",
                    cos.sizes());
  TORCH_CHECK_VALUE(cos.size(-1) == p.rotary_dim / 2, op, ": cos and sin must have last dim ",
                    p.rotary_dim / 2, " (rotary_dim / 2), got ", cos.size(-1));
  const auto acc = accumulation_dtype(q);
  at::Tensor c = cos.to(acc), s = sin.to(acc);
  if (c.dim() == 2) {
    c = c.unsqueeze(0);
    s = s.unsqueeze(0);
  } else {
    TORCH_CHECK_VALUE(c.size(0) == 1 || c.size(0) == p.batch, op,
                      ": per-token cos/sin [B, S, rotary_dim / 2] must have batch 1 or ", p.batch,
                      ", got ", c.size(0));
    TORCH_CHECK_VALUE(c.size(1) == p.seq, op, ": per-token cos/sin must have ", p.seq,
                      " rows (the sequence length), got ", c.size(1));
    TORCH_CHECK_VALUE(!position_ids.has_value() && offset == 0, op,
                      ": per-token cos/sin [B, S, rotary_dim / 2] are already indexed by position; "
                      "pass position_ids or offset only with a [positions, rotary_dim / 2] table");
  }
  c = c.contiguous();  // no-op for the tables fusedllm builds
  s = s.contiguous();
  if (c.size(0) == 1) {
    c = c.expand({p.batch, c.size(1), c.size(2)});
    s = s.expand({p.batch, s.size(1), s.size(2)});
  }
  p.cos = c;
  p.sin = s;
  const int64_t table_rows = c.size(1);

  // Positions.
  if (position_ids.has_value()) {
    const at::Tensor& pos = *position_ids;
    TORCH_CHECK_VALUE(pos.scalar_type() == at::kLong || pos.scalar_type() == at::kInt, op,
                      ": position_ids must be int64 or int32, got ", dtype_name(pos.scalar_type()));
    TORCH_CHECK_VALUE(pos.device() == q.device(), op, ": position_ids is on ", pos.device(),
                      " but q is on ", q.device());
    const bool ok = (pos.dim() == 1 && pos.size(0) == p.seq) ||
                    (pos.dim() == 2 && (pos.size(0) == p.batch || pos.size(0) == 1) &&
                     pos.size(1) == p.seq);
    TORCH_CHECK_VALUE(ok, op, ": position_ids must be [S] or [B, S] = [", p.batch, ", ", p.seq,
                      "], got ", pos.sizes());
    TORCH_CHECK_VALUE(offset == 0, op, ": pass either position_ids or offset, not both");
    at::Tensor pos2 = (pos.dim() == 1 ? pos.unsqueeze(0) : pos).to(at::kLong);
    if (pos2.stride(1) != 1) pos2 = pos2.contiguous();
    p.positions = pos2.expand({p.batch, p.seq});
  } else {
    TORCH_CHECK_VALUE(offset + p.seq <= table_rows, op, ": positions ", offset, "..",
                      offset + p.seq - 1, " are past the cos/sin table of ", table_rows,
                      " positions");
  }
  p.offset = offset;

  // Operands.
  auto operand = [&](const at::Tensor& t, const char* name) {
    RopeOperand o;
    if (in_place) {
      TORCH_CHECK_VALUE(t.size(3) <= 1 || t.stride(3) == 1, op, ": in place, ", name,
                        " needs unit stride along its last dim");
      o.in = t;
      o.out = t;
    } else {
      o.in = (t.size(3) > 1 && t.stride(3) != 1) ? t.contiguous() : t;
      o.out = at::empty(t.sizes(), t.options());
    }
    return o;
  };
  p.q = operand(q, "q");
  p.k = operand(k, "k");
  return p;
}

// `Impl` provides `static void run(const RopePlan&)` for non-empty plans, and
// may provide `static void check(const RopePlan&)`, run on every plan first.
template <typename Impl>
struct RopeOps {
  static void check(const RopePlan& p) {
    if constexpr (requires { Impl::check(p); }) Impl::check(p);
  }
  static std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& cos, const at::Tensor& sin,
                                                 const std::optional<at::Tensor>& position_ids,
                                                 int64_t offset, bool interleaved,
                                                 int64_t rotary_dim, bool inverse) {
    auto p = plan_rope("fusedllm.rope", q, k, cos, sin, position_ids, offset, interleaved,
                       rotary_dim, inverse, /*in_place=*/false);
    check(p);
    if (!p.empty()) Impl::run(p);
    return {p.q.out, p.k.out};
  }

  static void rope_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                    const at::Tensor& sin, const std::optional<at::Tensor>& position_ids,
                    int64_t offset, bool interleaved, int64_t rotary_dim, bool inverse) {
    auto p = plan_rope("fusedllm.rope_", q, k, cos, sin, position_ids, offset, interleaved,
                       rotary_dim, inverse, /*in_place=*/true);
    check(p);
    if (!p.empty()) Impl::run(p);
  }
};

}  // namespace fusedllm

// Registers the rope operators of one dispatch key; use inside TORCH_LIBRARY_IMPL.
#define FUSEDLLM_IMPL_ROPE_OPS(m, Impl)                      \
  do {                                                       \
    (m).impl("rope", &::fusedllm::RopeOps<Impl>::rope);      \
    (m).impl("rope_", &::fusedllm::RopeOps<Impl>::rope_);    \
  } while (0)
