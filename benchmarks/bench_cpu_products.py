"""The bfloat16 tile products of the CPU attention kernel, on the kernel's own
tile shapes, one thread: fusedllm's vdpbf16ps micro-kernel (`gemm_pairs` in
csrc/cpu/attention_pairs.h) against torch's `at::native::cpublas::brgemm`
(oneDNN's micro-kernels, which PyTorch's CPU flash attention calls where it
packs its operands) and against `at::mm_out` on the same tiles.

    python benchmarks/bench_cpu_products.py     # needs a CPU with AVX512-BF16

Both micro-kernels read the same buffers: A row-major (for the pair kernel,
each row's bfloat16 pairs are its words), B in the pair ("VNNI") layout,
B[k/2][n][2]. The harness is compiled on the fly with
torch.utils.cpp_extension, with the AVX512_BF16 variant's flags.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import Benchmark, run  # noqa: E402

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/native/CPUBlas.h>

#include <chrono>
#include <string>
#include <vector>

#include "attention_pairs.h"

namespace flash = fusedllm::cpu::AVX512_BF16::flash;

static double seconds_per_call(int64_t reps, const std::function<void()>& f) {
  f();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r) f();
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count() / reps;
}

// [pairs s, brgemm s (or -1), mm s, max |pairs - brgemm|, max |pairs - mm|] for C = A B,
// A [M, K] and B [K, N] bfloat16 (K and N even, N a multiple of 16), and brgemm's error.
std::tuple<std::vector<double>, std::string> measure(at::Tensor a, at::Tensor b, int64_t reps) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  TORCH_CHECK(K % 2 == 0 && N % 16 == 0, "K even, N a multiple of 16");
  // B in the pair layout: word (p, n) = (B[2p][n], B[2p+1][n]).
  at::Tensor bp = b.view({K / 2, 2, N}).transpose(1, 2).contiguous();
  auto c_pairs = at::zeros({M, N}, at::kFloat), c_brgemm = at::zeros({M, N}, at::kFloat);
  auto c_mm = at::zeros({M, N}, at::kBFloat16);
  const auto* A = reinterpret_cast<const uint32_t*>(a.data_ptr<at::BFloat16>());
  const auto* B = reinterpret_cast<const uint32_t*>(bp.data_ptr<at::BFloat16>());
  float* C = c_pairs.data_ptr<float>();
  std::vector<double> out(5, -1.0);
  out[0] = seconds_per_call(reps, [&] {
    flash::gemm_pairs<flash::ALayout::kRowMajor, false>(M, N, K / 2, A, K / 2, B, N, C, N);
  });
  std::string error;
  try {
    out[1] = seconds_per_call(reps, [&] {
      at::native::cpublas::brgemm(M, N, K, K, N, N, false, a.data_ptr<at::BFloat16>(),
                                  bp.data_ptr<at::BFloat16>(), c_brgemm.data_ptr<float>(), true);
    });
    at::native::cpublas::brgemm_release(true);
    out[3] = (c_pairs - c_brgemm).abs().max().item<double>();
  } catch (const std::exception& e) {
    error = e.what();
  }
  out[2] = seconds_per_call(reps, [&] { at::mm_out(c_mm, a, b); });
  out[4] = (c_pairs - c_mm.to(at::kFloat)).abs().max().item<double>() ;
  return {out, error.substr(0, 200)};
}

bool could_pack() { return at::native::cpublas::could_pack(at::kBFloat16); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("measure", &measure);
  m.def("could_pack", &could_pack);
}
"""

FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-mbmi",
         "-mbmi2", "-mavx512bf16", "-DCPU_CAPABILITY=AVX512_BF16", "-DCPU_CAPABILITY_AVX512", "-std=c++20"]

# (what, M, N, K): the forward's S^T = K Q^T and O += P V, the backward's
# dV += P^T dO, at head dim 128 and the kernel's 96-row, 96-key tiles.
SHAPES = [("S^T = K Q^T (96 keys x 96 rows, d=128)", 96, 96, 128),
          ("O += P V (96 rows x d=128, 96 keys)", 96, 128, 96),
          ("dV += P^T dO (96 keys x d=128, 96 rows)", 96, 128, 96),
          ("S^T at head dim 64", 96, 96, 64)]


def cases(args, device):
    from torch.utils.cpp_extension import load_inline

    flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    if "avx512_bf16" not in flags:
        print("this CPU has no AVX512-BF16: nothing to measure")
        return
    ext = load_inline("fusedllm_bench_cpu_products", [SOURCE], extra_cflags=FLAGS,
                      extra_include_paths=[os.path.join(ROOT, "csrc", "cpu"), os.path.join(ROOT, "csrc", "include")],
                      verbose=False)
    torch.set_num_threads(1)
    reps = args.reps or (2000 if args.quick else 20000)
    print(f"cpublas::could_pack(bfloat16): {ext.could_pack()}")
    for what, m, n, k in SHAPES:
        torch.manual_seed(0)
        a = torch.randn(m, k).bfloat16()
        b = torch.randn(k, n).bfloat16()
        # three interleaved rounds, the median of each
        rounds = [ext.measure(a, b, reps) for _ in range(3)]
        times = [sorted(r[0][i] for r in rounds)[1] for i in range(3)]
        error = rounds[0][1]
        flops = 2 * m * n * k
        row = dict(case=what, m=m, n=n, k=k,
                   pairs_gflops=flops / times[0] / 1e9,
                   mm_gflops=flops / times[2] / 1e9,
                   max_diff_vs_mm=rounds[0][0][4])
        if times[1] > 0:
            row.update(brgemm_gflops=flops / times[1] / 1e9, pairs_vs_brgemm=times[1] / times[0],
                       max_diff_vs_brgemm=rounds[0][0][3])
        else:
            row.update(brgemm_error=error)
        row["pairs_vs_mm"] = times[2] / times[0]
        yield row


COLUMNS = [
    ("case", "product", "s"),
    ("pairs_gflops", "fusedllm pairs GFLOP/s", ".1f"),
    ("brgemm_gflops", "cpublas::brgemm GFLOP/s", ".1f"),
    ("mm_gflops", "at::mm GFLOP/s", ".1f"),
    ("pairs_vs_brgemm", "× brgemm", ".2f"),
    ("pairs_vs_mm", "× mm", ".2f"),
    ("max_diff_vs_brgemm", "max |pairs - brgemm|", ".1e"),
    ("brgemm_error", "brgemm", "s"),
]


def describe(row):
    brgemm = (f"brgemm {row['brgemm_gflops']:.1f}" if "brgemm_gflops" in row
              else f"brgemm unavailable: {row['brgemm_error']}")
    return (f"{row['case']:<44} pairs {row['pairs_gflops']:.1f}   {brgemm}   mm {row['mm_gflops']:.1f} GFLOP/s"
            f"   (max|diff| vs mm {row['max_diff_vs_mm']:.1e})")


BENCHMARK = Benchmark("cpu_products", __doc__, cases, COLUMNS, "pairs_vs_mm",
                      "fusedllm's bfloat16 pair micro-kernel over at::mm on attention tiles", describe=describe)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
