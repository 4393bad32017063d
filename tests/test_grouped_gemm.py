"""The grouped matrix products of csrc/cuda/grouped_gemm.cuh (mixture-of-experts
rows grouped by expert through device-side offsets): under the emulator,
through torch.ops.fusedllm_simt_selftest.grouped_mm, against a float64
per-group reference; and compiled for sm_75 and sm_80 (tensor-core
instructions, no register spills). test_turing.py runs them on an emulated
sm_75 device; test_tensor_core.py reads the built sm_90a wgmma kernels."""

import contextlib
import os
import re
import shutil
import subprocess

import pytest
import torch

import gpu_extensions
from checks import assert_close, whole
from testkit.env import env_var
from test_tensor_core import _cuobjdump

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = {"rows_times_weight_t": 0, "rows_times_weight": 1, "weight_gradient": 2}
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SCHEDULES = ["lockstep", "warp-random"]


def reference(kind, a, b, offsets):
    """The grouped product in float64, one group at a time."""
    a, b = a.double(), b.double()
    bounds = offsets.tolist()
    if kind == 2:
        return torch.stack([a[lo:hi].T @ b[lo:hi] for lo, hi in zip(bounds, bounds[1:])])
    out = torch.zeros(a.shape[0], b.shape[1] if kind == 0 else b.shape[2], dtype=torch.float64)
    for e, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        out[lo:hi] = a[lo:hi] @ (b[e].T if kind == 0 else b[e])
    return out


def operands(kind, sizes, dims, dtype, exact, seed=0):
    """a, b and offsets for groups of `sizes` rows; dims = (K, N) for the row
    products, (M, N) for the weight gradient. `exact`: small integers, so that
    every product and partial sum is exact in float32, and a layout mistake
    shows as a wrong value."""
    g = torch.Generator().manual_seed(seed)
    rows, experts = sum(sizes), len(sizes)

    def make(*shape):
        if exact:
            return torch.randint(-3, 4, shape, generator=g).to(dtype)
        return torch.randn(shape, generator=g).to(dtype)

    first, n = dims
    a = make(rows, first)
    if kind == 0:
        b = make(experts, n, first)
    elif kind == 1:
        b = make(experts, first, n)
    else:
        b = make(rows, n)
    offsets = torch.tensor([0, *sizes]).cumsum(0)
    return a, b, offsets


def tolerance(dtype, exact):
    if exact:
        return None
    return {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12),
            torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}[dtype]


WGMMA = "wgmma 128x256"


def grouped_request(value):
    """FUSEDLLM_CUDA_GROUPED_MM = value for the calls inside."""
    return env_var("FUSEDLLM_CUDA_GROUPED_MM", value)


@contextlib.contextmanager
def launched(expect):
    """Asserts that the calls inside launched the grouped-product kernel
    `expect` names ("tc 128", "simt 64", WGMMA, ...) and no other."""
    import fusedllm.simt  # loads fusedllm._simt or says how to build it

    before = fusedllm.simt.stats()["kernel_launches"]
    yield
    after = fusedllm.simt.stats()["kernel_launches"]
    ran = sorted(n for n, c in after.items() if c > before.get(n, 0) and n.startswith("grouped_mm_"))
    kernel, size = expect.split()
    assert ran == [f"grouped_mm_{kernel}_kernel {size}"], ran


def run(a, b, offsets, kind, schedule, tensor_cores=True, tile=0, expect=None, request="auto"):
    """tile: the output tile asked for, 64 or 128 (0: grouped_mm's choice);
    expect: the kernel that must have run ("tc 128", "simt 64", ...);
    request: FUSEDLLM_CUDA_GROUPED_MM ("wgmma" reaches the sm_90a kernel)."""
    import fusedllm.simt

    checked = launched(expect) if expect is not None else contextlib.nullcontext()
    with grouped_request(request), checked, fusedllm.simt.kernels(schedule=schedule):
        return torch.ops.fusedllm_simt_selftest.grouped_mm(a, b, offsets, kind, tensor_cores, tile)


def kernel_for(dtype, tile, tensor_cores=True):
    """The kernel `run` must reach for dtype and an asked tile (on the emulated sm_80)."""
    if tensor_cores and dtype in (torch.bfloat16, torch.float16):
        return f"tc {tile}"
    return f"simt {tile if dtype == torch.float32 else 64}"


