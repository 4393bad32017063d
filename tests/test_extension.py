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


# --- The C++ runtime: taken from the libstdc++ torch loads, never copied in ---
# A module that carries its own copy of libstdc++ code runs that copy (a module's
# own symbols come first) on streams and locales the real libstdc++ made: the
# first error message that formats a number prints nothing or kills the process.
# Two checks: the modules built here reference every libstdc++ symbol instead of
# defining it (whichever op or error path would call it), and the configure-time
# check finds and fixes, or refuses, a toolchain that copies the runtime in.

import glob  # noqa: E402
import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _runtime_check():
    spec = importlib.util.spec_from_file_location(
        "cxx_runtime_check", os.path.join(ROOT, "build_support", "cxx_runtime_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


needs_gnu_toolchain = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("nm") is None or shutil.which("g++") is None,
    reason="checks libstdc++ with nm and g++ (Linux)")


@needs_gnu_toolchain
@pytest.mark.parametrize("module", ["_C", "_simt"])
def test_extension_modules_carry_no_copy_of_libstdcxx(module):
    check = _runtime_check()
    runtime = check.loaded_runtime()
    assert runtime and "libstdc++" in runtime
    spec = importlib.util.find_spec(f"fusedllm.{module}")
    if spec is None:
        assert module == "_simt", "fusedllm._C is not built"
        pytest.skip("fusedllm._simt is not built")
    copied = check.copied_symbols(spec.origin, runtime)
    assert not copied, f"{spec.origin} defines {len(copied)} of libstdc++'s symbols: {check.demangle(copied[:5])}"


def _compiler_that_links_libstdcxx_statically(tmp_path, drops_shared_runtime=False):
    """A g++ wrapper that copies libstdc++ into what it links, as devtoolset-style
    wrappers do with libstdc++_nonshared.a; optionally deaf to an explicit libstdc++.so."""
    script = tmp_path / ("g++-stubborn" if drops_shared_runtime else "g++-static-runtime")
    drop = 'for a in "$@"; do case "$a" in *libstdc++.so*) ;; *) args+=("$a");; esac; done\n' \
        if drops_shared_runtime else 'args=("$@")\n'
    script.write_text(f'#!/bin/bash\nargs=()\n{drop}exec g++ "${{args[@]}}" -static-libstdc++\n')
    script.chmod(0o755)
    return str(script)


# The system's g++ and every versioned one beside it (Debian's g++-11, g++-12...).
SYSTEM_COMPILERS = sorted({"g++", *(os.path.basename(p) for p in glob.glob("/usr/bin/g++-[0-9]*"))})


@needs_gnu_toolchain
@pytest.mark.parametrize("compiler", SYSTEM_COMPILERS)
def test_build_check_passes_the_system_compiler(tmp_path, compiler):
    result = _runtime_check().check(compiler, str(tmp_path), abi=int(torch._C._GLIBCXX_USE_CXX11_ABI))
    assert result["status"] == "ok", result["message"]


@needs_gnu_toolchain
def test_build_check_fixes_a_compiler_that_copies_libstdcxx(tmp_path):
    check = _runtime_check()
    compiler = _compiler_that_links_libstdcxx_statically(tmp_path)
    result = check.check(compiler, str(tmp_path / "work"), abi=int(torch._C._GLIBCXX_USE_CXX11_ABI))
    assert result["status"] == "fixed", result["message"]
    # what it found: the copied stream inserter, and numbers formatted wrongly
    assert "basic_ostream<char, std::char_traits<char> >::_M_insert<long>" in result["message"] and "formatted" in result["message"]
    assert result["link_first"] == [check.loaded_runtime()]


@needs_gnu_toolchain
def test_build_check_refuses_a_compiler_it_cannot_fix(tmp_path):
    compiler = _compiler_that_links_libstdcxx_statically(tmp_path, drops_shared_runtime=True)
    res = subprocess.run([sys.executable, os.path.join(ROOT, "build_support", "cxx_runtime_check.py"),
                          "--compiler", compiler, "--abi", str(int(torch._C._GLIBCXX_USE_CXX11_ABI)), "--workdir", str(tmp_path / "work")],
                         capture_output=True, text=True)
    assert res.returncode == 1
    assert compiler in res.stderr and "links parts of libstdc++" in res.stderr
    assert "CXX=/usr/bin/g++" in res.stderr
