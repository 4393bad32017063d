"""How fusedllm loads: version mismatch, missing extension, reference path, CPU variants.

Each case runs in a fresh interpreter, since the loader runs once at import.
"""

import os
import subprocess
import sys
import textwrap

import pytest

import fusedllm
from checks import runnable_cpu_isas

TESTS_DIR = os.path.dirname(__file__)


def run_python(*parts, **env_overrides):
    """Runs the code pieces (each dedented on its own) in a new interpreter."""
    code = "\n".join(textwrap.dedent(part) for part in parts)
    env = dict(os.environ)
    env.pop("FUSEDLLM_REQUIRE_EXTENSION", None)
    env.pop("FUSEDLLM_DISABLE_EXTENSION", None)
    env.pop("ATEN_CPU_CAPABILITY", None)
    env.update(env_overrides)
    env["PYTHONPATH"] = TESTS_DIR + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, env=env, timeout=300)


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


def test_torch_version_mismatch_names_the_rebuild_command():
    res = run_python("""
        import torch
        torch.__version__ = "1.0.0"
        import fusedllm
    """)
    assert res.returncode != 0
    assert "was built against torch" in res.stderr
    assert "pip install --no-build-isolation -e ." in res.stderr


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


@pytest.mark.parametrize("isa", runnable_cpu_isas())
def test_every_cpu_variant_this_machine_runs_matches_reference(isa):
    # ATEN_CPU_CAPABILITY caps torch's choice, and fusedllm follows it.
    res = run_python(f"""
        import torch, fusedllm
        from reference import rms_norm
        from checks import FORWARD_TOL
        assert fusedllm.build_info()["cpu_isa_active"] == "{isa}", fusedllm.build_info()
        for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            for n in (1, 7, 33, 4097):
                x = torch.randn(9, n, dtype=dt); w = torch.randn(n, dtype=dt)
                for casting in ("llama", "gemma"):
                    atol, rtol = FORWARD_TOL[dt]
                    torch.testing.assert_close(fusedllm.rms_norm(x, w, casting=casting),
                                               rms_norm(x, w, casting=casting), atol=atol, rtol=rtol)
                xg = x.clone().requires_grad_(); wg = w.clone().requires_grad_()
                fusedllm.rms_norm(xg, wg).float().sum().backward()
                xr = x.double().requires_grad_(); wr = w.double().requires_grad_()
                rms_norm(xr, wr, casting="gemma").sum().backward()
                tol = 1e-4 if dt in (torch.float32, torch.float64) else 0.1
                torch.testing.assert_close(xg.grad.double(), xr.grad, atol=tol * max(1, xr.grad.abs().max().item()), rtol=tol)
                torch.testing.assert_close(wg.grad.double(), wr.grad, atol=tol * max(1, wr.grad.abs().max().item()), rtol=tol)
        print("OK")
    """, ATEN_CPU_CAPABILITY=isa.lower(), FUSEDLLM_REQUIRE_EXTENSION="1")
    assert res.returncode == 0, res.stderr
    assert "OK" in res.stdout