def check(out, a, b, offsets, kind, exact):
    expected = reference(kind, a, b, offsets)
    assert out.dtype == a.dtype
    assert out.shape == expected.shape
    if exact:
        # integer products and sums are exact in the float32 accumulators; the
        # one rounding is the output's (bfloat16 holds integers exactly up to 256)
        rounded = expected.to(out.dtype).double()
        assert torch.equal(out.double(), rounded), (out.double() - rounded).abs().max()
    else:
        assert_close(out, expected, tolerance(out.dtype, exact), upcast=True)


# Groups: empty first, middle and last, a single row, a group over one 64-row
# tile; dims not multiples of 8 (element-wise loads) and multiples (cp.async).
GROUPS = [0, 5, 1, 0, 70, 3, 0]


TILES = [64, 128]
# float64's SIMT kernel has only the 64 x 64 tile
DTYPE_TILES = [(dtype, tile) for dtype in DTYPES for tile in (TILES if dtype != torch.float64 else [64])]


@pytest.mark.simt
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype,tile", DTYPE_TILES, ids=str)
def test_grouped_products_integers(dtype, tile, kind, schedule):
    k = KINDS[kind]
    a, b, offsets = operands(k, GROUPS, (40, 72), dtype, exact=True, seed=k)
    check(run(a, b, offsets, k, schedule, tile=tile, expect=kernel_for(dtype, tile)), a, b, offsets, k, exact=True)


@pytest.mark.simt
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype,tile", DTYPE_TILES, ids=str)
def test_grouped_products_random_ragged(dtype, tile, kind):
    """Random values; K (or the groups' rows) over two K-steps with a ragged
    tail, N over one tile, M ragged: every edge of both kernels."""
    k = KINDS[kind]
    a, b, offsets = operands(k, [3, 0, 37, 9], (45, 67), dtype, exact=False, seed=10 + k)
    check(run(a, b, offsets, k, "warp-random", tile=tile), a, b, offsets, k, exact=False)


@pytest.mark.simt
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_whole_tiles(dtype, tile, kind, schedule):
    """Groups over several whole row tiles, K over several whole K-steps (the
    stages turn over) with a ragged last one, N over two 128-column tiles,
    aligned rows: the staging that keeps its addresses from step to step
    (16-byte copies; the SIMT kernel's 16-byte reads held across a step's
    products), beside the element-wise edges of the same groups (their last
    row tile, the last K-step); integers, exact."""
    k = KINDS[kind]
    a, b, offsets = operands(k, [0, 130, 1, 0, 264, 0], (136, 264), dtype, exact=True, seed=70 + k)
    check(run(a, b, offsets, k, schedule, tile=tile, expect=kernel_for(dtype, tile)), a, b, offsets, k, exact=True)


@pytest.mark.simt
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_tile_choice(dtype, kind):
    """grouped_mm's own choice on the emulated GPU (4 multiprocessors): 128 x
    128 tiles where the groups average 128 rows or more (the row products)
    and those tiles give every multiprocessor a block (float64: its one
    tile); 64 x 64 tiles for small groups, or too few large tiles."""
    k = KINDS[kind]
    large, small = ("simt 64" if dtype == torch.float64 else kernel_for(dtype, 128)), kernel_for(dtype, 64)
    cases = [([300], (136, 264), large),  # 2 x 3 large tiles (weight gradient: 2 x 3 of [M, N])
             ([20, 30, 10], (136, 264), small if k != 2 else large),  # 20 rows a group; 3 x 2 x 3
             ([300], (136, 120), small)]  # 2 x 1 large tiles (weight gradient: 2 x 1)
    for sizes, dims, expect in cases:
        a, b, offsets = operands(k, sizes, dims, dtype, exact=True, seed=80 + k)
        check(run(a, b, offsets, k, "lockstep", expect=expect), a, b, offsets, k, exact=True)


@pytest.mark.simt
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_simt_kernel_for_16_bit_types(dtype, kind):
    """The SIMT kernel that 16-bit types take below sm_80 (its 64 x 64 tile)."""
    k = KINDS[kind]
    a, b, offsets = operands(k, [6, 0, 30], (24, 20), dtype, exact=True, seed=20 + k)
    check(run(a, b, offsets, k, "lockstep", tensor_cores=False), a, b, offsets, k, exact=True)


