"""benchmarks/sass_table.py: the SASS parser, loop finder and counts on a short
synthetic listing; on a machine with nvcc and cuobjdump, one real kernel."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("sass_table", ROOT / "benchmarks" / "sass_table.py")
sass_table = importlib.util.module_from_spec(spec)
sys.modules["sass_table"] = sass_table
spec.loader.exec_module(sass_table)

# A kernel whose loop (0x0040 .. 0x0160) holds 2 HMMA, a rarely taken side path
# (0x00f0 .. 0x0110, skipped by the branch at 0x00e0), and an inner loop of 3
# instructions run 4 times (i = 0, 0x80, 0x100, 0x180 < 0x200).
SASS = """
	code for sm_90
		Function : _Z11toy_kernelPf
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                      /* 0x0000000000007919 */
        /*0020*/                   MOV R2, RZ ;                            /* 0x000000ff00027202 */
        /*0030*/                   MOV R3, RZ ;                            /* 0x000000ff00037202 */
        /*0040*/                   LDS.128 R4, [R0] ;                      /* 0x0000000000047984 */
        /*0050*/                   HMMA.16816.F32.BF16 R8, R4.reuse, R6, R8 ;  /* 0x000000060408723c */
        /*0060*/                   FFMA R12, R8, R9, R12 ;                 /* 0x000000090c0c7223 */
        /*0070*/                   MOV R20, RZ ;                           /* 0x000000ff00147202 */
        /*0080*/                   LDG.E.128 R16, desc[UR4][R2.64] ;      /* 0x0000000402107981 */
        /*0090*/                   VIADD R20, R20, 0x80 ;                  /* 0x0000008014147836 */
        /*00a0*/                   ISETP.GE.AND P1, PT, R20, 0x180, PT ;  /* 0x000001801400780c */
        /*00b0*/              @!P1 BRA 0x80 ;                              /* 0xfffffffc00f09947 */
        /*00c0*/                   MUFU.EX2 R13, R12 ;                     /* 0x0000000c000d7308 */
        /*00d0*/                   ISETP.NE.AND P0, PT, R3, RZ, PT ;      /* 0x000000ff0300720c */
        /*00e0*/               @P0 BRA 0x120 ;                             /* 0x0000000000080947 */
        /*00f0*/                   FMUL R14, R13, R13 ;                    /* 0x0000000d0d0e7220 */
        /*0100*/                   FADD R14, R14, R13 ;                    /* 0x0000000d0e0e7221 */
        /*0110*/                   STL [R1], R14 ;                         /* 0x0000000e01007387 */
        /*0120*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;   /* 0x000000060408723c */
        /*0130*/                   IADD3 R2, R2, 0x1, RZ ;                 /* 0x0000000102027810 */
        /*0140*/                   ISETP.GE.AND P2, PT, R2, R0, PT ;      /* 0x000000000200720c */
        /*0150*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;          /* 0x0000000000007b1d */
        /*0160*/              @!P2 BRA 0x40 ;                              /* 0xfffffffc00b8a947 */
        /*0170*/                   EXIT ;                                  /* 0x000000000000794d */
        /*0180*/                   BRA 0x180 ;                             /* 0xfffffffc00fc7947 */
		..........
