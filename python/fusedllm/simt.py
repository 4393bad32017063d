"""fusedllm's CUDA kernels executed on the CPU by a SIMT emulator.

``fusedllm._simt`` is built from the same ``csrc/cuda/*.cu`` sources as the
CUDA extension, by the host compiler: each block's threads run as fibers,
``__syncthreads`` is a block barrier, warp shuffles are rendezvous of the
warp's lanes, shared memory is per block, and the real host code of each op
(its plan, pack widths, grid and shared-memory sizes) runs unchanged. Its ops
are ``torch.ops.fusedllm_simt.<op>``, with the schemas of
``torch.ops.fusedllm.<op>``, on CPU tensors.

    import fusedllm, fusedllm.simt
    with fusedllm.simt.kernels(schedule="warp"):
        y = fusedllm.rms_norm(x, w)     # x on the CPU: the CUDA kernel runs, emulated
        y.sum().backward()              # so does the backward kernel

Schedules (the order in which a block's threads take turns between sync
points): ``lockstep`` (round-robin in thread order, the default), ``reverse``,
``random``, and warp-at-a-time ``warp``, ``warp-reverse``, ``warp-random``
(one warp runs until all its lanes wait at a barrier: what exposes a missing
``__syncthreads``). ``FUSEDLLM_SIMT_SCHEDULE``, ``FUSEDLLM_SIMT_WORKERS`` (OS
threads running blocks at once), ``FUSEDLLM_SIMT_SMS`` (the emulated SM count,
4 by default so grid-stride loops wrap) and ``FUSEDLLM_SIMT_SEED`` set the
defaults; ``FUSEDLLM_SIMT_LIBRARY`` loads another build of the extension (the
sanitizer build of ``make sanitize``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import _fake

SCHEDULES = ("lockstep", "reverse", "random", "warp", "warp-reverse", "warp-random")


def _load():
    path = os.environ.get("FUSEDLLM_SIMT_LIBRARY")
    if path:
        spec = importlib.util.spec_from_file_location("fusedllm._simt", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"FUSEDLLM_SIMT_LIBRARY={path!r} is not a loadable extension")
        module = importlib.util.module_from_spec(spec)
        sys.modules["fusedllm._simt"] = module
        spec.loader.exec_module(module)
        return module
    try:
        from . import _simt
    except ImportError as exc:
        raise ImportError(
            "fusedllm.simt needs the emulated CUDA kernels (fusedllm._simt), which this build "
            "does not have. `make build` builds them; by hand: pip install --no-build-isolation "
            f"-C cmake.define.FUSEDLLM_SIMT=ON -e .  ({exc})") from exc
    return _simt


_simt = _load()
_fake.register_fakes("fusedllm_simt")
if os.environ.get("FUSEDLLM_SIMT_SEED"):
    _simt.set_random_seed(int(os.environ["FUSEDLLM_SIMT_SEED"]))

set_schedule = _simt.set_schedule
schedule = _simt.schedule
set_workers = _simt.set_workers
workers = _simt.workers
set_random_seed = _simt.set_random_seed
reset_stats = _simt.reset_stats
run_selftest = _simt.run_selftest


def stats() -> dict:
    """Since the last ``reset_stats()``: launches, blocks, threads, barriers
    released and warp collectives completed; ``kernel_launches`` by kernel name
    (which kernel an op's dispatch chose); ``ldmatrix`` and ``cp_async``, the
    warp instructions of the tensor-core wrappers' portable forms, and their
    shared-memory bank conflicts (``*_conflicts``: wavefronts past the first of
    each 8-lane phase, 32 banks of 4 bytes)."""
    return dict(_simt.stats())


def device_properties() -> dict:
    """The limits of the emulated device (an sm_80-class GPU with few SMs)."""
    return dict(_simt.device_properties())


class _EmulatedKernels(TorchDispatchMode):
    """Sends every ``torch.ops.fusedllm.*`` call on real tensors to its
    ``torch.ops.fusedllm_simt.*`` twin; other ops (and fake tensors, traced
    by torch.compile or opcheck) go on as they would."""

    # Higher-order operators (auto_functionalized, which torch.compile and
    # opcheck wrap around in-place ops) pass through to torch's own rules.
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if func.namespace == "fusedllm" and not any(
                isinstance(a, FakeTensor) or (isinstance(a, torch.Tensor) and a.is_meta)
                for a in tree_leaves((args, kwargs))):
            self.calls += 1
            twin = getattr(getattr(torch.ops.fusedllm_simt, func._opname), func._overloadname)
            return twin(*args, **kwargs)
        return func(*args, **kwargs)


_depth = 0


def active() -> bool:
    """Whether fusedllm ops are being sent to the emulated kernels (inside ``kernels()``)."""
    return _depth > 0


@contextlib.contextmanager
def kernels(schedule: str | None = None, workers: int | None = None):
    """Within the block, fusedllm ops on CPU tensors run the emulated CUDA
    kernels (forward and backward), under `schedule` with `workers` OS threads
    (both restored on exit). Yields the mode; its ``calls`` counts the op calls
    it redirected."""
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"fusedllm.simt.kernels: schedule must be one of {SCHEDULES}, got {schedule!r}")
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ValueError(f"fusedllm.simt.kernels: workers must be an int >= 1, got {workers!r}")
    global _depth
    old_schedule, old_workers = _simt.schedule(), _simt.workers()
    _depth += 1
    try:
        if schedule is not None:
            _simt.set_schedule(schedule)
        if workers is not None:
            _simt.set_workers(workers)
        with _EmulatedKernels() as mode:
            yield mode
    finally:
        _depth -= 1
        _simt.set_schedule(old_schedule)
        _simt.set_workers(old_workers)
