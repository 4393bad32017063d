// Memory hints for the outputs the CPU ops allocate.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace fusedllm::cpu {

// A large output freshly allocated by torch is untouched memory: without a
// hint, writing it takes one page fault per 4 KiB page, which on large
// tensors costs more than the kernel itself. Asking for transparent huge pages
// on its 2 MiB-aligned interior before the first write makes that one fault
// per 2 MiB. Only a hint: a kernel with THP disabled ignores it. Applies to
// the whole allocation behind `t` (call it on outputs the op just allocated).
inline void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (!t.defined() || t.storage().nbytes() < 4 * kHuge) return;
  const size_t bytes = t.storage().nbytes();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.storage().data());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + bytes) & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

}  // namespace fusedllm::cpu
