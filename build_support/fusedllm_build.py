"""Build backend: scikit-build-core, plus what a torch extension needs first.

fusedllm compiles against the torch of the environment it installs into (its
C++ ABI is that exact torch's), so:
- torch must be importable while building. pip and uv build in an isolated
  environment by default, where the installed torch is invisible: that fails
  at once, with the commands that build against the installed torch.
- missing build tools (scikit-build-core, CMake, Ninja) are one line that
  names them and the install command, not a traceback.
- each environment gets its own build directory (its torch, its interpreter),
  so building from a second environment never invalidates the first one's.
- the wheel's metadata pins the torch release it was built against
  (``dynamic_metadata``); the CUDA flavour is checked when fusedllm loads.
"""

from __future__ import annotations

import hashlib
import os
import sys

BUILD_TOOLS = "'scikit-build-core>=1.1' 'cmake>=3.26' ninja"
NO_ISOLATION = (
    "pip install --no-build-isolation <path>   (uv: uv pip install --no-build-isolation <path>)"
)


def _fail(message: str) -> None:
    print(f"fusedllm: {message}", file=sys.stderr)
    raise SystemExit(1)


def _torch():
    try:
        import torch
    except ImportError:
        _fail(
            "torch is not importable in the build environment. fusedllm is compiled against "
            "the torch it will run with: if torch is installed, the build was isolated from it "
            f"(pip's and uv's default); build against it with: {NO_ISOLATION} (after "
            f"pip install {BUILD_TOOLS}). If torch is not installed, install it first "
            "(pip install torch)."
        )
    return torch


def _skbuild():
    try:
        import scikit_build_core.build as backend
    except ImportError:
        _fail(f"scikit-build-core is not installed; install the build tools: pip install {BUILD_TOOLS}")
    return backend


def _missing(requirements: list[str]) -> list[str]:
    """The requirements not installed here. scikit-build-core lists CMake and
    Ninja when no suitable program is on the system, installed or not."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    missing = []
    for text in requirements:
        req = Requirement(text)
        try:
            if req.specifier.contains(version(req.name), prereleases=True):
                continue
        except PackageNotFoundError:
            pass
        missing.append(text)
    return missing


def _flavour(torch) -> str:
    return f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"


def _settings(config_settings) -> dict:
    """config_settings with this environment's build directory, after checking
    that torch and the build tools are there."""
    torch = _torch()
    backend = _skbuild()
    settings = dict(config_settings or {})
    missing = _missing(backend.get_requires_for_build_wheel(settings))
    if missing:
        _fail(f"missing build tools: {', '.join(missing)}; install them: pip install {BUILD_TOOLS}")
    if "build-dir" not in settings:
        env = os.path.basename(os.path.normpath(sys.prefix)).lstrip(".") or "env"
        env_hash = hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:8]
        release = torch.__version__.split("+")[0]
        tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
        settings["build-dir"] = f"build/{env}-{env_hash}-{tag}-torch{release}-{_flavour(torch)}"
    return settings


def get_requires_for_build_wheel(config_settings=None):
    _torch()
    return _skbuild().get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings=None):
    _torch()
    return _skbuild().get_requires_for_build_editable(config_settings)


def get_requires_for_build_sdist(config_settings=None):
    return _skbuild().get_requires_for_build_sdist(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    settings = _settings(config_settings)
    return _skbuild().prepare_metadata_for_build_wheel(metadata_directory, settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    settings = _settings(config_settings)
    return _skbuild().prepare_metadata_for_build_editable(metadata_directory, settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    settings = _settings(config_settings)
    return _skbuild().build_wheel(wheel_directory, settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    settings = _settings(config_settings)
    return _skbuild().build_editable(wheel_directory, settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    # A source distribution is compiled where it is installed: no torch needed here.
    return _skbuild().build_sdist(sdist_directory, config_settings)


# Metadata provider ([[tool.dynamic-metadata]] in pyproject.toml), the hooks
# scikit-build-core calls on it.
_build_state = None


def build_state(state):
    global _build_state
    _build_state = state


def dynamic_wheel(settings=None):
    # A source distribution's dependency is settled where it is compiled.
    return {"dependencies": True}


def dynamic_metadata(settings=None, project=None):
    """The torch pin. torch promises its C++ ABI only to extensions built
    against the same release (torchvision pins the same way); "+cu130"-style
    labels are left out so that PyPI's torch, which has none, matches."""
    if _build_state == "sdist":
        return {"dependencies": ["torch"]}
    return {"dependencies": [f"torch=={_torch().__version__.split('+')[0]}"]}
