"""Timing, rooflines, reporting and the command line shared by the benchmark scripts.

Candidates are timed in one process, interleaved (each repetition runs every
candidate once, in turn), after warm-up; we report medians, ratios and the
achieved bandwidth against a copy timed among them. On a GPU the same
code times with CUDA events.

A script declares a :class:`Benchmark` (its cases, table columns and plot) and
calls :func:`run`, which parses the options every script takes, describes the
machine, runs the cases and writes ``results/<name>.json``, ``.md`` (the table
that ``readme_tables.py`` copies between README.md's ``<!-- bench:<name> -->``
markers) and ``.png``; ``--quick`` runs small sizes and writes
``results/<name>_quick.*`` instead, which git ignores. On a GPU the names
take ``_cuda`` (``results/<name>_cuda.md``), beside the CPU results;
``--out DIR`` writes them into DIR instead of ``results/``.

Peers that may be missing: :func:`liger` gives Liger-Kernel where it imports
and the device is CUDA (its kernels are Triton), else None, and the scripts
then time it beside their own candidates. A table leaves out the columns that
no row fills, so a peer that was not measured has no column.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

if "--thp" in sys.argv:
    # Read by torch's CPU allocator at its first allocation, so this module is
    # imported before torch: large tensors then get 2 MB pages, which cuts the
    # page faults every freshly allocated output pays.
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"

import torch  # noqa: E402

import fusedllm  # noqa: E402

_UNSET = object()
_liger = _UNSET

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn, device: torch.device) -> float:
    """Seconds for one call of fn (CUDA events on a GPU, wall clock on a CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_medians(candidates: dict, device: torch.device, reps: int, warmup: int = 3,
                        min_seconds: float = 0.0) -> dict:
    """Median seconds per call for each named zero-argument callable.

    Runs at least `reps` rounds, more until `min_seconds` of total timing.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    samples = {name: [] for name in candidates}
    start = time.perf_counter()
    rounds = 0
    while rounds < reps or time.perf_counter() - start < min_seconds:
        for name, fn in candidates.items():
            samples[name].append(time_once(fn, device))
        rounds += 1
        if rounds >= 20 * reps:
            break
    return {name: statistics.median(s) for name, s in samples.items()}


def forward_only(fn, *inputs):
    """A zero-argument callable running fn(*inputs) without autograd."""
    def run():
        with torch.no_grad():
            fn(*inputs)
    return run


def forward_backward(fn, inputs, grad):
    """A zero-argument callable running fn(*inputs).backward(grad), clearing the
    inputs' gradients first (module parameters accumulate, as in training).
    With a tuple of gradients, fn returns as many outputs, each backpropagating
    its own."""
    def run():
        for t in inputs:
            t.grad = None
        if isinstance(grad, (tuple, list)):
            torch.autograd.backward(fn(*inputs), tuple(grad))
        else:
            fn(*inputs).backward(grad)
    return run


def copy_candidate(nbytes: int, device: torch.device):
    """`dst.copy_(src)` of nbytes between preallocated buffers: the bandwidth
    roofline, timed among the candidates so it sees the same machine load.
    Returns the callable and the bytes it moves per call (read + write)."""
    src = torch.empty(max(1, nbytes // 4), dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * src.numel() * 4


def clone_candidate(nbytes: int, device: torch.device):
    """`src.clone()` of nbytes: the same copy into freshly allocated memory, the
    roofline for an op that returns a fresh output (on a CPU, writing fresh
    pages first costs a page fault each). Returns the callable and the bytes it
    moves per call (read + write)."""
    src = torch.empty(max(1, nbytes // 4), dtype=torch.float32, device=device).uniform_()
    return (lambda: src.clone()), 2 * src.numel() * 4


class Roofline:
    """Memory-bandwidth rooflines timed among an op's candidates, as candidates
    themselves so that they see the same machine load.

    "copy" is ``dst.copy_(src)`` of ``nbytes`` between preallocated buffers;
    "clone" the same copy into freshly allocated memory (what any op returning a
    new tensor pays: on a CPU each fresh page faults the first time it is
    written). ``calls`` maps each name to its zero-argument callable, ``work``
    to the bytes one call moves (read + write)."""

    MAKERS = {"copy": copy_candidate, "clone": clone_candidate}

    def __init__(self, nbytes: int, device: torch.device, kinds=("copy", "clone")):
        self.calls, self.work = {}, {}
        for kind in kinds:
            self.calls[kind], self.work[kind] = self.MAKERS[kind](nbytes, device)


def roofline_row(work: float, times: dict, roofs: dict | None = None, subject: str = "fusedllm",
                 key: str = "fused", unit: str = "gbps", pct_prefix: str = "") -> dict:
    """Table fields for `work` units (bytes moved, or FLOPs) per call of
    candidate `subject`, from the median seconds in `times`:
    ``{key}_{unit}``, its rate in G units per second (GB/s, GFLOP/s); and for
    each measured roof in `roofs` (name -> work per call, timed under that
    name in `times`): ``{name}_{unit}``, the roof's own rate, and
    ``{pct_prefix}pct_{name}``, `subject`'s rate as a percentage of it."""
    rate = work / times[subject]
    row = {f"{key}_{unit}": rate / 1e9}
    for name, roof_work in (roofs or {}).items():
        roof_rate = roof_work / times[name]
        row[f"{name}_{unit}"] = roof_rate / 1e9
        row[f"{pct_prefix}pct_{name}"] = 100 * rate / roof_rate
    return row


def liger(device: torch.device, args=None):
    """The ``liger_kernel`` package when it imports and `device` is CUDA, else
    None (also with ``--no-liger``). Its kernels are Triton, so on a CPU it is
    not even imported: the scripts run there without it installed."""
    global _liger
    if device.type != "cuda" or (args is not None and getattr(args, "no_liger", False)):
        return None
    if _liger is _UNSET:
        try:
            import liger_kernel
            import liger_kernel.transformers  # noqa: F401  (the modules and functions a user patches with)
            import liger_kernel.transformers.functional  # noqa: F401
            _liger = liger_kernel
        except Exception as exc:  # not installed, or its triton does not load
            print(f"Liger-Kernel not measured: {type(exc).__name__}: {exc}", flush=True)
            _liger = None
    return _liger


def liger_version() -> str | None:
    """The installed Liger-Kernel's version, once :func:`liger` has imported it."""
    if _liger is _UNSET or _liger is None:
        return None
    try:
        from importlib.metadata import version
        return version("liger-kernel")
    except Exception:
        return getattr(_liger, "__version__", "unknown")


# Loose: a peer's kernel orders its float32 sums differently and rounds
# bfloat16 / float16 at other points; this catches a wrong layout or formula,
# not the last bits.
PEER_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
PEER_TOLERANCE_LOW_PRECISION = 6e-2


def agreement(ref, got) -> tuple[float, bool]:
    """(max |ref - got| over tensors or tuples of tensors, whether they are
    close at a loose tolerance for their dtype). Reported, not asserted."""
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    gots = got if isinstance(got, (tuple, list)) else (got,)
    diffs, close = [0.0], len(refs) == len(gots)
    for a, b in zip(refs, gots):
        tol = PEER_TOLERANCE.get(a.dtype, PEER_TOLERANCE_LOW_PRECISION)
        a, b = a.detach().double(), b.detach().double()
        if a.shape != b.shape:
            diffs.append(float("inf"))
            close = False
            continue
        diffs.append((a - b).abs().max().item() if a.numel() else 0.0)
        close = close and torch.allclose(a, b, rtol=tol, atol=tol)
    # a NaN anywhere shows as NaN (Python's max() would skip it)
    return (float("nan") if any(d != d for d in diffs) else max(diffs)), close


def liger_notes(rows: list, what: str, diff_keys=("liger_diff",)) -> list[str]:
    """Lines for under a table: which Liger-Kernel was measured and how, and the
    rows where its result disagrees with fusedllm's. Empty without Liger rows."""
    measured = [row for row in rows if row.get("liger_ms") is not None]
    if not measured:
        return []
    lines = [f"Liger-Kernel {liger_version()}: {what}; × Liger is Liger's time over fusedllm's "
             f"(above 1: fusedllm faster)."]
    for row in measured:
        if not row.get("liger_close", True):
            diffs = ", ".join(f"{k} {row[k]:.2e}" for k in diff_keys if row.get(k) is not None)
            lines.append(f"{row['case']}: Liger's result differs from fusedllm's beyond the loose "
                         f"tolerance ({diffs})")
    return lines


def dtype_name(dtype: torch.dtype) -> str:
    """float32, bfloat16, ...: how the case labels write a dtype."""
    return str(dtype).replace("torch.", "")


def standard_arguments(doc: str, argv=None, options: Callable | None = None):
    """The options every benchmark script takes (--quick, --device, --no-compile,
    --no-liger, --reps, --out, --thp), plus those `options(parser)` adds."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, fewer repetitions")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    parser.add_argument("--no-liger", action="store_true",
                        help="skip Liger-Kernel (measured by default where it imports and the device is CUDA)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per candidate")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help=f"write the json, md and png into DIR (created) instead of {RESULTS_DIR}")
    parser.add_argument("--thp", action="store_true",
                        help="THP_MEM_ALLOC_ENABLE=1: 2 MB pages for large CPU tensors "
                             "(read before torch allocates; harness checks sys.argv when imported)")
    if options is not None:
        options(parser)
    return parser.parse_args(argv)


def thp_enabled() -> bool:
    return os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"


def cpu_model() -> str:
    """The processor's marketing name where the system gives one (Linux
    /proc/cpuinfo, macOS sysctl), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")) and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip() or platform.machine()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    text = f"{cpu_model()} ({platform.machine()}), {torch.get_num_threads()} threads"
    return text + (", THP_MEM_ALLOC_ENABLE=1" if thp_enabled() else "")


