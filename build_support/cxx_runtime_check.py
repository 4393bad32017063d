"""Does the C++ compiler take the C++ runtime from the libstdc++ torch loads?

Some toolchains copy parts of libstdc++ into every shared library they link:
devtoolset-style GCC wrappers add ``libstdc++_nonshared.a``, others link
``libstdc++.a``. A Python extension loads with its own symbols first, so its
copies run instead of the process's libstdc++ while the objects they work on
(streams, locales) were made by the real one: the copied number formatting
finds no facet of its own in a locale it did not register, and the first
error message that prints a number comes out empty or kills the process.

The check builds one small library the way the extension is linked, loads it
in a process that has imported torch, and has it format numbers. If that
fails, it links the loaded libstdc++ explicitly before the compiler's own
libraries (the linker then takes every symbol it has from there and copies
only what it lacks) and tries again. CMake runs this at configure time and
the tests run it against a toolchain that copies the runtime.

    python cxx_runtime_check.py --compiler g++ --abi 1 --workdir DIR
prints nothing (fine as it is) or the library to link first; exits 1 with
the reason and the fix when neither works.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

PROBE_SOURCE = r"""
#include <cstring>
#include <sstream>
#include <string>
extern "C" int fusedllm_runtime_probe(char* out, int size) {
  std::ostringstream s;
  s << "shape [" << 2L << ", " << -3 << "] " << 2.5 << ' ' << 123456789012LL;
  const std::string text = s.str();
  std::strncpy(out, text.c_str(), size - 1);
  out[size - 1] = '\0';
  return static_cast<int>(text.size());
}
"""
PROBE_EXPECTED = "shape [2, -3] 2.5 123456789012"

# Prints the libstdc++ a process that imported torch has loaded (an empty line
# off Linux, or where torch runs on another C++ runtime), then, given a probe
# library, loads it as Python loads an extension (RTLD_LOCAL, after torch) and
# prints what it formatted.
_RUN_PROBE = r"""
import ctypes, os, sys
import torch
maps = open("/proc/self/maps").read().splitlines() if os.path.exists("/proc/self/maps") else []
print(next((os.path.realpath(l.split()[-1]) for l in maps if "libstdc++.so" in l), ""), flush=True)
if len(sys.argv) > 1:
    lib = ctypes.CDLL(sys.argv[1])
    out = ctypes.create_string_buffer(256)
    lib.fusedllm_runtime_probe(out, 256)
    print(out.value.decode())
