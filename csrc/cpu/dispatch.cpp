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

namespace {

struct ListedTable {
  const char* name;
  const std::atomic<int>* ran;
};

std::vector<ListedTable>& listed_tables() {
  static std::vector<ListedTable> tables;  // filled by static initialisers
  return tables;
}

}  // namespace

bool list_kernel_table(const char* name, const std::atomic<int>* ran) {
  listed_tables().push_back({name, ran});
  return true;
}

std::vector<std::pair<std::string, std::string>> kernels_ran() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& t : listed_tables()) {
    const int ran = t.ran->load(std::memory_order_relaxed);
    if (ran >= 0) out.emplace_back(t.name, isa_name(static_cast<Isa>(ran)));
  }
  return out;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "AVX512";
    case Isa::kAvx2: return "AVX2";
    default: return "DEFAULT";
  }
}

}  // namespace fusedllm::cpu
