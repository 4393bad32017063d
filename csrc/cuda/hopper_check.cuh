// A 64 x N x K matrix product built from the Hopper units of hopper.cuh the way
// a warp-specialized attention kernel uses them: a producer warpgroup issues
// TMA loads of 64-wide K tiles into a two-stage ring of shared memory (full and
// empty mbarriers, their phases flipping each round), a consumer warpgroup
// multiplies each stage with wgmma and frees it. It exists to check those
// units: under the emulator (torch.ops.fusedllm_simt_selftest.wgmma_tile) and
// on an sm_90a GPU (tests/hopper_check.cu), for every swizzle, both layouts of
// B, and A from shared memory or from registers. Also a TMA round trip of a
// 1-D to 5-D box (load, the bytes as they land, store).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "hopper.cuh"

namespace fusedllm::cuda::hopper {

constexpr int kCheckRows = 64;    // M
constexpr int kCheckKTileBytes = 128;  // of a row a stage holds: 64 16-bit elements, 128 float8 codes
template <typename T>
constexpr int kCheckKTile = kCheckKTileBytes / static_cast<int>(sizeof(T));  // K elements a stage holds
constexpr int kCheckStages = 2;
constexpr int kCheckThreads = 256;  // producer and consumer warpgroups

struct TmaCoords {
  int32_t c[5];
};

// Shared tiles are laid out as TMA writes them: boxes of kSpan bytes (the
// swizzle span; 16 without a swizzle) by their rows, side by side.
template <typename T, int N>
constexpr int check_stage_bytes() {
  return (kCheckRows + N) * kCheckKTileBytes;
}
template <typename T, int N>
constexpr size_t check_shared_bytes() {
  return static_cast<size_t>(kCheckStages) * check_stage_bytes<T, N>() + 1024 + 64;
}

// c [64, N] float32 = a [64, K] times b: b is [N, K] (kMajorB == kK: c = a b^T)
// or [K, N] (kMN: c = a b); K a multiple of kCheckKTile<T>. a_global: a, for the fragments
// of A from registers. T: bfloat16, float16 or float8 e4m3 (B K-major).
template <typename T, int N, int kSpan, Major kMajorB, bool kARegisters>
__global__ void __launch_bounds__(kCheckThreads, 1)
    wgmma_tile_kernel(const FUSEDLLM_GRID_CONSTANT TensorMap map_a, const FUSEDLLM_GRID_CONSTANT TensorMap map_b,
                      const T* a_global, int k_total, float* c) {
  constexpr Swizzle kSwizzle = kSpan == 16 ? Swizzle::kNone : static_cast<Swizzle>(kSpan);
  constexpr int kElement = static_cast<int>(sizeof(T));
  constexpr int kBoxElements = kSpan / kElement;
  constexpr int kATileBytes = kCheckRows * kCheckKTileBytes;
  constexpr int kKTile = kCheckKTile<T>;
  constexpr int kStepK = kWgmmaK<T>;  // 32 bytes of a row a step
  unsigned char* raw = dynamic_shared<unsigned char>();
  unsigned char* tiles = raw + (1024 - shared_address(raw) % 1024) % 1024;
  auto* full = reinterpret_cast<uint64_t*>(tiles + kCheckStages * check_stage_bytes<T, N>());
  uint64_t* empty = full + kCheckStages;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < kCheckStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], 128);
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  const int k_tiles = k_total / kKTile;
  // The warpgroup, uniform across each warp as the compiler can see (else it
  // serialises the wgmma of a branch it takes for divergent).
  const int warpgroup = __shfl_sync(kFullMask, tid / 128, 0);

  if (warpgroup == 0) {  // producer
    setmaxnreg<40, false>();
    if (tid == 0) {
      for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % kCheckStages, round = kt / kCheckStages;
        mbarrier_wait(&empty[s], (round & 1) ^ 1);
        mbarrier_arrive_expect_tx(&full[s], check_stage_bytes<T, N>());
        unsigned char* a_tile = tiles + s * check_stage_bytes<T, N>();
        unsigned char* b_tile = a_tile + kATileBytes;
        for (int box = 0; box < kKTile / kBoxElements; ++box) {
          const int32_t at_a[2] = {kt * kKTile + box * kBoxElements, 0};
          tma_load(a_tile + box * kCheckRows * kSpan, map_a, &full[s], at_a);
        }
        if constexpr (kMajorB == Major::kK) {
          for (int box = 0; box < kKTile / kBoxElements; ++box) {
            const int32_t at_b[2] = {kt * kKTile + box * kBoxElements, 0};
            tma_load(b_tile + box * N * kSpan, map_b, &full[s], at_b);
          }
        } else {
          for (int box = 0; box < N / kBoxElements; ++box) {
            const int32_t at_b[2] = {box * kBoxElements, kt * kKTile};
            tma_load(b_tile + box * kKTile * kSpan, map_b, &full[s], at_b);
          }
        }
      }
    }
    return;
  }

  setmaxnreg<232, true>();
  const int t = tid - 128, w = t / 32, g = (t % 32) / 4, q = t % 4;
  float acc[N / 2];
  for (int i = 0; i < N / 2; ++i) acc[i] = 1.0f;  // the first product overwrites (scale-d = 0)
  for (int kt = 0; kt < k_tiles; ++kt) {
    const int s = kt % kCheckStages, round = kt / kCheckStages;
    mbarrier_wait(&full[s], round & 1);
    const unsigned char* a_tile = tiles + s * check_stage_bytes<T, N>();
    const unsigned char* b_tile = a_tile + kATileBytes;
    // A's fragments from registers are written before the fence that orders
    // them before the products: each register is 4 bytes of a row (2
    // elements, or 4 float8 codes), at k 4q / kElement and half a step on.
    mma::FragA frags[kARegisters ? kKTile / kStepK : 1];
    if constexpr (kARegisters) {
      for (int step = 0; step < kKTile / kStepK; ++step) {
        const int k0 = kt * kKTile + step * kStepK + q * (4 / kElement);
        const auto word = [&](int row, int k) {
          return *reinterpret_cast<const uint32_t*>(a_global + static_cast<int64_t>(row) * k_total + k);
        };
        const int top = 16 * w + g;
        frags[step] = mma::FragA{{word(top, k0), word(top + 8, k0), word(top, k0 + kStepK / 2),
                                  word(top + 8, k0 + kStepK / 2)}};
      }
    }
    fence_operand(acc);
    for (auto& f : frags) fence_operand(f);
    wgmma_fence();
    for (int step = 0; step < kKTile / kStepK; ++step) {
      const bool accumulate = kt > 0 || step > 0;
      // K-major operand of `rows` rows: the step's 32 bytes of each row.
      auto k_major = [&](const unsigned char* tile, int rows) {
        if constexpr (kSpan == 16) {
          return make_descriptor(tile + 2 * step * rows * 16, kSwizzle, rows * 16, 128);
        } else {
          const int byte = 32 * step;
          return make_descriptor(tile + (byte / kSpan) * rows * kSpan + byte % kSpan, kSwizzle, 16, 8 * kSpan);
        }
      };
      uint64_t desc_b;
      if constexpr (kMajorB == Major::kK) {
        desc_b = k_major(b_tile, N);
      } else if constexpr (kSpan == 16) {
        desc_b = make_descriptor(b_tile + 16 * step * 16, kSwizzle, 128, kKTile * 16);
      } else {
        desc_b = make_descriptor(b_tile + 16 * step * kSpan, kSwizzle, kKTile * kSpan, 8 * kSpan);
      }
      if constexpr (kARegisters) {
        wgmma<T, N, kMajorB>(acc, frags[step], desc_b, accumulate);
      } else {
        wgmma<T, N, Major::kK, kMajorB>(acc, k_major(a_tile, kCheckRows), desc_b, accumulate);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_operand(acc);
    mbarrier_arrive(&empty[s]);
  }
  for (int r = 0; r < N / 2; ++r) {
    const int j = r / 4, h = (r % 4) / 2, col = r % 2;
    c[(16 * w + g + 8 * h) * N + 8 * j + 2 * q + col] = acc[r];
  }
}

template <typename T, int N, int kSpan, Major kMajorB, bool kARegisters>
void launch_wgmma_tile_as(const T* a, const T* b, float* c, int k, Stream stream) {
  constexpr Swizzle kSwizzle = kSpan == 16 ? Swizzle::kNone : static_cast<Swizzle>(kSpan);
  constexpr int kElement = static_cast<int>(sizeof(T));
  const int box_inner = kSpan / kElement;
  const int64_t a_dims[2] = {k, kCheckRows}, a_strides[1] = {kElement * static_cast<int64_t>(k)};
  const int a_box[2] = {box_inner, kCheckRows};
  const TensorMap map_a = encode_tensor_map(a, kElement, 2, a_dims, a_strides, a_box, kSwizzle);
  TensorMap map_b;
  if constexpr (kMajorB == Major::kK) {
    const int64_t dims[2] = {k, N}, strides[1] = {kElement * static_cast<int64_t>(k)};
    const int box[2] = {box_inner, N};
    map_b = encode_tensor_map(b, kElement, 2, dims, strides, box, kSwizzle);
  } else {
    const int64_t dims[2] = {N, k}, strides[1] = {kElement * N};
    const int box[2] = {box_inner, kCheckKTile<T>};
    map_b = encode_tensor_map(b, kElement, 2, dims, strides, box, kSwizzle);
  }
  auto* kernel = wgmma_tile_kernel<T, N, kSpan, kMajorB, kARegisters>;
  allow_dynamic_shared_memory(kernel, check_shared_bytes<T, N>());
  launch("wgmma_tile_kernel", kernel, 1, kCheckThreads, check_shared_bytes<T, N>(), stream, map_a, map_b, a, k,
         c);
}

template <typename T, int N, int kSpan>
void launch_wgmma_tile_span(const T* a, const T* b, float* c, int k, bool b_mn_major, bool a_in_registers,
                            Stream stream) {
  if (b_mn_major) {
    if constexpr (kIsE4m3<T>) {
      TORCH_CHECK_VALUE(false, "wgmma_tile: float8 wgmma reads K-major operands only: b must be [n, k]");
    } else {
      a_in_registers ? launch_wgmma_tile_as<T, N, kSpan, Major::kMN, true>(a, b, c, k, stream)
                     : launch_wgmma_tile_as<T, N, kSpan, Major::kMN, false>(a, b, c, k, stream);
    }
  } else {
    a_in_registers ? launch_wgmma_tile_as<T, N, kSpan, Major::kK, true>(a, b, c, k, stream)
                   : launch_wgmma_tile_as<T, N, kSpan, Major::kK, false>(a, b, c, k, stream);
  }
}

template <typename T, int N>
void launch_wgmma_tile_n(const T* a, const T* b, float* c, int k, int span, bool b_mn_major, bool a_in_registers,
                         Stream stream) {
  switch (span) {
    case 16: return launch_wgmma_tile_span<T, N, 16>(a, b, c, k, b_mn_major, a_in_registers, stream);
    case 32: return launch_wgmma_tile_span<T, N, 32>(a, b, c, k, b_mn_major, a_in_registers, stream);
    case 64: return launch_wgmma_tile_span<T, N, 64>(a, b, c, k, b_mn_major, a_in_registers, stream);
    case 128: return launch_wgmma_tile_span<T, N, 128>(a, b, c, k, b_mn_major, a_in_registers, stream);
    default: TORCH_CHECK_VALUE(false, "wgmma_tile: span must be 16 (no swizzle), 32, 64 or 128, got ", span);
  }
}

// The check product c = a b^T (b [n, k]) or a b (b_mn_major: b [k, n]) over
// tensors where the kernels run (CPU tensors under the emulator): a [64, k],
// both bfloat16, float16 or float8 e4m3 (b then [n, k]); n 64, 128 or 256
// (kAllN; else 128 only, which is ptxas time where a GPU check builds it), k
// a positive multiple of 64 (128 for float8); span: the swizzle span in bytes, 16 for none.
template <bool kAllN = true>
at::Tensor wgmma_tile(const at::Tensor& a, const at::Tensor& b, int64_t span, bool b_mn_major, bool a_in_registers,
                      Stream stream) {
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && a.size(0) == 64, "wgmma_tile: a must be [64, k] and b 2-D");
  const at::ScalarType dtype = a.scalar_type();
  TORCH_CHECK_VALUE(dtype == b.scalar_type() &&
                        (dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat8_e4m3fn),
                    "wgmma_tile: a and b must both be bfloat16, float16 or float8_e4m3fn");
  const int64_t k = a.size(1), n = b_mn_major ? b.size(1) : b.size(0);
  TORCH_CHECK_VALUE((b_mn_major ? b.size(0) : b.size(1)) == k, "wgmma_tile: b's k must be a's, got ", b.sizes());
  const int64_t k_tile = dtype == at::kFloat8_e4m3fn ? kCheckKTile<c10::Float8_e4m3fn> : kCheckKTile<c10::Half>;
  TORCH_CHECK_VALUE(k > 0 && k % k_tile == 0, "wgmma_tile: k must be a positive multiple of ", k_tile, ", got ", k);
  TORCH_CHECK_VALUE(n == 128 || (kAllN && (n == 64 || n == 256)), "wgmma_tile: n must be ",
                    kAllN ? "64, 128 or 256" : "128", ", got ", n);
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor c = at::empty({64, n}, a.options().dtype(at::kFloat));
  const auto run = [&](auto type_tag) {
    using T = decltype(type_tag);
    const T* pa = static_cast<const T*>(ac.const_data_ptr());
    const T* pb = static_cast<const T*>(bc.const_data_ptr());
    const int ki = static_cast<int>(k), si = static_cast<int>(span);
    float* pc = c.data_ptr<float>();
    if constexpr (kAllN) {
      if (n == 64) return launch_wgmma_tile_n<T, 64>(pa, pb, pc, ki, si, b_mn_major, a_in_registers, stream);
      if (n == 256) return launch_wgmma_tile_n<T, 256>(pa, pb, pc, ki, si, b_mn_major, a_in_registers, stream);
    }
    launch_wgmma_tile_n<T, 128>(pa, pb, pc, ki, si, b_mn_major, a_in_registers, stream);
  };
  if (dtype == at::kBFloat16) {
    run(c10::BFloat16{});
  } else if (dtype == at::kHalf) {
    run(c10::Half{});
  } else {
    run(c10::Float8_e4m3fn{});
  }
  return c;
}

