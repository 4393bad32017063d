"""The machine code of the CUDA attention kernels' main loops, without a GPU.

Compiles csrc/cuda/attention*.cu for one real architecture (as the CMake build
compiles them: same groups, defines, include paths and flags, device code only),
or reads an already-built cubin / extension, disassembles it with
`cuobjdump -sass`, finds each attention kernel's loop over key tiles and counts
the instructions one iteration issues, by kind. Prints one markdown table.

    python benchmarks/sass_table.py                    # sm_90, every attention kernel
    python benchmarks/sass_table.py --arch 80 --kernel 'mma_forward<bf16,Tile<64,80>>'
    python benchmarks/sass_table.py --arch 75 --kernel 'Tile<128,75>'    # Turing, float16
    python benchmarks/sass_table.py --so python/fusedllm/_C.cpython-311-x86_64-linux-gnu.so

How the loop and its iteration are chosen (static analysis, no profile):

- the loop: a backward branch and its target bound a loop. Tensor-core kernels:
  the loop holding the most HMMA/HGMMA, the smallest such. Others: among the
  innermost loops holding FFMA (and shared loads, where any loop has both), the
  one with the most FFMA.
- one iteration: the loop body also holds paths a plain call never takes (score
  modifiers, masks, dropout, element-wise copies for unaligned tensors). The
  counted path is the one from the loop head to its back-edge with the most
  tensor-core instructions, then the most asynchronous global->shared copies
  (or 16-byte global loads: sm_75 has no cp.async)
  (so the steady state, which stages the next tile), then the fewest
  instructions. The loop's full static size is printed beside it.
- loops inside the loop (e.g. the tile-staging loop) count once per trip; the
  trip count is read from the inner loop's exit test (an induction register
  stepped by a constant and compared with a constant, counted for thread 0) and
  marked `?` (counted once) where that pattern is not found.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# --- instruction kinds --------------------------------------------------------
# Table columns in order; `classify` maps an opcode to one of them.
KINDS = ["HMMA", "HGMMA", "int", "FP", "MUFU", "cvt", "shared", "global", "local", "branch", "barrier", "other"]
TENSOR = {"HMMA", "HGMMA", "IMMA", "DMMA", "QMMA", "OMMA", "UTCHMMA", "UTCQMMA", "UTCIMMA"}
ASYNC_COPY = {"LDGSTS", "UBLKCP", "UTMALDG", "UTMAPF"}
INT_OPS = {
    "IMAD", "IADD3", "IADD", "IADD32I", "VIADD", "VIADDMNMX", "LEA", "SHF", "SHL", "SHR", "LOP3", "LOP",
    "LOP32I", "ISETP", "ICMP", "IMNMX", "VIMNMX", "VIMNMX3", "IMUL", "IMUL32I", "IABS", "ISCADD", "POPC",
    "FLO", "BREV", "BMSK", "SGXT", "IDP", "IDP4A", "MOV", "MOV32I", "SEL", "PRMT", "PLOP3", "P2R", "R2P",
}
FP_OPS = {
    "FFMA", "FFMA32I", "FADD", "FADD32I", "FMUL", "FMUL32I", "FMNMX", "FMNMX3", "FSETP", "FSET", "FSEL",
    "FCHK", "FSWZADD", "HFMA2", "HADD2", "HMUL2", "HMNMX2", "HSETP2", "HSET2", "DFMA", "DADD", "DMUL",
    "DSETP", "DMNMX", "FCMP",
}
CVT_OPS = {"F2F", "F2FP", "F2I", "I2F", "I2FP", "F2IP", "I2I", "I2IP", "FRND"}
SHARED_OPS = {"LDS", "LDSM", "STS", "STSM", "ATOMS"}
GLOBAL_OPS = {"LDG", "STG", "LD", "ST", "ATOMG", "ATOM", "RED", "REDG"} | ASYNC_COPY
LOCAL_OPS = {"LDL", "STL"}
BRANCH_OPS = {"BRA", "BRX", "JMP", "JMX", "BSSY", "BSYNC", "BREAK", "BPT", "CALL", "RET", "EXIT", "KILL"}
BARRIER_OPS = {"BAR", "WARPSYNC", "DEPBAR", "MEMBAR", "ERRBAR", "SYNCS", "ARRIVES", "WARPGROUP", "CCTL"}


def classify(opcode: str, pred: str) -> str:
    """The column of one instruction. `@!PT` instructions never execute (ptxas
    pads with them) but still take an issue slot: counted as other."""
    base = opcode.split(".")[0]
    if pred == "@!PT":
        return "other"
    if base in ("HMMA", "HGMMA"):
        return base
    if base in TENSOR:
        return "HMMA"
    # The uniform datapath's integer ops (UIADD3, ULOP3...) still take an issue slot.
    if base in INT_OPS or (base.startswith("U") and base[1:] in INT_OPS):
        return "int"
    if base in FP_OPS:
        return "FP"
    if base == "MUFU":
        return "MUFU"
    if base in CVT_OPS:
        return "cvt"
    if base in SHARED_OPS:
        return "shared"
    if base in GLOBAL_OPS:
        return "global"
    if base in LOCAL_OPS:
        return "local"
    if base in BRANCH_OPS:
        return "branch"
    if base in BARRIER_OPS:
        return "barrier"
    return "other"


# --- parsing cuobjdump -sass ----------------------------------------------------
@dataclass
class Instr:
    addr: int
    pred: str      # "" or the guard, e.g. "@!P0"
    opcode: str    # with modifiers, e.g. "HMMA.16816.F32.BF16"
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    def branch_target(self) -> int | None:
        # cuobjdump prints absolute targets: "BRA 0x4150" or "BRA P4, 0x1520".
        if self.base not in ("BRA", "BRX", "JMP", "CALL"):
            return None
        m = re.search(r"0x([0-9a-f]+)\s*$", self.operands)
        return int(m.group(1), 16) if m else None

    def falls_through(self) -> bool:
        # Unguarded BRA/EXIT/RET never reach the next instruction; `BRA P4, x` is still conditional.
        if self.base in ("BRA", "JMP", "EXIT", "RET", "KILL") and self.pred in ("", "@PT"):
            return self.base == "BRA" and re.match(r"!?P\d", self.operands) is not None
        return True


@dataclass
class Kernel:
    mangled: str
    demangled: str = ""
    instrs: list[Instr] = field(default_factory=list)


LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z0-9_][A-Z0-9_.]*)\s*([^;]*);")


def parse_sass(text: str) -> list[Kernel]:
    """Splits `cuobjdump -sass` output into kernels and their instructions."""
    kernels: list[Kernel] = []
    for line in text.splitlines():
        m = re.match(r"\s*Function\s*:\s*(\S+)", line)
        if m:
            kernels.append(Kernel(m.group(1)))
            continue
        m = LINE.search(line)
        if m and kernels:
            pred = (m.group(2) or "").strip()
            operands = m.group(4).replace(".reuse", "").strip()  # an operand-cache hint
            kernels[-1].instrs.append(Instr(int(m.group(1), 16), pred, m.group(3), operands))
    return kernels


def demangle(names: list[str]) -> list[str]:
    """c++filt / cu++filt when present, the mangled names otherwise."""
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None or not names:
        return list(names)
    out = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    return lines if len(lines) == len(names) else list(names)


TYPE_NAMES = {"c10::BFloat16": "bf16", "c10::Half": "fp16", "float": "fp32", "double": "fp64"}


def _split_top(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` outside <> and ()."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c in "<(") - (c in ">)")
        if c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def short_name(demangled: str) -> str:
    """`fusedllm::cuda::(anon)::attention_mma_forward_kernel<c10::BFloat16, ns::Tile<128, 80>>(...)`
    -> `mma_forward<bf16,Tile<128,80>>`; an enum argument `(ns::Stored)2` -> `Stored(2)`."""
    head = demangled.removeprefix("void ")
    depth, end = 0, len(head)
    for i, c in enumerate(head):  # the parameter list: the first "(" outside <> not after "::"
        depth += (c == "<") - (c == ">")
        if c == "(" and depth == 0 and not head[:i].endswith("::"):
            end = i
            break
    name, _, args = head[:end].partition("<")
    if not args:  # no template arguments: the plain name
        return name
    name = name.split("::")[-1].removeprefix("attention_").removesuffix("_kernel")
    return f"{name}<{_short_args(args.removesuffix('>'))}>"


def _short_args(args: str) -> str:
    """Template arguments, short: types by TYPE_NAMES, enum casts as Name(n),
    class templates without their namespaces (`ns::Tile<64, 80>` -> `Tile<64,80>`)."""
    shown = []
    for arg in _split_top(args.strip()):
        arg = arg.strip()
        cast = re.fullmatch(r"\((.+)\)(-?\d+)", arg)
        nested = re.fullmatch(r"([^<]+)<(.*)>", arg)
        if cast:
            shown.append(f"{cast.group(1).split('::')[-1]}({cast.group(2)})")
        elif nested and arg not in TYPE_NAMES:
            shown.append(f"{nested.group(1).split('::')[-1]}<{_short_args(nested.group(2))}>")
        else:
            shown.append(TYPE_NAMES.get(arg, arg))
    return ",".join(shown)


# --- the loop and one iteration ---------------------------------------------------
@dataclass
class Block:
    first: int                 # index of its first instruction
    last: int                  # index of its last instruction
    succ: list[int] = field(default_factory=list)   # block numbers


def basic_blocks(instrs: list[Instr]) -> list[Block]:
    """Blocks split at branch targets and after every branch or exit."""
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    leaders = {0}
    for i, ins in enumerate(instrs):
        t = ins.branch_target()
        if t is not None and t in index:
            leaders.add(index[t])
        if ins.base in BRANCH_OPS - {"BSSY", "BSYNC", "CALL"}:
            leaders.add(i + 1)
    starts = sorted(x for x in leaders if x < len(instrs))
    blocks = [Block(a, b - 1) for a, b in zip(starts, starts[1:] + [len(instrs)])]
    number = {b.first: n for n, b in enumerate(blocks)}
    for n, b in enumerate(blocks):
        last = instrs[b.last]
        if last.falls_through() and n + 1 < len(blocks):
            b.succ.append(n + 1)
        t = last.branch_target()
        if t is not None and t in index and last.base != "CALL":
            b.succ.append(number[index[t]])
    return blocks


def dominators(blocks: list[Block]) -> list[int]:
    """Each block's dominator set as a bit mask (iterative data flow from block 0;
    blocks it cannot reach, such as the trailing `BRA self`, are left out)."""
    reach, stack = {0}, [0]
    while stack:
        for s in blocks[stack.pop()].succ:
            if s not in reach:
                reach.add(s)
                stack.append(s)
    preds: list[list[int]] = [[] for _ in blocks]
    for n, b in enumerate(blocks):
        for s in b.succ:
            if n in reach:
                preds[s].append(n)
    every = (1 << len(blocks)) - 1
    dom = [every] * len(blocks)
    dom[0] = 1
    changed = True
    while changed:
        changed = False
        for n in sorted(reach - {0}):
            new = every
            for p in preds[n]:
                new &= dom[p]
            new = (new if preds[n] else 0) | (1 << n)
            if new != dom[n]:
                dom[n], changed = new, True
    # no dominators for the unreachable: an edge out of one is no back edge
    return [d if n in reach else 0 for n, d in enumerate(dom)]


@dataclass
class Loop:
    head: int          # block number
    latches: set[int]  # blocks branching back to the head
    body: set[int]     # block numbers


def find_loops(blocks: list[Block], dom: list[int]) -> list[Loop]:
    """Natural loops: an edge to a block that dominates its source is a back edge."""
    preds: list[list[int]] = [[] for _ in blocks]
    for n, b in enumerate(blocks):
        for s in b.succ:
            preds[s].append(n)
    loops: dict[int, Loop] = {}
    for n, b in enumerate(blocks):
        for h in b.succ:
            if dom[n] >> h & 1:
                loop = loops.setdefault(h, Loop(h, set(), {h}))
                loop.latches.add(n)
                stack = [n]
                while stack:
                    x = stack.pop()
                    if x not in loop.body:
                        loop.body.add(x)
                        stack.extend(preds[x])
    return list(loops.values())


def instrs_of(blocks: list[Block], body: set[int], instrs: list[Instr]):
    return [instrs[i] for n in body for i in range(blocks[n].first, blocks[n].last + 1)]


def count_in(items: list[Instr], kinds: set[str]) -> int:
    return sum(1 for ins in items if ins.base in kinds)


def main_loop(instrs: list[Instr], blocks: list[Block], loops: list[Loop]) -> Loop | None:
    """Tensor-core kernels: the smallest loop with the most tensor ops. Others:
    the innermost FFMA loop (with shared loads where one has them) with the most FFMA."""
    body = {id(lp): instrs_of(blocks, lp.body, instrs) for lp in loops}
    tensor = [(count_in(body[id(lp)], TENSOR), lp) for lp in loops]
    most = max((n for n, _ in tensor), default=0)
    if most:
        return min((lp for n, lp in tensor if n == most), key=lambda lp: len(body[id(lp)]))
    fma = {"FFMA", "DFMA", "HFMA2"}
    cands = [lp for lp in loops if count_in(body[id(lp)], fma)]
    cands = [lp for lp in cands if count_in(body[id(lp)], {"LDS", "LDSM"})] or cands
    inner = [lp for lp in cands if not any(o is not lp and o.body < lp.body for o in cands)]
    if not inner:
        return None
    return max(inner, key=lambda lp: (count_in(body[id(lp)], fma), -lp.head))


def hot_path(instrs: list[Instr], blocks: list[Block], dom: list[int], loop: Loop, tensor: bool) -> list[int]:
    """Block numbers one iteration runs: the path from the head to a latch ranked
    by (most tensor ops, most async copies or 16-byte loads, fewest instructions) in tensor-core
    kernels, by (most FMA, most shared loads, fewest instructions) in others.
    Back edges are dropped, so an inner loop's body is on the path once."""
    def weight(n: int) -> tuple[int, int, int]:
        items = instrs[blocks[n].first:blocks[n].last + 1]
        if tensor:
            # Copies: asynchronous ones, or (sm_75, no cp.async) 16-byte loads.
            wide_loads = sum(1 for ins in items if ins.base == "LDG" and ".128" in ins.opcode)
            return (-count_in(items, TENSOR), -count_in(items, ASYNC_COPY) - wide_loads, len(items))
        return (-count_in(items, {"FFMA", "DFMA", "HFMA2"}), -count_in(items, {"LDS", "LDSM"}), len(items))

    def forward(n: int) -> list[int]:
        return [s for s in blocks[n].succ if s in loop.body and not dom[n] >> s & 1]

    order, seen = [], set()   # reverse post-order of the loop's acyclic part
    def visit(n: int) -> None:
        stack = [(n, iter(forward(n)))]
        seen.add(n)
        while stack:
            x, it = stack[-1]
            nxt = next((s for s in it if s not in seen), None)
            if nxt is None:
                order.append(x)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(forward(nxt))))
    visit(loop.head)
    best = {loop.head: weight(loop.head)}
    prev: dict[int, int] = {}
    for n in reversed(order):
        if n not in best:
            continue
        for s in forward(n):
            cost = tuple(a + b for a, b in zip(best[n], weight(s)))
            if s not in best or cost < best[s]:
                best[s], prev[s] = cost, n
    end = min((n for n in loop.latches if n in best), key=lambda n: best[n])
    path = [end]
    while path[-1] != loop.head:
        path.append(prev[path[-1]])
    return path[::-1]


