"""Nsight Compute's view of fusedllm's attention kernels on this machine's GPU, in one command.

    python3 benchmarks/gpu_profile.py --out DIR [--ncu PATH] [--workloads train,decode]

Profiles one launch of each kernel of two workloads, with ncu's speed-of-light, scheduler and
occupancy sections and the warp-stall reasons (cycles a warp waits per instruction it issues):
`train`, a causal bfloat16 attention forward and backward (batch 2, 32 query / 8 kv heads, head
dim 128, 4096 positions), and `decode`, one decoding step over a long bfloat16 cache (batch 8,
32 / 8 heads, 32768 keys). Writes ncu's report of each to DIR/ncu_<workload>.txt and a table of
every kernel's duration and largest stalls to DIR/stalls.md, printed last. Run it against the
fusedllm that Python imports (PYTHONPATH=DIR/build/site after gpu_check.py).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys

STALLS = ["barrier", "branch_resolving", "dispatch_stall", "drain", "lg_throttle", "long_scoreboard",
          "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction", "not_selected",
          "short_scoreboard", "sleeping", "tex_throttle", "wait"]
METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
SECTIONS = ["SpeedOfLight", "WarpStateStats", "SchedulerStats", "Occupancy"]
# workload: (kernel name filter, launches to skip, launches to profile): the second iteration's
# forward, dQ and dK/dV (the Hopper kernels on an sm_90, the mma.sync ones elsewhere), decoding step.
WORKLOADS = {"train": ("regex:attention_(hopper|mma)_(forward|dq|dkdv)_kernel", 3, 3),
             "decode": ("regex:attention_decode", 1, 1)}


def run_workload(name: str) -> None:
    """The calls ncu profiles: three iterations, so that the second one's launches are warm."""
    import torch

    import fusedllm

    torch.manual_seed(0)
    if name == "train":
        q = torch.randn(2, 32, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(2, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        for _ in range(3):
            fusedllm.attention(q, k, v, causal=True).sum().backward()
    else:
        q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(8, 8, 32768, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for _ in range(3):
            fusedllm.attention(q, k, v, causal=True)
    torch.cuda.synchronize()


def parse_report(text: str) -> list[dict]:
    """Per profiled kernel of an ncu text report: its name, duration (µs), cycles between a warp's
    instructions, eligible warps a scheduler, and the stall reasons (cycles per issued instruction)."""
    kernels = []
    for line in text.splitlines():
        launch = re.match(r"\s{2}(?:void )?(?:\S+::)?(\w+)(?:<[^(]*>)?\(.*\)x\(", line)
        if launch:
            kernels.append({"kernel": launch.group(1), "stalls": {}})
            continue
        if not kernels:
            continue
        fields = line.split()
        if len(fields) >= 3 and fields[0].startswith("smsp__average_warps_issue_stalled_"):
            reason = fields[0][len("smsp__average_warps_issue_stalled_"):-len("_per_issue_active.ratio")]
            kernels[-1]["stalls"][reason] = float(fields[-1].replace(",", ""))
        elif line.strip().startswith("Duration"):
            scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[fields[-2]]
            kernels[-1]["duration_us"] = float(fields[-1].replace(",", "")) * scale
        elif line.strip().startswith("Warp Cycles Per Issued Instruction"):
            kernels[-1]["cycles_per_issue"] = float(fields[-1].replace(",", ""))
        elif line.strip().startswith("Eligible Warps Per Scheduler"):
            kernels[-1]["eligible"] = float(fields[-1].replace(",", ""))
    return kernels


def stall_table(kernels: list[dict], top: int = 5) -> str:
    lines = ["| kernel | µs | cycles between issues | eligible warps / scheduler "
             "| largest stalls (cycles per issue) |", "|---|---|---|---|---|"]
    for k in kernels:
        waits = sorted(((v, r) for r, v in k["stalls"].items() if r != "selected"), reverse=True)[:top]
        lines.append(f"| {k['kernel']} | {k.get('duration_us', float('nan')):.0f} | "
                     f"{k.get('cycles_per_issue', float('nan')):.2f} | {k.get('eligible', float('nan')):.2f} | "
                     + ", ".join(f"{r} {v:.2f}" for v, r in waits) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the reports and stalls.md")
    parser.add_argument("--ncu", default=None, help="Nsight Compute's ncu (default: on PATH or in /usr/local/cuda*)")
    parser.add_argument("--workloads", default="train,decode", help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--run", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)  # what ncu launches
    args = parser.parse_args(argv)
    if args.run:
        run_workload(args.run)
        return 0
    if not args.out:
        parser.error("--out is required")
    ncu = args.ncu or shutil.which("ncu") or next(
        (p for p in sorted(glob.glob("/usr/local/cuda*/bin/ncu") + glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
         if os.access(p, os.X_OK)), None)
    if ncu is None:
        print("gpu_profile: Nsight Compute's ncu was not found (put it on PATH or pass --ncu)", file=sys.stderr)
        return 2
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {', '.join(unknown)} (known: {', '.join(WORKLOADS)})")
    os.makedirs(args.out, exist_ok=True)
    kernels = []
    for name in names:
        kernel_filter, skip, count = WORKLOADS[name]
        cmd = [ncu, "--clock-control", "none", *(f"--section={s}" for s in SECTIONS),
               "--metrics", ",".join(METRIC.format(r) for r in STALLS + ["selected"]),
               "-k", kernel_filter, "--launch-skip", str(skip), "--launch-count", str(count),
               sys.executable, os.path.abspath(__file__), "--run", name]
        done = subprocess.run(cmd, capture_output=True, text=True)
        report = os.path.join(args.out, f"ncu_{name}.txt")
        with open(report, "w") as f:
            f.write(done.stdout + done.stderr)
        if done.returncode != 0:
            print(f"gpu_profile: ncu failed on {name} ({done.returncode}); see {report}", file=sys.stderr)
            return 1
        kernels += parse_report(done.stdout)
    table = stall_table(kernels)
    with open(os.path.join(args.out, "stalls.md"), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
