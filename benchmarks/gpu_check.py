"""Build, test and benchmark fusedllm on the CUDA machine this runs on, in one command.

    python3 benchmarks/gpu_check.py --out DIR        (or: make gpu-check OUT=DIR)

Needs a CUDA build of torch that sees a GPU, nvcc, CMake, Ninja,
scikit-build-core and pytest (pytest-xdist to use every core); no network and
no virtual environment of the project's. It builds fusedllm for the visible
GPU's architecture into DIR/build (the source tree and the environment are
left as they are), runs every ``cuda`` test on all cores against that build,
then the GPU benchmarks with their peers (Liger-Kernel where it imports), and
writes everything to DIR: environment.txt, build.log, test_extensions.log, compile_warmup.log,
tests.log, tests.xml, bench/*.{json,md,png}, bench/*.log and summary.md, which is printed last.
While it builds and tests, the benchmarks' torch.compile baselines are compiled once into
DIR/cache, which the timed runs then read.
Each part's time is in the summary. Missing prerequisites stop it before
anything is built.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = ["rms_norm", "swiglu", "rope", "cross_entropy", "attention", "decode", "kv_int8", "moe",
              "model:--dtype bfloat16"]
# The benchmarks with torch.compile baselines, whose compiles are warmed while fusedllm builds,
# in the order they are warmed: most compile time first (H200, 2026-11-28: attention's took 48 s,
# RMSNorm's 30, SwiGLU's and RoPE's 15, the cross-entropy's 9).
COMPILING = ["attention", "rms_norm", "swiglu", "rope", "cross_entropy", "moe", "model"]


def _run(cmd, log_path, env=None, timeout=None, cwd=ROOT) -> tuple[int, float]:
    """(exit status, seconds); output to log_path. 124 when it ran past timeout."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            log.write(f"\n[stopped after {timeout} s]\n")
            rc = 124
    return rc, time.perf_counter() - start


def _tail(path: str, lines: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def prerequisites() -> tuple[dict, list[str]]:
    """What the run needs, and what is missing (each with how to get it)."""
    missing = []
    info = {"python": sys.executable}
    try:
        import torch
    except ImportError:
        return info, [f"torch is not importable by {sys.executable}"]
    info["torch"] = torch.__version__
    info["torch CUDA"] = torch.version.cuda or "none"
    if not torch.version.cuda:
        missing.append(f"torch {torch.__version__} is not a CUDA build")
    elif not torch.cuda.is_available():
        missing.append("torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES?)")
    else:
        props = torch.cuda.get_device_properties(0)
        info["GPU"] = f"{props.name}, compute capability {props.major}.{props.minor}, " \
                      f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
        info["arch"] = f"{props.major}.{props.minor}"
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        missing.append("nvcc not found (put it on PATH or set CUDACXX)")
    else:
        info["nvcc"] = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout \
            .strip().splitlines()[-1]
        info["nvcc path"] = nvcc
    for module, package in [("scikit_build_core", "scikit-build-core"), ("pytest", "pytest"),
                            ("cmake", "cmake"), ("ninja", "ninja")]:
        try:
            __import__(module)
        except ImportError:
            if shutil.which(module) is None:
                missing.append(f"{package} (pip install {package})")
    for module in ["xdist", "hypothesis"]:
        try:
            __import__(module)
        except ImportError:
            info[f"no {module}"] = "tests run in one process" if module == "xdist" else "missing"
            if module == "hypothesis":
                missing.append("hypothesis (pip install hypothesis): several test files need it")
    cxx = os.environ.get("CXX") or shutil.which("c++") or "c++"
    info["C++ compiler"] = cxx + ": " + (subprocess.run([cxx, "--version"], capture_output=True, text=True)
                                         .stdout.splitlines() or ["?"])[0]
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version
        info["Liger-Kernel"] = version("liger-kernel")
    except Exception:
        info["Liger-Kernel"] = "not importable: its columns are left out"
    info["cores"] = str(os.cpu_count())
    info["date"] = datetime.date.today().isoformat()
    return info, missing


def build(out: str, arch: str, jobs: int, nvcc: str) -> tuple[int, float, str]:
    site = os.path.join(out, "build", "site")
    shutil.rmtree(site, ignore_errors=True)
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=arch, FUSEDLLM_CUDA="1",
               CMAKE_BUILD_PARALLEL_LEVEL=str(jobs), CUDACXX=nvcc)
    cmd = [sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps",
           "--no-index", "--target", site, "-C", f"build-dir={os.path.join(out, 'build', 'cmake')}",
           # With many cores each file compiles on its own: the largest group would be the critical path.
           "-C", f"cmake.define.FUSEDLLM_SOURCE_GROUPS={'OFF' if jobs >= 8 else 'ON'}", ROOT]
    rc, seconds = _run(cmd, os.path.join(out, "build.log"), env=env)
    return rc, seconds, site