def trip_count(instrs: list[Instr], blocks: list[Block], inner: Loop) -> int | None:
    """Trips of an inner loop for thread 0, from its exit test: `@!P BRA head`
    with P = ISETP.cc(R, imm) and R stepped by a constant in the loop. None
    when the pattern is not there."""
    if len(inner.latches) != 1:
        return None
    latch = instrs[blocks[next(iter(inner.latches))].last]
    m = re.match(r"@(!?)(P\d)", latch.pred)
    if not m or latch.base != "BRA":
        return None
    negated, p = m.group(1) == "!", m.group(2)
    body = instrs_of(blocks, inner.body, instrs)
    test = step = None
    for ins in body:
        t = re.match(rf"{p}, PT, (R\d+), (0x[0-9a-f]+|\d+), PT$", ins.operands)
        if ins.base == "ISETP" and t:
            test = (ins.opcode.split(".")[1], t.group(1), int(t.group(2), 0))
    if test is None:
        return None
    cc, reg, bound = test
    for ins in body:
        s = re.match(rf"{reg}, {reg}, (0x[0-9a-f]+|\d+)(, RZ)?$", ins.operands)
        if ins.base in ("IADD3", "VIADD", "IADD") and s:
            step = int(s.group(1), 0)
    compare = {"GE": lambda u: u >= bound, "GT": lambda u: u > bound,
               "LT": lambda u: u < bound, "LE": lambda u: u <= bound}.get(cc)
    if not step or step >= 1 << 31 or compare is None:
        return None
    for trips in range(1, 100000):
        if compare((trips - 1) * step) == negated:  # the branch back is not taken
            return trips
    return None


