"""The tensor-core building blocks of csrc/cuda/mma.cuh (mma.sync m16n8k16,
ldmatrix with and without .trans, cp.async), through the 64x64x64 check tile of
csrc/cuda/mma_check.cuh: under the emulator (their portable forms, through
torch.ops.fusedllm_simt_selftest.mma_tile; as two m16n8k8 on an emulated sm_75
in test_turing.py), compiled for sm_75, sm_80 and sm_90 (the
instructions they become), and on a GPU (the hardware
instructions and the portable forms on the same inputs); and the machine code of
the built extension's tensor-core kernels (attention forward, grouped products)."""

import functools
import os
import re
import shutil
import subprocess

import pytest
import torch

import gpu_extensions
from checks import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = [torch.bfloat16, torch.float16]
LAYOUTS = {"b_is_n_by_k": True, "b_is_k_by_n": False}


def operands(dtype, exact, b_rows_are_n, device="cpu"):
    """a, b and the float64 product. `exact`: small integers, so that every
    product and partial sum is exact in float32 and any fragment-layout mistake
    shows as a wrong value, whatever the summation order."""
    g = torch.Generator().manual_seed(7 + 2 * exact + b_rows_are_n)
    if exact:
        a, b = (torch.randint(-4, 5, (64, 64), generator=g).to(dtype) for _ in range(2))
    else:
        a, b = (torch.randn(64, 64, generator=g).to(dtype) for _ in range(2))
    expected = a.double() @ (b.double().T if b_rows_are_n else b.double())
    return a.to(device), b.to(device), expected.to(device)


def check(c, expected, exact):
    if exact:
        assert torch.equal(c, expected.float()), (c - expected.float()).abs().max()
    else:
        assert_close(c, expected, (1e-5, 1e-5), upcast=True)