"""


def test_synthetic_loop_counts():
    kernels = sass_table.parse_sass(SASS)
    assert [k.mangled for k in kernels] == ["_Z11toy_kernelPf"]
    assert len(kernels[0].instrs) == 25
    kernels[0].demangled = "toy_kernel(float*)"
    r = sass_table.analyse(kernels[0])
    assert r.kernel == "toy_kernel"  # no template arguments: the plain name
    # The loop holds 19 instructions; one iteration skips the 3 of the side path
    # (it has no HMMA) and runs the inner loop's 4 instructions 4 times: 16 - 4 + 16.
    assert r.static_size == 19
    assert r.inner == ["4x4"]
    assert r.total == 28
    assert r.counts["HMMA"] == 2
    assert r.counts["shared"] == 1
    assert r.counts["global"] == 4 and r.global_widths == {"LDG.128": 4}
    assert r.counts["FP"] == 1           # the FFMA; FMUL/FADD are on the side path
    assert r.counts["MUFU"] == 1
    assert r.counts["local"] == 0        # the STL is on the side path too
    assert r.counts["int"] == 1 + 4 * 2 + 1 + 2   # MOV; VIADD+ISETP per trip; ISETP; IADD3+ISETP
    assert r.counts["branch"] == 4 + 1 + 1        # inner back edge x4, side branch, the latch
    assert r.counts["barrier"] == 1
    assert sum(r.counts.values()) == r.total


def test_classify_and_names():
    assert sass_table.classify("HGMMA.64x128x16.F32.BF16", "") == "HGMMA"
    assert sass_table.classify("LDSM.16.M88.4", "") == "shared"
    assert sass_table.classify("LDGSTS.E.BYPASS.128", "") == "global"
    assert sass_table.classify("F2FP.BF16.F32.PACK_AB", "") == "cvt"
    assert sass_table.classify("UIADD3", "") == "int"
    assert sass_table.classify("LDS", "@!PT") == "other"  # never executes; an issue slot
    name = ("fusedllm::cuda::(anonymous namespace)::attention_mma_forward_kernel<c10::BFloat16, "
            "fusedllm::cuda::(anonymous namespace)::tc::Tile<128, 80> >(c10::BFloat16 const*, fusedllm::cuda::Strides)")
    assert sass_table.short_name(name) == "mma_forward<bf16,Tile<128,80>>"


def test_enum_arguments_and_unreachable_code():
    """An enum template argument (a cast in the demangled name) keeps the name whole;
    an edge out of a block nothing reaches (code after a call that never returns)
    is no back edge, so it makes no loop whose latch no path reaches."""
    name = ("void fusedllm::cuda::(anonymous namespace)::attention_decode_kernel<c10::BFloat16, "
            "(fusedllm::cuda::(anonymous namespace)::Stored)2, 128>(c10::BFloat16 const*, int)")
    assert sass_table.short_name(name) == "decode<bf16,Stored(2),128>"
    Block = sass_table.Block
    blocks = [Block(0, 0, [1]), Block(1, 1, [2, 1]), Block(2, 2, []), Block(3, 3, [1])]
    dom = sass_table.dominators(blocks)
    assert dom[3] == 0
    loops = sass_table.find_loops(blocks, dom)
    assert [(lp.head, lp.latches) for lp in loops] == [(1, {1})]


def test_missing_tool_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(sass_table.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="cuobjdump not found"):
        sass_table.main(["--cubin", "nothing.cubin"])


def _tool(name):
    try:
        return sass_table.find_tool(name, "")
    except SystemExit:
        return None


@pytest.mark.skipif(_tool("nvcc") is None or _tool("cuobjdump") is None, reason="needs nvcc and cuobjdump")
def test_one_real_kernel_sm80(tmp_path):
    # About a minute on 2 cores: the forward tensor-core source alone, for sm_80.
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sass_table.py"), "--arch", "80", "--sources",
         str(ROOT / "csrc" / "cuda" / "attention_mma.cu"), "--kernel", r"mma_forward<bf16,Tile<64,80>>",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| mma_forward")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    head = [c.strip() for c in out.stdout.splitlines()[0].strip("|").split("|")]
    row = dict(zip(head, cells))
    # S = Q K^T and O += P V for 64 keys x 64 dims: 2 x 32 m16n8k16 per 16-row
    # m-tile, a warp holding one or two m-tiles (Tile<kD>::kFwdM).
    assert row["HMMA"] in ("64", "128"), row["HMMA"]
    assert row["local"] == "0" and row["stack+local B"] == "0"
