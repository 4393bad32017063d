"""The CUDA kernels on GPUs with less shared memory than the emulated
sm_80-class device. Mostly as an sm_75 (Turing: T4) GPU runs them: the emulator as
an sm_75 device (FUSEDLLM_SIMT_SM=75: compute capability 7.5, 64 KiB of
shared memory a block, each float16 m16n8k16 product as two mma.m16n8k8, no
bfloat16 product), in processes of their own since the emulated device's
properties are read once. There mma.cuh's check tile and the grouped products
multiply exactly in float16 on the tensor cores (bfloat16: the check tile
refuses, the grouped products take the SIMT kernel);
test_attention_tensor_core.py's float16 and dispatch cases pass on the Turing
tiles (bfloat16 on the SIMT kernels); and head dims past 128 run on the SIMT
kernels' narrow tiles, which fit 64 KiB. And as an sm_86/89 GPU, whose
blocks get 99 KiB: head dim 256's tensor-core backward fits it exactly."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

pytestmark = pytest.mark.simt


def _emulated(args, timeout, **device):
    """python `args` with the emulated device as the FUSEDLLM_SIMT_* variables
    `device` say."""
    env = dict(os.environ, **device, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def _as_sm75(args, timeout):
    return _emulated(args, timeout, FUSEDLLM_SIMT_SM="75")


PRODUCTS = r"""
import json, torch, fusedllm, fusedllm.simt as simt
from test_tensor_core import LAYOUTS, check, operands
from test_grouped_gemm import GROUPS, check as check_grouped, operands as grouped_operands
props = simt._simt.device_properties()
assert (props["major"], props["minor"], props["shared_mem_per_block_optin"]) == (7, 5, 64 * 1024), props
for rows_are_n in LAYOUTS.values():
    for exact in (True, False):
        a, b, expected = operands(torch.float16, exact, rows_are_n)
        with simt.kernels(schedule="warp-random"):
            check(torch.ops.fusedllm_simt_selftest.mma_tile(a, b, rows_are_n), expected, exact)
a, b, _ = operands(torch.bfloat16, True, True)
try:
    with simt.kernels():
        torch.ops.fusedllm_simt_selftest.mma_tile(a, b, True)
    refused = ""
except RuntimeError as e:
    refused = str(e)
grouped = {}
for dtype in ("float16", "bfloat16"):
    for kind in range(3):
        for tile in (64, 128):
            a, b, offsets = grouped_operands(kind, GROUPS, (40, 72), getattr(torch, dtype), exact=True, seed=kind)
            before = simt.stats()["kernel_launches"]
            with simt.kernels(schedule="warp-random"):
                out = torch.ops.fusedllm_simt_selftest.grouped_mm(a, b, offsets, kind, True, tile)
            after = simt.stats()["kernel_launches"]
            check_grouped(out, a, b, offsets, kind, exact=True)
            grouped[f"{dtype} {kind} {tile}"] = sorted(n for n, c in after.items() if c > before.get(n, 0))
print(json.dumps({"refused": refused, "grouped": grouped}))
"""


def test_products_as_two_k8_products():
    """float16: the m16n8k16 product as two m16n8k8 ones, exact on small
    integers in both B layouts of the check tile and in the three grouped
    products (on both tiles of their tensor-core kernel); bfloat16 has no product there: the
    check tile stops (dispatch never asks for one on sm_75) and the grouped
    products run the SIMT kernel."""
    done = _as_sm75(["-c", PRODUCTS], 600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "no bfloat16 tensor-core product before sm_80" in result["refused"], result
    for case, kernels in result["grouped"].items():
        tile = case.split()[-1]
        want = f"grouped_mm_tc_kernel {tile}" if case.startswith("float16") else "grouped_mm_simt_kernel 64"
        assert kernels == [want], (case, kernels)


def test_attention_grid_on_turing_tiles():
    """test_attention_tensor_core.py's float16 cases (the tensor-core forward,
    delta, dQ and dK/dV on the Turing tiles: 32-key forward tiles and 16-row
    backward tiles at head dim 128), its dispatch cases (bfloat16 and decoding
    on the SIMT kernels) and its bank-conflict count, under the round-robin
    schedule (both schedules run the same kernels on the sm_80 tiles)."""
    done = _as_sm75(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-m", "simt",
                     os.path.join(TESTS, "test_attention_tensor_core.py"),
                     "-k", "(float16 or dispatch or bank_conflicts or simt_kernel_on_request) and not hopper "
                     "and not simt-warp"], 1800)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary


WIDE_HEADS = r"""
import json, torch, fusedllm, fusedllm.simt as simt
from test_attention_options import check_against_reference
out = []
for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
    for d, sq, sk, causal in ((256, 40, 70, True), (160, 33, 33, False), (256, 2, 300, False)):
        g = torch.Generator().manual_seed(d + sq)
        q = torch.randn(2, 4, sq, d, generator=g).to(dtype).requires_grad_()
        k = torch.randn(2, 2, sk, d, generator=g).to(dtype).requires_grad_()
        v = torch.randn(2, 2, sk, d, generator=g).to(dtype).requires_grad_()
        before = simt.stats()["kernel_launches"]
        with simt.kernels(schedule="warp-random"):
            o = fusedllm.attention(q, k, v, causal=causal, softcap=5.0)
            grad_out = torch.randn_like(o)
            grads = torch.autograd.grad(o, (q, k, v), grad_out)
        after = simt.stats()["kernel_launches"]
        check_against_reference(q, k, v, o, grad_out, grads, dtype, causal=causal, softcap=5.0)
        out.append(sorted(n for n, c in after.items() if c > before.get(n, 0)))