def start_test_extensions(out: str):
    """Builds the tests' check extensions, each in a process of its own (one
    nvcc each), while fusedllm builds."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import gpu_extensions

    names = [build.__name__ for build in gpu_extensions.for_visible_gpu()]
    log = open(os.path.join(out, "test_extensions.log"), "w")
    processes = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "gpu_extensions.py"), name],
                                  stdout=log, stderr=subprocess.STDOUT, cwd=ROOT) for name in names]
    return processes, log, time.perf_counter()


def finish_test_extensions(processes, log, start, deadline) -> tuple:
    """The part's summary row once the tests' extensions are built: its seconds
    are the wait past the build's end (at most until the deadline)."""
    waited = time.perf_counter()
    failed = []
    for process in processes:
        try:
            rc = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            rc = "stopped (--time-limit)"
        if rc != 0:
            failed.append(str(rc))
    log.close()
    status = "ok" if not failed else f"failed ({', '.join(failed)}): the tests build them again"
    end = time.perf_counter()
    return ("test extensions (beside the build)", status, end - waited,
            f"{len(processes)} built in {end - start:.0f} s from the build's start; test_extensions.log")


def compile_caches(out: str) -> dict:
    """torch.compile's and Triton's on-disk caches, in DIR: the warm-up fills them, the timed
    benchmarks read them."""
    return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(out, "cache", "inductor"),
            "TRITON_CACHE_DIR": os.path.join(out, "cache", "triton")}


class CompileWarmup:
    """Runs the benchmarks that compile baselines once each (one repetition, fusedllm's plain
    path, its build not being done) at the lowest CPU priority while fusedllm builds and the
    tests run, so that their torch.compile graphs and Triton kernels are in the caches when the
    timed runs compile the same functions. `LANES` scripts at a time: compiling is mostly one
    thread's work, and the build's last files leave cores idle. Nothing it measures is kept;
    `finish` stops what still runs when the benchmarks start."""

    LANES = 3

    def __init__(self, out: str, names: list[str], extra: list[str]):
        self.items = sorted((item for item in names if item.partition(":")[0] in COMPILING),
                            key=lambda item: COMPILING.index(item.partition(":")[0]))
        self.out, self.extra = out, extra
        self.lock = threading.Lock()
        self.stopped = False
        self.todo = list(self.items)
        self.running = []
        self.finished = []
        self.log = open(os.path.join(out, "compile_warmup.log"), "w")
        self.start = time.perf_counter()
        self.threads = [threading.Thread(target=self._lane, daemon=True) for _ in range(self.LANES)]
        for thread in self.threads:
            thread.start()

    def _lane(self):
        env = dict(os.environ, **compile_caches(self.out), FUSEDLLM_DISABLE_EXTENSION="1",
                   PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), ROOT,
                                               os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        scratch = os.path.join(self.out, "compile_warmup")
        while True:
            with self.lock:
                if self.stopped or not self.todo:
                    return
                item = self.todo.pop(0)
                name, _, own = item.partition(":")
                cmd = [sys.executable, os.path.join(ROOT, "benchmarks", f"bench_{name}.py"), "--device", "cuda",
                       "--reps", "1", "--out", scratch, *self.extra, *own.split()]
                self.log.write(f"$ {' '.join(cmd)}\n")
                self.log.flush()
                process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
                # lowest priority, set before it starts its compile workers (no preexec_fn: threads)
                try:
                    os.setpriority(os.PRIO_PROCESS, process.pid, 19)
                except ProcessLookupError:  # it has already ended
                    pass
                self.running.append(process)
            rc = process.wait()
            with self.lock:
                self.running.remove(process)
                if not self.stopped:
                    self.finished.append(item if rc == 0 else f"{item} (failed {rc})")

    def finish(self) -> tuple:
        """Stops what is still running; the summary's row. A warm-up cut short or failed only
        leaves the caches colder: the row says how far it got, never failing the check, and has
        no seconds of its own (it ran beside the other parts)."""
        with self.lock:
            self.stopped = True
            for process in self.running:
                if process.poll() is None:
                    process.kill()
        for thread in self.threads:
            thread.join()
        self.log.close()
        return ("compile warm-up (beside the build and tests)", "ok", 0.0,
                f"{len(self.finished)} of {len(self.items)} in {time.perf_counter() - self.start:.0f} s"
                f"{': ' + ', '.join(self.finished) if self.finished else ''}; compile_warmup.log")