"""


def _probe_process(library: str | None) -> tuple[str | None, str | None]:
    """(the loaded libstdc++ or None, None when the probe formatted its numbers
    else what went wrong)."""
    res = subprocess.run([sys.executable, "-c", _RUN_PROBE, *([library] if library else [])],
                         capture_output=True, text=True, timeout=300)
    lines = res.stdout.split("\n", 1)
    runtime = lines[0].strip() or None
    if res.returncode < 0:
        return runtime, f"the process died with signal {-res.returncode}"
    if res.returncode != 0:
        return runtime, f"the process failed: {res.stderr.strip().splitlines()[-1:]}"
    got = lines[1].strip() if len(lines) > 1 else ""
    if library and got != PROBE_EXPECTED:
        return runtime, f"it formatted {got!r} instead of {PROBE_EXPECTED!r}"
    return runtime, None


def loaded_runtime() -> str | None:
    """The libstdc++ shared library a process that imported torch has loaded
    (None off Linux, or where torch runs on another C++ runtime)."""
    return _probe_process(None)[0]


def _nm_symbols(path: str, dynamic: bool) -> set[str]:
    args = ["nm", "--defined-only", "--format=posix"] + (["-D"] if dynamic else []) + [path]
    res = subprocess.run(args, capture_output=True, text=True)
    if res.returncode != 0:
        return set()
    # posix format: "name type value size"; local symbols (lower-case types) cannot be interposed
    # ("name@@GLIBCXX_3.4.9" in a versioned library)
    return {fields[0].split("@")[0] for fields in (line.split() for line in res.stdout.splitlines())
            if len(fields) >= 2 and fields[1] in "TWVDRBui"}


def copied_symbols(library: str, runtime: str) -> list[str]:
    """Symbols ``library`` defines itself that the C++ runtime ``runtime`` exports:
    pieces of the runtime linked into the library (empty where nm is missing)."""
    if shutil.which("nm") is None:
        return []
    return sorted(_nm_symbols(library, dynamic=False) & _nm_symbols(runtime, dynamic=True))


def demangle(symbols: list[str]) -> list[str]:
    if not symbols or shutil.which("c++filt") is None:
        return symbols
    res = subprocess.run(["c++filt"], input="\n".join(symbols), capture_output=True, text=True)
    return res.stdout.splitlines() if res.returncode == 0 else symbols


def build_probe(compiler: str, workdir: str, name: str, abi: int | None, link_first: list[str]) -> str:
    """The probe library linked as an extension is, ``link_first`` before the
    compiler's own libraries. Raises RuntimeError with the compiler's output."""
    os.makedirs(workdir, exist_ok=True)
    source = os.path.join(workdir, "probe.cpp")
    with open(source, "w") as f:
        f.write(PROBE_SOURCE)
    library = os.path.join(workdir, f"{name}.so")
    args = [compiler, "-shared", "-fPIC", "-O2"]
    if abi is not None:
        args.append(f"-D_GLIBCXX_USE_CXX11_ABI={abi}")
    args += [source, *link_first, "-o", library]
    res = subprocess.run(args, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{res.stdout}{res.stderr}")
    return library


def run_probe(library: str) -> str | None:
    """None when the probe formatted its numbers, else what went wrong."""
    return _probe_process(library)[1]


def _compiler_name(compiler: str) -> str:
    path = shutil.which(compiler) or compiler
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        version = "version unknown"
    real = os.path.realpath(path)
    return f"{path}{f' (-> {real})' if real != path else ''}, {version}"


def check(compiler: str, workdir: str, abi: int | None = None) -> dict:
    """``{"status": "ok" | "fixed" | "broken", "link_first": [...], "message": str}``."""
    plain = build_probe(compiler, workdir, "plain", abi, [])
    runtime, failure = _probe_process(plain)
    if runtime is None:
        return {"status": "ok", "link_first": [], "message": "torch loads no libstdc++: nothing to check"}
    copied = copied_symbols(plain, runtime)
    if failure is None and not copied:
        return {"status": "ok", "link_first": [], "message": f"C++ runtime from {runtime}"}
    fixed = build_probe(compiler, workdir, "runtime_first", abi, [runtime])
    fixed_failure = run_probe(fixed)
    fixed_copied = copied_symbols(fixed, runtime)
    found = (f"the C++ compiler {_compiler_name(compiler)} links parts of libstdc++ into shared "
             f"libraries instead of taking them from the libstdc++ torch loads ({runtime})")
    # std::ostream's number inserters first: what error messages call
    shown = demangle(sorted(copied or fixed_copied, key=lambda name: (not name.startswith("_ZNSo9_M_insertIl"),
                                                                 not name.startswith("_ZNSo9_M_insert"), name))[:3])
    if shown:
        found += f": {len(copied)} of its symbols, such as {'; '.join(shown)}"
    if failure:
        found += f". A library built so, loaded after torch, formatted numbers wrongly: {failure}"
    if fixed_failure is None and not fixed_copied:
        return {"status": "fixed", "link_first": [runtime],
                "message": f"{found}. Linking {runtime} first fixes it"}
    still = fixed_failure or f"it still defines {len(fixed_copied)} of libstdc++'s symbols"
    return {"status": "broken", "link_first": [], "message": (
        f"{found}. Linking {runtime} first did not help ({still}). An extension built with this "
        f"compiler would crash or print empty text at its first error message that formats a number. "
        f"Build with the compiler your system's libstdc++ comes from, e.g. "
        f"CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ pip install --no-build-isolation <fusedllm>")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compiler", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--abi", type=int, default=None, help="_GLIBCXX_USE_CXX11_ABI of torch")
    args = parser.parse_args()
    try:
        result = check(args.compiler, args.workdir, args.abi)
    except RuntimeError as exc:
        print(f"fusedllm: could not build the C++ runtime probe with {args.compiler}: {exc}", file=sys.stderr)
        return 1
    if result["status"] == "broken":
        print(f"fusedllm: {result['message']}", file=sys.stderr)
        return 1
    if result["status"] == "fixed":
        print(f"fusedllm: {result['message']}", file=sys.stderr)
    print(";".join(result["link_first"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