@dataclass
class LoopReport:
    kernel: str
    static_size: int
    counts: Counter
    total: int
    inner: list[str]
    global_widths: Counter
    path: list[tuple[int, Instr]]


def analyse(kernel: Kernel) -> LoopReport | None:
    instrs = kernel.instrs
    if not instrs:
        return None
    blocks = basic_blocks(instrs)
    dom = dominators(blocks)
    loops = find_loops(blocks, dom)
    loop = main_loop(instrs, blocks, loops)
    if loop is None:
        return None
    tensor = count_in(instrs_of(blocks, loop.body, instrs), TENSOR) > 0
    path = hot_path(instrs, blocks, dom, loop, tensor)
    weight = {n: 1 for n in path}
    inner_notes = []
    for inner in loops:
        if inner is loop or not inner.body < loop.body or inner.head not in weight:
            continue
        trips = trip_count(instrs, blocks, inner)
        on = [n for n in path if n in inner.body]
        size = sum(blocks[n].last - blocks[n].first + 1 for n in on)
        inner_notes.append(f"{size}x{trips if trips else '?'}")
        for n in on:
            weight[n] *= trips or 1
    counts, widths, listing = Counter(), Counter(), []
    for n in path:
        for ins in instrs[blocks[n].first:blocks[n].last + 1]:
            kind = classify(ins.opcode, ins.pred)
            counts[kind] += weight[n]
            listing.append((weight[n], ins))
            if kind == "global":
                width = re.search(r"\.(8|16|32|64|128|U8|S8|U16|S16)\b", ins.opcode)
                widths[f"{ins.base}.{width.group(1) if width else '32'}"] += weight[n]
    static = len(instrs_of(blocks, loop.body, instrs))
    return LoopReport(short_name(kernel.demangled or kernel.mangled), static, counts, sum(counts.values()),
                      inner_notes, widths, listing)


