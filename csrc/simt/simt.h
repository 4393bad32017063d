// The SIMT emulator: runs the __global__ kernels of csrc/cuda, compiled by the
// host C++ compiler, on CPU memory. Each block's threads are fibers that run
// until they reach a barrier or a warp collective; a scheduler on the calling
// OS thread decides who runs next (FUSEDLLM_SIMT_SCHEDULE), so the same kernel
// can be executed in several legal orders and its results compared.
//
// This header is what kernel code sees in the emulated build (through
// csrc/cuda/runtime.cuh): the CUDA built-in variables, __syncthreads, the warp
// collectives, dynamic shared memory, device math and CUDA_KERNEL_ASSERT. It is
// included after the torch headers, so its macros cannot change them.
#pragma once

#include <c10/core/Device.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Ends the calling emulated thread; it never returns. Not declared noreturn
// under AddressSanitizer, whose no-return hook misreads a fiber's stack.
#if defined(__SANITIZE_ADDRESS__)
#define FUSEDLLM_SIMT_NORETURN
#else
#define FUSEDLLM_SIMT_NORETURN [[noreturn]]
#endif

namespace fusedllm::simt {

constexpr int kWarpSize = 32;

// Limits of the emulated device: an sm_80-class GPU, or with FUSEDLLM_SIMT_SM=75
// a Turing one (compute capability 7.5, 64 KiB of shared memory a block, whose
// tensor-core products are float16 mma.m16n8k8 only); the SM count is small by
// default (FUSEDLLM_SIMT_SMS) so grid-stride loops run more than once.
struct DeviceProperties {
  char name[256];
  int multiProcessorCount;
  size_t sharedMemPerBlock;       // without cudaFuncAttributeMaxDynamicSharedMemorySize
  size_t sharedMemPerBlockOptin;  // the most a kernel may opt in to
  int maxThreadsPerBlock;
  int warpSize;
  int major, minor;
};
const DeviceProperties& device_properties();

namespace detail {
const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
unsigned char* dynamic_shared_base();
void syncthreads(const char* file, int line);

enum class Collective : int { kShfl, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll, kSyncWarp };
// Every lane of `mask` deposits `value` (up to 8 bytes) and `arg`; returns
// this lane's result bits once all of them have arrived.
uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg, int width,
                         const char* file, int line);
// The tensor-core wrappers' shared-memory accesses, one 16-byte row per lane:
// ldmatrix (x4: lanes 8i..8i+7 address matrix i's rows) and cp.async (16-byte
// stores). A GPU serves each group of 8 lanes (a phase) in as many wavefronts
// as the most distinct 4-byte words that fall in one of its 32 banks. Lanes
// run one after another between sync points, so the n-th access of each lane
// since the last barrier is taken as one warp instruction; the warp's
// instructions are scored when the block's threads next meet at a barrier or
// the block ends.
enum class SharedAccess : int { kLdmatrix = 0, kCpAsync = 1 };
void record_shared_access(SharedAccess kind, const void* address);
FUSEDLLM_SIMT_NORETURN void kernel_assert_failed(const char* cond, const char* file, int line);

// Hopper's asynchronous units (csrc/cuda/hopper.cuh), emulated. Shared-memory
// addresses are byte offsets from the block's dynamic shared memory (the GPU
// swizzles on the address bits, so kernels align their tiles by these).
uint32_t shared_address(const void* p);
void mbarrier_init(void* bar, unsigned count, const char* file, int line);
// One arrival (after raising the transaction count by expect_tx bytes);
// returns the barrier's phase before the arrival.
uint64_t mbarrier_arrive(void* bar, uint32_t expect_tx, const char* file, int line);
void mbarrier_expect_tx(void* bar, uint32_t bytes, const char* file, int line);
// Returns once the phase of parity `parity` has completed.
void mbarrier_wait(void* bar, unsigned parity, const char* file, int line);
// fence.proxy.async: what ordinary stores wrote to shared memory becomes
// visible to wgmma and TMA (the emulator's view of the async proxy).
void fence_proxy_async();
// The tensor map a host encodes (hopper.cuh), as the emulator keeps it in the
// 128 bytes of a CUtensorMap.
struct TensorMapImage {
  uint32_t magic;
  uint8_t rank, element_bytes, swizzle_bytes, nan_fill;
  const void* global;
  uint64_t dims[5];
  uint64_t strides[4];  // bytes, of dimensions 1..rank-1
  uint16_t box[5];
};
constexpr uint32_t kTensorMapMagic = 0x544d4150u;
// Box at coords (innermost first) into shared `dst`, completing `bytes` on `bar`.
void tma_load(void* dst, const void* map, void* bar, const int32_t* coords, const char* file, int line);
void tma_store(const void* map, const void* src, const int32_t* coords, const char* file, int line);
// One warpgroup matrix product as issued by one thread, executed when its
// warpgroup waits for it (wgmma_wait).
struct WgmmaIssue {
  int n = 0;               // 8..256
  bool bf16 = true;        // else float16
  bool e4m3 = false;       // float8 e4m3 (k32, K-major), whatever bf16 says
  bool a_in_registers = false;
  bool trans_a = false, trans_b = false;  // operand MN-major
  bool accumulate = true;  // scale-d
  uint64_t desc_a = 0, desc_b = 0;
  uint32_t a[4] = {0, 0, 0, 0};
  float* d = nullptr;      // this thread's n / 2 accumulators
};
void wgmma_issue(const WgmmaIssue& op, const char* file, int line);
void wgmma_fence(const char* file, int line);
void wgmma_commit(const char* file, int line);
void wgmma_wait(int pending, const char* file, int line);
void setmaxnreg(int registers, const char* file, int line);
// Named barriers (bar.sync / bar.arrive id, threads): `threads` arrivals
// complete a phase; sync waits for its phase, arrive does not.
void named_barrier(int id, int threads, bool wait, const char* file, int line);

template <typename T>
uint64_t to_bits(T v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8,
                "warp shuffles move values of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <typename T>
T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

template <typename T>
T shuffle(Collective kind, unsigned mask, T v, int arg, int width, const char* file, int line) {
  return from_bits<T>(warp_collective(kind, mask, to_bits(v), arg, width, file, line));
}
}  // namespace detail

// Launch of `body` (the kernel applied to its arguments) on grid x block with
// `dynamic_smem` bytes of dynamic shared memory; `kernel` identifies the
// function for the shared-memory attribute. Throws a c10::Error naming the
// kernel, block and thread when the launch or the kernel goes wrong.
void launch(const char* name, const void* kernel, dim3 grid, dim3 block, size_t dynamic_smem,
            const std::function<void()>& body);

// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes).
void set_max_dynamic_shared_memory(const void* kernel, size_t bytes);

// Scheduling orders; see README "Executing the CUDA kernels on the CPU".
enum class Schedule : int { kLockstep, kReverse, kRandom, kWarp, kWarpReverse, kWarpRandom };
void set_schedule(Schedule s);
Schedule schedule();
const char* schedule_name(Schedule s);
bool parse_schedule(const std::string& name, Schedule& out);
void set_workers(int workers);  // OS threads running blocks at once
int workers();
void set_random_seed(uint64_t seed);

// Counters since the last reset, for tests and reports. Shared-memory bank
// conflicts are counted for the portable forms of ldmatrix and cp.async
// (csrc/cuda/mma.cuh; see record_shared_access): `ldmatrix` and `cp_async` are
// the warp instructions seen, `*_conflicts` the extra shared-memory wavefronts
// they would take on a GPU.
struct Stats {
  int64_t launches = 0, blocks = 0, threads = 0, barriers = 0, collectives = 0;
  int64_t ldmatrix = 0, ldmatrix_conflicts = 0, cp_async = 0, cp_async_conflicts = 0;
  std::map<std::string, int64_t> kernel_launches;  // by the name a launch gives
};
Stats stats();
void reset_stats();

}  // namespace fusedllm::simt

// ---- What kernel sources see ------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// One copy per OS thread; each block runs on one OS thread from start to end,
// so its threads (fibers of that OS thread) share it, as a block's threads do.
#define __shared__ static thread_local

#define threadIdx (::fusedllm::simt::detail::thread_idx())
#define blockIdx (::fusedllm::simt::detail::block_idx())
#define blockDim (::fusedllm::simt::detail::block_dim())
#define gridDim (::fusedllm::simt::detail::grid_dim())

#define __syncthreads() ::fusedllm::simt::detail::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) \
  ::fusedllm::simt::detail::syncwarp_at(__FILE__, __LINE__ __VA_OPT__(, ) __VA_ARGS__)
#define __shfl_sync(...) ::fusedllm::simt::detail::shfl_at(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) ::fusedllm::simt::detail::shfl_up_at(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) ::fusedllm::simt::detail::shfl_down_at(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) ::fusedllm::simt::detail::shfl_xor_at(__FILE__, __LINE__, __VA_ARGS__)
#define __ballot_sync(...) ::fusedllm::simt::detail::ballot_at(__FILE__, __LINE__, __VA_ARGS__)
#define __any_sync(...) ::fusedllm::simt::detail::any_at(__FILE__, __LINE__, __VA_ARGS__)
#define __all_sync(...) ::fusedllm::simt::detail::all_at(__FILE__, __LINE__, __VA_ARGS__)

