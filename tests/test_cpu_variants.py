"""Each op's correctness tests under each compiled CPU variant (DEFAULT, AVX2,
AVX512) this machine can execute.

A case runs a selection of the op's own tests in a fresh interpreter with
ATEN_CPU_CAPABILITY set (fusedllm follows torch's choice), then asks that same
interpreter which variant every CPU kernel of the op ran, so a case cannot pass
on another variant than the one it names.
"""

import json

import pytest

from checks import compiled_cpu_isas, run_python, runnable_cpu_isas

# op: (its test file, -k selection of its core correctness tests, its CPU kernel tables)
OPS = {
    "rms_norm": ("test_rms_norm.py",
                 "(rms_norm_matches_reference and cpu-37) or (fused_add_rms_norm_matches_reference "
                 "and not cpu-1-) or strided or zero_size",
                 ("rms_norm_forward", "rms_norm_backward")),
    "swiglu": ("test_swiglu.py",
               "matches_reference or agree_exactly or strided or gradcheck",
               ("swiglu_forward", "swiglu_backward")),
    "rope": ("test_rope.py",
             "(rope_matches_reference and not 2048) or position_ids_and_offset or in_place_variant "
             "or strided or gradcheck",
             ("rope",)),
    "attention": ("test_attention.py",
                  "test_matches_reference or (masks_match_reference and float32) or dropout_matches "
                  "or strided or test_gradcheck_float64",
                  ("attention_forward", "attention_backward")),
    "attention options": ("test_attention_options.py",
                          "(option_matches_reference and float32 and (17x17 or 1x300)) or "
                          "(options_with_masks and float32) or (varlen_matches_reference and float32) "
                          "or (test_gradcheck_float64 and all)",
                          ("attention_forward", "attention_backward")),
    "linear_cross_entropy": ("test_cross_entropy.py",
                             "(matches_cross_entropy and not float16) or options or gradcheck",
                             ("cross_entropy_rows",)),
}

# The cpu device only: the emulated CUDA kernels and torch.compile traces do
# not depend on the CPU variant.
MARKS = "not slow and not simt and not cuda"

RUN_TESTS = """
    import json, sys
    import pytest
    rc = pytest.main(sys.argv[1:])
    import fusedllm
    print("KERNELS_RAN " + json.dumps(fusedllm.build_info()["cpu_kernels_ran"]))
    sys.exit(int(rc))
"""


def run_op_tests(op: str, isa: str):
    """Runs `op`'s selected tests with ATEN_CPU_CAPABILITY=isa; returns the
    process result and the variant each CPU kernel ran there."""
    test_file, selection, _ = OPS[op]
    args = ["-q", "-p", "no:cacheprovider", "-m", MARKS, "-k", selection, f"tests/{test_file}"]
    res = run_python(f"import sys; sys.argv[1:] = {args!r}", RUN_TESTS,
                     ATEN_CPU_CAPABILITY=isa.lower(), FUSEDLLM_REQUIRE_EXTENSION="1")
    line = next((x for x in res.stdout.splitlines() if x.startswith("KERNELS_RAN ")), None)
    ran = json.loads(line.split(" ", 1)[1]) if line else None
    return res, ran


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
    for table in OPS[op][2]:
        assert ran.get(table) == isa, f"kernel {table} ran {ran.get(table)}, not {isa}: {ran}"
