"""A paper model of the tensor-core attention forward (csrc/cuda/attention_mma.cu)
on an A100 and an H100: per-tile FLOPs and bytes, occupancy from the ptxas
report, and the TFLOP/s the kernel cannot exceed if every resource runs at
its rated rate (an upper bound; what latency costs is not modelled). No GPU runs here; docs/attention-cuda.md
explains every assumption and prints this script's table.

    python benchmarks/attention_cuda_model.py
"""

from __future__ import annotations

import math

ROWS = 64      # query rows of a block (4 warps x 16)
WARPS = 4
ELEM = 2       # bytes of a bfloat16 / float16 element

# From `ptxas -v` on sm_80 (registers per thread) and Tile<kD>::forward_smem.
KERNELS = {  # padded head dim: (keys per tile, registers per thread)
    64: (64, 158),
    96: (64, 174),
    128: (64, 190),
    256: (16, 244),
}

# Dense bf16 tensor FLOP per clock per SM, clock (GHz), SMs, shared memory bytes
# per clock per SM, shared memory per SM usable by blocks (bytes), registers per SM.
GPUS = {
    "A100": dict(flop_clk=2048, ghz=1.41, sms=108, smem_clk=128, smem_sm=167936, regs=65536, l2_clk=33),
    # mma.sync is taken at the full dense rate here; on an H100 only wgmma reaches
    # it, which makes this column the optimistic one (see the document).
    "H100": dict(flop_clk=4096, ghz=1.83, sms=132, smem_clk=128, smem_sm=233472, regs=65536, l2_clk=41),
}
MUFU_CLK = 16       # exp2 per clock per SM (4 per sub-partition)
SOFTMAX_ISSUE = 8   # issued instructions per score besides exp2 (scale, bounds, max, sum, convert)


def smem_bytes(d, keys):
    return ELEM * (d + 8) * (ROWS + 4 * keys)


def ctas_per_sm(gpu, d):
    keys, regs = KERNELS[d]
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = gpu["regs"] // (per_warp * WARPS)
    by_smem = gpu["smem_sm"] // (smem_bytes(d, keys) + 1024)
    return min(by_regs, by_smem)


def tile_costs(gpu, d):
    """Clocks one SM spends on one block's key tile, by resource."""
    keys, _ = KERNELS[d]
    flops = 2 * 2 * ROWS * keys * d                       # S = Q K^T and O += P V
    smem = WARPS * 2 * keys * d * ELEM + 2 * keys * d * ELEM  # ldmatrix of K, V by every warp; cp.async in
    scores = ROWS * keys
    return dict(
        flops=flops,
        tensor=flops / gpu["flop_clk"],
        smem=smem / gpu["smem_clk"],
        mufu=scores / MUFU_CLK,
        issue=scores * SOFTMAX_ISSUE / (32 * 4),          # warp instructions, 4 schedulers
        l2=2 * keys * d * ELEM / gpu["l2_clk"],  # K and V tiles, once per block
    )


def predict(gpu, d, seq, batch, heads, causal):
    keys, _ = KERNELS[d]
    c = tile_costs(gpu, d)
    resident = ctas_per_sm(gpu, d)
    # With one warp per scheduler the softmax work does not overlap the tensor
    # work of the same warp; with two or more, another warp's products fill it.
    softmax = max(c["mufu"], c["issue"])
    per_tile = (c["tensor"] + softmax) if resident == 1 else max(c["tensor"], softmax)
    per_tile = max(per_tile, c["smem"], c["l2"])
    n = seq // keys
    row_blocks = seq // ROWS
    tiles_per_block = ((n * (n + 1) / 2) / row_blocks) if causal else n  # diagonal tiles run whole
    blocks = batch * heads * row_blocks
    slots = gpu["sms"] * resident
    waves = math.ceil(blocks / slots)
    # A wave's blocks share an SM's clocks: `resident` of them run at once.
    seconds = waves * tiles_per_block * per_tile * resident / (gpu["ghz"] * 1e9)
    useful = 4 * batch * heads * seq * seq * d * (0.5 if causal else 1.0)
    return useful / seconds / 1e12, resident, per_tile, c


def main():
    print("| GPU | head dim | CTAs/SM | tensor clk | smem clk | L2 clk | softmax clk | bound |")
    print("|---|---|---|---|---|---|---|---|")
    for name, gpu in GPUS.items():
        for d in KERNELS:
            c = tile_costs(gpu, d)
            softmax = max(c["mufu"], c["issue"])
            bound = max((c["tensor"], "tensor"), (c["smem"], "shared memory"), (c["l2"], "L2"),
                        (softmax, "softmax"))[1]
            print(f"| {name} | {d} | {ctas_per_sm(gpu, d)} | {c['tensor']:.0f} | {c['smem']:.0f} | {c['l2']:.0f} | "
                  f"{softmax:.0f} | {bound} |")
    print()
    print("| GPU | head dim | heads | B x S | causal | bound TFLOP/s | % of dense peak |")
    print("|---|---|---|---|---|---|---|")
    for name, gpu in GPUS.items():
        peak = gpu["flop_clk"] * gpu["ghz"] * gpu["sms"] / 1e3
        for d, heads in ((64, 32), (128, 16)):
            for batch, seq in ((8, 2048), (4, 4096), (2, 8192), (1, 16384)):
                for causal in (False, True):
                    tflops, *_ = predict(gpu, d, seq, batch, heads, causal)
                    print(f"| {name} | {d} | {heads} | {batch} x {seq} | {'yes' if causal else 'no'} | "
                          f"{tflops:.0f} | {100 * tflops / peak:.0f}% |")


if __name__ == "__main__":
    main()
