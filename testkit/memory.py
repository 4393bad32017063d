"""Peak memory of one call, measured the same way in the tests and the benchmarks."""

import torch


def peak_memory_bytes(fn, device) -> int:
    """Peak bytes allocated by torch while fn() runs, above what was live before.

    CUDA: the caching allocator's peak counter. CPU: torch keeps no such counter,
    so we replay the allocation and free events the profiler records
    (profile_memory=True) in time order and take the highest running total.
    Memory that does not go through torch's allocator is not counted.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak
