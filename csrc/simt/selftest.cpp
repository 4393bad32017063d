// Deliberately broken kernels (and one correct twin) that the tests run to show
// the emulator catches what it claims: a missing barrier, shared memory read
// past its end, divergent and mismatched barriers, a full-mask shuffle in a
// partial warp, a shuffle waiting on lanes held at a barrier, a failed device
// assert, launches over the device's limits, shared-memory bank conflicts, and
// misuse of Hopper's units (mbarrier waits that never complete, wgmma without
// its fences, shared memory read by wgmma without fence.proxy.async, partial
// warpgroups). Also the tensor-core check tiles (mma_check.cuh,
// hopper_check.cuh) and the grouped matrix products (grouped_gemm.cuh) on CPU
// tensors. Built only into fusedllm._simt.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "grouped_gemm.cuh"
#include "hopper_check.cuh"
#include "mma_check.cuh"
#include "primitives.cuh"

namespace fusedllm::simt {
namespace {

using cuda::dynamic_shared;
using cuda::kWarpSize;
using cuda::warp_reduce_sum;

// Each thread publishes a value, the warp meets in a reduction (a warp-level
// sync point only), then every thread reads the next warp's value. Without the
// barrier a warp can read before the next warp has written.
__global__ void neighbour_warp_kernel(float* out, bool with_barrier) {
  float* s = dynamic_shared<float>();
  const int t = threadIdx.x;
  s[t] = static_cast<float>(t);
  const float one = warp_reduce_sum(1.0f) / kWarpSize;
  if (with_barrier) __syncthreads();
  out[t] = s[(t + kWarpSize) % blockDim.x] * one;
}

__global__ void shared_past_end_kernel(float* out) {
  float* s = dynamic_shared<float>();
  s[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x + 1];  // the last thread reads one past the end
}

__global__ void divergent_barrier_kernel(float* out) {
  if (threadIdx.x < kWarpSize) __syncthreads();
  out[threadIdx.x] = 1.0f;
}

__global__ void mismatched_barriers_kernel(float* out) {
  if (threadIdx.x < kWarpSize) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

__global__ void partial_warp_shuffle_kernel(float* out) {
  out[threadIdx.x] = warp_reduce_sum(1.0f);  // full mask, but the block ends mid-warp
}

__global__ void shuffle_waits_on_barrier_kernel(float* out) {
  if (threadIdx.x % kWarpSize < 16) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_sync(0xffffffffu, 1.0f, 0);
  }
}

__global__ void failed_assert_kernel(float* out, int limit) {
  CUDA_KERNEL_ASSERT(static_cast<int>(threadIdx.x) < limit);
  out[threadIdx.x] = 1.0f;
}

__global__ void plain_kernel(float* out) { out[threadIdx.x] = 1.0f; }

// One warp: each lane copies a 16-byte chunk with cp.async into row lane % 8,
// chunk lane / 8 of shared rows `stride` bytes apart, then ldmatrix x4 reads
// rows 0..7 (chunk i for matrix i). With 128-byte rows every phase's 8 rows
// fall in the same 4 banks (8 wavefronts each: 7 conflicts per phase, 28 per
// instruction); with 144-byte rows none do.
__global__ void bank_conflicts_kernel(float* out, int stride) {
  unsigned char* s = dynamic_shared<unsigned char>();
  const int lane = threadIdx.x;
  unsigned char* row = s + (lane % 8) * stride + (lane / 8) * 16;
  cuda::mma::cp_async_16(row, reinterpret_cast<const unsigned char*>(out) + lane * 16);
  cuda::mma::cp_async_commit();
  cuda::mma::cp_async_wait<0>();
  __syncwarp();
  uint32_t r[4];
  cuda::mma::ldmatrix_x4<false>(r, row);
  out[256 + lane] = static_cast<float>(r[0] & 0xffu);
}

// Hopper (hopper.cuh). One warpgroup; `mode` picks the mistake.
namespace hp = cuda::hopper;

// A 64 x 64 x 16 product from shared tiles written with ordinary stores:
// fenced (mode 0) it is exact; without fence_proxy_async (1), without
// wgmma_fence (2), or with the accumulators written before the wait (3) the
// emulator refuses it.
__global__ void wgmma_shared_stores_kernel(float* out, int mode) {
  unsigned char* raw = dynamic_shared<unsigned char>();
  auto* tile = reinterpret_cast<c10::BFloat16*>(raw + (1024 - hp::shared_address(raw) % 1024) % 1024);
  const int t = threadIdx.x;
  // A and B (64 x 16 each, K-major, no swizzle) all ones: every product is 16.
  for (int i = t; i < 2 * 64 * 16; i += blockDim.x) tile[i] = c10::BFloat16(1.f);
  if (mode != 1) hp::fence_proxy_async();
  __syncthreads();
  float acc[32];
  for (float& x : acc) x = 0.f;
  if (mode != 2) hp::wgmma_fence();
  const uint64_t a = hp::make_descriptor(tile, hp::Swizzle::kNone, 64 * 16, 128);
  const uint64_t b = hp::make_descriptor(tile + 64 * 16, hp::Swizzle::kNone, 64 * 16, 128);
  hp::wgmma<c10::BFloat16, 64, hp::Major::kK, hp::Major::kK>(acc, a, b, true);
  hp::wgmma_commit();
  if (mode == 3) acc[0] = 2.f;
  hp::wgmma_wait<0>();
  out[t] = acc[0];
}

// mbarrier misuse: a wait on a phase nobody completes (mode 0), an expected
// transaction count that a smaller copy never completes (1), a TMA box past the
// end of shared memory (2), a swizzled box starting inside a swizzle atom (4);
// a copy read before waiting reads NaN (3).
__global__ void mbarrier_misuse_kernel(const FUSEDLLM_GRID_CONSTANT hp::TensorMap map, float* out, int mode) {
  unsigned char* raw = dynamic_shared<unsigned char>();
  unsigned char* tile = raw + (1024 - hp::shared_address(raw) % 1024) % 1024;
  auto* bar = reinterpret_cast<uint64_t*>(tile + 4096);
  if (threadIdx.x == 0) hp::mbarrier_init(bar, 1);
  __syncthreads();
  const int32_t at[2] = {0, 0};
  if (mode == 0) {
    hp::mbarrier_wait(bar, 0);
  } else if (mode == 1) {
    if (threadIdx.x == 0) {
      hp::mbarrier_arrive_expect_tx(bar, 4096);
      hp::tma_load(tile, map, bar, at);  // 2048 bytes
    }
    hp::mbarrier_wait(bar, 0);
  } else if (mode == 2) {
    if (threadIdx.x == 0) hp::tma_load(tile + 4096, map, bar, at);
  } else if (mode == 4) {
    if (threadIdx.x == 0) hp::tma_load(tile + 512, map, bar, at);
  } else {
    if (threadIdx.x == 0) {
      hp::mbarrier_arrive_expect_tx(bar, 2048);
      hp::tma_load(tile, map, bar, at);
    }
    __syncthreads();
    const auto* row = reinterpret_cast<const c10::BFloat16*>(tile);
    const int t = threadIdx.x % 32;
    if (threadIdx.x < 32) out[t] = static_cast<float>(row[t]);
    __syncthreads();
    hp::mbarrier_wait(bar, 0);
    if (threadIdx.x < 32) out[32 + t] = static_cast<float>(row[t]);
  }
}

// Warpgroup instructions from threads that are not a whole warpgroup.
__global__ void partial_warpgroup_kernel(float* out) {
  hp::wgmma_fence();
  out[threadIdx.x] = 1.f;
}

// Warps 1 to 4 (two warpgroups' parts) meet in wgmma_wait.
__global__ void misaligned_warpgroup_kernel(float* out) {
  if (threadIdx.x >= 32 && threadIdx.x < 160) hp::wgmma_wait<0>();
  out[threadIdx.x % 64] = 1.f;
}

// A named barrier of 128 threads that only 64 reach (mode 0), or of 48 (1).
__global__ void named_barrier_kernel(float* out, int mode) {
  if (mode == 0 && threadIdx.x >= 64) return;
  hp::named_barrier_sync(1, mode == 0 ? 128 : 48);
  out[threadIdx.x % 64] = 1.f;
}

__global__ void setmaxnreg_kernel(float* out) {
  hp::setmaxnreg<20, false>();
  out[threadIdx.x % 64] = 1.f;
}

}  // namespace

// Runs self-test `name`; returns the block's output (64 floats).
std::vector<float> run_selftest(const std::string& name) {
  std::vector<float> out(1024, 0.0f);
  float* o = out.data();
  const cuda::Stream stream;
  if (name == "neighbour_warp" || name == "neighbour_warp_with_barrier") {
    cuda::launch("neighbour_warp_kernel", neighbour_warp_kernel, 1, 64, 64 * sizeof(float), stream, o,
                 name == "neighbour_warp_with_barrier");
  } else if (name == "shared_past_end") {
    cuda::launch("shared_past_end_kernel", shared_past_end_kernel, 1, 64, 64 * sizeof(float), stream, o);
  } else if (name == "divergent_barrier") {
    cuda::launch("divergent_barrier_kernel", divergent_barrier_kernel, 1, 64, 0, stream, o);
  } else if (name == "mismatched_barriers") {
    cuda::launch("mismatched_barriers_kernel", mismatched_barriers_kernel, 1, 64, 0, stream, o);
  } else if (name == "partial_warp_shuffle") {
    cuda::launch("partial_warp_shuffle_kernel", partial_warp_shuffle_kernel, 1, 48, 0, stream, o);
  } else if (name == "shuffle_waits_on_barrier") {
    cuda::launch("shuffle_waits_on_barrier_kernel", shuffle_waits_on_barrier_kernel, 1, 64, 0, stream, o);
  } else if (name == "failed_assert") {
    cuda::launch("failed_assert_kernel", failed_assert_kernel, 2, 64, 0, stream, o, 40);
  } else if (name == "bank_conflicts_128" || name == "bank_conflicts_144") {
    const int stride = name == "bank_conflicts_128" ? 128 : 144;
    cuda::launch("bank_conflicts_kernel", bank_conflicts_kernel, 1, cuda::kWarpSize, 8 * stride, stream, o, stride);
  } else if (name == "wgmma_fenced" || name == "wgmma_without_proxy_fence" || name == "wgmma_without_fence" ||
             name == "wgmma_accumulator_written") {
    const int mode = name == "wgmma_fenced" ? 0 : name == "wgmma_without_proxy_fence" ? 1
                     : name == "wgmma_without_fence" ? 2 : 3;
    cuda::launch("wgmma_shared_stores_kernel", wgmma_shared_stores_kernel, 1, 128, 1024 + 4096, stream, o, mode);
  } else if (name == "mbarrier_never_completes" || name == "tma_bytes_never_arrive" || name == "tma_box_past_shared" ||
             name == "tma_box_inside_atom" || name == "tma_read_before_wait") {
    const int mode = name == "mbarrier_never_completes" ? 0 : name == "tma_bytes_never_arrive" ? 1
                     : name == "tma_box_past_shared" ? 2 : name == "tma_box_inside_atom" ? 4 : 3;
    static std::vector<c10::BFloat16> source = [] {
      std::vector<c10::BFloat16> v(64 * 64);
      for (size_t i = 0; i < v.size(); ++i) v[i] = c10::BFloat16(static_cast<float>(i % 64));
      return v;
    }();
    const int64_t dims[2] = {64, 64}, strides[1] = {128};
    const int box[2] = {64, 16};  // 2048 bytes
    const hp::TensorMap map = hp::encode_tensor_map(source.data(), 2, 2, dims, strides, box, hp::Swizzle::k128B);
    cuda::launch("mbarrier_misuse_kernel", mbarrier_misuse_kernel, 1, 64, 1024 + 4096 + 64, stream, map, o, mode);
  } else if (name == "partial_warpgroup") {
    cuda::launch("partial_warpgroup_kernel", partial_warpgroup_kernel, 1, 96, 0, stream, o);
  } else if (name == "misaligned_warpgroup") {
    cuda::launch("misaligned_warpgroup_kernel", misaligned_warpgroup_kernel, 1, 256, 0, stream, o);
  } else if (name == "named_barrier_never_completes" || name == "named_barrier_odd_count") {
    cuda::launch("named_barrier_kernel", named_barrier_kernel, 1, 128, 0, stream, o,
                 name == "named_barrier_never_completes" ? 0 : 1);
  } else if (name == "setmaxnreg_out_of_range") {
    cuda::launch("setmaxnreg_kernel", setmaxnreg_kernel, 1, 128, 0, stream, o);
  } else if (name == "too_many_threads") {
    cuda::launch("plain_kernel", plain_kernel, 1, 1025, 0, stream, o);
  } else if (name == "grid_too_large") {
    cuda::launch("plain_kernel", plain_kernel, dim3(1, 65536), 32, 0, stream, o);
  } else if (name == "shared_without_opt_in") {
    cuda::launch("plain_kernel", plain_kernel, 1, 32, 64 * 1024, stream, o);
  } else if (name == "shared_over_opt_in") {
    cuda::allow_dynamic_shared_memory(plain_kernel, 1 << 20);
  } else {
    TORCH_CHECK_VALUE(false, "fusedllm.simt: no self-test named '", name, "'");
  }
  out.resize(64);
  return out;
}

namespace {

// The tensor-core check tile (mma_check.cuh): a [64, 64] times b, b given as
// [n, k] (b_rows_are_n) or [k, n]; bfloat16 or float16 CPU tensors.
at::Tensor mma_tile(const at::Tensor& a, const at::Tensor& b, bool b_rows_are_n) {
  const int64_t d = cuda::mma::kCheckDim;
  TORCH_CHECK_VALUE(a.device().is_cpu() && b.device().is_cpu(), "mma_tile: a and b must be CPU tensors");
  TORCH_CHECK_VALUE(a.sizes() == at::IntArrayRef({d, d}) && b.sizes() == at::IntArrayRef({d, d}),
                    "mma_tile: a and b must be [64, 64], got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type() &&
                        (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf),
                    "mma_tile: a and b must both be bfloat16 or both float16, got ", a.scalar_type(),
                    " and ", b.scalar_type());
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor c = at::empty({d, d}, a.options().dtype(at::kFloat));
  const cuda::Stream stream;
  if (a.scalar_type() == at::kBFloat16) {
    cuda::mma::launch_mma_tile(ac.const_data_ptr<at::BFloat16>(), bc.const_data_ptr<at::BFloat16>(),
                               c.data_ptr<float>(), b_rows_are_n, /*portable=*/true, stream);
  } else {
    cuda::mma::launch_mma_tile(ac.const_data_ptr<at::Half>(), bc.const_data_ptr<at::Half>(),
                               c.data_ptr<float>(), b_rows_are_n, /*portable=*/true, stream);
  }
  return c;
}

// The Hopper check product (hopper_check.cuh): a [64, k] times b, b given as
// [n, k] or (b_mn_major) [k, n]; span: the swizzle span in bytes (16: none).
at::Tensor wgmma_tile(const at::Tensor& a, const at::Tensor& b, int64_t span, bool b_mn_major, bool a_in_registers) {
  TORCH_CHECK_VALUE(a.device().is_cpu() && b.device().is_cpu(), "wgmma_tile: a and b must be CPU tensors");
  return cuda::hopper::wgmma_tile(a, b, span, b_mn_major, a_in_registers, cuda::Stream{});
}

// The TMA round trip (hopper_check.cuh) over CPU tensors.
std::tuple<at::Tensor, at::Tensor> tma_box(const at::Tensor& src, at::IntArrayRef box, at::IntArrayRef coords,
                                           int64_t swizzle) {
  return cuda::hopper::tma_box(src, box, coords, swizzle, cuda::Stream{});
}

// encode_tensor_map over a CPU tensor as it lies (dimensions and box
// innermost first, as TMA counts them); its refusals are the test.
void encode_tensor_map(const at::Tensor& t, at::IntArrayRef box, int64_t swizzle) {
  cuda::hopper::TmaShape(t, box, "encode_tensor_map").encode(t, static_cast<int>(swizzle));
}

// cuda::grouped_mm on CPU tensors, out allocated here: kind is a
// GroupedProduct (0: a @ b[e]^T, 1: a @ b[e], 2: the weight gradient);
// tensor_cores = false runs the SIMT kernel for 16-bit types too; tile 64 or
// 128 picks the output tile (0: grouped_mm's choice).
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets, int64_t kind,
                      bool tensor_cores, int64_t tile) {
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 2, "grouped_mm: kind must be 0, 1 or 2, got ", kind);
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() >= 2 && offsets.dim() == 1,
                    "grouped_mm: a must be 2-D, b 2-D or 3-D, offsets 1-D");
  const auto product = static_cast<cuda::GroupedProduct>(kind);
  at::Tensor out;
  if (product == cuda::GroupedProduct::kWeightGradient) {
    out = at::empty({offsets.size(0) - 1, a.size(1), b.size(-1)}, a.options());
  } else {
    out = at::empty({a.size(0), b.size(product == cuda::GroupedProduct::kRowsTimesWeightT ? 1 : 2)},
                    a.options());
  }
  cuda::grouped::grouped_mm(out, a, b, offsets, product, tensor_cores, static_cast<int>(tile));
  return out;
}

}  // namespace

}  // namespace fusedllm::simt