@pytest.mark.simt
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_expert(dtype, kind):
    k = KINDS[kind]
    a, b, offsets = operands(k, [19], (16, 8), dtype, exact=True, seed=30 + k)
    check(run(a, b, offsets, k, "lockstep"), a, b, offsets, k, exact=True)


def strided(t, pad, shift):
    """t's values in a view with unit last stride: every other slice along the
    first dimension (rows of a 2-D t, experts of a 3-D one) of a tensor whose
    rows are `pad` elements wider, starting `shift` elements into each row."""
    wide = torch.zeros(2 * t.shape[0], *t.shape[1:-1], t.shape[-1] + pad, dtype=t.dtype)
    view = wide[::2, ..., shift : shift + t.shape[-1]]
    view.copy_(t)
    return view


# Row strides multiples of 8 elements and aligned pointers (16-byte copies stay
# possible), row strides that are not, pointers that are not 16-byte aligned.
LAYOUT = {"aligned": (8, 0), "odd_stride": (3, 0), "odd_pointer": (8, 1)}


@pytest.mark.simt
@pytest.mark.parametrize("layout", list(LAYOUT))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_operands(dtype, kind, layout):
    """Row-strided slices of a and of b (every other expert of a larger b for
    the row products), for every alignment case, in both tiles."""
    k = KINDS[kind]
    a, b, offsets = operands(k, [9, 0, 24, 2], (32, 24), dtype, exact=True, seed=40 + k)
    a_s, b_s = (strided(t, *LAYOUT[layout]) for t in (a, b))
    assert not a_s.is_contiguous() and not b_s.is_contiguous() and b_s.stride(-1) == 1
    for tile in TILES:
        check(run(a_s, b_s, offsets, k, "warp-random", tile=tile), a, b, offsets, k, exact=True)


@pytest.mark.simt
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transposed_weight_views(dtype):
    """The forward's b as the transpose of a contiguous [E, K, N] (and the
    input gradient's b as the transpose of [E, N, K]) after .contiguous()
    of the transposed view: the layouts a module's weight and its .T give."""
    a, w, offsets = operands(1, [7, 12], (16, 24), dtype, exact=True, seed=50)
    wt = w.transpose(1, 2).contiguous()  # [E, N, K]
    check(run(a, wt, offsets, 0, "lockstep"), a, wt, offsets, 0, exact=True)
    check(run(a, wt.transpose(1, 2).contiguous(), offsets, 1, "lockstep"), a, w, offsets, 1, exact=True)


@pytest.mark.simt
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_rows_and_empty_experts(dtype):
    a, b, offsets = operands(2, [0, 0], (5, 7), dtype, exact=True)
    out = run(a, b, offsets, 2, "lockstep")
    assert out.shape == (2, 5, 7) and torch.equal(out, torch.zeros_like(out))
    a, b, offsets = operands(0, [0, 0, 0], (5, 7), dtype, exact=True)
    assert run(a, b, offsets, 0, "lockstep").shape == (0, 7)
    for kind in (0, 1):  # K = 0: every output is an empty sum
        a, b, offsets = operands(kind, [3, 0, 4], (0, 7), dtype, exact=True)
        out = run(a, b, offsets, kind, "lockstep")
        assert out.shape == (7, 7) and torch.equal(out, torch.zeros_like(out))


@pytest.mark.simt
def test_bad_arguments_name_the_argument():
    a, b, offsets = operands(0, [2, 3], (8, 4), torch.float32, exact=True)
    with pytest.raises(ValueError, match=whole(
            "grouped_mm: b must be [E, N, K] = [2, N, 8] (E from offsets [E + 1], K from a [S, K]), got [1, 4, 8]")):
        run(a, b[:1], offsets, 0, "lockstep")
    with pytest.raises(ValueError, match=whole(
            "grouped_mm: b must be [E, K, N] = [2, 8, N] (E from offsets [E + 1], K from a [S, K]), got [2, 4, 8]")):
        run(a, b, offsets, 1, "lockstep")
    with pytest.raises(ValueError, match=whole(
            "grouped_mm: offsets must be a contiguous int64 [E + 1] tensor, got torch.int32 [3] with strides [1]")):
        run(a, b, offsets.int(), 0, "lockstep")
    with pytest.raises(ValueError, match=whole(
            "grouped_mm: a, b and out must have one dtype, got torch.float32, torch.float64 and torch.float32")):
        run(a, b.double(), offsets, 0, "lockstep")
    with pytest.raises(ValueError, match=whole(
            "grouped_mm: a's last dimension must have unit stride, got strides [1, 5]")):
        run(a.T.contiguous().T, b, offsets, 0, "lockstep")
    with pytest.raises(ValueError, match=whole("grouped_mm: tile must be 0 (chosen), 64 or 128, got 32")):
        run(a, b, offsets, 0, "lockstep", tile=32)