def speed_and_peak_plot(rows: list, names, path, title: str, baseline: str) -> None:
    """Two bar charts per case: each candidate's speed over "eager" (rows'
    "<name>_ms") and its peak memory ("<name>_peak_mb"); a candidate missing
    from a row shows no bar there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        speed = [row["eager_ms"] / row[f"{name}_ms"] if f"{name}_ms" in row else 0 for row in rows]
        peak = [row.get(f"{name}_peak_mb", 0) for row in rows]
        xs = [j + i * width for j in range(len(rows))]
        axes[0].bar(xs, speed, width, label=name)
        axes[1].bar(xs, peak, width, label=name)
    for ax in axes:
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(rows))])
        ax.set_xticklabels([row["case"] for row in rows], rotation=30, ha="right", fontsize=7)
        ax.legend(fontsize=7)
    axes[0].axhline(1.0, color="gray", lw=1, ls="--")
    axes[0].set_ylabel(f"speed over {baseline} (higher is better)")
    axes[1].set_ylabel("peak MiB (lower is better)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class Report:
    """Rows of results; written as JSON, a markdown table and a PNG."""

    name: str
    device: str
    rows: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def add(self, **row) -> None:
        self.rows.append(row)

    def write(self, columns: list[tuple[str, str, str]], plot_key: str, plot_label: str,
              results_dir: str = RESULTS_DIR, suffix: str = "", plot: Callable | None = None,
              notes: list[str] = ()) -> dict:
        """columns: (key, header, format). `plot(rows, path, device)` replaces
        the bar chart of `plot_key`; `notes` become a list under the table. Returns
        the paths written and the table."""
        os.makedirs(results_dir, exist_ok=True)
        base = os.path.join(results_dir, f"{self.name}{suffix}{'_thp' if thp_enabled() else ''}")
        meta = {
            "benchmark": self.name,
            "device": self.device,
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            **self.meta,
        }
        # a column no row fills (a peer not measured here, compile with --no-compile) is left out
        columns = [c for c in columns if any(row.get(c[0]) is not None for row in self.rows)]
        with open(base + ".json", "w") as f:
            json.dump({"meta": meta, "rows": self.rows}, f, indent=2)
        lines = [f"| {' | '.join(h for _, h, _ in columns)} |",
                 f"|{'|'.join('---' for _ in columns)}|"]
        for row in self.rows:
            cells = []
            for key, _, fmt in columns:
                value = row.get(key)
                cells.append("" if value is None else format(value, fmt))
            lines.append(f"| {' | '.join(cells)} |")
        table = "\n".join(lines) + "\n"
        with open(base + ".md", "w") as f:
            f.write(f"{self.name} on {self.device}, torch {torch.__version__}, {meta['date']}\n\n")
            f.write(table)
            if notes:
                f.write("\n" + "\n".join(f"- {line}" for line in notes) + "\n")
        if plot is None:
            self._plot(base + ".png", plot_key, plot_label)
        else:
            plot(self.rows, base + ".png", self.device)
        return {"json": base + ".json", "md": base + ".md", "png": base + ".png", "table": table}

    def _plot(self, path: str, key: str, label: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [row["case"] for row in self.rows]
        values = [row.get(key) or 0.0 for row in self.rows]
        fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(labels)), 4))
        ax.bar(range(len(values)), values, color="#3b7dd8")
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=40, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.set_title(f"{self.name} ({self.device})")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


@dataclass
class Benchmark:
    """What a benchmark script declares; :func:`run` does the rest.

    cases(args, device) yields the table's rows (dicts with a "case" label),
    measuring as it goes; args holds the standard options (args.quick,
    args.reps, args.no_compile, ...) and those `options(parser)` adds.
    columns: (row key, header, format) of the markdown table. The PNG is a bar
    chart of `plot_key` per case unless `plot(rows, path, device)` draws it
    (device: the machine's description);
    `notes(rows)` gives lines listed under the table. `describe(row)` is the
    line printed as each row arrives."""

    name: str
    doc: str
    cases: Callable[[argparse.Namespace, torch.device], Iterable[dict]]
    columns: list
    plot_key: str
    plot_label: str
    describe: Callable[[dict], str] | None = None
    options: Callable[[argparse.ArgumentParser], None] | None = None
    plot: Callable | None = None
    notes: Callable[[list], list] | None = None


def run(bench: Benchmark, argv=None) -> Report:
    """Parse the command line, run the cases, write results/<name>[_cuda][_quick].*
    (or into --out DIR) and print the table."""
    args = standard_arguments(bench.doc, argv, bench.options)
    device = torch.device(args.device)
    torch.manual_seed(0)
    machine = machine_description(device)
    print(f"fusedllm {fusedllm.backend()} on {machine}", flush=True)
    report = Report(bench.name, machine)
    for row in bench.cases(args, device):
        report.add(**row)
        if bench.describe is not None:
            print(f"  {bench.describe(row)}", flush=True)
    notes = bench.notes(report.rows) if bench.notes is not None else []
    # GPU results sit beside the CPU ones: <name>_cuda.md
    suffix = ("_cuda" if device.type == "cuda" else "") + ("_quick" if args.quick else "")
    if liger_version() is not None:
        report.meta["liger_kernel"] = liger_version()
    paths = report.write(bench.columns, bench.plot_key, bench.plot_label,
                         results_dir=args.out or RESULTS_DIR, suffix=suffix, plot=bench.plot, notes=notes)
    print(f"\nwrote {paths['json']}, {paths['md']}, {paths['png']}\n")
    print(paths["table"])
    if notes:
        print("\n".join(notes))
    return report
