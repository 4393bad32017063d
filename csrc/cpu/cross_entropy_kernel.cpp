// Cross-entropy row kernel on CPU, compiled once per instruction set, in place
// on a chunk of logits of the input dtype (float32 math): per row, one pass for
// the cap, the maximum and the sum of s, one for the sum of exponentials, and,
// for the gradient, one writing it over the logits (a row of a 128k vocabulary
// is 256-512 KB: it stays in L2 between the passes). A slab of a row's columns
// (the weight gradient's pass) takes the row's lse and writes the gradient only.
#include "fusedllm/cross_entropy.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "vec.h"

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {
namespace {

template <typename A>
struct ScalarMath {
  static A tanh(A x) { return std::tanh(x); }
};

// s = softcap * tanh(z / softcap) in the accumulation type, or z: each pass
// caps the logits it reads, so that the capped values are rounded nowhere (an
// in-place cap stored in T would round them a second time).
template <typename AV>
AV cap_of(AV z, bool capped, AV cap) {
  return capped ? ce::capped<VecMath<AV>>(z, cap) : z;
}

template <typename A>
A cap_of(A z, const ce::Options& o) {
  return o.softcap > 0.0 ? ce::capped<ScalarMath<A>>(z, A(o.softcap)) : z;
}

// The maximum and the sum of s over the row.
template <typename T, typename A>
void max_sum(const T* row, int64_t n, const ce::Options& o, A& max_out, A& sum_out) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  const bool capped = o.softcap > 0.0;
  const AV cap(A(o.softcap));
  AV vmax(-std::numeric_limits<A>::infinity()), vsum(A(0));
  int64_t j = 0;
  for (; j + IO::kStep <= n; j += IO::kStep) {
    AV v[P];
    IO::load(row + j, v);
    for (int q = 0; q < P; ++q) {
      const AV s = cap_of(v[q], capped, cap);
      vmax = at::vec::maximum(vmax, s);
      vsum = vsum + s;
    }
  }
  A m = at::vec::vec_reduce_all<A>([](AV& a, AV& b) { return at::vec::maximum(a, b); }, vmax);
  A total = reduce_sum(vsum);
  for (; j < n; ++j) {
    const A s = cap_of(static_cast<A>(row[j]), o);
    m = std::max(m, s);
    total += s;
  }
  max_out = m;
  sum_out = total;
}

template <typename T, typename A>
A sum_exp(const T* row, int64_t n, A m, const ce::Options& o) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  const bool capped = o.softcap > 0.0;
  const AV cap(A(o.softcap));
  const AV vm(m);
  AV acc[2] = {AV(A(0)), AV(A(0))};
  int64_t j = 0;
  for (; j + IO::kStep <= n; j += IO::kStep) {
    AV v[P];
    IO::load(row + j, v);
    for (int q = 0; q < P; ++q) acc[q % 2] = acc[q % 2] + VecMath<AV>::exp(cap_of(v[q], capped, cap) - vm);
  }
  A total = reduce_sum(acc[0] + acc[1]);
  for (; j < n; ++j) total += std::exp(cap_of(static_cast<A>(row[j]), o) - m);
  return total;
}

// d[j] = (p_scale * exp(s[j] - lse) - off) * ds/dz[j], over the logits in
// place; the target's term is added by the caller.
template <typename T, typename A>
void write_grad(T* row, int64_t n, A lse, const ce::RowGrad<A>& g, const ce::Options& o) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  const AV vlse(lse), vp(g.p_scale), voff(g.off);
  const bool capped = o.softcap > 0.0;
  const AV cap(A(o.softcap));
  const AV inv_cap(capped ? A(1) / A(o.softcap) : A(0));
  row_for_each<IO>(n, [&](int64_t j, int64_t c) {
    AV v[P];
    load_step<IO>(row + j, c, v);
    for (int q = 0; q < P; ++q) {
      const AV s = cap_of(v[q], capped, cap);
      const AV d = vp * VecMath<AV>::exp(s - vlse) - voff;
      v[q] = capped ? d * ce::cap_slope(s, inv_cap) : d;
    }
    store_step<IO>(row + j, c, v);
  });
}

template <typename T>
void rows_typed(const CrossEntropyRowArgs& a) {
  using A = typename VecIO<T>::acc_t;
  const ce::Options o = a.options;
  at::parallel_for(0, a.rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = static_cast<T*>(a.logits) + r * a.logits_stride;
      const int64_t t = a.target[r];
      const bool ignored = t == a.ignore_index;
      // The target's column in this row's logits, if they hold it.
      const int64_t tc = t - a.column0;
      const bool has_target = !ignored && tc >= 0 && tc < a.vocab;
      A lse;
      if (a.slab) {
        lse = static_cast<const A*>(a.lse)[r];  // the row's statistics are known
      } else {
        A m, s_sum;
        max_sum<T, A>(row, a.vocab, o, m, s_sum);
        lse = m + std::log(sum_exp<T, A>(row, a.vocab, m, o));
        static_cast<A*>(a.lse)[r] = lse;
        static_cast<A*>(a.loss)[r] =
            ignored ? A(0) : ce::row_loss<A>(o, lse, cap_of(static_cast<A>(row[tc]), o), s_sum);
      }
      if (!a.grad) continue;
      if (ignored) {
        std::fill(row, row + a.vocab, T(0));
        continue;
      }
      const A s_t = has_target ? cap_of(static_cast<A>(row[tc]), o) : A(0);
      const A scale = a.scale ? static_cast<const A*>(a.scale)[r] : A(1);
      const ce::RowGrad<A> g = ce::row_grad<A>(o, lse, scale);
      write_grad<T, A>(row, a.vocab, lse, g, o);
      if (!has_target) continue;
      A d_t = g.p_scale * std::exp(s_t - lse) - g.off - g.on;
      if (o.softcap > 0.0) d_t *= ce::cap_slope(s_t, A(1) / A(o.softcap));
      row[tc] = static_cast<T>(d_t);
    }
  });
}

void cross_entropy_rows(const CrossEntropyRowArgs& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.dtype, "fusedllm_cross_entropy_cpu",
                                  [&] { rows_typed<scalar_t>(a); });
}

}  // namespace

FUSEDLLM_REGISTER_CPU_KERNEL(cross_entropy_row_kernels, &cross_entropy_rows);

}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