# The wgmma kernel (sm_90a), asked for on the emulated device: every product,
# both 16-bit types, its edges and its whole tiles.
HALVES = [torch.bfloat16, torch.float16]


@pytest.mark.simt
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_wgmma_products_integers(dtype, kind, schedule):
    """Empty, one-row and ragged groups, K below one K-step, N below one tile:
    the element-wise edges of the swizzled staging."""
    k = KINDS[kind]
    a, b, offsets = operands(k, GROUPS, (40, 72), dtype, exact=True, seed=k)
    check(run(a, b, offsets, k, schedule, tile=128, expect=WGMMA, request="wgmma"), a, b, offsets, k, exact=True)


@pytest.mark.simt
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_wgmma_whole_tiles(kind, schedule):
    """Groups over several 128-row tiles, K over five whole K-steps of 64 and
    a ragged one (the three stages turn over twice; the weight gradient's K,
    the groups' rows, over two and four), N over two 256-column tiles:
    16-byte copies into the swizzled layout at kept addresses, beside the
    edges of the same groups; integers, exact."""
    k = KINDS[kind]
    a, b, offsets = operands(k, [0, 130, 1, 0, 264, 0], (328, 264), torch.bfloat16, exact=True, seed=90 + k)
    check(run(a, b, offsets, k, schedule, tile=128, expect=WGMMA, request="wgmma"), a, b, offsets, k, exact=True)


@pytest.mark.simt
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_wgmma_random_ragged(dtype, kind):
    k = KINDS[kind]
    a, b, offsets = operands(k, [3, 0, 137, 9], (45, 67), dtype, exact=False, seed=100 + k)
    check(run(a, b, offsets, k, "warp-random", tile=128, expect=WGMMA, request="wgmma"), a, b, offsets, k,
          exact=False)


@pytest.mark.simt
@pytest.mark.parametrize("layout", list(LAYOUT))
@pytest.mark.parametrize("kind", list(KINDS))
def test_wgmma_strided_operands(kind, layout):
    k = KINDS[kind]
    a, b, offsets = operands(k, [9, 0, 140, 2], (72, 24), torch.bfloat16, exact=True, seed=110 + k)
    a_s, b_s = (strided(t, *LAYOUT[layout]) for t in (a, b))
    check(run(a_s, b_s, offsets, k, "warp-random", tile=128, expect=WGMMA, request="wgmma"), a, b, offsets, k,
          exact=True)


@pytest.mark.simt
@pytest.mark.parametrize("kind", list(KINDS))
def test_wgmma_choice(kind):
    """Asked for, the wgmma kernel takes the large tiles grouped_mm chooses
    (small groups keep the mma.sync kernel's 64 x 64); "mma" and "auto" keep
    the mma.sync kernel; another value is refused."""
    k = KINDS[kind]
    for sizes, request, expect in (([300], "wgmma", WGMMA), ([20, 30, 10], "wgmma", WGMMA if k == 2 else "tc 64"),
                                   ([300], "mma", "tc 128"), ([300], "auto", "tc 128")):
        a, b, offsets = operands(k, sizes, (136, 264), torch.bfloat16, exact=True, seed=120 + k)
        check(run(a, b, offsets, k, "lockstep", expect=expect, request=request), a, b, offsets, k, exact=True)
    with pytest.raises(ValueError, match=whole("FUSEDLLM_CUDA_GROUPED_MM must be 'auto', 'mma' or 'wgmma', "
                                               "got 'hopper'")):
        run(a, b, offsets, k, "lockstep", request="hopper")


