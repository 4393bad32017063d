// The SIMT emulator's runtime: fibers, the block scheduler, barriers, warp
// collectives, launches and the errors they raise. See simt.h. One translation
// unit in five parts, each a job: the thread-local block and thread state stay
// internal to it, and the hot paths (a barrier, a shuffle) inline across parts.
#include "simt/simt.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <csetjmp>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define FUSEDLLM_SIMT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FUSEDLLM_SIMT_ASAN 1
#endif
#endif
#if defined(FUSEDLLM_SIMT_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace fusedllm::simt {

#include "simt/fiber.inc"
#include "simt/scheduler.inc"
#include "simt/kernel_calls.inc"
#include "simt/hopper.inc"
#include "simt/launch.inc"

}  // namespace fusedllm::simt