def run_tests(out: str, site: str, jobs: int, marker: str, has_xdist: bool, timeout=None) -> tuple[int, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               FUSEDLLM_REQUIRE_EXTENSION="1", OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider", "-rf",
           f"--junitxml={os.path.join(out, 'tests.xml')}", os.path.join(ROOT, "tests")]
    if has_xdist and jobs > 1:
        cmd[4:4] = ["-n", str(jobs)]
    return _run(cmd, os.path.join(out, "tests.log"), env=env, timeout=timeout)


def test_counts(out: str) -> tuple[dict, list[str]]:
    path = os.path.join(out, "tests.xml")
    if not os.path.exists(path):
        return {}, []
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts, failed


def run_benchmarks(out: str, site: str, names: list[str], extra: list[str], timeout: int,
                   deadline: float) -> list[tuple]:
    bench_dir = os.path.join(out, "bench")
    os.makedirs(bench_dir, exist_ok=True)
    env = dict(os.environ, **compile_caches(out), FUSEDLLM_REQUIRE_EXTENSION="1",
               PYTHONPATH=os.pathsep.join([site, ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    results = []
    for item in names:
        name, _, own = item.partition(":")  # "model:--dtype bfloat16": options of that script alone
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", f"bench_{name}.py"), "--device", "cuda",
               "--out", bench_dir, *extra, *own.split()]
        log = f"{name}{'_' + own.replace('-', '').replace(' ', '_') if own else ''}.log"
        left = deadline - time.monotonic()
        if left < 20:
            results.append((item, "skipped", 0.0, "no time left (--time-limit)"))
            continue
        rc, seconds = _run(cmd, os.path.join(bench_dir, log), env=env, timeout=int(min(timeout, left)))
        results.append((item, rc, seconds, f"bench/{log}"))
    return results


def benchmark_summary(out: str) -> list[str]:
    """Per benchmark row: fusedllm's time and its speed against each peer (× > 1: fusedllm faster)."""
    lines = []
    for path in sorted(glob.glob(os.path.join(out, "bench", "*.json"))):
        with open(path) as f:
            data = json.load(f)
        rows = data.get("rows", [])
        if not rows:
            continue
        lines += ["", f"### {data.get('meta', {}).get('benchmark', os.path.basename(path))}", ""]
        peers = sorted({k for row in rows for k, v in row.items()
                        if k.startswith("vs_") and isinstance(v, (int, float))})
        lines.append("| case | fusedllm ms | " + " | ".join(f"× {p[3:]}" for p in peers) + " |")
        lines.append("|---|---|" + "---|" * len(peers))
        for row in rows:
            fused = row.get("fused_ms")
            cells = [f"{row[p]:.2f}" if isinstance(row.get(p), (int, float)) else "" for p in peers]
            lines.append(f"| {row.get('case', '?')} | {fused:.3f} | " if isinstance(fused, (int, float))
                         else f"| {row.get('case', '?')} | | ")
            lines[-1] += " | ".join(cells) + " |"
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for logs, results and the summary")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="build jobs and test processes")
    parser.add_argument("--tests", default="cuda", metavar="MARKERS",
                        help="pytest marker expression (default: every cuda test; 'cuda and not slow' "
                             "leaves out torch.compile and long runs), or 'none'")
    parser.add_argument("--bench", default=",".join(BENCHMARKS),
                        help=f"comma-separated benchmarks, each optionally with its own options after a "
                             f"colon ('model:--dtype bfloat16'), or 'none' (default: {','.join(BENCHMARKS)})")
    parser.add_argument("--bench-args", default="", metavar="ARGS",
                        help="options for every benchmark script, e.g. '--quick' (small sizes) or '--no-compile'")
    parser.add_argument("--bench-timeout", type=int, default=300, help="seconds per benchmark script")
    parser.add_argument("--site", default=None, metavar="DIR",
                        help="test and benchmark the fusedllm installed in DIR (an earlier run's DIR/build/site) "
                             "instead of building")
    parser.add_argument("--time-limit", type=int, default=None, metavar="SECONDS",
                        help="stop the tests and skip benchmarks so that the whole run ends within this, "
                             "summary included")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)

    info, missing = prerequisites()
    with open(os.path.join(out, "environment.txt"), "w") as f:
        f.write("".join(f"{k}: {v}\n" for k, v in info.items()))
    if missing:
        print("gpu_check: cannot run here; nothing was built:\n  - " + "\n  - ".join(missing), file=sys.stderr)
        return 2

    deadline = time.monotonic() + (args.time_limit or 10**9)
    parts = []  # (part, status, seconds, detail)
    if args.site:
        site = os.path.abspath(args.site)
        rc = 0 if os.path.isdir(os.path.join(site, "fusedllm")) else 2
        parts.append(("build", "given" if rc == 0 else "failed (no fusedllm in --site)", 0.0, site))
    names = [] if args.bench == "none" else [n.strip() for n in args.bench.split(",") if n.strip()]
    extra = args.bench_args.split()
    warmup = None
    if not args.site:
        warmup = CompileWarmup(out, names, extra) if "--no-compile" not in extra else None
        # The tests' own extensions (check kernels over the same device code) build beside fusedllm's build.
        extensions = start_test_extensions(out) if args.tests != "none" else None
        rc, seconds, site = build(out, info["arch"], args.jobs, info["nvcc path"])
        parts.append(("build", "ok" if rc == 0 else f"failed ({rc})", seconds, f"sm_{info['arch'].replace('.', '')}"))
        if extensions is not None:
            parts.append(finish_test_extensions(*extensions, deadline))
    if rc != 0:
        if warmup is not None:
            warmup.finish()
        if not args.site:
            print(_tail(os.path.join(out, "build.log")), file=sys.stderr)
    else:
        if args.tests != "none":
            rc, seconds = run_tests(out, site, args.jobs, args.tests, "no xdist" not in info,
                                    timeout=max(30, int(deadline - time.monotonic() - 30)) if args.time_limit else None)
            counts, failed = test_counts(out)
            detail = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failures", "errors", "skipped") if counts.get(k)) \
                if counts else "no report (see tests.log)"
            status = "ok" if rc == 0 else "timed out" if rc == 124 else f"failed ({rc})"
            parts.append((f"tests ({args.tests})", status, seconds, detail))
        if warmup is not None:
            parts.append(warmup.finish())
        for name, rc, seconds, log in run_benchmarks(out, site, names, extra, args.bench_timeout, deadline):
            status = rc if isinstance(rc, str) else "ok" if rc == 0 else "timed out" if rc == 124 else f"failed ({rc})"
            parts.append((f"bench {name}", status, seconds, log))

    lines = [f"# fusedllm GPU check, {info['date']}", ""]
    lines += [f"- {k}: {v}" for k, v in info.items() if k != "date"]
    lines += ["", "| part | status | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {p} | {s} | {t:.0f} | {d} |" for p, s, t, d in parts]
    lines.append(f"| total | | {sum(t for _, _, t, _ in parts):.0f} | |")
    if len(parts) > 1:
        _, failed = test_counts(out)
        if failed:
            lines += ["", f"Failed tests ({len(failed)}):"] + [f"- {name}" for name in failed[:40]]
        lines += benchmark_summary(out)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all(s in ("ok", "given") for _, s, _, _ in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
