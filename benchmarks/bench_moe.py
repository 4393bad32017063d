"""Sparse mixture-of-experts layer (router + experts), forward and
forward+backward, float32 and bfloat16, in two shapes: Mixtral's (hidden 1024,
8 experts of width 3584, top-2) and Qwen3-MoE's (hidden 1024, 64 experts of
width 768, top-8), at 4096 tokens:

- "eager": transformers' sparse MoE block (``MixtralSparseMoeBlock`` /
  ``Qwen3MoeSparseMoeBlock``) with ``experts_implementation="eager"``, a loop
  over the experts that received tokens;
- "grouped_mm" / "batched_mm": the same block with transformers' other experts
  implementations (``batched_mm`` gathers one weight matrix per routed token:
  skipped where that gather would not fit in memory, and the row says so);
- "compile": ``torch.compile`` of the eager block (the expert loop is
  data-dependent, so not ``fullgraph``);
- "hf+fusedllm": the block with ``experts_implementation="fusedllm"``
  (transformers' router, :func:`fusedllm.moe_experts`);
- "fusedllm": ``fusedllm.nn.MoE.from_config`` sharing the block's weights
  (:func:`fusedllm.moe_route` and :func:`fusedllm.moe_experts`);
- "fusedllm_wgmma" (on an sm_90 GPU): the same module with its bfloat16
  products' large tiles on the wgmma kernel (``FUSEDLLM_CUDA_GROUPED_MM=wgmma``).

All candidates hold the very same parameters. A candidate that fails is
reported in the row's notes, not fatal.

    python benchmarks/bench_moe.py                 # both shapes at 4096 tokens
    python benchmarks/bench_moe.py --tokens 1024   # the same shapes, fewer tokens
    python benchmarks/bench_moe.py --quick         # hidden 256, 512 tokens
"""

from __future__ import annotations

import copy
import os
import sys

# the profiler's trace collector logs every start and stop (peak memory runs it once per candidate)
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# harness before torch: with --thp it configures torch's allocator
from benchmarks.harness import Benchmark, dtype_name, interleaved_medians, run, speed_and_peak_plot  # noqa: E402

import torch  # noqa: E402

import fusedllm  # noqa: E402
from fusedllm.nn import MoE  # noqa: E402
from testkit.env import env_var  # noqa: E402
from testkit.memory import peak_memory_bytes  # noqa: E402

SHAPES = {
    "mixtral": dict(hidden=1024, intermediate=3584, experts=8, top_k=2),
    "qwen3_moe": dict(hidden=1024, intermediate=768, experts=64, top_k=8),
}
QUICK_SHAPES = {
    "mixtral": dict(hidden=256, intermediate=512, experts=8, top_k=2),
    "qwen3_moe": dict(hidden=256, intermediate=192, experts=16, top_k=4),
}
TOKENS, QUICK_TOKENS = 4096, 512
# batched_mm gathers [tokens * top_k, 2 * intermediate, hidden] weights; above this it is skipped
BATCHED_MM_LIMIT_BYTES = 4 * 2**30
HF_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm", "fusedllm")


def hf_block(family, shape):
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    import fusedllm.hf  # noqa: F401  (registers experts_implementation="fusedllm")

    if family == "mixtral":
        config = transformers.MixtralConfig(hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                                            num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"])
        return config, MixtralSparseMoeBlock
    config = transformers.Qwen3MoeConfig(hidden_size=shape["hidden"], moe_intermediate_size=shape["intermediate"],
                                         num_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                                         norm_topk_prob=True)
    return config, Qwen3MoeSparseMoeBlock


class DenseSameFlops(torch.nn.Module):
    """Every (token, choice) row through one expert's gated MLP: dense matrix
    products of the experts' FLOPs, no routing, no grouping. What the
    machine's BLAS needs for the arithmetic alone: the floor under every
    candidate's time."""

    def __init__(self, block, top_k):
        super().__init__()
        self.experts, self.top_k = block.experts, top_k

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1]).repeat_interleave(self.top_k, 0)
        gate_up = torch.nn.functional.linear(rows, self.experts.gate_up_proj[0])
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.experts.down_proj[0])
        return out.view(*x.shape[:-1], self.top_k, x.shape[-1]).sum(-2)


