"""Timing and reporting shared by the benchmark scripts.

Candidates are timed in one process, interleaved (each repetition runs every
candidate once, in turn), after warm-up; we report medians, ratios and the
achieved bandwidth against a copy timed among them. On a GPU the same
code times with CUDA events.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

if "--thp" in sys.argv:
    # Read by torch's CPU allocator at its first allocation, so this module is
    # imported before torch: large tensors then get 2 MB pages, which cuts the
    # page faults every freshly allocated output pays.
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"

import torch  # noqa: E402

# peak_memory_bytes is shared with the tests
_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)
from checks import peak_memory_bytes  # noqa: E402,F401

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
    inputs' gradients first (module parameters accumulate, as in training)."""
    def run():
        for t in inputs:
            t.grad = None
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


def standard_arguments(doc: str, argv=None):
    """The options every benchmark script takes: --quick, --device, --no-compile, --reps."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, fewer repetitions")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per candidate")
    parser.add_argument("--thp", action="store_true",
                        help="THP_MEM_ALLOC_ENABLE=1: 2 MB pages for large CPU tensors "
                             "(read before torch allocates; the scripts check sys.argv early)")
    return parser.parse_args(argv)


def thp_enabled() -> bool:
    return os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    text = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return text + (", THP_MEM_ALLOC_ENABLE=1" if thp_enabled() else "")


@dataclass
class Report:
    """Rows of results; written as JSON, a markdown table and a PNG."""

    name: str
    device: str
    rows: list = field(default_factory=list)

    def add(self, **row) -> None:
        self.rows.append(row)

    def write(self, columns: list[tuple[str, str, str]], plot_key: str, plot_label: str,
              results_dir: str = RESULTS_DIR, suffix: str = "") -> dict:
        """columns: (key, header, format). Returns the paths written."""
        os.makedirs(results_dir, exist_ok=True)
        base = os.path.join(results_dir, f"{self.name}{suffix}{'_thp' if thp_enabled() else ''}")
        meta = {
            "benchmark": self.name,
            "device": self.device,
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
        }
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
        self._plot(base + ".png", plot_key, plot_label)
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