// A TMA round trip: the box of `src_map` at `coords` is loaded into shared
// memory `offset` bytes (a multiple of 128) past a 1024-byte boundary, its
// bytes as they landed (swizzled) copied to `image`, and the box stored from
// there to `dst_map` at the same coordinates.
template <int kRank>
__global__ void __launch_bounds__(128)
    tma_box_kernel(const FUSEDLLM_GRID_CONSTANT TensorMap src_map, const FUSEDLLM_GRID_CONSTANT TensorMap dst_map,
                   TmaCoords coords, int box_bytes, int offset, unsigned char* image) {
  unsigned char* raw = dynamic_shared<unsigned char>();
  unsigned char* tile = raw + (1024 - shared_address(raw) % 1024) % 1024 + offset;
  auto* bar = reinterpret_cast<uint64_t*>(tile + ((box_bytes + 127) / 128) * 128);
  int32_t at[kRank];
  for (int d = 0; d < kRank; ++d) at[d] = coords.c[d];
  if (threadIdx.x == 0) {
    mbarrier_init(bar, 1);
    mbarrier_init_fence();
    mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(box_bytes));
    tma_load(tile, src_map, bar, at);
  }
  __syncthreads();
  mbarrier_wait(bar, 0);
  for (int i = threadIdx.x; i < box_bytes; i += blockDim.x) image[i] = tile[i];
  if (threadIdx.x == 0) {
    tma_store(dst_map, tile, at);
    tma_store_commit();
    tma_store_wait<0>();
  }
}

