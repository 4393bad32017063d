"""What a user installing fusedllm meets: the build backend's checks and pins,
and the import-time check of the torch the extension was built against."""

import os
import subprocess
import sys
import types

import pytest
import torch

from fusedllm import _extension

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BUILD_SUPPORT = os.path.join(ROOT, "build_support")


def run_backend(code: str, hide: tuple = ()) -> subprocess.CompletedProcess:
    """Runs `code` with the build backend imported and the modules in `hide`
    made unimportable, as in an isolated build environment without them."""
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in hide)
    prelude += f"sys.path.insert(0, {BUILD_SUPPORT!r})\nimport fusedllm_build\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_isolated_build_without_torch_fails_at_once_with_the_commands():
    for hook in ("get_requires_for_build_wheel", "get_requires_for_build_editable",
                 "build_wheel"):
        args = "('/nonexistent')" if hook == "build_wheel" else "()"
        res = run_backend(f"fusedllm_build.{hook}{args}", hide=("torch",))
        assert res.returncode == 1, (hook, res.stderr)
        err = res.stderr.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1, err
        assert "torch is not importable" in err and "isolated" in err
        assert "pip install --no-build-isolation" in err and "uv pip install --no-build-isolation" in err


def test_missing_scikit_build_core_is_one_line():
    res = run_backend("fusedllm_build.build_wheel('/nonexistent')",
                      hide=("scikit_build_core", "scikit_build_core.build"))
    err = res.stderr.strip()
    assert res.returncode == 1 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "scikit-build-core is not installed" in err and "pip install 'scikit-build-core" in err


def test_missing_build_tools_are_named():
    res = run_backend("print(fusedllm_build._missing(['cmake>=3.26', 'ninja>=1.5', "
                      "'no-such-build-tool>=1']))")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['no-such-build-tool>=1']"


def test_wheel_pins_the_torch_it_is_built_against():
    res = run_backend("print(fusedllm_build.dynamic_metadata()['dependencies'])")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == repr([f"torch=={torch.__version__.split('+')[0]}"])


def test_build_directory_is_per_environment():
    code = "print(fusedllm_build._settings({})['build-dir'])"
    res = run_backend(code)
    assert res.returncode == 0, res.stderr
    build_dir = res.stdout.strip()
    flavour = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    assert build_dir.startswith("build/") and build_dir.endswith(
        f"-cp{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__.split('+')[0]}-{flavour}")
    assert os.path.basename(os.path.normpath(sys.prefix)).lstrip(".") in build_dir
    # Given explicitly, the caller's choice stands.
    res = run_backend("print(fusedllm_build._settings({'build-dir': 'elsewhere'})['build-dir'])")
    assert res.stdout.strip() == "elsewhere"


def config(version, cuda, kernels):
    return types.SimpleNamespace(TORCH_VERSION=version, TORCH_CUDA=cuda, CUDA_KERNELS=kernels)


def test_loader_accepts_the_torch_it_was_built_against():
    assert _extension._torch_mismatch(config(torch.__version__, torch.version.cuda or "", False)) is None


@pytest.mark.parametrize("built,cuda,kernels,running_cuda,expected", [
    ("2.0.0", "", False, None, "built against torch 2.0.0"),
    (None, "12.8", True, None, "has no CUDA"),
    (None, "12.8", True, "13.0", "has CUDA 13.0"),
])
def test_loader_names_the_mismatch(monkeypatch, built, cuda, kernels, running_cuda, expected):
    monkeypatch.setattr(torch.version, "cuda", running_cuda)
    reason = _extension._torch_mismatch(config(built or torch.__version__, cuda, kernels))
    assert reason is not None and expected in reason


def test_sdist_builds_without_torch_and_leaves_the_pin_to_the_wheel(tmp_path):
    import tarfile

    res = run_backend(f"print(fusedllm_build.build_sdist({str(tmp_path)!r}))", hide=("torch",))
    assert res.returncode == 0, res.stderr
    with tarfile.open(tmp_path / res.stdout.strip().splitlines()[-1]) as sdist:
        names = sdist.getnames()
        info = sdist.extractfile("fusedllm-0.1.0/PKG-INFO").read().decode()
    assert "fusedllm-0.1.0/build_support/fusedllm_build.py" in names
    assert "fusedllm-0.1.0/LICENSE" in names
    assert "Dynamic: Requires-Dist" in info and "Requires-Dist: torch\n" in info
