"""The SIMT emulator itself (fusedllm.simt): it catches the kernel bugs it
claims to, its ops are the fusedllm ops under the same schemas, and what the
kernels compute depends neither on the schedule nor on the number of OS
threads running blocks. The ops' own tests run under it through the `device`
fixture (conftest.py: "simt", "simt-warp")."""

import importlib.util
import math
import os

import pytest
import torch

import fusedllm

if importlib.util.find_spec("fusedllm._simt") is None and not os.environ.get("FUSEDLLM_SIMT_LIBRARY"):
    # A build made without them (FUSEDLLM_SIMT=OFF, as for a GPU); one that has them must import.
    pytest.skip("this build has no emulated kernels (fusedllm._simt)", allow_module_level=True)

import fusedllm.simt as simt  # noqa: E402
from checks import FORWARD_TOL, assert_close

pytestmark = pytest.mark.simt

BROKEN_KERNELS = [
    ("shared_past_end", r"shared_past_end_kernel, block \(0,0,0\), thread \(63,0,0\): access past "
                        r"the end of dynamic shared memory"),
    ("divergent_barrier", r"divergent __syncthreads at csrc/simt/selftest.cpp:\d+: 32 threads wait "
                          r"there but 32 threads of the block have exited"),
    ("mismatched_barriers", r"threads wait at different barriers: thread \(0,0,0\) at __syncthreads "
                            r"csrc/simt/selftest.cpp:\d+, thread \(32,0,0\) at __syncthreads "
                            r"csrc/simt/selftest.cpp:\d+"),
    ("partial_warp_shuffle", r"thread \(32,0,0\): __shfl_xor_sync at csrc/cuda/primitives.cuh:\d+: "
                             r"the mask 0xffffffff names lanes past the end of the block"),
    ("shuffle_waits_on_barrier", r"deadlock, no thread can go on: 16 threads .* at __syncthreads .*"
                                 r"16 threads .* in a warp collective"),
    ("failed_assert", r"block \(0,0,0\), thread \(40,0,0\): CUDA_KERNEL_ASSERT\(.*< limit\) failed"),
    ("too_many_threads", r"launch of plain_kernel .* block \(1025,1,1\): a block has 1 to 1024 threads"),
    ("grid_too_large", r"grid \(1,65536,1\).*grid dimensions must be"),
    ("shared_without_opt_in", r"65536 bytes of dynamic shared memory exceed the 49152 bytes allowed "
                              r"\(above 48 KiB a kernel must opt in"),
    ("shared_over_opt_in", r"over the device's opt-in limit"),
]


@pytest.mark.parametrize("schedule", ["lockstep", "warp"])
@pytest.mark.parametrize("name,message", BROKEN_KERNELS, ids=[b[0] for b in BROKEN_KERNELS])
def test_broken_kernels_fail_with_the_matching_error(name, message, schedule):
    with simt.kernels(schedule=schedule), pytest.raises(RuntimeError, match=message):
        simt.run_selftest(name)


def test_a_missing_barrier_shows_under_warp_at_a_time_schedules():
    expected = [float((t + 32) % 64) for t in range(64)]
    for schedule in simt.SCHEDULES:
        with simt.kernels(schedule=schedule):
            assert simt.run_selftest("neighbour_warp_with_barrier") == expected, schedule
    # Without the barrier, warp 0 reads warp 1's slots before warp 1 has run:
    # dynamic shared memory starts as NaN bytes, so the read shows.
    for schedule in ("warp", "warp-reverse"):
        with simt.kernels(schedule=schedule):
            out = simt.run_selftest("neighbour_warp")
        assert sum(math.isnan(v) for v in out) == 32, schedule
    # Round-robin lets every thread write before any reads: it hides the bug,
    # which is why every simt test runs under both.
    with simt.kernels(schedule="lockstep"):
        assert simt.run_selftest("neighbour_warp") == expected


def test_ops_have_the_schemas_of_the_fusedllm_ops():
    names = torch._C._dispatch_get_all_op_names()
    ours = sorted(n.split("::")[1] for n in names if n.startswith("fusedllm::"))
    emulated = sorted(n.split("::")[1] for n in names if n.startswith("fusedllm_simt::"))
    assert ours and ours == emulated
    for name in ours:
        a = str(getattr(torch.ops.fusedllm, name).default._schema)
        b = str(getattr(torch.ops.fusedllm_simt, name).default._schema)
        assert a.replace("fusedllm::", "") == b.replace("fusedllm_simt::", "")