@pytest.mark.simt
@pytest.mark.parametrize("schedule", ["lockstep", "warp-random"])
@pytest.mark.parametrize("exact", [True, False], ids=["integers", "random"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_check_tile_under_the_emulator(dtype, layout, exact, schedule):
    import fusedllm.simt  # loads fusedllm._simt or says how to build it

    a, b, expected = operands(dtype, exact, LAYOUTS[layout])
    with fusedllm.simt.kernels(schedule=schedule):
        c = torch.ops.fusedllm_simt_selftest.mma_tile(a, b, LAYOUTS[layout])
    check(c, expected, exact)


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else None


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
def test_primitives_compile_to_tensor_core_instructions(tmp_path, arch):
    """Evidence without a GPU: the check tile's machine code holds HMMA (mma.sync),
    LDSM and LDSM .MT (ldmatrix, ldmatrix .trans) and LDGSTS (cp.async); on
    sm_75 the float16 m16n8k8 (HMMA.1688) and no LDGSTS (a load and a store)."""
    cuobjdump = _cuobjdump()
    assert cuobjdump, "nvcc is here but cuobjdump is not (the CUDA toolkit's, or triton's copy)"
    probe = tmp_path / "probe.cu"
    instances = [f"template __global__ void fusedllm::cuda::mma::mma_tile_kernel<{t}, {rows}, false>"
                 f"(const {t}*, const {t}*, float*);"
                 for t in ("c10::BFloat16", "c10::Half") for rows in ("true", "false")]
    probe.write_text('#include "mma_check.cuh"\n' + "\n".join(instances) + "\n")
    cubin = tmp_path / "probe.cubin"
    subprocess.run(["nvcc", "-std=c++20", f"-arch={arch}", "--expt-relaxed-constexpr", "-cubin",
                    *gpu_extensions.cuda_include_dirs(), str(probe), "-o", str(cubin)], check=True, capture_output=True)
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True,
                          text=True).stdout
    expected = (("HMMA.1688.F32 ", "LDSM.16.M88.4", "LDSM.16.MT88.4", "STS.128") if arch == "sm_75" else
                ("HMMA.16816.F32.BF16", "HMMA.16816.F32 ", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS.E.BYPASS.128"))
    for instruction in expected:
        assert instruction in sass, f"{instruction.strip()} not in the {arch} machine code"
    if arch == "sm_75":
        assert "HMMA.16816" not in sass and "LDGSTS" not in sass


@functools.cache
def _kernels_sass(cuobjdump, library, arch):
    """{mangled name: SASS} of the library's `arch` attention and grouped-product
    kernels (a dump of the whole library takes minutes: once an architecture)."""
    sass = subprocess.run([cuobjdump, "-sass", "-arch", arch, library], check=True, capture_output=True,
                          text=True).stdout
    found = {}
    for section in re.split(r"\n\s*Function : ", sass)[1:]:
        name, _, body = section.partition("\n")
        if re.search(r"attention_|grouped_mm_(tc|wgmma)_kernel", name):
            found[name.strip()] = body
    return found


def _functions_sass(cuobjdump, library, arch, pattern):
    """{mangled name: SASS} of those kernels whose name matches the regular
    expression `pattern`."""
    return {name: body for name, body in _kernels_sass(cuobjdump, library, arch).items()
            if re.search(pattern, name)}


ATTENTION_KERNELS = r"attention_mma_(forward|dq|dkdv)_kernel"


def _registers_after_dealloc(body):
    """The highest general register that code reachable from the function's
    USETMAXREG.DEALLOC reads or writes (the producer warpgroup's code once it
    gave its registers up), following branches to EXIT; -1 where none."""
    code = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", body)]
    index = {address: i for i, (address, _) in enumerate(code)}
    todo = [i for i, (_, text) in enumerate(code) if "USETMAXREG.DEALLOC" in text]
    seen, top = set(), -1
    while todo:
        i = todo.pop()
        while i < len(code) and i not in seen:
            seen.add(i)
            text = code[i][1]
            top = max([top] + [int(r) for r in re.findall(r"\bR(\d+)\b", text)])
            branch = re.search(r"\bBRA(?:\.\S+)? (?:!?U?P[T\d], )?0x([0-9a-f]+)", text)
            if branch and int(branch.group(1), 16) in index:
                todo.append(index[int(branch.group(1), 16)])
            if re.match(r"(EXIT|BRA|RET)\b", text):  # unpredicated: the path ends or went to its target
                break
            i += 1
    return top


@pytest.mark.slow
def test_built_tensor_core_kernels_hold_tensor_core_instructions():
    """Evidence from the installed build itself, without a GPU, where it holds
    machine code for sm_75, sm_80 and sm_90a (FUSEDLLM_CUDA=1, as CI builds):
    the Hopper forward's 10 instantiations and the Hopper backward's 14 hold
    HGMMA, UTMALDG and USETMAXREG on sm_90a, the 6 wgmma grouped products
    HGMMA.64x256x16 and cp.async (LDGSTS), and compile to traps elsewhere; on sm_80 and sm_90a every
    instantiation of the tensor-core attention kernels on sm_80 tiles (the
    forward and dQ for two dtypes x four head dims, dK/dV for three) and of the
    grouped products holds HMMA (mma.sync; .BF16 for bfloat16), ldmatrix (LDSM)
    and cp.async (LDGSTS). On sm_75 the float16 kernels on Turing tiles (the
    forward, dQ and dK/dV at head dims 64, 96 and 128) and the float16 grouped
    products hold HMMA.1688 and ldmatrix, no cp.async; every other
    instantiation, there and on the newer architectures, compiles to a trap
    and holds no HMMA."""
    import fusedllm
    from fusedllm import _extension

    archs = fusedllm.build_info().get("cuda_archs", [])
    if not {"75-real", "80-real", "90a-real"} <= set(archs):
        pytest.skip(f"this build holds machine code for {archs or 'no GPU'} (FUSEDLLM_CUDA=1 builds sm_75, 80 and 90a)")
    cuobjdump = _cuobjdump()
    assert cuobjdump, "the build holds CUDA machine code but cuobjdump is not here (the toolkit's, or triton's copy)"
    library = _extension._C.__file__
    hopper = _functions_sass(cuobjdump, library, "sm_90a", "attention_hopper_forward_kernel")
    assert len(hopper) == 10, list(hopper)  # two dtypes x (head dims 64, 128 x plain or not, 256 plain)
    backward = {**_functions_sass(cuobjdump, library, "sm_90a", "attention_hopper_dq_kernel"),
                **_functions_sass(cuobjdump, library, "sm_90a", "attention_hopper_dkdv_kernel")}
    # two kernels x two dtypes x (head dim 64 x plain or not, 128 plain), and dQ at 128 with two K/V stages
    assert len(backward) == 14, list(backward)
    hopper.update(backward)
    for name, body in hopper.items():
        hgmma = r"HGMMA\.64x\d+x16\.F32\.BF16" if "BFloat16" in name else r"HGMMA\.64x\d+x16\.F32 "
        assert re.search(hgmma, body) and "UTMALDG.4D" in body and "USETMAXREG" in body, name
        # The producer gives its registers up to 24 (setmaxnreg): its code must stay below R24.
        assert "USETMAXREG.DEALLOC" in body and 0 <= _registers_after_dealloc(body) < 24, name

    wgmma = _functions_sass(cuobjdump, library, "sm_90a", "grouped_mm_wgmma_kernel")
    assert len(wgmma) == 6, list(wgmma)  # two dtypes x three products
    for name, body in wgmma.items():
        hgmma = "HGMMA.64x256x16.F32.BF16" if "BFloat16" in name else "HGMMA.64x256x16.F32 "
        assert hgmma in body and "LDGSTS.E.BYPASS.128" in body and "FENCE.VIEW.ASYNC.S" in body, name
    for arch in ("sm_75", "sm_80"):
        traps = _functions_sass(cuobjdump, library, arch, "grouped_mm_wgmma_kernel")
        assert len(traps) == 6 and not any("GMMA" in b or "LDGSTS" in b for b in traps.values()), arch

    def split(arch):
        """The attention kernels on Turing tiles (Tile<kD, 75>, mangled TileILi..ELi75E) and the others."""
        attention = _functions_sass(cuobjdump, library, arch, ATTENTION_KERNELS)
        turing = {n: b for n, b in attention.items() if re.search(r"TileILi\d+ELi75E", n)}
        return turing, {n: b for n, b in attention.items() if n not in turing}

    for arch in ("sm_80", "sm_90a"):
        turing, attention = split(arch)
        grouped = _functions_sass(cuobjdump, library, arch, "grouped_mm_tc_kernel")
        # two dtypes x three products x two tiles
        assert len(attention) == 24 and len(turing) == 9 and len(grouped) == 12, (arch, list(attention), list(grouped))
        for name, body in {**attention, **grouped}.items():
            hmma = "HMMA.16816.F32.BF16" if "BFloat16" in name else "HMMA.16816.F32 "
            assert hmma in body and "LDGSTS.E.BYPASS.128" in body, (arch, name)
            assert "LDSM.16.M88.4" in body or "LDSM.16.MT88.4" in body, (arch, name)
        for name, body in attention.items():  # Q K^T plain, P V (dS K, P^T dO, dS^T Q) through .trans
            assert "LDSM.16.M88.4" in body and "LDSM.16.MT88.4" in body, (arch, name)
        assert not any("HMMA" in body for body in turing.values()), (arch, list(turing))
    turing, attention = split("sm_75")
    grouped = _functions_sass(cuobjdump, library, "sm_75", "grouped_mm_tc_kernel")
    grouped_fp16 = {n: b for n, b in grouped.items() if "N3c104HalfE" in n}
    assert len(turing) == 9 and all("Half" in name for name in turing), list(turing)
    assert len(grouped) == 12 and len(grouped_fp16) == 6, list(grouped)
    for name, body in {**turing, **grouped_fp16}.items():
        assert "HMMA.1688.F32 " in body and ("LDSM.16.M88.4" in body or "LDSM.16.MT88.4" in body), name
        assert "HMMA.16816" not in body and "LDGSTS" not in body, name
    for name, body in turing.items():
        assert "LDSM.16.M88.4" in body and "LDSM.16.MT88.4" in body, name
    old = {**attention, **{n: b for n, b in grouped.items() if n not in grouped_fp16}}
    assert len(old) == 30 and not any("HMMA" in body or "LDGSTS" in body for body in old.values()), list(old)


@pytest.fixture(scope="module")
def gpu_check_tile():
    return gpu_extensions.tensor_core_check()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("exact", [True, False], ids=["integers", "random"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_check_tile_on_a_gpu_hardware_and_portable_forms_agree(gpu_check_tile, dtype, layout, exact):
    if torch.cuda.get_device_capability() < (8, 0) and dtype == torch.bfloat16:
        pytest.skip("a bfloat16 mma.sync needs sm_80 (sm_75: float16 m16n8k8)")
    a, b, expected = operands(dtype, exact, LAYOUTS[layout], device="cuda")
    hardware = gpu_check_tile.mma_tile(a, b, LAYOUTS[layout], False)
    portable = gpu_check_tile.mma_tile(a, b, LAYOUTS[layout], True)
    check(hardware, expected, exact)
    check(portable, expected, exact)
    if exact:
        assert torch.equal(hardware, portable)