#undef CUDA_KERNEL_ASSERT
#define CUDA_KERNEL_ASSERT(cond) \
  ((cond) ? void(0) : ::fusedllm::simt::detail::kernel_assert_failed(#cond, __FILE__, __LINE__))
#define __trap() ::fusedllm::simt::detail::kernel_assert_failed("__trap()", __FILE__, __LINE__)

namespace fusedllm::simt::detail {
using C = Collective;
inline void syncwarp_at(const char* f, int l, unsigned mask = 0xffffffffu) {
  warp_collective(C::kSyncWarp, mask, 0, 0, kWarpSize, f, l);
}
template <typename T>
T shfl_at(const char* f, int l, unsigned mask, T v, int src, int width = kWarpSize) {
  return shuffle(C::kShfl, mask, v, src, width, f, l);
}
template <typename T>
T shfl_up_at(const char* f, int l, unsigned mask, T v, unsigned delta, int width = kWarpSize) {
  return shuffle(C::kShflUp, mask, v, static_cast<int>(delta), width, f, l);
}
template <typename T>
T shfl_down_at(const char* f, int l, unsigned mask, T v, unsigned delta, int width = kWarpSize) {
  return shuffle(C::kShflDown, mask, v, static_cast<int>(delta), width, f, l);
}
template <typename T>
T shfl_xor_at(const char* f, int l, unsigned mask, T v, int lane_mask, int width = kWarpSize) {
  return shuffle(C::kShflXor, mask, v, lane_mask, width, f, l);
}
inline unsigned ballot_at(const char* f, int l, unsigned mask, int pred) {
  return static_cast<unsigned>(warp_collective(C::kBallot, mask, pred != 0, 0, kWarpSize, f, l));
}
inline int any_at(const char* f, int l, unsigned mask, int pred) {
  return static_cast<int>(warp_collective(C::kAny, mask, pred != 0, 0, kWarpSize, f, l));
}
inline int all_at(const char* f, int l, unsigned mask, int pred) {
  return static_cast<int>(warp_collective(C::kAll, mask, pred != 0, 0, kWarpSize, f, l));
}
}  // namespace fusedllm::simt::detail

#include "simt/device_math.h"
