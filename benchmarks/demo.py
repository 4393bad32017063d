"""fusedllm in one minute: what was built, a correctness check, the speedups.

Run with `make demo`.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedllm  # noqa: E402
import bench_rms_norm  # noqa: E402


def correctness_check(device):
    """Fused RMSNorm against the eager notebook module: values and gradients."""
    print("correctness (fusedllm.nn.RMSNorm vs the eager notebook module, 64 x 4097):")
    for dtype in (torch.float32, torch.bfloat16):
        eager = bench_rms_norm.NotebookRMSNorm(4097).to(device=device, dtype=dtype)
        with torch.no_grad():
            eager.weight.normal_(1.0, 0.1)
        fused = fusedllm.nn.RMSNorm(4097).to(device=device, dtype=dtype)
        fused.load_state_dict(eager.state_dict())
        x = torch.randn(64, 4097, device=device, dtype=dtype)
        xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yf = eager(xe), fused(xf)
        g = torch.randn_like(ye)
        ye.backward(g)
        yf.backward(g)
        def diff(a, b):
            return (a.float() - b.float()).abs().max().item()
        print(f"  {str(dtype):15} max|dy| {diff(ye, yf):.2e}   max|dx| {diff(xe.grad, xf.grad):.2e}   "
              f"max|dw| {diff(eager.weight.grad, fused.weight.grad):.2e}")


def main():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = fusedllm.build_info()
    print(f"fusedllm {fusedllm.__version__}: backend {fusedllm.backend()}, built against torch "
          f"{info.get('torch_version')}, CPU variants {info.get('cpu_isas')} "
          f"(running {info.get('cpu_isa_active')}), CUDA kernels "
          f"{'for ' + ','.join(info['cuda_archs']) if info.get('cuda') else 'not built'}\n")
    correctness_check(device)
    print("\nspeed (small sizes; `make bench` runs the full table):")
    bench_rms_norm.main(["--quick", "--device", device.type])


if __name__ == "__main__":
    main()