# --- registers and spills --------------------------------------------------------
def resource_usage(cuobjdump: str, binary: Path, arch: str) -> dict[str, dict[str, int]]:
    """REG / STACK / LOCAL per mangled kernel name, from `cuobjdump -res-usage`."""
    out = run([cuobjdump, "-res-usage", *arch_filter(binary, arch), str(binary)])
    usage, name = {}, None
    for line in out.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
        elif name and "REG:" in line:
            usage[name] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
            name = None
    return usage


# --- compiling and disassembling ---------------------------------------------------
def run(cmd: list[str], **kw) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if res.returncode != 0:
        sys.exit(f"sass_table: failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr[-4000:]}")
    return res.stdout + res.stderr


def arch_filter(binary: Path, arch: str) -> list[str]:
    # A fat binary (.so, .o) may hold several architectures: disassemble the one asked for.
    return [] if binary.suffix == ".cubin" else ["-arch", f"sm_{arch}"]


def find_tool(name: str, hint: str) -> str:
    """The tool on PATH, else next to this Python (a venv's triton ships cuobjdump)."""
    path = shutil.which(name)
    if path is None:
        spec = importlib.util.find_spec("triton")
        if spec and spec.submodule_search_locations:
            cand = Path(spec.submodule_search_locations[0]) / "backends" / "nvidia" / "bin" / name
            path = str(cand) if cand.exists() else None
    if path is None:
        sys.exit(f"sass_table: {name} not found ({hint})")
    return path