def _every_kernel():
    """One call of each op, forward and backward, with masks, dropout, GQA and
    odd sizes; returns every output and gradient."""
    torch.manual_seed(0)
    out = []
    x = torch.randn(9, 131, requires_grad=True)
    r = torch.randn(9, 131, requires_grad=True)
    w = torch.randn(131, requires_grad=True)
    y, h = fusedllm.fused_add_rms_norm(x, r, w)
    (y.sum() + (h * h).sum()).backward()
    out += [y, h, x.grad, r.grad, w.grad]
    gu = torch.randn(5, 2 * 72, dtype=torch.bfloat16, requires_grad=True)
    s = fusedllm.swiglu(gu, activation="gelu_tanh")
    s.float().square().sum().backward()
    out += [s, gu.grad]
    q = torch.randn(2, 4, 11, 40, requires_grad=True)
    k = torch.randn(2, 2, 11, 40, requires_grad=True)
    v = torch.randn(2, 2, 11, 40, requires_grad=True)
    cos, sin = fusedllm.rope_tables(32, 64)
    rq, rk = fusedllm.apply_rope(q, k, cos, sin, offset=3, rotary_dim=32)
    mask = torch.rand(2, 1, 11, 11) > 0.2
    o = fusedllm.attention(rq, rk, v, causal=True, mask=mask, dropout_p=0.25)
    o.square().sum().backward()
    out += [rq, rk, o, q.grad, k.grad, v.grad]
    return [t.detach() for t in out]


def test_results_do_not_depend_on_schedule_or_workers():
    with simt.kernels() as mode:
        simt.reset_stats()
        first = _every_kernel()
        stats = simt.stats()
    assert mode.calls >= 8 and stats["launches"] >= 10 and stats["barriers"] > 0 and stats["collectives"] > 0
    for schedule in simt.SCHEDULES:
        for workers in (1, 2):
            with simt.kernels(schedule=schedule, workers=workers):
                again = _every_kernel()
            for i, (a, b) in enumerate(zip(first, again)):
                assert torch.equal(a, b), f"result {i} differs under schedule {schedule}, {workers} workers"
    # and they are the CPU kernels' results, within the float32 tolerance
    cpu = _every_kernel()
    for i, (a, b) in enumerate(zip(first, cpu)):
        tol = FORWARD_TOL[torch.bfloat16] if a.dtype == torch.bfloat16 else (1e-4, 1e-4)
        assert_close(a, b, tol, what=f"result {i}")


def test_settings_are_checked_and_restored():
    before = simt.schedule(), simt.workers()
    with pytest.raises(ValueError, match="schedule must be one of"):
        with simt.kernels(schedule="sideways"):
            pass
    with pytest.raises(ValueError, match="workers must be an int >= 1"):
        with simt.kernels(workers=0):
            pass
    with simt.kernels(schedule="warp-random", workers=2):
        assert (simt.schedule(), simt.workers()) == ("warp-random", 2)
    assert (simt.schedule(), simt.workers()) == before


def test_opcheck_on_the_emulated_ops():
    x = torch.randn(3, 5, 33)
    w = torch.randn(33)
    q = torch.randn(1, 4, 6, 16)
    k = torch.randn(1, 2, 6, 16)
    cos, sin = fusedllm.rope_tables(16, 8)
    ops = torch.ops.fusedllm_simt
    torch.library.opcheck(ops.rms_norm.default, (x, w, 1e-6, 0.0, "llama"))
    torch.library.opcheck(ops.swiglu_packed.default, (x[..., :32], "silu"))
    torch.library.opcheck(ops.rope.default, (q, k, cos, sin, None, 2, False, 16, False))
    torch.library.opcheck(ops.attention.default, (q, k, k, None, 0.25, True, -1, 0.0, None))


def test_out_of_range_positions_are_a_device_assert_naming_the_condition():
    q = torch.randn(1, 2, 4, 8)
    cos, sin = fusedllm.rope_tables(8, 16)
    positions = torch.tensor([0, 1, 2, 16])
    with pytest.raises(RuntimeError, match=r"rope(_packed)?_kernel, block \(\d+,0,0\), thread \(\d+,0,0\): "
                                           r"CUDA_KERNEL_ASSERT\(pos >= 0 && pos < table_rows\) failed"):
        torch.ops.fusedllm_simt.rope(q, q, cos, sin, positions, 0, False, 8, False)


@pytest.mark.parametrize("stride,conflicts", [(128, 28), (144, 0)])
def test_bank_conflicts_are_counted(stride, conflicts):
    """One cp.async and one ldmatrix x4 over 8 shared rows `stride` bytes apart:
    128-byte rows put each 8-lane phase in the same 4 banks (7 extra wavefronts
    per phase), 144-byte rows spread them over all 32."""
    simt.reset_stats()
    simt.run_selftest(f"bank_conflicts_{stride}")
    stats = simt.stats()
    assert (stats["cp_async"], stats["ldmatrix"]) == (1, 1)
    assert (stats["cp_async_conflicts"], stats["ldmatrix_conflicts"]) == (conflicts, conflicts)
    assert stats["kernel_launches"] == {"bank_conflicts_kernel": 1}
