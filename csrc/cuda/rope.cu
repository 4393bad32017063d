// rope ops on CUDA: one thread per (row, pair) rotates a pair with the shared
// fusedllm/rope.h math; out of place, the remaining threads of a row copy the
// features past rotary_dim. Where the layout allows, one thread per 16-byte
// pack of a row instead (rope_packed_kernel).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "fusedllm/rope.h"
#include "fusedllm/rope_op.h"
#include "primitives.cuh"

namespace fusedllm::cuda {
namespace {

struct RopeTensor {
  int64_t heads;
  const void* in; int64_t in_b, in_h, in_s;
  void* out; int64_t out_b, out_h, out_s;
};

// Row r of the q rows followed by the k rows: where its features are read and
// written, its batch and its position in the sequence.
template <typename T>
struct RopeRow {
  const T* x;
  T* y;
  int64_t b, s;
};

template <typename T>
__device__ __forceinline__ RopeRow<T> rope_row(const RopeTensor& q, const RopeTensor& k, int64_t q_rows,
                                               int64_t seq, int64_t r) {
  // Each field chosen by value: a reference to one of the two parameters
  // chosen at run time put both on the stack.
  const bool is_q = r < q_rows;
  const int64_t idx = is_q ? r : r - q_rows, heads = is_q ? q.heads : k.heads;
  // Rows in (batch, position, head) order, the head fastest: the rows of a
  // block share their positions' cos and sin, read from L2 once for all heads
  // (in (batch, head, position) order every row read its own, twice its
  // bfloat16 features' bytes).
  int64_t s, h, b;
  if (idx <= INT32_MAX && seq <= INT32_MAX && heads <= INT32_MAX) {
    // 32-bit divisions where the indices fit: a 64-bit one is a call of some
    // 40 instructions, three of them per pack
    const uint32_t i = static_cast<uint32_t>(idx), n = static_cast<uint32_t>(seq);
    const uint32_t nh = static_cast<uint32_t>(heads), rest = i / nh;
    h = i - rest * nh;
    s = rest % n;
    b = rest / n;
  } else {
    h = idx % heads;
    s = (idx / heads) % seq;
    b = idx / (seq * heads);
  }
  const T* in = static_cast<const T*>(is_q ? q.in : k.in);
  T* out = static_cast<T*>(is_q ? q.out : k.out);
  return {in + b * (is_q ? q.in_b : k.in_b) + h * (is_q ? q.in_h : k.in_h) + s * (is_q ? q.in_s : k.in_s),
          out + b * (is_q ? q.out_b : k.out_b) + h * (is_q ? q.out_h : k.out_h) + s * (is_q ? q.out_s : k.out_s),
          b, s};
}

template <typename T>
__global__ void rope_kernel(RopeTensor q, RopeTensor k, int64_t batch, int64_t seq,
                            int64_t head_dim, int64_t rotary_dim, bool interleaved, bool inverse,
                            const at::opmath_type<T>* __restrict__ cos,
                            const at::opmath_type<T>* __restrict__ sin, int64_t table_b,
                            int64_t table_row, int64_t table_rows,
                            const int64_t* __restrict__ positions, int64_t positions_b,
                            int64_t offset) {
  using acc_t = at::opmath_type<T>;
  const int64_t half = rotary_dim / 2;
  const bool copy_rest = q.in != q.out;
  const int64_t cols = half + (copy_rest ? head_dim - rotary_dim : 0);
  const int64_t q_rows = batch * q.heads * seq;
  const int64_t rows = q_rows + batch * k.heads * seq;
  grid_stride_2d(rows, cols, [&](int64_t r, int64_t col) {
    const auto [x, y, b, s] = rope_row<T>(q, k, q_rows, seq, r);
    if (col >= half) {  // pass-through feature
      const int64_t j = rotary_dim + (col - half);
      y[j] = x[j];
      return;
    }
    const int64_t pos = positions != nullptr ? positions[b * positions_b + s] : offset + s;
    CUDA_KERNEL_ASSERT(pos >= 0 && pos < table_rows);
    const int64_t table = b * table_b + pos * table_row + col;
    const int64_t i0 = rope::pair_first(col, rotary_dim, interleaved);
    const int64_t i1 = rope::pair_second(col, rotary_dim, interleaved);
    acc_t x0 = static_cast<acc_t>(x[i0]);
    acc_t x1 = static_cast<acc_t>(x[i1]);
    const acc_t sn = inverse ? -sin[table] : sin[table];
    rope::rotate_pair(x0, x1, cos[table], sn);
    y[i0] = static_cast<T>(x0);
    y[i1] = static_cast<T>(x1);
  });
}

// As rope_kernel with one 16-byte pack of a row per thread: kVec features
// of each half (half-split) or kVec / 2 pairs (interleaved), their angles read
// as one pack; for layouts where every row start and split allows
// (rope_packable), the row's indices worked out once per pack, not per pair.
template <typename T, bool kInterleaved>
__global__ void rope_packed_kernel(RopeTensor q, RopeTensor k, int64_t batch, int64_t seq,
                                   int64_t head_dim, int64_t rotary_dim, bool inverse,
                                   const at::opmath_type<T>* __restrict__ cos,
                                   const at::opmath_type<T>* __restrict__ sin, int64_t table_b,
                                   int64_t table_row, int64_t table_rows,
                                   const int64_t* __restrict__ positions, int64_t positions_b,
                                   int64_t offset) {
  using acc_t = at::opmath_type<T>;
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kAngles = kInterleaved ? kVec / 2 : kVec;
  const int64_t half = rotary_dim / 2;
  const bool copy_rest = q.in != q.out;
  const int64_t rotary_packs = half / kAngles;
  const int64_t packs = rotary_packs + (copy_rest ? (head_dim - rotary_dim) / kVec : 0);
  const int64_t q_rows = batch * q.heads * seq;
  const int64_t rows = q_rows + batch * k.heads * seq;
  grid_stride_2d(rows, packs, [&](int64_t r, int64_t pack) {
    const auto [x, y, b, s] = rope_row<T>(q, k, q_rows, seq, r);
    if (pack >= rotary_packs) {  // pass-through features
      const int64_t j = rotary_dim + (pack - rotary_packs) * kVec;
      store_pack<T, kVec>(y + j, load_pack<T, kVec>(x + j));
      return;
    }
    const int64_t pos = positions != nullptr ? positions[b * positions_b + s] : offset + s;
    CUDA_KERNEL_ASSERT(pos >= 0 && pos < table_rows);
    const int64_t col = pack * kAngles;  // the first pair's index
    const int64_t table = b * table_b + pos * table_row + col;
    const Pack<acc_t, kAngles> c = load_pack<acc_t, kAngles>(cos + table);
    const Pack<acc_t, kAngles> sn = load_pack<acc_t, kAngles>(sin + table);
    if constexpr (kInterleaved) {
      Pack<T, kVec> a = load_pack<T, kVec>(x + 2 * col);
#pragma unroll
      for (int i = 0; i < kAngles; ++i) {
        acc_t x0 = static_cast<acc_t>(a.v[2 * i]);
        acc_t x1 = static_cast<acc_t>(a.v[2 * i + 1]);
        rope::rotate_pair(x0, x1, c.v[i], inverse ? -sn.v[i] : sn.v[i]);
        a.v[2 * i] = static_cast<T>(x0);
        a.v[2 * i + 1] = static_cast<T>(x1);
      }
      store_pack_words<T, kVec>(y + 2 * col, a);
    } else {
      Pack<T, kVec> a = load_pack<T, kVec>(x + col);
      Pack<T, kVec> e = load_pack<T, kVec>(x + col + half);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        acc_t x0 = static_cast<acc_t>(a.v[i]);
        acc_t x1 = static_cast<acc_t>(e.v[i]);
        rope::rotate_pair(x0, x1, c.v[i], inverse ? -sn.v[i] : sn.v[i]);
        a.v[i] = static_cast<T>(x0);
        e.v[i] = static_cast<T>(x1);
      }
      store_pack_words<T, kVec>(y + col, a);
      store_pack_words<T, kVec>(y + col + half, e);
    }
  });
}

// Whether rope_packed_kernel<T> can take the plan: every feature pack and
// angle pack it reads starts on its own size.
template <typename T>
bool rope_packable(const RopePlan& p) {
  using acc_t = at::opmath_type<T>;
  constexpr int kVec = 16 / sizeof(T);
  const int angles = p.interleaved ? kVec / 2 : kVec;
  const int64_t half = p.rotary_dim / 2;
  if (half % angles != 0 || (p.head_dim - p.rotary_dim) % kVec != 0 || p.head_dim % kVec != 0) return false;
  for (const RopeOperand* o : {&p.q, &p.k}) {
    for (const at::Tensor* t : {&o->in, &o->out}) {
      if (t->numel() == 0) continue;
      if (t->stride(3) != 1 || !pack_aligned<T, kVec>(t->data_ptr())) return false;
      for (int d = 0; d < 3; ++d) {
        if (t->size(d) > 1 && t->stride(d) % kVec != 0) return false;
      }
    }
  }
  const auto aligned_table = [&](const at::Tensor& t) {
    return reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % (sizeof(acc_t) * angles) == 0 &&
           t.stride(0) % angles == 0 && t.stride(1) % angles == 0;
  };
  return aligned_table(p.cos) && aligned_table(p.sin);
}

RopeTensor tensor_args(const RopeOperand& o) {
  return {o.in.size(1),
          o.in.data_ptr(), o.in.stride(0), o.in.stride(1), o.in.stride(2),
          o.out.data_ptr(), o.out.stride(0), o.out.stride(1), o.out.stride(2)};
}

struct CudaRope {
  static void run(const RopePlan& p) {
    const DeviceGuard guard(p.q.in.device());
    const Stream stream = current_stream();
    const int64_t copy_cols = p.q.in.data_ptr() != p.q.out.data_ptr() ? p.head_dim - p.rotary_dim : 0;
    const int64_t work = p.batch * p.seq * (p.q.in.size(1) + p.k.in.size(1)) * (p.rotary_dim / 2 + copy_cols);
    if (work == 0) return;
    constexpr int kThreads = 256;
    const int64_t max_blocks =
        static_cast<int64_t>(device_properties().multiProcessorCount) * 16;
    const int blocks = static_cast<int>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, max_blocks));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.q.in.scalar_type(), "fusedllm_rope_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      if (rope_packable<scalar_t>(p)) {
        constexpr int kVec = 16 / sizeof(scalar_t);
        const int64_t packs = p.batch * p.seq * (p.q.in.size(1) + p.k.in.size(1)) *
                              (p.rotary_dim / 2 / (p.interleaved ? kVec / 2 : kVec) + copy_cols / kVec);
        const int packed_blocks =
            static_cast<int>(std::clamp<int64_t>((packs + kThreads - 1) / kThreads, 1, max_blocks));
        auto run = [&](auto kernel) {
          launch("rope_packed_kernel", kernel, packed_blocks, kThreads, 0, stream, tensor_args(p.q),
                 tensor_args(p.k), p.batch, p.seq, p.head_dim, p.rotary_dim, p.inverse,
                 p.cos.const_data_ptr<acc_t>(), p.sin.const_data_ptr<acc_t>(), p.cos.stride(0),
                 p.cos.stride(1), p.cos.size(1),
                 p.positions.defined() ? p.positions.const_data_ptr<int64_t>() : nullptr,
                 p.positions.defined() ? p.positions.stride(0) : 0, p.offset);
        };
        if (p.interleaved) {
          run(rope_packed_kernel<scalar_t, true>);
        } else {
          run(rope_packed_kernel<scalar_t, false>);
        }
        return;
      }
      launch("rope_kernel", rope_kernel<scalar_t>, blocks, kThreads, 0, stream,
          tensor_args(p.q), tensor_args(p.k), p.batch, p.seq, p.head_dim, p.rotary_dim,
          p.interleaved, p.inverse, p.cos.const_data_ptr<acc_t>(), p.sin.const_data_ptr<acc_t>(),
          p.cos.stride(0), p.cos.stride(1), p.cos.size(1),
          p.positions.defined() ? p.positions.const_data_ptr<int64_t>() : nullptr,
          p.positions.defined() ? p.positions.stride(0) : 0, p.offset);
    });
  }
};

}  // namespace

FUSEDLLM_CUDA_OPS_DEFINE(define_rope_ops)
FUSEDLLM_CUDA_OPS_IMPL(m) { FUSEDLLM_IMPL_ROPE_OPS(m, CudaRope); }

}  // namespace fusedllm::cuda