@pytest.mark.simt
@pytest.mark.parametrize("transposed", [False, True], ids=["mixtral_layout", "gpt_oss_layout"])
def test_moe_experts_on_wgmma(transposed):
    """moe_experts, forward and backward, with every product on the wgmma
    kernel (groups of 256 rows; biases added to its sums; Mixtral's weight
    layout, and gpt-oss's transposed, interleaved one): against the float64
    reference, as test_moe checks the op."""
    import fusedllm.simt
    from test_moe import check_experts, make_gpt_oss

    args, activation, options = make_gpt_oss(256, 128, 64, 4, 4, torch.bfloat16, "cpu", biases=True,
                                             transposed=transposed, interleaved=transposed, activation="silu")
    with grouped_request("wgmma"), launched(WGMMA), fusedllm.simt.kernels(schedule="lockstep"):
        check_experts(*args, activation, **options)


@pytest.fixture(scope="module")
def gpu_grouped_mm():
    return gpu_extensions.grouped_gemm_check().grouped_mm


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("exact", [True, False], ids=["integers", "random"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_products_on_a_gpu(gpu_grouped_mm, dtype, kind, exact):
    """Larger groups than the emulator can afford (several tiles and K-steps),
    every kernel for the 16-bit types (on an H100 or H200 the large tiles run
    the wgmma kernel when it is asked for), and run-to-run determinism."""
    k = KINDS[kind]
    a, b, offsets = operands(k, [0, 300, 1, 0, 517, 64, 0], (200, 136), dtype, exact=exact, seed=60 + k)
    for request in ("auto", "wgmma"):
        with grouped_request(request):
            for tensor_cores, tile in ((True, 0), (True, 64), (True, 128), (False, 0)):
                out = gpu_grouped_mm(a.cuda(), b.cuda(), offsets.cuda(), k, tensor_cores, tile)
                check(out.cpu(), a, b, offsets, k, exact)
                again = gpu_grouped_mm(a.cuda(), b.cuda(), offsets.cuda(), k, tensor_cores, tile)
                assert torch.equal(out, again)
            a_s, b_s = (strided(t, 3, 1).cuda() for t in (a, b))
            for tile in (64, 128):
                check(gpu_grouped_mm(a_s, b_s, offsets.cuda(), k, True, tile).cpu(), a, b, offsets, k, exact)


SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_75", "sm_80"])
def test_kernels_compile_to_tensor_core_instructions_without_spills(tmp_path, arch):
    """Evidence without a GPU: for sm_80, the 16-bit kernels' machine code holds
    HMMA (mma.sync), LDSM and LDSM .MT (ldmatrix, ldmatrix .trans) and LDGSTS
    (cp.async); for sm_75, the float16 ones' holds HMMA.1688 (two m16n8k8 a
    product) and LDSM, no LDGSTS; ptxas reports no spills for any grouped kernel."""
    cuobjdump = _cuobjdump()
    assert cuobjdump, "nvcc is here but cuobjdump is not (the CUDA toolkit's, or triton's copy)"
    probe = tmp_path / "probe.cu"
    # The host function instantiates every kernel.
    probe.write_text('#include "grouped_gemm.cuh"\n')
    cubin = tmp_path / "probe.cubin"
    build = subprocess.run(["nvcc", "-std=c++20", f"-arch={arch}", "--expt-relaxed-constexpr", "-cubin",
                            "-Xptxas=-v", *gpu_extensions.cuda_include_dirs(), str(probe), "-o", str(cubin)],
                           check=True, capture_output=True, text=True)
    spills = [(int(s), int(l)) for s, l in SPILLS.findall(build.stderr)]
    assert len(spills) >= 18 and all(s == l == 0 for s, l in spills), build.stderr
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True,
                          text=True).stdout
    expected = (("HMMA.1688.F32 ", "LDSM.16.M88.4", "LDSM.16.MT88.4") if arch == "sm_75" else
                ("HMMA.16816.F32.BF16", "HMMA.16816.F32 ", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS.E.BYPASS.128"))
    for instruction in expected:
        assert instruction in sass, f"{instruction.strip()} not in the {arch} machine code"
    if arch == "sm_75":
        assert "HMMA.16816" not in sass and "LDGSTS" not in sass