print(json.dumps(out))
"""


def test_head_dims_past_128_fit_64_kib():
    """Head dims 129-256 on sm_75: the full SIMT tiles take 83 KB of shared
    memory a block (more than the 64 KiB there), so those calls run on tiles
    of half the keys, forward and backward, in every dtype, a decoding call's
    key slices included; values and gradients against the float64 reference."""
    done = _as_sm75(["-c", WIDE_HEADS], 900)
    assert done.returncode == 0, done.stderr[-4000:]
    for kernels in json.loads(done.stdout.strip().splitlines()[-1]):
        assert {"attention_forward_kernel", "attention_dq_kernel", "attention_dkdv_kernel"} <= set(kernels), kernels


TURING_TILES = r"""
import json, torch, fusedllm, fusedllm.simt as simt
from test_attention_options import check_against_reference
out = []
for d in (64, 96, 128):
    for schedule in ("lockstep", "warp-random"):
        g = torch.Generator().manual_seed(d)
        q = torch.randn(1, 4, 40, d, generator=g).half().requires_grad_()
        k = torch.randn(1, 2, 70, d, generator=g).half().requires_grad_()
        v = torch.randn(1, 2, 70, d, generator=g).half().requires_grad_()
        before = simt.stats()["kernel_launches"]
        with simt.kernels(schedule=schedule):
            o = fusedllm.attention(q, k, v, causal=True, softcap=5.0)
            grad_out = torch.randn_like(o)
            grads = torch.autograd.grad(o, (q, k, v), grad_out)
        after = simt.stats()["kernel_launches"]
        check_against_reference(q, k, v, o, grad_out, grads, torch.float16, causal=True, softcap=5.0)
        out.append(sorted(n for n, c in after.items() if c > before.get(n, 0)))
print(json.dumps(out))
"""


def test_turing_tiles_under_both_schedules():
    """The tensor-core forward, delta, dQ and dK/dV on the Turing tiles of head
    dims 64, 96 and 128, under the round-robin and a warp-at-a-time schedule:
    small enough to run under the sanitizer build too."""
    done = _as_sm75(["-c", TURING_TILES], 900)
    assert done.returncode == 0, done.stderr[-4000:]
    for kernels in json.loads(done.stdout.strip().splitlines()[-1]):
        assert kernels == ["attention_mma_delta_kernel", "attention_mma_dkdv_kernel", "attention_mma_dq_kernel",
                           "attention_mma_forward_kernel"], kernels


HEAD_DIM_256_IN_99_KIB = r"""
import json, torch, fusedllm, fusedllm.simt as simt
from test_attention_options import check_against_reference
props = simt._simt.device_properties()
assert (props["major"], props["shared_mem_per_block_optin"]) == (8, 99 * 1024), props
out = []
for dtype, d, sq, sk in ((torch.bfloat16, 256, 40, 130), (torch.float16, 200, 33, 70)):
    g = torch.Generator().manual_seed(d)
    q = torch.randn(1, 4, sq, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(1, 2, sk, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(1, 2, sk, d, generator=g).to(dtype).requires_grad_()
    before = simt.stats()["kernel_launches"]
    with simt.kernels(schedule="warp-random"):
        o = fusedllm.attention(q, k, v, causal=True)
        grad_out = torch.randn_like(o)
        grads = torch.autograd.grad(o, (q, k, v), grad_out)
    after = simt.stats()["kernel_launches"]
    check_against_reference(q, k, v, o, grad_out, grads, dtype, causal=True)
    out.append(sorted(n for n, c in after.items() if c > before.get(n, 0)))
print(json.dumps(out))
"""


def test_head_dim_256_backward_in_99_kib():
    """sm_86/89 GPUs (A10G, L4, RTX 30 and 40) give a block 99 KiB of shared
    memory, exactly what head dim 256's dQ and dK/dV tiles take (dK/dV keeps
    its rows' lse and delta in K's padding columns): there the whole forward
    and backward run on the tensor cores, dK/dV in column halves over several
    key blocks and row tiles."""
    done = _emulated(["-c", HEAD_DIM_256_IN_99_KIB], 900, FUSEDLLM_SIMT_SMEM_OPTIN=str(99 * 1024))
    assert done.returncode == 0, done.stderr[-4000:]
    for kernels in json.loads(done.stdout.strip().splitlines()[-1]):
        assert kernels == ["attention_mma_delta_kernel", "attention_mma_dkdv_kernel", "attention_mma_dq_kernel",
                           "attention_mma_forward_kernel"], kernels
