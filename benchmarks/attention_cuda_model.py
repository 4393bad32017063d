"""A paper model of the tensor-core attention kernels (csrc/cuda/attention_mma.cu,
the forward; csrc/cuda/attention_mma_backward.cu, dQ and dK/dV) on an A100 and
an H100: per-tile FLOPs and bytes, occupancy from the ptxas report, and the
TFLOP/s a kernel cannot exceed if every resource runs at its rated rate (an
upper bound; what latency costs is not modelled). No GPU runs here;
docs/attention-cuda.md explains every assumption and prints this script's tables.

    python benchmarks/attention_cuda_model.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BLOCK = 64     # rows a block holds: query rows (forward, dQ) or keys (dK/dV); 4 warps x 16
WARPS = 4
ELEM = 2       # bytes of a bfloat16 / float16 element

# Dense bf16 tensor FLOP per clock per SM, clock (GHz), SMs, shared memory bytes
# per clock per SM, shared memory per SM usable by blocks (bytes), registers per SM.
GPUS = {
    "A100": dict(flop_clk=2048, ghz=1.41, sms=108, smem_clk=128, smem_sm=167936, regs=65536, l2_clk=33),
    # mma.sync is taken at the full dense rate here; on an H100 only wgmma reaches
    # it, which makes this column the optimistic one (see the document).
    "H100": dict(flop_clk=4096, ghz=1.83, sms=132, smem_clk=128, smem_sm=233472, regs=65536, l2_clk=41),
}
MUFU_CLK = 16       # exp2 per clock per SM (4 per sub-partition)


@dataclass(frozen=True)
class Kernel:
    """One kernel at one padded head dim. A block holds BLOCK rows and streams
    tiles of `tile` rows of the other side (keys, or query rows for dK/dV)."""
    name: str
    d: int
    tile: int
    regs: int          # ptxas -v, sm_80
    products: int      # [BLOCK x tile x d] tensor-core products per tile
    streamed: int      # operands streamed per tile (cp.async), [tile x d] each
    held_reads: int    # the block's own [BLOCK x d] operands read again by ldmatrix per tile
    streamed_reads: int  # times each warp reads each streamed tile by ldmatrix
    issue_per_score: int  # issued instructions per score besides exp2 (read from the code)
    extra_smem: int = 0   # bytes besides the operand rows (lse / delta of streamed rows)

    @property
    def smem(self):
        held = 2 if self.name != "forward" else 1  # Q (forward); Q, dO (dQ); K, V (dK/dV)
        return ELEM * (self.d + 8) * (held * BLOCK + 2 * self.streamed * self.tile) + self.extra_smem


# From `ptxas -v` on sm_80 (registers per thread) and Tile<kD> (attention_mma.cuh).
FORWARD = {d: Kernel("forward", d, tile, regs, products=2, streamed=2, held_reads=1, streamed_reads=1,
                     issue_per_score=8)
           for d, tile, regs in ((64, 64, 168), (96, 64, 251), (128, 64, 254), (256, 16, 255))}
DQ = {d: Kernel("dQ", d, tile, regs, products=3, streamed=2, held_reads=2, streamed_reads=1.5,
                issue_per_score=10)
      for d, tile, regs in ((64, 32, 224), (96, 32, 244), (128, 32, 248), (256, 16, 255))}
DKDV = {d: Kernel("dK/dV", d, 32, regs, products=4, streamed=2, held_reads=2, streamed_reads=2,
                  issue_per_score=14, extra_smem=4 * 4 * 32)
        for d, regs in ((64, 192), (96, 240), (128, 255))}


def ctas_per_sm(gpu, k):
    per_warp = math.ceil(k.regs * 32 / 256) * 256
    by_regs = gpu["regs"] // (per_warp * WARPS)
    by_smem = gpu["smem_sm"] // (k.smem + 1024)
    return min(by_regs, by_smem)


def tile_costs(gpu, k):
    """Clocks one SM spends on one block's tile, by resource."""
    flops = k.products * 2 * BLOCK * k.tile * k.d
    # ldmatrix: every warp reads each streamed tile `streamed_reads` times per
    # streamed operand, and its own 16 rows of the held operands; cp.async writes.
    reads = (WARPS * k.streamed_reads * k.streamed * k.tile * k.d + k.held_reads * BLOCK * k.d) * ELEM
    writes = k.streamed * k.tile * k.d * ELEM
    scores = BLOCK * k.tile
    return dict(
        flops=flops,
        tensor=flops / gpu["flop_clk"],
        smem=(reads + writes) / gpu["smem_clk"],
        mufu=scores / MUFU_CLK,
        issue=scores * k.issue_per_score / (32 * 4),   # warp instructions, 4 schedulers
        l2=k.streamed * k.tile * k.d * ELEM / gpu["l2_clk"],  # the streamed tiles, once per block
    )


