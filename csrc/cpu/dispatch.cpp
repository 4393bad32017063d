#include "fusedllm/cpu_dispatch.h"

#include <ATen/Version.h>

namespace fusedllm::cpu {

Isa active_isa() {
  static const Isa isa = [] {
    const std::string torch_choice = at::get_cpu_capability();
    Isa best = Isa::kDefault;
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("bmi2");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512dq");
    if (avx512 && torch_choice == "AVX512") {
      best = Isa::kAvx512;
    } else if (avx2 && (torch_choice == "AVX2" || torch_choice == "AVX512")) {
      best = Isa::kAvx2;
    }
#endif
    return best;
  }();
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "AVX512";
    case Isa::kAvx2: return "AVX2";
    default: return "DEFAULT";
  }
}

}  // namespace fusedllm::cpu