// torch.ops.fusedllm_simt_selftest: checks of the emulated primitives, apart
// from the fusedllm_simt ops (whose schemas are fusedllm's).
TORCH_LIBRARY(fusedllm_simt_selftest, m) {
  m.def("mma_tile(Tensor a, Tensor b, bool b_rows_are_n) -> Tensor");
  m.impl("mma_tile", c10::DispatchKey::CPU, &fusedllm::simt::mma_tile);
  m.def("wgmma_tile(Tensor a, Tensor b, int span, bool b_mn_major, bool a_in_registers) -> Tensor");
  m.impl("wgmma_tile", c10::DispatchKey::CPU, &fusedllm::simt::wgmma_tile);
  m.def("tma_box(Tensor src, int[] box, int[] coords, int swizzle) -> (Tensor, Tensor)");
  m.impl("tma_box", c10::DispatchKey::CPU, &fusedllm::simt::tma_box);
  m.def("encode_tensor_map(Tensor t, int[] box, int swizzle) -> ()");
  m.impl("encode_tensor_map", c10::DispatchKey::CPU, &fusedllm::simt::encode_tensor_map);
  m.def("grouped_mm(Tensor a, Tensor b, Tensor offsets, int kind, bool tensor_cores=True, int tile=0) -> Tensor");
  m.impl("grouped_mm", c10::DispatchKey::CPU, &fusedllm::simt::grouped_mm);
}
