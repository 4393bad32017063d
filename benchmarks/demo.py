"""fusedllm in about a minute: what was built, correctness against the notebooks'
eager modules, and the speedups at small sizes. Run with `make demo`.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]

import torch

import bench_rms_norm
import bench_rope
import bench_swiglu
import fusedllm
from reference import NotebookRMSNorm, NotebookRotaryEmbedding, NotebookSwiGLU


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def compare(name, eager, fused, inputs):
    """Same state dict, same inputs: largest differences of outputs and gradients."""
    if list(eager.parameters()):
        fused.load_state_dict(eager.state_dict())
    copies = [[t.clone().requires_grad_() for t in inputs] for _ in range(2)]
    outs = [m(*c) for m, c in zip((eager, fused), copies)]
    outs = [o if isinstance(o, tuple) else (o,) for o in outs]
    grads = [torch.randn_like(o) for o in outs[0]]
    for o in outs:
        torch.autograd.backward(list(o), grads)
    dy = max(max_diff(a, b) for a, b in zip(*outs))
    dx = max(max_diff(a.grad, b.grad) for a, b in zip(*copies))
    params = dict(eager.named_parameters())
    dw = max((max_diff(p.grad, params[n].grad) for n, p in fused.named_parameters()), default=0.0)
    print(f"  {name:34} max|dy| {dy:.2e}   max|dx| {dx:.2e}   max|dweight| {dw:.2e}")


def correctness(device):
    print("correctness: fusedllm modules against the notebooks' eager modules (float32)")
    torch.manual_seed(0)
    x = torch.randn(8, 64, 512, device=device)
    compare("RMSNorm(512)", NotebookRMSNorm(512).to(device), fusedllm.nn.RMSNorm(512).to(device), [x])
    compare("SwiGLU(512, 1408)", NotebookSwiGLU(512, 1408).to(device),
            fusedllm.nn.SwiGLU(512, 1408).to(device), [x])
    q = torch.randn(2, 8, 64, 64, device=device)
    k = torch.randn(2, 2, 64, 64, device=device)
    compare("RotaryEmbedding(64), offset 0", NotebookRotaryEmbedding(64, 1024).to(device),
            fusedllm.nn.RotaryEmbedding(64, 1024).to(device), [q, k])


def main():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = fusedllm.build_info()
    print(f"fusedllm {fusedllm.__version__}: backend {fusedllm.backend()}, built against torch "
          f"{info.get('torch_version')}, CPU variants {info.get('cpu_isas')} "
          f"(running {info.get('cpu_isa_active')}), CUDA kernels "
          f"{'for ' + ','.join(info['cuda_archs']) if info.get('cuda') else 'not built'}\n")
    correctness(device)
    quick = ["--quick", "--no-compile", "--device", device.type]
    print("\nspeed at small sizes (`make bench` runs the full tables, with torch.compile):")
    for bench in (bench_rms_norm, bench_swiglu, bench_rope):
        print()
        bench.main(quick)


if __name__ == "__main__":
    main()
