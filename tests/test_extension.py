"""How fusedllm loads: version mismatch, missing extension, reference path.

Each case runs in a fresh interpreter, since the loader runs once at import.
"""

import fusedllm
from checks import run_python

CHECK_AGAINST_REFERENCE = """
    import torch, fusedllm
    from reference import rms_norm, fused_add_rms_norm
    x = torch.randn(5, 37, requires_grad=True); w = torch.randn(37, requires_grad=True)
    r = torch.randn(5, 37)
    torch.testing.assert_close(fusedllm.rms_norm(x, w), rms_norm(x, w))
    y, h = fusedllm.fused_add_rms_norm(x, r, w, offset=1.0, casting="gemma")
    ry, rh = fused_add_rms_norm(x, r, w, offset=1.0, casting="gemma")
    torch.testing.assert_close(y, ry); torch.testing.assert_close(h, rh)
    fusedllm.rms_norm(x, w).sum().backward()
    assert x.grad is not None and w.grad is not None
    print("BACKEND", fusedllm.backend())
"""


def test_torch_version_mismatch_says_which_torch_or_how_to_rebuild():
    res = run_python("""
        import torch
        torch.__version__ = "1.0.0"
        import fusedllm
    """)
    assert res.returncode != 0
    assert "was built against torch" in res.stderr and "but torch 1.0.0 is running" in res.stderr
    built = fusedllm.build_info()["torch_version"].split("+")[0]
    assert f"pip install torch=={built}" in res.stderr
    assert "pip install --no-build-isolation --force-reinstall" in res.stderr
    assert "FUSEDLLM_DISABLE_EXTENSION=1" in res.stderr


BLOCK_EXTENSION = """
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "fusedllm._C":
                raise ImportError("simulated: cannot load the shared library")
    sys.meta_path.insert(0, Block())
"""


def test_unloadable_extension_warns_once_and_uses_reference_path():
    res = run_python(BLOCK_EXTENSION, """
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import fusedllm
        import fusedllm.functional
    relevant = [w for w in caught if "reference path" in str(w.message)]
    assert len(relevant) == 1, [str(w.message) for w in caught]
    assert fusedllm.build_info()["backend"] == "reference"
    """, CHECK_AGAINST_REFERENCE)
    assert res.returncode == 0, res.stderr
    assert "BACKEND reference" in res.stdout


def test_require_extension_turns_a_load_failure_into_an_error():
    res = run_python(BLOCK_EXTENSION, "import fusedllm", FUSEDLLM_REQUIRE_EXTENSION="1")
    assert res.returncode != 0
    assert "FUSEDLLM_REQUIRE_EXTENSION is set" in res.stderr


def test_disable_extension_selects_reference_path_quietly():
    res = run_python("import warnings; warnings.simplefilter('error')", CHECK_AGAINST_REFERENCE,
                     FUSEDLLM_DISABLE_EXTENSION="1")
    assert res.returncode == 0, res.stderr
    assert "BACKEND reference" in res.stdout
