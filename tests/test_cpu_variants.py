"""Each op's correctness tests under each compiled CPU variant (DEFAULT, AVX2,
AVX512, AVX512_BF16, AMX) this machine can execute, and the instructions the
variants were built to use.

A case runs the op's own tests marked cpu_variants in a fresh interpreter with
ATEN_CPU_CAPABILITY and FUSEDLLM_CPU_ISA set (fusedllm follows torch's choice,
capped by its own variable), then asks that same
interpreter which variant every CPU kernel of the op ran, so a case cannot pass
on another variant than the one it names (the AMX variant has the attention
forward only: the op's other kernels run AVX512_BF16 there).
"""

import functools
import json
import platform

import pytest

import os
import re
import shutil
import subprocess

from checks import ATEN_CAPABILITY, compiled_cpu_isas, run_python, runnable_cpu_isas, variant_run

# op: (its test file, its CPU kernel tables, its entries in tests/op_table.py);
# the tests run are the file's cases marked cpu_variants (its core correctness
# tests) and the gradchecks of the entries' samples marked `variants`.
OPS = {
    "rms_norm": ("test_rms_norm.py", ("rms_norm_forward", "rms_norm_backward"), ("rms_norm", "fused_add_rms_norm")),
    "swiglu": ("test_swiglu.py", ("swiglu_forward", "swiglu_backward"), ("swiglu",)),
    "rope": ("test_rope.py", ("rope",), ("apply_rope",)),
    "attention": ("test_attention.py", ("attention_forward", "attention_backward"), ("attention",)),
    "attention options": ("test_attention_options.py", ("attention_forward", "attention_backward"), ()),
    "int8 attention": ("test_kv_quant.py", ("attention_forward",), ()),
    "paged attention": ("test_kv_paged.py", ("attention_forward",), ()),
    "linear_cross_entropy": ("test_cross_entropy.py", ("cross_entropy_rows",), ("linear_cross_entropy",)),
    # No kernel table: the variant picks how half-precision products are made (matmul.cpp).
    "moe experts": ("test_moe.py", (), ()),
}

# The cpu device only: the emulated CUDA kernels and torch.compile traces do
# not depend on the CPU variant.
MARKS = "cpu_variants and not slow and not simt and not cuda"


def selection_args(op: str):
    """pytest arguments that select `op`'s cases."""
    test_file, _, entries = OPS[op]
    if not entries:
        return ["-q", "-p", "no:cacheprovider", "-m", MARKS, f"tests/{test_file}"]
    table = " or ".join(f"op(name={name!r})" for name in entries)
    return ["-q", "-p", "no:cacheprovider", "-m", f"{MARKS} and (not op or {table})", f"tests/{test_file}",
            "tests/test_op_table.py"]


RUN_TESTS = """
    import json, sys
    import pytest
    rc = pytest.main(sys.argv[1:])
    import fusedllm
    print("KERNELS_RAN " + json.dumps(fusedllm.build_info()["cpu_kernels_ran"]))
    sys.exit(int(rc))
"""


def run_op_tests(op: str, isa: str):
    """Runs `op`'s selected tests on the variant `isa`; returns the
    process result and the variant each CPU kernel ran there."""
    args = selection_args(op)
    res = run_python(f"import sys; sys.argv[1:] = {args!r}", RUN_TESTS,
                     ATEN_CPU_CAPABILITY=ATEN_CAPABILITY[isa], FUSEDLLM_CPU_ISA=isa.lower(),
                     FUSEDLLM_REQUIRE_EXTENSION="1")
    line = next((x for x in res.stdout.splitlines() if x.startswith("KERNELS_RAN ")), None)
    ran = json.loads(line.split(" ", 1)[1]) if line else None
    return res, ran


@pytest.mark.parametrize("op", list(OPS))
def test_every_op_selects_cases(op):
    """Each op's selection holds cases, on a machine that cannot execute any
    variant past DEFAULT too."""
    res = run_python(f"import sys, pytest; sys.exit(pytest.main({selection_args(op) + ['--collect-only']!r}))")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]  # 5: no case selected


@pytest.mark.parametrize("isa", compiled_cpu_isas())
@pytest.mark.parametrize("op", list(OPS))
def test_op_under_every_cpu_variant(op, isa):
    if isa not in runnable_cpu_isas():
        pytest.skip(f"this CPU cannot execute the {isa} variant")
    res, ran = run_op_tests(op, isa)
    output = res.stdout[-4000:] + res.stderr[-4000:]
    assert res.returncode == 0, output  # 5 would mean no test was selected
    assert " passed" in res.stdout, output
    assert ran is not None, output
    for table in OPS[op][1]:
        want = variant_run(isa, table)
        assert ran.get(table) == want, f"kernel {table} ran {ran.get(table)}, not {want}: {ran}"


@functools.cache
def _cpu_functions():
    """{demangled function name: its instructions} for the extension's
    fusedllm::cpu functions (the library is disassembled once a process: each
    disassembly takes seconds)."""
    import fusedllm._C as ext

    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", ext.__file__],
                         capture_output=True, text=True, check=True).stdout
    functions, name = {}, None
    for line in out.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            name = head.group(1) if "fusedllm::cpu::" in head.group(1) else None
            if name:
                functions[name] = []
        elif name and "\t" in line:
            functions[name].append(line.split("\t", 1)[1].strip())
    return functions


def _disassembly(symbol_pattern):
    """{demangled function name: its instructions} for the extension's
    functions whose name matches symbol_pattern (which names fusedllm::cpu::...)."""
    if shutil.which("objdump") is None:
        pytest.skip("objdump is not installed")
    assert symbol_pattern.startswith("fusedllm::cpu::"), symbol_pattern
    return {name: body for name, body in _cpu_functions().items()
            if re.search(symbol_pattern, name, re.IGNORECASE)}