def seconds(gpu, k, seq, batch, heads, causal):
    c = tile_costs(gpu, k)
    resident = ctas_per_sm(gpu, k)
    # With one warp per scheduler the softmax work does not overlap the tensor
    # work of the same warp; with two or more, another warp's products fill it.
    softmax = max(c["mufu"], c["issue"])
    per_tile = (c["tensor"] + softmax) if resident == 1 else max(c["tensor"], softmax)
    per_tile = max(per_tile, c["smem"], c["l2"])
    blocks_per_head = seq // BLOCK
    # Causal: block i sees (i + 1) * BLOCK / tile tiles (its diagonal ones whole);
    # dK/dV mirrors it (keys near the end are seen by few queries).
    tiles = (BLOCK / k.tile) * (blocks_per_head + 1) / 2 if causal else seq / k.tile
    waves = math.ceil(batch * heads * blocks_per_head / (gpu["sms"] * resident))
    # A wave's blocks share an SM's clocks: `resident` of them run at once.
    return waves * tiles * per_tile * resident / (gpu["ghz"] * 1e9)


def useful_flops(seq, batch, heads, d, causal, backward):
    """The products' FLOPs counted as FlashAttention-2's paper counts them: 2
    products forward, 5 backward (recomputation not counted), halved when causal."""
    return (5 if backward else 2) * 2 * batch * heads * seq * seq * d * (0.5 if causal else 1.0)


SHAPES = [(batch, seq) for batch, seq in ((8, 2048), (4, 4096), (2, 8192), (1, 16384))]


def main():
    print("| kernel | head dim (padded) | tile | registers / thread | shared memory / block |")
    print("|---|---|---|---|---|")
    for kernels in (FORWARD, DQ, DKDV):
        for k in kernels.values():
            print(f"| {k.name} | {k.d} | {k.tile} | {k.regs} | {k.smem / 1024:.0f} KiB |")
    print()
    print("| GPU | kernel | head dim | CTAs/SM | tensor clk | smem clk | L2 clk | softmax clk | bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, gpu in GPUS.items():
        for kernels in (FORWARD, DQ, DKDV):
            for k in kernels.values():
                c = tile_costs(gpu, k)
                softmax = max(c["mufu"], c["issue"])
                bound = max((c["tensor"], "tensor"), (c["smem"], "shared memory"), (c["l2"], "L2"),
                            (softmax, "softmax"))[1]
                print(f"| {name} | {k.name} | {k.d} | {ctas_per_sm(gpu, k)} | {c['tensor']:.0f} | "
                      f"{c['smem']:.0f} | {c['l2']:.0f} | {softmax:.0f} | {bound} |")
    print()
    print("| GPU | head dim | heads | B x S | causal | forward TFLOP/s | % of peak | backward TFLOP/s | % of peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, gpu in GPUS.items():
        peak = gpu["flop_clk"] * gpu["ghz"] * gpu["sms"] / 1e3
        for d, heads in ((64, 32), (128, 16)):
            for batch, seq in SHAPES:
                for causal in (False, True):
                    fwd = useful_flops(seq, batch, heads, d, causal, False) / seconds(
                        gpu, FORWARD[d], seq, batch, heads, causal) / 1e12
                    bwd_s = sum(seconds(gpu, k[d], seq, batch, heads, causal) for k in (DQ, DKDV))
                    bwd = useful_flops(seq, batch, heads, d, causal, True) / bwd_s / 1e12
                    print(f"| {name} | {d} | {heads} | {batch} x {seq} | {'yes' if causal else 'no'} | "
                          f"{fwd:.0f} | {100 * fwd / peak:.0f}% | {bwd:.0f} | {100 * bwd / peak:.0f}% |")


if __name__ == "__main__":
    main()
