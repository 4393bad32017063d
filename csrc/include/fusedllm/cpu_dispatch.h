// Run-time choice among the CPU kernel variants compiled for each instruction
// set (CMakeLists.txt compiles csrc/cpu/*_kernel.cpp once per ISA).
#pragma once

#include <string>

namespace fusedllm::cpu {

enum class Isa : int { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr int kNumIsas = 3;

// The best variant this CPU runs, capped by torch's own choice (so
// ATEN_CPU_CAPABILITY=default or =avx2 also limits fusedllm).
Isa active_isa();
const char* isa_name(Isa isa);

// A per-op table of kernel variants. Zero-initialised at compile time, so the
// kernel files can fill it from static initialisers in any order.
template <typename Fn>
struct KernelTable {
  Fn variants[kNumIsas];

  Fn get() const {
    for (int i = static_cast<int>(active_isa()); i >= 0; --i) {
      if (variants[i] != nullptr) return variants[i];
    }
    return nullptr;
  }
};

}  // namespace fusedllm::cpu

#if defined(FUSEDLLM_ISA_AVX512)
#define FUSEDLLM_ISA_INDEX 2
#elif defined(FUSEDLLM_ISA_AVX2)
#define FUSEDLLM_ISA_INDEX 1
#else
#define FUSEDLLM_ISA_INDEX 0
#endif

#define FUSEDLLM_CONCAT_INNER(a, b) a##b
#define FUSEDLLM_CONCAT(a, b) FUSEDLLM_CONCAT_INNER(a, b)

// In a *_kernel.cpp: put `fn` into `table` for the ISA this file is compiled for.
#define FUSEDLLM_REGISTER_CPU_KERNEL(table, fn)                                        \
  static const bool FUSEDLLM_CONCAT(fusedllm_registered_, __COUNTER__) = [] {          \
    (table).variants[FUSEDLLM_ISA_INDEX] = (fn);                                        \
    return true;                                                                        \
  }()