// A tensor of 1 to 5 dimensions as TMA counts them (innermost first), with a
// box of `box` elements (innermost first).
struct TmaShape {
  int rank = 0, element_bytes = 0;
  int64_t dims[5] = {}, strides[4] = {};  // strides in bytes, of dimensions 1..rank-1
  int box[5] = {};
  int64_t box_bytes = 0;

  TmaShape(const at::Tensor& t, at::IntArrayRef box_sizes, const char* op) {
    rank = static_cast<int>(t.dim());  // encode_tensor_map checks it is 1 to 5
    TORCH_CHECK_VALUE(static_cast<int>(box_sizes.size()) == rank, op, ": one box size per dimension");
    element_bytes = static_cast<int>(t.element_size());
    box_bytes = element_bytes;
    for (int d = 0; d < rank && d < 5; ++d) {
      dims[d] = t.size(rank - 1 - d);
      box[d] = static_cast<int>(box_sizes[d]);
      box_bytes *= box[d];
      if (d > 0) strides[d - 1] = t.stride(rank - 1 - d) * t.element_size();
    }
  }
  TensorMap encode(const at::Tensor& t, int swizzle_bytes) const {
    return encode_tensor_map(t.const_data_ptr(), element_bytes, rank, dims, strides, box,
                             static_cast<Swizzle>(swizzle_bytes));
  }
};

