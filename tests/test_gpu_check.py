"""benchmarks/gpu_check.py's own flow (build, tests, benchmarks, summary) without a GPU: its
parts are replaced by stand-ins that write what the real ones write."""

import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks import gpu_check, gpu_profile

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3" failures="1"
errors="0" skipped="1"><testcase classname="tests.test_a" name="test_ok"/><testcase classname="tests.test_a"
name="test_bad"><failure message="x"/></testcase><testcase classname="tests.test_a" name="test_skip">
<skipped/></testcase></testsuite></testsuites>"""


@pytest.fixture
def stand_ins(monkeypatch, tmp_path):
    calls = {"build": 0, "tests": [], "bench": [], "extensions": 0}
    info = {"python": "python3", "GPU": "a stand-in", "arch": "9.0", "nvcc path": "nvcc", "date": "2000-01-01"}
    monkeypatch.setattr(gpu_check, "prerequisites", lambda: (dict(info), []))

    def build(out, arch, jobs, nvcc):
        calls["build"] += 1
        site = os.path.join(out, "build", "site")
        os.makedirs(os.path.join(site, "fusedllm"))
        return 0, 1.0, site

    def run_tests(out, site, jobs, marker, has_xdist, timeout=None):
        calls["tests"].append((site, marker))
        with open(os.path.join(out, "tests.xml"), "w") as f:
            f.write(REPORT)
        return 1, 2.0

    def run(cmd, log_path, env=None, timeout=None, cwd=None):
        calls["bench"].append(cmd)
        bench = cmd[cmd.index("--out") + 1]
        name = os.path.basename(cmd[1])[len("bench_"):-len(".py")]
        with open(os.path.join(bench, f"{name}.json"), "w") as f:
            json.dump({"meta": {"benchmark": name}, "rows": [{"case": "c1", "fused_ms": 0.5, "vs_liger": 1.25}]}, f)
        return 0, 3.0

    def start_test_extensions(out):
        calls["extensions"] += 1
        return [], open(os.path.join(out, "test_extensions.log"), "w"), time.perf_counter()

    class CompileWarmup:
        def __init__(self, out, names, extra):
            calls["warmup"] = (names, extra)

        def finish(self):
            return ("compile warm-up (beside the build and tests)", "ok", 0.0, "stand-in")

    monkeypatch.setattr(gpu_check, "CompileWarmup", CompileWarmup)
    monkeypatch.setattr(gpu_check, "start_test_extensions", start_test_extensions)
    monkeypatch.setattr(gpu_check, "build", build)
    monkeypatch.setattr(gpu_check, "run_tests", run_tests)
    monkeypatch.setattr(gpu_check, "_run", run)
    return calls, tmp_path


def test_the_whole_flow_writes_a_summary_of_every_part(stand_ins, capsys):
    calls, tmp = stand_ins
    rc = gpu_check.main(["--out", str(tmp / "out"), "--bench", "rms_norm,model:--dtype bfloat16"])
    assert rc == 1  # one test failed
    assert calls["build"] == 1 and calls["tests"][0][1] == "cuda"
    assert [os.path.basename(c[1]) for c in calls["bench"]] == ["bench_rms_norm.py", "bench_model.py"]
    assert calls["bench"][1][-2:] == ["--dtype", "bfloat16"]
    summary = (tmp / "out" / "summary.md").read_text()
    assert capsys.readouterr().out.strip() == summary.strip()  # printed last
    assert "| build | ok | 1 | sm_90 |" in summary and calls["extensions"] == 1
    assert "| test extensions (beside the build) | ok | 0 |" in summary
    assert calls["warmup"] == (["rms_norm", "model:--dtype bfloat16"], [])
    assert "| compile warm-up (beside the build and tests) | ok | 0 | stand-in |" in summary
    assert "| tests (cuda) | failed (1) | 2 | 1 passed, 1 failures, 1 skipped |" in summary
    assert "| bench rms_norm | ok | 3 |" in summary and "| total | | 9 | |" in summary
    assert "- tests.test_a::test_bad" in summary
    assert "| c1 | 0.500 | 1.25 |" in summary


def test_a_given_build_is_not_rebuilt_and_none_skips_a_part(stand_ins):
    calls, tmp = stand_ins
    site = tmp / "site"
    (site / "fusedllm").mkdir(parents=True)
    rc = gpu_check.main(["--out", str(tmp / "out"), "--site", str(site), "--tests", "none", "--bench", "rope"])
    assert rc == 0 and calls["build"] == 0 and calls["tests"] == [] and calls["extensions"] == 0
    assert len(calls["bench"]) == 1
    assert "| build | given | 0 |" in (tmp / "out" / "summary.md").read_text()
    assert gpu_check.main(["--out", str(tmp / "out2"), "--site", str(tmp / "nothing"), "--bench", "none"]) == 1
    assert "no fusedllm in --site" in (tmp / "out2" / "summary.md").read_text()


def test_no_benchmark_starts_past_the_time_limit(stand_ins):
    calls, tmp = stand_ins
    gpu_check.main(["--out", str(tmp / "out"), "--bench", "rms_norm,rope", "--time-limit", "10"])
    assert calls["bench"] == []  # under 20 s left: each is skipped, the summary still written
    assert "| bench rope | skipped | 0 | no time left (--time-limit) |" in (tmp / "out" / "summary.md").read_text()


def test_the_compile_warmup_runs_the_compiling_benchmarks_once_and_stops_when_told(monkeypatch, tmp_path):
    """Each benchmark with torch.compile baselines runs once (one repetition, the options
    given, fusedllm's plain path, the caches the timed runs read); the one still running when
    the benchmarks start is stopped, and neither that nor a failure fails the check."""
    root, record = tmp_path / "root", tmp_path / "record"
    (root / "benchmarks").mkdir(parents=True)
    script = ("import os, sys\n"
              f"open({str(record)!r}, 'a').write(' '.join(sys.argv[1:] + [os.environ['FUSEDLLM_DISABLE_EXTENSION'],"
              " os.environ['TORCHINDUCTOR_CACHE_DIR']]) + '\\n')\n")
    (root / "benchmarks" / "bench_rms_norm.py").write_text(script + "sys.exit(3)\n")
    (root / "benchmarks" / "bench_model.py").write_text(script + "import time; time.sleep(60)\n")
    monkeypatch.setattr(gpu_check, "ROOT", str(root))
    out = tmp_path / "out"
    out.mkdir()
    warmup = gpu_check.CompileWarmup(str(out), ["model:--dtype bfloat16", "decode", "rms_norm"], ["--quick"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(record.read_text().splitlines() if record.exists() else []) < 2:
        time.sleep(0.05)
    start = time.perf_counter()
    part, status, seconds, detail = warmup.finish()
    assert time.perf_counter() - start < 30  # the sleeping one was stopped
    # decode has no compile baseline: not run; RMSNorm, whose compiles take longer, started first
    started = [line for line in (out / "compile_warmup.log").read_text().splitlines() if line.startswith("$ ")]
    assert [line.split()[2].rsplit("/", 1)[1] for line in started] == ["bench_rms_norm.py", "bench_model.py"]
    cache = str(out / "cache" / "inductor")
    assert sorted(record.read_text().splitlines()) == [
        f"--device cuda --reps 1 --out {out / 'compile_warmup'} --quick --dtype bfloat16 1 {cache}",
        f"--device cuda --reps 1 --out {out / 'compile_warmup'} --quick 1 {cache}"]
    assert (part, status, seconds) == ("compile warm-up (beside the build and tests)", "ok", 0.0)
    assert detail.startswith("1 of 2 in ") and detail.endswith(": rms_norm (failed 3); compile_warmup.log")


def test_extension_builds_past_the_time_limit_are_stopped(tmp_path):
    """The wait for the tests' extensions ends at the deadline: what is still
    building is stopped (the tests would build it again) and the row says so."""
    log = open(tmp_path / "log", "w")
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    start = time.perf_counter()
    part, status, seconds, detail = gpu_check.finish_test_extensions([slow], log, start, time.monotonic() + 1)
    assert slow.poll() is not None and seconds < 30
    assert part == "test extensions (beside the build)" and status.startswith("failed (stopped (--time-limit))")


# An excerpt of ncu's text report as Nsight Compute printed it for the Hopper forward (H200).
NCU_REPORT = "\n".join([
    '==PROF== Profiling "attention_hopper_forward_kernel": 0%....50%....100% - 17 passes',
    "  void unnamed>::attention_hopper_forward_kernel<BFloat16, 128, 1>(TensorMap, TensorMap, TensorMap, T1 *, "
    "float *, QueryRows, Seqs, int, float, Mask, unnamed>::WorkItems) (132, 1, 1)x(384, 1, 1), Context 1, Stream 7",
    "    Section: Command line profiler metrics",
    "    smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio                   inst         0.39",
    "    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio           inst         0.99",
    "    smsp__average_warps_issue_stalled_selected_per_issue_active.ratio                  inst         1.00",
    "    smsp__average_warps_issue_stalled_wait_per_issue_active.ratio                      inst         0.92",
    "    Duration                         ms         1.07",
    "    Eligible Warps Per Scheduler        warp         0.65",
    "    Warp Cycles Per Issued Instruction             cycle         5.18",
])


def test_the_profile_table_reads_ncu_reports():
    kernels = gpu_profile.parse_report(NCU_REPORT)
    assert kernels == [{"kernel": "attention_hopper_forward_kernel", "duration_us": 1070.0, "eligible": 0.65,
                        "cycles_per_issue": 5.18,
                        "stalls": {"barrier": 0.39, "long_scoreboard": 0.99, "selected": 1.0, "wait": 0.92}}]
    row = gpu_profile.stall_table(kernels).splitlines()[2]
    assert row == "| attention_hopper_forward_kernel | 1070 | 5.18 | 0.65 | long_scoreboard 0.99, wait 0.92, barrier 0.39 |"


def test_the_profile_refuses_an_unknown_workload(capsys):
    with pytest.raises(SystemExit):
        gpu_profile.main(["--out", "unused", "--ncu", "ncu", "--workloads", "train,nothing"])
    assert "unknown nothing" in capsys.readouterr().err