def _variant_uses(isa, pattern, instruction):
    """Whether a function of CPU variant `isa` whose name matches `pattern` holds `instruction`."""
    funcs = _disassembly(rf"fusedllm::cpu::{isa}::.*{pattern}")
    assert funcs, f"no {isa} function matches {pattern}"
    return any(ins.startswith(instruction) for body in funcs.values() for ins in body)


@pytest.mark.skipif("AVX512_BF16" not in compiled_cpu_isas(), reason="no AVX512-BF16 variant built")
@pytest.mark.parametrize("kernel, instruction", [
    ("flash::", "vdpbf16ps"),  # the attention kernels' products (their micro-kernels may be out of line)
    ("flash::", "vpdpwssd"),  # decoding over int8 K/V: int16 products (AVX512-VNNI)
    ("RmsNorm", "vcvtne2ps2bf16"),
    ("swiglu", "vcvtne2ps2bf16"),
])
def test_bf16_variant_uses_the_bf16_instructions(kernel, instruction):
    """The AVX512_BF16 variant's bfloat16 attention runs its products on
    vdpbf16ps (over int8 keys and values when decoding, vpdpwssd) and the
    other ops narrow float32 to bfloat16 with vcvtne2ps2bf16; the AVX512
    variant's code uses none of them."""
    pattern = re.escape(kernel)
    assert _variant_uses("AVX512_BF16", pattern, instruction)
    assert not _variant_uses("AVX512", pattern, instruction)


@pytest.mark.skipif("AMX" not in compiled_cpu_isas(), reason="no AMX variant built")
@pytest.mark.parametrize("instruction", ["tdpbf16ps", "ldtilecfg", "sttilecfg", "tilerelease"])
def test_amx_variant_uses_the_tiles(instruction):
    """The AMX variant's attention forward runs its prefill products on the
    tiles (tdpbf16ps), after configuring them (ldtilecfg, the thread's
    configuration saved first with sttilecfg) and releasing or restoring
    them after; the AVX512_BF16 variant's code has no tile instruction."""
    assert _variant_uses("AMX", "flash::", instruction)
    assert not _variant_uses("AVX512_BF16", "flash::", instruction)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 prefetch instructions")
def test_forward_kernels_prefetch_the_next_tile():
    """Every variant's forward kernel asks for the next K/V tile ahead of use
    (a compiler once dropped those requests without a word)."""
    for isa in compiled_cpu_isas():
        funcs = _disassembly(rf"fusedllm::cpu::{isa}::.*Forward(Kernel|Task)<")
        assert funcs, f"no {isa} forward kernel"
        assert any(ins.startswith("prefetch") for body in funcs.values() for ins in body), isa


@pytest.mark.skipif(not any(i in compiled_cpu_isas() for i in ("AVX2", "AVX512")),
                    reason="no AVX2 or AVX-512 variant built")
def test_float16_variants_convert_with_f16c():
    """float16 rows convert with vcvtph2ps / vcvtps2ph (F16C, AVX-512F)
    wherever the variant has them."""
    for isa in [i for i in compiled_cpu_isas() if i != "DEFAULT" and variant_run(i, "rms_norm_forward") == i]:
        funcs = _disassembly(rf"fusedllm::cpu::{isa}::.*RmsNorm")
        body = [ins for b in funcs.values() for ins in b]
        assert any(ins.startswith("vcvtph2ps") for ins in body), isa
        assert any(ins.startswith("vcvtps2ph") for ins in body), isa


def test_unknown_cpu_isa_is_refused():
    res = run_python("""
        try:
            import torch, fusedllm
            fusedllm.rms_norm(torch.randn(4, 8), torch.ones(8))
        except Exception as e:
            print("ERROR", e)
    """, FUSEDLLM_CPU_ISA="avx1024", FUSEDLLM_REQUIRE_EXTENSION="1")
    assert "FUSEDLLM_CPU_ISA=avx1024 is not one of default, avx2, avx512, avx512_bf16, amx" in res.stdout, \
        res.stdout + res.stderr


@pytest.mark.parametrize("isa", compiled_cpu_isas())
def test_bfloat16_rounding_equals_torch_under_every_variant(isa):
    """Outputs narrowed to bfloat16 equal torch's rounding in every variant,
    subnormals (which vcvtne2ps2bf16 alone would flush to zero), signed zeros,
    infinities and ties included."""
    if isa not in runnable_cpu_isas():
        pytest.skip(f"this CPU cannot execute the {isa} variant")
    res = run_python("""
        import torch, fusedllm
        tiny = torch.tensor([3e-39, -7e-39, 1e-45, 1.2e-38, 0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8,
                             3.0e38, float("inf"), -float("inf"), 65504.0, 1e-30, 5.5])
        up = tiny.repeat(5)[:64]
        gate = torch.full((64,), 20.0)  # silu(20) = 20 * sigmoid(20): up times almost 20
        out = fusedllm.swiglu(gate.bfloat16(), up.bfloat16())
        ref = (torch.nn.functional.silu(gate.bfloat16().float()) * up.bfloat16().float()).bfloat16()
        same = torch.equal(out.view(torch.int16), ref.view(torch.int16))
        print("SAME", same, fusedllm.build_info()["cpu_kernels_ran"].get("swiglu_forward"))
        if not same:
            print(out.float().tolist()); print(ref.float().tolist())
    """, ATEN_CPU_CAPABILITY=ATEN_CAPABILITY[isa], FUSEDLLM_CPU_ISA=isa.lower(), FUSEDLLM_REQUIRE_EXTENSION="1")
    assert f"SAME True {variant_run(isa, 'swiglu_forward')}" in res.stdout, res.stdout + res.stderr