def attention_groups() -> dict[str, list[Path]]:
    """csrc/cuda/attention*.cu in CMake's two attention groups (CMakeLists.txt)."""
    groups: dict[str, list[Path]] = {"attention_forward": [], "attention_backward": []}
    for cu in sorted((ROOT / "csrc" / "cuda").glob("attention*.cu")):
        backward = re.match(r"^attention.*(dq|dkdv|backward)$", cu.stem)
        groups["attention_backward" if backward else "attention_forward"].append(cu)
    return groups


def nvcc_flags(nvcc: str, out_dir: Path) -> list[str]:
    """The flags CMake gives the CUDA groups of _C: defines, include paths and options."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("sass_table: torch is not importable here; its headers are needed to compile")
    torch_dir = Path(spec.submodule_search_locations[0])
    import torch  # noqa: PLC0415  (only for the ABI flag CMake reads from it)

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # CMake copies the cuBLAS/cuSPARSE/... headers the toolkit lacks from torch's
    # nvidia-* wheels (ATen's CUDA headers include them): the same here.
    toolkit_inc = Path(os.path.realpath(nvcc)).parent.parent / "include"
    extra = out_dir / "cuda_library_headers"
    extra.mkdir(exist_ok=True)
    for inc in sorted(torch_dir.parent.glob("nvidia/*/include")):
        for h in inc.glob("*.h"):
            if not (toolkit_inc / h.name).exists() and not (extra / h.name).exists():
                shutil.copy(h, extra / h.name)
    return [
        "-O3", "-DNDEBUG", "-std=c++20", "--expt-relaxed-constexpr", "-Xptxas=-v",
        "-Xcudafe=--diag_suppress=186", "-Xcompiler=-fPIC", "-Xcompiler=-fvisibility=hidden",
        "-DFUSEDLLM_WITH_CUDA=1", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{ROOT / 'csrc' / 'include'}", "-isystem", str(extra),
        "-isystem", sysconfig.get_paths()["include"],
        "-isystem", str(torch_dir / "include"),
        "-isystem", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
    ]


def compile_cubins(arch: str, out_dir: Path, sources: list[Path] | None) -> list[Path]:
    """Device code only (-cubin), one translation unit per CMake group (or per
    given source), one nvcc at a time."""
    nvcc = find_tool("nvcc", "install the CUDA toolkit or put nvcc on PATH")
    flags = nvcc_flags(nvcc, out_dir)
    units = {s.stem: [s] for s in sources} if sources else attention_groups()
    cubins = []
    for name, files in units.items():
        tu = out_dir / f"{name}.cu"
        tu.write_text("".join(f'#include "{f.resolve()}"\n' for f in files))
        cubin = out_dir / f"{name}.sm_{arch}.cubin"
        print(f"sass_table: nvcc {name} for sm_{arch} ...", file=sys.stderr, flush=True)
        log = run([nvcc, "-cubin", f"-arch=sm_{arch}", *flags, "-o", str(cubin), str(tu)])
        (out_dir / f"{name}.sm_{arch}.ptxas.log").write_text(log)
        cubins.append(cubin)
    return cubins


# --- the table --------------------------------------------------------------------
def table(reports: list[tuple[LoopReport, dict[str, int]]]) -> str:
    kinds = [k for k in KINDS if k != "HGMMA" or any(r.counts["HGMMA"] for r, _ in reports)]
    head = ["kernel", "instr / iteration", "loop (static)", *kinds, "HMMA share", "non-HMMA per HMMA",
            "global widths", "inner loops (instr x trips)", "regs", "stack+local B"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, use in reports:
        tensor = r.counts["HMMA"] + r.counts["HGMMA"]
        share = f"{tensor / r.total:.1%}" if r.total else "-"
        ratio = f"{(r.total - tensor) / tensor:.1f}" if tensor else "-"
        widths = ", ".join(f"{k} x{v}" for k, v in sorted(r.global_widths.items())) or "-"
        cells = [r.kernel, str(r.total), str(r.static_size), *(str(r.counts[k]) for k in kinds), share, ratio,
                 widths, ", ".join(r.inner) or "-", str(use.get("REG", "?")),
                 str(use.get("STACK", 0) + use.get("LOCAL", 0)) if use else "?"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="90", help="SM architecture, e.g. 80, 90 (default 90)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--cubin", type=Path, help="read this cubin instead of compiling")
    src.add_argument("--so", type=Path, help="read this built extension (its sm_ARCH SASS) instead of compiling")
    src.add_argument("--sources", type=Path, nargs="+",
                     help="compile these .cu files (each alone) instead of the attention groups")
    ap.add_argument("--out", type=Path, help="directory for the compiled cubins (default: a temporary one)")
    ap.add_argument("--kernel", help="regular expression: only kernels whose short or full name matches")
    ap.add_argument("--all-kernels", action="store_true", help="not only kernels named attention*")
    ap.add_argument("--dump", action="store_true", help="also print each counted iteration's instructions")
    args = ap.parse_args(argv)
    arch = args.arch.removeprefix("sm_").replace(".", "")

    cuobjdump = find_tool("cuobjdump", "it comes with the CUDA toolkit (or the triton wheel)")
    tmp = None
    if args.cubin or args.so:
        binaries = [args.cubin or args.so]
        for b in binaries:
            if not b.exists():
                sys.exit(f"sass_table: {b} does not exist")
    else:
        out_dir = args.out
        if out_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="sass_table_")
            out_dir = Path(tmp.name)
        out_dir = out_dir.resolve()
        if out_dir == ROOT or ROOT / "csrc" in [out_dir, *out_dir.parents]:
            sys.exit("sass_table: --out must not be the source tree")
        out_dir.mkdir(parents=True, exist_ok=True)
        binaries = compile_cubins(arch, out_dir, args.sources)

    reports = []
    for binary in binaries:
        sass = run([cuobjdump, "-sass", *arch_filter(binary, arch), str(binary)])
        kernels = parse_sass(sass)
        if not kernels:
            sys.exit(f"sass_table: no sm_{arch} SASS in {binary} (a PTX-only build, or another architecture?)")
        for k, name in zip(kernels, demangle([k.mangled for k in kernels])):
            k.demangled = name
        usage = resource_usage(cuobjdump, binary, arch)
        for k in kernels:
            short = short_name(k.demangled)
            if not args.all_kernels and not short.startswith("attention") and "attention" not in k.demangled:
                continue
            if args.kernel and not (re.search(args.kernel, short) or re.search(args.kernel, k.demangled)):
                continue
            r = analyse(k)
            if r is None:
                print(f"sass_table: {short}: no loop found", file=sys.stderr)
                continue
            reports.append((r, usage.get(k.mangled, {})))
    if not reports:
        sys.exit("sass_table: no kernel matched")
    reports.sort(key=lambda ru: ru[0].kernel)
    print(table(reports))
    if args.dump:
        for r, _ in reports:
            print(f"\n{r.kernel}: the counted iteration (count x instruction)")
            for w, ins in r.path:
                print(f"  {w:3d} x /*{ins.addr:05x}*/ {ins.pred} {ins.opcode} {ins.operands}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
