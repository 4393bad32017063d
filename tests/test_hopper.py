"""Hopper's asynchronous units of csrc/cuda/hopper.cuh (mbarriers, TMA tile
copies, wgmma from shared-memory descriptors and from registers, setmaxnreg,
named barriers),
through the warp-specialized check product of csrc/cuda/hopper_check.cuh: under
the emulator for every swizzle, both layouts of B, both sources of A, both
16-bit types and float8 e4m3 (K-major); the misuse the emulator refuses, each with its message; compiled
for sm_90a (the instructions they become); and on an sm_90a GPU."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import gpu_extensions
from test_tensor_core import _cuobjdump, check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPANS = {"none": 16, "32B": 32, "64B": 64, "128B": 128}


def operands(dtype, n, k, b_mn_major, exact, device="cpu"):
    """a [64, k], b ([n, k] or [k, n]) and the float64 product. `exact`: small
    integers, so that every product and partial sum is exact in float32 and a
    layout mistake shows as a wrong value whatever the summation order."""
    g = torch.Generator().manual_seed(11 + n + k + 2 * b_mn_major + exact)
    shape_b = (k, n) if b_mn_major else (n, k)
    if exact:
        a = torch.randint(-3, 4, (64, k), generator=g).to(dtype)
        b = torch.randint(-3, 4, shape_b, generator=g).to(dtype)
    else:
        a = torch.randn(64, k, generator=g).to(dtype)
        b = torch.randn(*shape_b, generator=g).to(dtype)
    expected = a.double() @ (b.double() if b_mn_major else b.double().T)
    return a.to(device), b.to(device), expected.to(device)


def simt():
    import fusedllm.simt  # loads fusedllm._simt or says how to build it

    return fusedllm.simt


# (dtype, b_mn_major): float8 (k32 a step) reads K-major operands only.
CHECK_TYPES = [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False), (torch.float16, True),
               (torch.float8_e4m3fn, False)]
check_types = pytest.mark.parametrize(
    "dtype,b_mn_major", CHECK_TYPES, ids=lambda x: str(x).replace("torch.", "") if not isinstance(x, bool) else
    ("b_mn_major" if x else "b_k_major"))


@pytest.mark.simt
@pytest.mark.parametrize("a_in_registers", [False, True], ids=["a_shared", "a_registers"])
@pytest.mark.parametrize("span", list(SPANS))
@check_types
def test_check_product_under_the_emulator(dtype, span, b_mn_major, a_in_registers):
    """Four K tiles through two stages (each mbarrier's phase flips twice),
    N = 128, every swizzle of TMA and the descriptors, B K-major (Q K^T's
    layout) and MN-major (P V's), 16-bit and float8 operands."""
    a, b, expected = operands(dtype, 128, 256, b_mn_major, exact=True)
    with simt().kernels(schedule="lockstep"):
        c = torch.ops.fusedllm_simt_selftest.wgmma_tile(a, b, SPANS[span], b_mn_major, a_in_registers)
    check(c, expected, exact=True)


@pytest.mark.simt
@pytest.mark.parametrize("schedule", ["lockstep", "reverse", "warp-random"])
@pytest.mark.parametrize("n", [64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_check_product_shapes_and_schedules(dtype, n, schedule):
    a, b, expected = operands(dtype, n, 128, False, exact=False)
    with simt().kernels(schedule=schedule):
        c = torch.ops.fusedllm_simt_selftest.wgmma_tile(a, b, 128, False, False)
    check(c, expected, exact=False)


@pytest.mark.simt
def test_check_product_bad_arguments():
    a = torch.zeros(64, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^wgmma_tile: k must be a positive multiple of 64, got 96$"):
        torch.ops.fusedllm_simt_selftest.wgmma_tile(a, torch.zeros(64, 96, dtype=torch.bfloat16), 128, False, False)
    a = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^wgmma_tile: span must be 16 \\(no swizzle\\), 32, 64 or 128, got 8$"):
        torch.ops.fusedllm_simt_selftest.wgmma_tile(a, torch.zeros(64, 64, dtype=torch.bfloat16), 8, False, False)
    a8 = torch.zeros(64, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="^wgmma_tile: k must be a positive multiple of 128, got 64$"):
        torch.ops.fusedllm_simt_selftest.wgmma_tile(a8, torch.zeros(64, 64, dtype=torch.float8_e4m3fn), 128, False,
                                                    False)
    a8 = torch.zeros(64, 128, dtype=torch.float8_e4m3fn)
    refused = "^wgmma_tile: float8 wgmma reads K-major operands only: b must be \\[n, k\\]$"
    with pytest.raises(ValueError, match=refused):
        torch.ops.fusedllm_simt_selftest.wgmma_tile(a8, torch.zeros(128, 128, dtype=torch.float8_e4m3fn), 128, True,
                                                    False)


def tma_image(src, box, coords, swizzle, offset=0):
    """The oracle of a TMA load: the box of src at coords (innermost first),
    zero outside the tensor, as a dense row-major tile whose 16-byte chunks are
    swizzled on the address bits (bits 4.. xor bits 7.., as many as the span
    has 16-byte chunks' bits) of a box landing `offset` bytes (a multiple of
    128) past a 1024-byte boundary, as bytes."""
    rank = src.dim()
    index = []
    for d in range(rank):  # tensor dimension rank-1-d is TMA dimension d
        index.append(torch.arange(coords[d], coords[d] + box[d]))
    index = index[::-1]
    tile = torch.zeros([box[d] for d in range(rank)][::-1], dtype=src.dtype)
    inside = [(i >= 0) & (i < n) for i, n in zip(index, src.shape)]
    grids = torch.meshgrid(*index, indexing="ij")
    keep = torch.ones(tile.shape, dtype=torch.bool)
    for d, g in enumerate(grids):
        keep &= inside[d].reshape([-1 if e == d else 1 for e in range(rank)]).expand(tile.shape)
    clamped = [g.clamp(0, n - 1) for g, n in zip(grids, src.shape)]
    tile[keep] = src[tuple(clamped)][keep]
    raw = tile.contiguous().view(torch.uint8).reshape(-1)
    if swizzle == 0:
        return raw
    bits = {32: 1, 64: 2, 128: 3}[swizzle]
    offsets = torch.arange(0, raw.numel(), 16)
    moved = offsets ^ ((((offsets + offset) >> 7) & ((1 << bits) - 1)) << 4)
    out = torch.empty_like(raw)
    for o, m in zip(offsets.tolist(), moved.tolist()):
        out[m:m + 16] = raw[o:o + 16]
    return out


TMA_BOXES = [  # shape (outermost first), box and coords (innermost first), swizzle, dtype
    ((40, 64), [64, 16], [0, 30], 128, torch.bfloat16),       # rows past the end read zero
    ((3, 5, 48), [16, 4, 2], [40, 3, 2], 32, torch.bfloat16),  # past the end in every dimension
    ((3, 5, 48), [16, 4, 2], [8, 3, 2], 32, torch.bfloat16),
    ((2, 3, 4, 40), [32, 3, 2, 2], [8, 1, 2, 0], 64, torch.bfloat16),
    ((2, 2, 3, 4, 24), [8, 4, 2, 2, 1], [16, 2, 1, 0, 1], 0, torch.float32),
    ((100,), [32], [80], 0, torch.float32),
]


@pytest.mark.simt
@pytest.mark.parametrize("shape,box,coords,swizzle,dtype", TMA_BOXES, ids=lambda x: str(x))
def test_tma_round_trip_of_a_box(shape, box, coords, swizzle, dtype):
    """1-D to 5-D boxes, every swizzle, partly outside the tensor: the bytes
    that land in shared memory are the oracle's, and the store writes back
    exactly the box's elements that lie inside the tensor."""
    simt()
    src = (torch.arange(torch.Size(shape).numel()) % 251 + 1).reshape(shape).to(dtype)
    with simt().kernels(schedule="lockstep"):
        image, stored = torch.ops.fusedllm_simt_selftest.tma_box(src, box, coords, swizzle)
    assert torch.equal(image, tma_image(src, box, coords, swizzle))
    want = torch.zeros_like(src)
    region = tuple(slice(max(c, 0), max(min(c + b, n), 0)) for c, b, n in zip(coords[::-1], box[::-1], shape))
    want[region] = src[region]
    assert torch.equal(stored, want)


@pytest.mark.simt
@pytest.mark.parametrize("swizzle", [0, 32])
def test_a_tma_box_starting_before_the_tensor_is_refused(swizzle):
    """On an H200 (2026-11-27) the round trip of a box at coordinates
    [-8, 3, 2], swizzled or not, stopped the kernel with an illegal
    instruction (the same box at [8, 3, 2] passed): the emulator refuses it."""
    simt()
    src = torch.ones(3, 5, 48, dtype=torch.bfloat16)
    with simt().kernels(schedule="lockstep"), pytest.raises(
            RuntimeError, match=r"tma_load at .*: the box starts at coordinate -8 of dimension 0; a TMA box must "
                                r"not start before the tensor"):
        torch.ops.fusedllm_simt_selftest.tma_box(src, [16, 4, 2], [-8, 3, 2], swizzle)


TENSOR_MAP_REFUSALS = [
    ((64, 64), [64, 300], 128, "box dimension 1 must be 1 to 256 elements, got 300"),
    ((64, 64), [4, 64], 0, "the box's inner dimension must be a multiple of 16 bytes, got 8"),
    ((64, 64), [32, 64], 128, "a swizzled box's inner dimension must be the swizzle span (128 bytes), got 64 bytes"),
    ((64, 60), [8, 8], 0, "the stride of dimension 1 must be a positive multiple of 16 bytes below 2^40, got 120"),
    ((2, 2, 2, 2, 2, 8), [8, 1, 1, 1, 1, 1], 0, "rank must be 1 to 5, got 6"),
    ("overlapping", [8, 8], 0, "the stride of dimension 1 (16 bytes) must reach past dimension 0 (128 bytes)"),
]


@pytest.mark.simt
@pytest.mark.parametrize("shape,box,swizzle,message", TENSOR_MAP_REFUSALS, ids=[r[3][:24] for r in TENSOR_MAP_REFUSALS])
def test_tensor_map_refuses_what_tma_cannot_copy(shape, box, swizzle, message):
    """encode_tensor_map checks what cuTensorMapEncodeTiled checks (and the
    emulator's one restriction, swizzled boxes as wide as the span), naming
    the argument."""
    simt()
    if shape == "overlapping":  # rows 16 bytes apart, 128 bytes long
        t = torch.zeros(64 * 64, dtype=torch.bfloat16).as_strided((64, 64), (8, 1))
    else:
        t = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^encode_tensor_map: " + re.escape(message) + "$"):
        torch.ops.fusedllm_simt_selftest.encode_tensor_map(t, box, swizzle)
    torch.ops.fusedllm_simt_selftest.encode_tensor_map(torch.zeros(64, 64, dtype=torch.bfloat16), [64, 64], 128)


MISUSE = {
    "wgmma_without_proxy_fence": r"wgmma at csrc/simt/selftest.cpp:\d+ \(A\) reads shared memory at offset 0x\w+ "
                                 r"that ordinary stores wrote after the last fence.proxy.async",
    "wgmma_without_fence": r"wgmma at csrc/simt/selftest.cpp:\d+: no wgmma_fence since the kernel began or since "
                           r"the last wgmma_wait",
    "wgmma_accumulator_written": r"wrote its accumulator registers between issuing the wgmma and wgmma_wait",
    "mbarrier_never_completes": r"deadlock, no thread can go on: 64 threads \(from \(0,0,0\)\) at mbarrier_wait "
                                r"csrc/simt/selftest.cpp:\d+ on the mbarrier at shared offset 0x\w+ for the phase "
                                r"of parity 0 \(its phase 0 waits for 1 of 1 arrivals and 0 transaction bytes\)",
    "tma_bytes_never_arrive": r"deadlock, .* \(its phase 0 waits for 0 of 1 arrivals and 2048 transaction bytes\)",
    "tma_box_past_shared": r"tma_load at csrc/simt/selftest.cpp:\d+: the box of 2048 bytes at shared offset 0x\w+ "
                           r"ends past the block's \d+ bytes of dynamic shared memory",
    "tma_box_inside_atom": r"tma_load at csrc/simt/selftest.cpp:\d+: the shared destination 0x\w+ of a 128-byte "
                           r"swizzled box is not aligned to its swizzle atom \(1024 bytes\)",
    "partial_warpgroup": r"wgmma_fence at csrc/simt/selftest.cpp:\d+: warpgroup 0 \(warps 0 to 3\) is not whole: "
                         r"the block has 96 threads",
    "misaligned_warpgroup": r"deadlock, .*in wgmma_wait at csrc/simt/selftest.cpp:\d+ \(warpgroup 0\);.*"
                            r"in wgmma_wait at csrc/simt/selftest.cpp:\d+ \(warpgroup 1\)",
    "named_barrier_never_completes": r"deadlock, no thread can go on: 64 threads \(from \(0,0,0\)\) at named "
                                     r"barrier 1 csrc/simt/selftest.cpp:\d+ \(64 of 128 threads arrived\); 64 threads "
                                     r"\(from \(64,0,0\)\) exited;",
    "named_barrier_odd_count": r"bar.sync 1 at csrc/simt/selftest.cpp:\d+: a named barrier is 1 to 15 \(0 is "
                               r"__syncthreads'\) and counts a multiple of 32 threads up to the block's 128, got 48",
    "setmaxnreg_out_of_range": r"setmaxnreg at csrc/simt/selftest.cpp:\d+: the register count must be a multiple "
                               r"of 8 from 24 to 256, got 20",
}


@pytest.mark.simt
@pytest.mark.parametrize("schedule", ["lockstep", "warp"])
@pytest.mark.parametrize("name", list(MISUSE))
def test_the_emulator_refuses_misuse_of_the_hopper_units(name, schedule):
    with simt().kernels(schedule=schedule), pytest.raises(RuntimeError, match=MISUSE[name]):
        simt().run_selftest(name)


@pytest.mark.simt
def test_the_correct_twin_runs():
    """The kernel of the wgmma misuse tests with its fences: every product is 16."""
    with simt().kernels(schedule="warp-random"):
        out = simt().run_selftest("wgmma_fenced")
    assert out == [16.0] * 64


@pytest.mark.simt
def test_a_tma_copy_read_before_its_wait_reads_nan():
    """A TMA load lands when its mbarrier is waited on: read before the wait,
    the destination holds NaN; after it, the data (row 0 of the source: 0, 1, 2, ...)."""
    with simt().kernels(schedule="lockstep"):
        out = simt().run_selftest("tma_read_before_wait")
    assert all(x != x for x in out[:32]), out
    assert out[32:] == [float(i) for i in range(32)], out


HEAD_DIM_256 = r"""
import json, torch, fusedllm, fusedllm.simt as simt
from reference import attention as ref_attention
out = []
for causal, softcap, dtype in ((True, None, torch.bfloat16), (False, None, torch.float16), (True, 5.0, torch.bfloat16)):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 150, 256, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 150, 256, generator=g).to(dtype) for _ in range(2))
    with simt.kernels(schedule="lockstep"):
        before = dict(simt.stats()["kernel_launches"])
        o = fusedllm.attention(q, k, v, causal=causal, softcap=softcap)
        ran = simt.stats()["kernel_launches"].get("attention_hopper_forward_kernel", 0) - before.get(
            "attention_hopper_forward_kernel", 0)
    want, _ = ref_attention(q.double(), k.double(), v.double(), causal=causal, softcap=softcap)
    out.append(dict(ran=ran, err=(o.double() - want).abs().max().item()))
print(json.dumps(out))
"""


def _on_an_sm90_sized_device(script):
    """What `script` prints last (JSON), run on the Hopper kernels in a process
    whose emulated device has an sm_90's 227 KiB of shared memory
    (FUSEDLLM_SIMT_SMEM_OPTIN is read once, hence a process of its own)."""
    simt()
    env = dict(os.environ, FUSEDLLM_SIMT_SMEM_OPTIN=str(227 * 1024), FUSEDLLM_CUDA_ATTENTION="hopper",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.simt
def test_hopper_forward_at_head_dim_256_on_an_sm90_sized_device():
    """At head dim 256 the Hopper forward takes 197 KiB of shared memory: the
    emulated device gets an sm_90's 227 KiB and runs it in plain calls; with
    soft-capping the call keeps the mma.sync forward."""
    plain, plain_fp16, softcap = _on_an_sm90_sized_device(HEAD_DIM_256)
    for case in (plain, plain_fp16):
        assert case["ran"] == 1 and case["err"] < 2e-2, case
    # With a score modifier at head dim 256 the mma.sync forward serves.
    assert softcap["ran"] == 0 and softcap["err"] < 2e-2, softcap


DQ_THREE_STAGES = r"""
import json, torch, fusedllm, fusedllm.simt as simt
from reference import attention as ref_attention
out = []
for d, s, schedule in ((128, 300, "lockstep"), (128, 300, "warp-random"), (64, 600, "warp-random")):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, s, d, generator=g).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, 2, s, d, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(2))
    go = torch.randn(1, 8, s, d, generator=g).to(torch.bfloat16)
    with simt.kernels(schedule=schedule):
        before = dict(simt.stats()["kernel_launches"])
        fusedllm.attention(q, k, v, causal=True).backward(go)
        ran = simt.stats()["kernel_launches"].get("attention_hopper_dq_kernel", 0) - before.get(
            "attention_hopper_dq_kernel", 0)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want, _ = ref_attention(*leaves, causal=True)
    want.backward(go.double())
    err = max(((t.grad.double() - r.grad).abs().max() / r.grad.abs().max()).item() for t, r in zip((q, k, v), leaves))
    out.append(dict(d=d, ran=ran, err=err))
print(json.dumps(out))
"""


@pytest.mark.simt
def test_hopper_dq_with_three_stages_on_an_sm90_sized_device():
    """dQ keeps three K/V tiles in flight where they fit: 197 KB at head dim
    128 (an sm_90's shared memory), and at head dim 64 everywhere. Over 5
    tiles, so that the ring wraps, in both kinds of schedule, the gradients
    match the reference."""
    for case in _on_an_sm90_sized_device(DQ_THREE_STAGES):
        assert case["ran"] == 1 and case["err"] < 2e-2, case


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_units_compile_to_hopper_instructions(tmp_path):
    """Evidence without a GPU: the sm_90a check product holds HGMMA (16-bit
    wgmma, from shared memory and from registers), QGMMA (float8), UTMALDG (TMA loads), SYNCS
    (mbarrier), USETMAXREG (setmaxnreg: ptxas drops it when it cannot tell the
    kernel's register count) and WARPGROUP.ARRIVE (wgmma.fence), and no
    local-memory traffic; ptxas did not serialise the products."""
    cuobjdump = _cuobjdump()
    assert cuobjdump, "nvcc is here but cuobjdump is not (the CUDA toolkit's, or triton's copy)"
    probe = tmp_path / "probe.cu"
    instances = []
    for t, major in (("c10::BFloat16", "kMN"), ("c10::Half", "kMN"), ("c10::Float8_e4m3fn", "kK")):
        for regs in ("true", "false"):
            instances.append(
                f"template __global__ void fusedllm::cuda::hopper::wgmma_tile_kernel<{t}, 128, 128, "
                f"fusedllm::cuda::hopper::Major::{major}, {regs}>(const __grid_constant__ "
                f"fusedllm::cuda::hopper::TensorMap, const __grid_constant__ fusedllm::cuda::hopper::TensorMap, "
                f"const {t}*, int, float*);")
    probe.write_text('#include "hopper_check.cuh"\n' + "\n".join(instances) + "\n")
    cubin = tmp_path / "probe.cubin"
    built = subprocess.run(["nvcc", "-std=c++20", "-arch=sm_90a", "--expt-relaxed-constexpr", "-cubin",
                            "-Xptxas", "-v", *gpu_extensions.cuda_include_dirs(), str(probe), "-o", str(cubin)],
                           check=True, capture_output=True, text=True)
    assert "serialized" not in built.stderr and "setmaxnreg' ignored" not in built.stderr, built.stderr
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    for instruction in ("HGMMA.64x128x16.F32.BF16", "HGMMA.64x128x16.F32 ", "QGMMA.64x128x32.F32.E4M3.E4M3",
                        "UTMALDG.2D", "SYNCS.PHASECHK",
                        "USETMAXREG", "WARPGROUP.ARRIVE"):
        assert instruction in sass, f"{instruction.strip()} not in the sm_90a machine code"
    assert "LDL" not in sass and "STL" not in sass


@pytest.fixture(scope="module")
def gpu_check_product():
    return gpu_extensions.hopper_check()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("a_in_registers", [False, True], ids=["a_shared", "a_registers"])
@pytest.mark.parametrize("span", list(SPANS))
@check_types
def test_check_product_on_a_hopper_gpu(gpu_check_product, dtype, span, b_mn_major, a_in_registers):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma and TMA need sm_90a (an H100 or H200)")
    a, b, expected = operands(dtype, 128, 256, b_mn_major, exact=True, device="cuda")
    c = gpu_check_product.wgmma_tile(a, b, SPANS[span], b_mn_major, a_in_registers)
    check(c, expected, exact=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("shape,box,coords,swizzle,dtype", TMA_BOXES, ids=lambda x: str(x))
def test_tma_round_trip_on_a_hopper_gpu(gpu_check_product, shape, box, coords, swizzle, dtype):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("TMA needs sm_90a (an H100 or H200)")
    src = (torch.arange(torch.Size(shape).numel()) % 251 + 1).reshape(shape).to(dtype)
    image, stored = gpu_check_product.tma_box(src.cuda(), box, coords, swizzle, 0)
    assert torch.equal(image.cpu(), tma_image(src, box, coords, swizzle))
    want = torch.zeros_like(src)
    region = tuple(slice(max(c, 0), max(min(c + b, n), 0)) for c, b, n in zip(coords[::-1], box[::-1], shape))
    want[region] = src[region]
    assert torch.equal(stored.cpu(), want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("offset", [256, 512])
def test_tma_box_inside_a_swizzle_atom_on_a_hopper_gpu(gpu_check_product, offset, record_property):
    """What the emulator refuses, asked of the GPU: a 128-byte-swizzled box
    landing 2 or 4 rows into a swizzle atom is swizzled either by its shared
    addresses (as a box on a whole atom is) or by its own rows; the test
    passes on either and records which (the kernels avoid such boxes until
    this is known)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("TMA needs sm_90a (an H100 or H200)")
    src = (torch.arange(64 * 64) % 251 + 1).reshape(64, 64).to(torch.bfloat16)
    box, coords = [64, 8], [0, 8]
    image, _ = gpu_check_product.tma_box(src.cuda(), box, coords, 128, offset)
    by_address, by_rows = tma_image(src, box, coords, 128, offset), tma_image(src, box, coords, 128)
    assert not torch.equal(by_address, by_rows)
    found = "address" if torch.equal(image.cpu(), by_address) else "rows" if torch.equal(image.cpu(), by_rows) else None
    assert found is not None, "the box landed neither swizzled by its addresses nor by its rows"
    record_property("swizzled_by", found)
    print(f"TMA box {offset} bytes into a 128-byte swizzle atom: swizzled by its {found}")

