// Run-time choice among the CPU kernel variants compiled for each instruction
// set (CMakeLists.txt compiles csrc/cpu/*_kernel.cpp once per ISA).
#pragma once

#include <atomic>
#include <string>
#include <utility>
#include <vector>

namespace fusedllm::cpu {

// kAvx512Bf16 is the AVX-512 variant built with AVX512-BF16 as well: native
// float32 -> bfloat16 conversions and bfloat16 dot products (vdpbf16ps).
// kAmx is kAvx512Bf16 plus the AMX tiles (AMX-TILE, AMX-BF16: tdpbf16ps),
// chosen only where the CPU has them and Linux granted this process the tile
// data state; only the attention forward is compiled for it, every other
// table runs its AVX512_BF16 kernel there.
enum class Isa : int { kDefault = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };
constexpr int kNumIsas = 5;

// The best variant this CPU runs, capped by torch's own choice (so
// ATEN_CPU_CAPABILITY=default or =avx2 also limits fusedllm) and by
// FUSEDLLM_CPU_ISA (default, avx2, avx512, avx512_bf16 or amx) when it is set.
Isa active_isa();
const char* isa_name(Isa isa);

// A per-op table of kernel variants. Constant-initialised, so the kernel files
// can fill it from static initialisers in any order. `ran` is the variant the
// last call ran (-1 before the first), which build_info reports: a test that
// asks for a variant can see that it executed, not only that it was chosen.
template <typename Fn>
struct KernelTable {
  const char* name;
  Fn variants[kNumIsas];
  mutable std::atomic<int> ran{-1};

  Fn get() const {
    for (int i = static_cast<int>(active_isa()); i >= 0; --i) {
      if (variants[i] != nullptr) {
        // Written only when it changes: no shared cache line written per call.
        if (ran.load(std::memory_order_relaxed) != i) ran.store(i, std::memory_order_relaxed);
        return variants[i];
      }
    }
    return nullptr;
  }
};

// Lists a table for kernels_ran(); see FUSEDLLM_DEFINE_CPU_KERNEL_TABLE.
bool list_kernel_table(const char* name, const std::atomic<int>* ran);
// (table name, ISA name) for every listed table that has run.
std::vector<std::pair<std::string, std::string>> kernels_ran();

}  // namespace fusedllm::cpu

#if defined(FUSEDLLM_ISA_AMX)
#define FUSEDLLM_ISA_INDEX 4
#elif defined(FUSEDLLM_ISA_AVX512_BF16)
#define FUSEDLLM_ISA_INDEX 3
#elif defined(FUSEDLLM_ISA_AVX512)
#define FUSEDLLM_ISA_INDEX 2
#elif defined(FUSEDLLM_ISA_AVX2)
#define FUSEDLLM_ISA_INDEX 1
#else
#define FUSEDLLM_ISA_INDEX 0
#endif

#define FUSEDLLM_CONCAT_INNER(a, b) a##b
#define FUSEDLLM_CONCAT(a, b) FUSEDLLM_CONCAT_INNER(a, b)

// In an op's .cpp: define the kernel table `table` of function type `Fn`,
// reported by build_info as `name`.
#define FUSEDLLM_DEFINE_CPU_KERNEL_TABLE(Fn, table, name)                             \
  constinit KernelTable<Fn> table{name};                                               \
  static const bool FUSEDLLM_CONCAT(fusedllm_listed_, __COUNTER__) =                   \
      ::fusedllm::cpu::list_kernel_table(name, &(table).ran)

// In a *_kernel.cpp: put `fn` into `table` for the ISA this file is compiled for.
#define FUSEDLLM_REGISTER_CPU_KERNEL(table, fn)                                        \
  static const bool FUSEDLLM_CONCAT(fusedllm_registered_, __COUNTER__) = [] {          \
    (table).variants[FUSEDLLM_ISA_INDEX] = (fn);                                        \
    return true;                                                                        \
  }()
