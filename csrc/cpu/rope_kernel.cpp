// Rotary embedding CPU kernels, compiled once per instruction set.
#include "fusedllm/rope.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "fusedllm/rope.h"
#include "vec.h"

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {
namespace {

// 2 * AV::size() consecutive elements as two accumulator vectors.
template <typename IO, typename T>
inline void load_pairs(const T* p, int64_t count, typename IO::AV& a, typename IO::AV& b) {
  using AV = typename IO::AV;
  if constexpr (IO::kParts == 2) {
    AV parts[2];
    load_step<IO>(p, count, parts);
    a = parts[0];
    b = parts[1];
  } else {
    AV one[1];
    load_step<IO>(p, std::min<int64_t>(count, AV::size()), one);
    a = one[0];
    one[0] = AV(typename IO::acc_t(0));
    if (count > AV::size()) load_step<IO>(p + AV::size(), count - AV::size(), one);
    b = one[0];
  }
}

template <typename IO, typename T>
inline void store_pairs(T* p, int64_t count, const typename IO::AV& a, const typename IO::AV& b) {
  using AV = typename IO::AV;
  if constexpr (IO::kParts == 2) {
    const AV parts[2] = {a, b};
    store_step<IO>(p, count, parts);
  } else {
    const AV first[1] = {a};
    store_step<IO>(p, std::min<int64_t>(count, AV::size()), first);
    if (count > AV::size()) {
      const AV second[1] = {b};
      store_step<IO>(p + AV::size(), count - AV::size(), second);
    }
  }
}

// Rotates the first `rotary_dim` features of one row and copies the rest when
// out of place. Every value is a parameter (vector stores may alias).
template <typename T, bool kInterleaved>
void rotate_row(const T* x, T* y, const typename VecIO<T>::acc_t* cos,
                const typename VecIO<T>::acc_t* sin, int64_t head_dim, int64_t rotary_dim,
                bool inverse) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  using acc_t = typename IO::acc_t;
  const int64_t half = rotary_dim / 2;
  const AV sign(inverse ? acc_t(-1) : acc_t(1));
  if constexpr (!kInterleaved) {
    constexpr int P = IO::kParts;
    row_for_each<IO>(half, [&](int64_t j, int64_t c) {
      AV x0[P], x1[P], cv[P], sv[P];
      load_step<IO>(x + j, c, x0);
      load_step<IO>(x + half + j, c, x1);
      load_acc<IO>(cos + j, c, cv);
      load_acc<IO>(sin + j, c, sv);
      for (int q = 0; q < P; ++q) rope::rotate_pair(x0[q], x1[q], cv[q], sv[q] * sign);
      store_step<IO>(y + j, c, x0);
      store_step<IO>(y + half + j, c, x1);
    });
  } else {
    constexpr int64_t kPairs = AV::size();  // pairs per step: 2 * kPairs elements
    for (int64_t i = 0; i < half; i += kPairs) {
      const int64_t pairs = std::min(kPairs, half - i);
      AV a, b;
      load_pairs<IO>(x + 2 * i, 2 * pairs, a, b);
      auto [even, odd] = at::vec::deinterleave2(a, b);
      const AV c = AV::loadu(cos + i, pairs);
      const AV s = AV::loadu(sin + i, pairs) * sign;
      rope::rotate_pair(even, odd, c, s);
      auto [lo, hi] = at::vec::interleave2(even, odd);
      store_pairs<IO>(y + 2 * i, 2 * pairs, lo, hi);
    }
  }
  if (x != y && rotary_dim < head_dim) {
    std::memcpy(y + rotary_dim, x + rotary_dim, (head_dim - rotary_dim) * sizeof(T));
  }
}

template <typename T, bool kInterleaved>
void rope_typed(const RopeArgs& a) {
  using acc_t = typename VecIO<T>::acc_t;
  const int64_t q_rows = a.batch * a.q.heads * a.seq;
  const int64_t rows = q_rows + a.batch * a.k.heads * a.seq;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(a.head_dim, 1));
  at::parallel_for(0, rows, grain, [&a, q_rows](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bool is_q = r < q_rows;
      const RopeTensorArgs& t = is_q ? a.q : a.k;
      const int64_t idx = is_q ? r : r - q_rows;
      const int64_t s = idx % a.seq;
      const int64_t h = (idx / a.seq) % t.heads;
      const int64_t b = idx / (a.seq * t.heads);
      const int64_t pos = a.positions != nullptr ? a.positions[b * a.positions_b + s] : a.offset + s;
      TORCH_INTERNAL_ASSERT_DEBUG_ONLY(pos >= 0 && pos < a.table_rows);  // plan_rope checked
      const int64_t table = b * a.table_b + pos * a.table_row;
      rotate_row<T, kInterleaved>(
          static_cast<const T*>(t.in) + b * t.in_b + h * t.in_h + s * t.in_s,
          static_cast<T*>(t.out) + b * t.out_b + h * t.out_h + s * t.out_s,
          static_cast<const acc_t*>(a.cos) + table, static_cast<const acc_t*>(a.sin) + table,
          a.head_dim, a.rotary_dim, a.inverse);
    }
  });
}

void rope(const RopeArgs& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.dtype, "fusedllm_rope_cpu", [&] {
    if (a.interleaved) {
      rope_typed<scalar_t, true>(a);
    } else {
      rope_typed<scalar_t, false>(a);
    }
  });
}

}  // namespace

FUSEDLLM_REGISTER_CPU_KERNEL(rope_kernels, &rope);

}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
