// Cross-entropy row kernel on CPU, compiled once per instruction set: per row,
// one pass for the cap, the maximum and the sum of s, one for the sum of
// exponentials, and, for the gradient, one writing it (a row of a 128k
// vocabulary is 512 KB of float32: it stays in L2 between the passes).
#include "cross_entropy_kernel.h"

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

template <typename AV>
struct VecMath {
  static AV tanh(const AV& x) { return x.tanh(); }
  static AV exp(const AV& x) {
    // exp_u20 (about 1e-6 relative error) for float; double keeps the 1-ulp exp.
    if constexpr (std::is_same_v<typename AV::value_type, float>) {
      return x.exp_u20();
    } else {
      return x.exp();
    }
  }
};

template <typename A>
struct ScalarMath {
  static A tanh(A x) { return std::tanh(x); }
  static A exp(A x) { return std::exp(x); }
};

// Row statistics: caps z in place (when capping) and returns max and sum of s.
template <typename A>
void cap_max_sum(A* s, int64_t n, const ce::Options& o, A& max_out, A& sum_out) {
  using AV = Vectorized<A>;
  constexpr int64_t W = AV::size();
  const A cap = A(o.softcap);
  AV vmax(-std::numeric_limits<A>::infinity()), vsum(A(0));
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    AV v = AV::loadu(s + j);
    if (o.softcap > 0.f) {
      v = ce::capped<VecMath<AV>>(v, AV(cap));
      v.store(s + j);
    }
    vmax = at::vec::maximum(vmax, v);
    vsum = vsum + v;
  }
  A m = at::vec::vec_reduce_all<A>([](AV& a, AV& b) { return at::vec::maximum(a, b); }, vmax);
  A total = reduce_sum(vsum);
  for (; j < n; ++j) {
    if (o.softcap > 0.f) s[j] = ce::capped<ScalarMath<A>>(s[j], cap);
    m = std::max(m, s[j]);
    total += s[j];
  }
  max_out = m;
  sum_out = total;
}

template <typename A>
A sum_exp(const A* s, int64_t n, A m) {
  using AV = Vectorized<A>;
  constexpr int64_t W = AV::size();
  const AV vm(m);
  AV acc[4] = {AV(A(0)), AV(A(0)), AV(A(0)), AV(A(0))};
  int64_t j = 0;
  for (; j + 4 * W <= n; j += 4 * W) {
    for (int u = 0; u < 4; ++u) acc[u] = acc[u] + VecMath<AV>::exp(AV::loadu(s + j + u * W) - vm);
  }
  for (; j + W <= n; j += W) acc[0] = acc[0] + VecMath<AV>::exp(AV::loadu(s + j) - vm);
  A total = reduce_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; j < n; ++j) total += std::exp(s[j] - m);
  return total;
}

// d[j] = (p_scale * exp(s[j] - lse) - off) * ds/dz[j]; the target's term is
// added by the caller.
template <typename T, typename A>
void write_grad(const A* s, T* d, int64_t n, A lse, const ce::RowGrad<A>& g, const ce::Options& o) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  static_assert(std::is_same_v<typename IO::acc_t, A>);
  constexpr int P = IO::kParts;
  const AV vlse(lse), vp(g.p_scale), voff(g.off);
  const bool capped = o.softcap > 0.f;
  const AV inv_cap(capped ? A(1) / A(o.softcap) : A(0));
  row_for_each<IO>(n, [&](int64_t j, int64_t c) {
    AV sv[P], dv[P];
    load_acc<IO>(s + j, c, sv);
    for (int q = 0; q < P; ++q) {
      dv[q] = vp * VecMath<AV>::exp(sv[q] - vlse) - voff;
      if (capped) dv[q] = dv[q] * ce::cap_slope(sv[q], inv_cap);
    }
    store_step<IO>(d + j, c, dv);
  });
}

template <typename T, typename A>
void rows_typed(const CrossEntropyRowArgs& a) {
  const ce::Options o = a.options;
  at::parallel_for(0, a.rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      A* s = static_cast<A*>(a.logits) + r * a.logits_stride;
      A m, s_sum;
      cap_max_sum(s, a.vocab, o, m, s_sum);
      const A lse = m + std::log(sum_exp(s, a.vocab, m));
      const int64_t t = a.target[r];
      const bool ignored = t == a.ignore_index;
      static_cast<A*>(a.lse)[r] = lse;
      static_cast<A*>(a.loss)[r] = ignored ? A(0) : ce::row_loss<A>(o, lse, s[t], s_sum);
      if (a.grad_logits == nullptr) continue;
      T* d = static_cast<T*>(a.grad_logits) + r * a.grad_stride;
      if (ignored) {
        std::fill(d, d + a.vocab, T(0));
        continue;
      }
      const A scale = a.scale ? static_cast<const A*>(a.scale)[r] : A(1);
      const ce::RowGrad<A> g = ce::row_grad<A>(o, lse, scale);
      const A s_t = s[t];  // read before d (which may be s itself) is written
      write_grad<T, A>(s, d, a.vocab, lse, g, o);
      A d_t = g.p_scale * std::exp(s_t - lse) - g.off - g.on;
      if (o.softcap > 0.f) d_t *= ce::cap_slope(s_t, A(1) / A(o.softcap));
      d[t] = static_cast<T>(d_t);
    }
  });
}

void cross_entropy_rows(const CrossEntropyRowArgs& a) {
  if (a.acc == at::kDouble) {
    rows_typed<double, double>(a);
    return;
  }
  // The gradient's dtype: float32 in place, or the input's half-precision dtype.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.grad_dtype, "fusedllm_cross_entropy_cpu", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "fusedllm.linear_cross_entropy: float64 gradient with float32 logits");
    } else {
      rows_typed<scalar_t, float>(a);
    }
  });
}

}  // namespace

FUSEDLLM_REGISTER_CPU_KERNEL(cross_entropy_row_kernels, &cross_entropy_rows);

}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