// The round trip over a contiguous copy of src at `coords` (innermost
// first): the box's shared-memory bytes as they landed, and a zero tensor
// with the box stored. swizzle_bytes: 0, 32, 64 or 128; offset: where the
// box lands past a 1024-byte boundary (the emulator refuses a swizzled box
// inside a swizzle atom; a GPU check asks the hardware).
inline std::tuple<at::Tensor, at::Tensor> tma_box(const at::Tensor& src, at::IntArrayRef box,
                                                  at::IntArrayRef coords, int64_t swizzle_bytes, Stream stream,
                                                  int64_t offset = 0) {
  TORCH_CHECK_VALUE(offset >= 0 && offset < 1024 && offset % 128 == 0,
                    "tma_box: offset must be a multiple of 128 below 1024, got ", offset);
  const at::Tensor s = src.contiguous();
  const TmaShape shape(s, box, "tma_box");
  TORCH_CHECK_VALUE(shape.rank >= 1 && shape.rank <= 5 && static_cast<int>(coords.size()) == shape.rank,
                    "tma_box: a 1-D to 5-D tensor and one coordinate per dimension");
  at::Tensor dst = at::zeros_like(s);
  at::Tensor image = at::empty({shape.box_bytes}, s.options().dtype(at::kByte));
  const TensorMap src_map = shape.encode(s, static_cast<int>(swizzle_bytes));
  const TensorMap dst_map = shape.encode(dst, static_cast<int>(swizzle_bytes));
  const int box_bytes = static_cast<int>(shape.box_bytes);
  TmaCoords at{};
  for (int d = 0; d < shape.rank; ++d) at.c[d] = static_cast<int32_t>(coords[d]);
  unsigned char* out = image.data_ptr<uint8_t>();
  const size_t smem = 1024 + static_cast<size_t>(offset) + ((box_bytes + 127) / 128) * 128 + 8;
  const auto go = [&](auto kernel) {
    allow_dynamic_shared_memory(kernel, smem);
    launch("tma_box_kernel", kernel, 1, 128, smem, stream, src_map, dst_map, at, box_bytes,
           static_cast<int>(offset), out);
  };
  switch (shape.rank) {
    case 1: go(tma_box_kernel<1>); break;
    case 2: go(tma_box_kernel<2>); break;
    case 3: go(tma_box_kernel<3>); break;
    case 4: go(tma_box_kernel<4>); break;
    default: go(tma_box_kernel<5>); break;
  }
  return {image, dst};
}

}  // namespace fusedllm::cuda::hopper