def build(family, shape, dtype, device, with_compile, tokens):
    """name -> module (or a string: why it was not built); all share one set of weights."""
    config, block_cls = hf_block(family, shape)
    torch.manual_seed(0)
    config._experts_implementation = "eager"
    base = block_cls(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        base.gate.weight.normal_(0.0, shape["hidden"] ** -0.5)  # logits of unit scale
        base.experts.gate_up_proj.normal_(0.0, shape["hidden"] ** -0.5)
        base.experts.down_proj.normal_(0.0, shape["intermediate"] ** -0.5)
    modules = {}
    for impl in HF_IMPLEMENTATIONS:
        name = "hf+fusedllm" if impl == "fusedllm" else impl
        if impl == "batched_mm":
            gathered = tokens * shape["top_k"] * 2 * shape["intermediate"] * shape["hidden"] * dtype.itemsize
            if gathered > BATCHED_MM_LIMIT_BYTES:
                modules[name] = f"skipped: it would gather {gathered / 2**30:.0f} GiB of expert weights"
                continue
        if impl == "eager":
            modules[name] = base
            continue
        cfg = copy.deepcopy(config)
        cfg._experts_implementation = impl
        block = copy.copy(base)  # a shallow twin: the same parameters, its own experts config
        block._modules = dict(base._modules)
        experts = copy.copy(base.experts)
        experts.config = cfg
        block._modules["experts"] = experts
        modules[name] = block
    if with_compile:
        torch._dynamo.reset()  # a fresh compilation per case: each shape and dtype is its own graph
        modules["compile"] = torch.compile(base)
    fused = MoE.from_config(config, device="meta")
    fused.gate.weight = base.gate.weight
    fused.experts.gate_up_proj, fused.experts.down_proj = base.experts.gate_up_proj, base.experts.down_proj
    modules["fusedllm"] = fused
    if str(device).startswith("cuda") and torch.cuda.get_device_capability() == (9, 0):
        modules["fusedllm_wgmma"] = fused  # called under FUSEDLLM_CUDA_GROUPED_MM=wgmma (on_wgmma)
    modules["dense"] = DenseSameFlops(base, shape["top_k"])
    return modules


def on_wgmma(call):
    """call with fusedllm's 16-bit grouped products on the wgmma kernel where it serves."""
    def wrapped():
        with env_var("FUSEDLLM_CUDA_GROUPED_MM", "wgmma"):
            call()
    return wrapped


def cases(args, device):
    shapes = QUICK_SHAPES if args.quick else SHAPES
    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    reps = args.reps or (5 if args.quick else 3)
    for family in args.shapes:
        shape = shapes[family]
        for dtype in (torch.float32, torch.bfloat16):
            modules = build(family, shape, dtype, device, not args.no_compile, tokens)
            skipped = {name: why for name, why in modules.items() if isinstance(why, str)}
            modules = {name: m for name, m in modules.items() if not isinstance(m, str)}
            torch.manual_seed(1)
            x = torch.randn(1, tokens, shape["hidden"], dtype=dtype, device=device)
            with torch.no_grad():
                reference = modules["eager"](x).float()
                max_diff = {}
                for name, m in list(modules.items()):
                    if name in ("eager", "dense"):
                        continue
                    try:
                        max_diff[name] = (m(x).float() - reference).abs().max().item()
                    except Exception as exc:  # an implementation that does not run here
                        if name == "fusedllm":
                            raise
                        skipped[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                        del modules[name]
            xg = x.clone().requires_grad_()
            grad = torch.randn_like(x)
            for mode in ("forward", "forward+backward"):
                if mode == "forward":
                    def make(m):
                        def call():
                            with torch.no_grad():
                                m(x)
                        return call
                else:
                    def make(m):
                        def call():
                            xg.grad = None
                            for p in modules["eager"].parameters():
                                p.grad = None
                            m(xg).backward(grad)
                        return call
                candidates = {name: on_wgmma(make(m)) if name == "fusedllm_wgmma" else make(m)
                              for name, m in modules.items()}
                mode_skipped = dict(skipped)
                for name, fn in list(candidates.items()):
                    try:
                        fn()
                    except Exception as exc:
                        if name in ("eager", "fusedllm"):
                            raise
                        mode_skipped[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                        del candidates[name]
                times = interleaved_medians(candidates, device, reps, warmup=1)
                peaks = {name: peak_memory_bytes(fn, device) for name, fn in candidates.items()}
                t = times["fusedllm"]
                row = dict(case=f"{family} {tokens} {dtype_name(dtype)} {'fwd' if mode == 'forward' else 'fwd+bwd'}",
                           family=family, mode=mode, dtype=str(dtype), shape=shape, tokens=tokens,
                           fused_ms=t * 1e3, vs_eager=times["eager"] / t, max_abs_diff=max_diff["fusedllm"],
                           skipped=mode_skipped)
                for name in times:
                    row[f"{name}_ms"] = times[name] * 1e3
                    row[f"{name}_peak_mb"] = peaks[name] / 2**20
                    if name != "fusedllm":
                        row[f"vs_{name}"] = times[name] / t
                yield row


def describe(row):
    others = "  ".join(f"x{row[f'vs_{n}']:.2f} {n}" for n in ("eager", "grouped_mm", "batched_mm", "compile",
                                                                "hf+fusedllm", "fusedllm_wgmma") if f"vs_{n}" in row)
    return (f"{row['case']:<30} fused {row['fused_ms']:8.1f} ms  {others}  peak MiB fused "
            f"{row['fusedllm_peak_mb']:.0f} eager {row['eager_peak_mb']:.0f}")


NAMES = ("eager", "grouped_mm", "batched_mm", "compile", "hf+fusedllm", "fusedllm", "fusedllm_wgmma", "dense")


def plot(rows, path, device):
    names = [n for n in NAMES if any(f"{n}_ms" in row for row in rows)]
    speed_and_peak_plot(rows, names, path, f"sparse MoE layer ({device})", "HF eager experts")


def notes(rows):
    lines = []
    for family in dict.fromkeys(row["family"] for row in rows):
        shape = next(row["shape"] for row in rows if row["family"] == family)
        lines.append(f"{family}: hidden {shape['hidden']}, {shape['experts']} experts of width "
                     f"{shape['intermediate']}, top-{shape['top_k']}")
    seen = set()
    for row in rows:
        for name, why in row["skipped"].items():
            if (name, why) not in seen:
                seen.add((name, why))
                lines.append(f"{name} ({row['case']}): {why}")
    lines.append("eager / grouped_mm / batched_mm / hf+fusedllm: transformers' sparse MoE block (its router) with "
                 "that experts implementation; compile: torch.compile of the eager block; fusedllm: nn.MoE "
                 "(moe_route + moe_experts); dense: the experts' FLOPs as dense products of one expert's "
                 "weights over all (token, choice) rows (no routing), the floor of the machine's BLAS under every "
                 "candidate's time; max |Δ| compares fusedllm's forward with eager's. All share the weights. "
                 "In bfloat16 a router logit ties another now and then; torch.topk breaks ties either way, "
                 "moe_route toward the lower expert index, so such a token may take another expert and max |Δ| is "
                 "then of the order of the output.")
    return lines


COLUMNS = [
    ("case", "case", "s"),
    ("eager_ms", "eager ms", ".0f"),
    ("grouped_mm_ms", "grouped_mm ms", ".0f"),
    ("batched_mm_ms", "batched_mm ms", ".0f"),
    ("compile_ms", "compile ms", ".0f"),
    ("hf+fusedllm_ms", "HF router + fused experts ms", ".0f"),
    ("fused_ms", "fusedllm ms", ".0f"),
    ("dense_ms", "dense same-FLOPs ms", ".0f"),
    ("vs_eager", "× eager", ".2f"),
    ("vs_grouped_mm", "× grouped_mm", ".2f"),
    ("vs_compile", "× compile", ".2f"),
    ("vs_fusedllm_wgmma", "× fusedllm on wgmma", ".2f"),
    ("eager_peak_mb", "eager peak MiB", ".0f"),
    ("grouped_mm_peak_mb", "grouped_mm peak MiB", ".0f"),
    ("compile_peak_mb", "compile peak MiB", ".0f"),
    ("fusedllm_peak_mb", "fusedllm peak MiB", ".0f"),
    ("max_abs_diff", "max |Δ|", ".1e"),
]


def options(parser):
    parser.add_argument("--tokens", type=int, default=None, help=f"tokens per case (default {TOKENS}, "
                                                                  f"--quick {QUICK_TOKENS})")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES),
                        help="which layer shapes to run")


BENCHMARK = Benchmark("moe", __doc__, cases, COLUMNS, "vs_eager", "speedup over eager",
                      describe=describe, options=options, plot=plot, notes=notes)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
