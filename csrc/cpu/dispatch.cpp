#include "fusedllm/cpu_dispatch.h"

#include <ATen/Version.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <stdexcept>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace fusedllm::cpu {

namespace {

// Whether this process may run AMX tile instructions: the CPU has AMX-TILE
// and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22), the OS saves the tile
// state (XCR0 bits 17 and 18), and Linux granted the process the tile data
// state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), which must
// precede the first tile instruction: without it that instruction faults).
// Asked once, by active_isa(); the grant holds for every thread of the process.
bool amx_usable() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  const bool amx_bf16 = (edx >> 22) & 1u, amx_tile = (edx >> 24) & 1u;
  if (!amx_bf16 || !amx_tile) return false;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0 || ((ecx >> 27) & 1u) == 0) return false;  // OSXSAVE
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  constexpr unsigned kTileCfg = 1u << 17, kTileData = 1u << 18;
  if ((xcr0_lo & (kTileCfg | kTileData)) != (kTileCfg | kTileData)) return false;
  constexpr long kArchReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM (asm/prctl.h)
  constexpr long kXfeatureXtiledata = 18;     // XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace

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
    const bool avx512_bf16 = avx512 && __builtin_cpu_supports("avx512bf16") &&
                             __builtin_cpu_supports("avx512vnni");
    if (avx512_bf16 && torch_choice == "AVX512" && amx_usable()) {
      best = Isa::kAmx;
    } else if (avx512_bf16 && torch_choice == "AVX512") {
      best = Isa::kAvx512Bf16;
    } else if (avx512 && torch_choice == "AVX512") {
      best = Isa::kAvx512;
    } else if (avx2 && (torch_choice == "AVX2" || torch_choice == "AVX512")) {
      best = Isa::kAvx2;
    }
#endif
    if (const char* cap = std::getenv("FUSEDLLM_CPU_ISA"); cap != nullptr && *cap != '\0') {
      const std::string want(cap);
      int limit = -1;
      for (int i = 0; i < kNumIsas; ++i) {
        std::string name = isa_name(static_cast<Isa>(i));
        for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        if (name == want) limit = i;
      }
      if (limit < 0) {
        throw std::invalid_argument("FUSEDLLM_CPU_ISA=" + want +
                                    " is not one of default, avx2, avx512, avx512_bf16, amx");
      }
      best = static_cast<Isa>(std::min(limit, static_cast<int>(best)));
    }
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
    case Isa::kAmx: return "AMX";
    case Isa::kAvx512Bf16: return "AVX512_BF16";
    case Isa::kAvx512: return "AVX512";
    case Isa::kAvx2: return "AVX2";
    default: return "DEFAULT";
  }
}

}  // namespace fusedllm::cpu
