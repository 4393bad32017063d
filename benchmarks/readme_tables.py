"""Copies the latest benchmark tables (benchmarks/results/<name>.md) into README.md and the pages
of docs/, between the `<!-- bench:<name> -->` and `<!-- /bench:<name> -->` markers, and writes the
README's benchmark summaries between `<!-- bench-summary:<device> -->` and
`<!-- /bench-summary:<device> -->`: a few rows picked from those tables, each with the machine and
date its table names. tests/test_docs.py fails when a copy differs from what this script writes.

    python benchmarks/readme_tables.py            # rewrite README.md and docs/*.md
    python benchmarks/readme_tables.py --check    # exit 1 if anything would change
"""

import glob
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

# (block, table, case, [(column, how the peer reads in the summary), ...]); a column the table
# lacks (a peer that was not measured, e.g. Liger-Kernel where it is not installed) is left out.
SUMMARY = {
    "cpu": [
        ("RMSNorm", "rms_norm", "4096x4096 bfloat16 fwd+bwd",
         [("× eager", "eager"), ("× F.rms_norm", "`F.rms_norm`"), ("× compile", "`torch.compile`")]),
        ("SwiGLU", "swiglu", "4096x11008 bfloat16 fwd+bwd",
         [("× eager", "eager"), ("× compile", "`torch.compile`")]),
        ("RoPE", "rope", "4x32/8x2048x128 bfloat16 fwd+bwd",
         [("× HF", "HF `apply_rotary_pos_emb`"), ("× compile", "`torch.compile`")]),
        ("attention", "attention", "S=2048 bfloat16 fwd+bwd",
         [("× SDPA", "SDPA"), ("× eager", "eager")]),
        ("linear cross-entropy", "cross_entropy", "16384x2048->32000 bfloat16 fwd+bwd",
         [("× eager", "eager"), ("× compile", "`torch.compile`"), ("peak / eager", "eager's peak memory")]),
        ("MoE layer", "moe", "qwen3_moe 4096 bfloat16 fwd+bwd",
         [("× eager", "eager"), ("× grouped_mm", "`grouped_mm`"), ("× compile", "`torch.compile`")]),
        ("int8 KV cache, decoding step", "kv_int8", "batch 8, context 32768",
         [("int8 × bf16", "our bfloat16 cache"), ("int8 × SDPA", "SDPA over bfloat16")]),
        ("HF Llama training step, patched", "model_bfloat16", "HF Llama: fusedllm patch, fused loss",
         [("× HF sdpa", "HF sdpa"), ("peak / HF sdpa", "HF sdpa's peak memory")]),
    ],
    "cuda": [
        ("RMSNorm", "rms_norm_cuda", "4096x4096 bfloat16 fwd+bwd",
         [("× eager", "eager"), ("× F.rms_norm", "`F.rms_norm`"), ("× compile", "`torch.compile`"),
          ("× Liger", "Liger-Kernel")]),
        ("SwiGLU", "swiglu_cuda", "4096x11008 bfloat16 fwd+bwd",
         [("× eager", "eager"), ("× compile", "`torch.compile`"), ("× Liger", "Liger-Kernel")]),
        ("RoPE", "rope_cuda", "4x32/8x2048x128 bfloat16 fwd+bwd",
         [("× HF", "HF `apply_rotary_pos_emb`"), ("× compile", "`torch.compile`"),
          ("× Liger (HF layout)", "Liger-Kernel")]),
        ("attention", "attention_cuda", "S=4096 bfloat16 fwd+bwd",
         [("× SDPA", "SDPA"), ("× compile", "`torch.compile`")]),
        ("linear cross-entropy", "cross_entropy_cuda", "4096x2048->32000 bfloat16 fwd+bwd",
         [("× eager", "eager"), ("× Liger", "Liger-Kernel"), ("peak / eager", "eager's peak memory")]),
        ("MoE layer", "moe_cuda", "qwen3_moe 4096 bfloat16 fwd+bwd",
         [("× eager", "eager"), ("× grouped_mm", "`grouped_mm`")]),
        ("int8 KV cache, decoding step", "kv_int8_cuda", "batch 8, context 32768",
         [("int8 × bf16", "our bfloat16 cache"), ("int8 × SDPA", "SDPA over bfloat16")]),
        ("tiny HF Llama, decoding", "decode_cuda", "decode B=1 prompt=1024 +32",
         [("× SDPA", "SDPA")]),
    ],
}


def read_table(name):
    """(first line, header cells, {case: row cells}) of results/<name>.md, or None."""
    path = os.path.join(RESULTS, f"{name}.md")
    if not os.path.exists(path):
        return None
    lines = open(path).read().strip().splitlines()
    rows = [line for line in lines if line.startswith("|")]
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split(" | ")]
    header = cells(rows[0])
    body = {}
    for line in rows[2:]:
        row = cells(line)
        body[row[0]] = row
    return lines[0], header, body


def summary(device):
    """The markdown summary table of SUMMARY[device]."""
    out = ["| block | case | fusedllm against (×: their time / ours; peak: ours / theirs) | machine, torch, date |", "| --- | --- | --- | --- |"]
    for block, name, case, peers in SUMMARY[device]:
        table = read_table(name)
        if table is None or case not in table[2]:
            print(f"summary {device}: no row {case!r} in results/{name}.md: left out")
            continue
        title, header, rows = table
        row = rows[case]
        parts = []
        for column, peer in peers:
            if column in header and row[header.index(column)]:
                parts.append(f"{row[header.index(column)]}× {peer}")
        machine = title.split(" on ", 1)[1] if " on " in title else title
        out.append(f"| {block} | {case} | {', '.join(parts)} | {machine} |")
    return "\n".join(out)


def rewrite(text):
    """text with every bench block and summary block replaced by what the results say now."""
    for name in re.findall(r"<!-- bench:(\w+) -->", text):
        path = os.path.join(RESULTS, f"{name}.md")
        if not os.path.exists(path):
            print(f"no {path}: left as it is")
            continue
        table = open(path).read().strip()
        # the block may be empty: the closing marker then follows the opening one directly
        text = re.sub(rf"(<!-- bench:{name} -->\n)(?:.*?\n)?(<!-- /bench:{name} -->)",
                      lambda m: m.group(1) + table + "\n" + m.group(2), text, flags=re.S)
    for device in re.findall(r"<!-- bench-summary:(\w+) -->", text):
        table = summary(device)
        text = re.sub(rf"(<!-- bench-summary:{device} -->\n)(?:.*?\n)?(<!-- /bench-summary:{device} -->)",
                      lambda m: m.group(1) + table + "\n" + m.group(2), text, flags=re.S)
    return text


def documents():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def main(argv=None):
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale = []
    for path in documents():
        text = open(path).read()
        new = rewrite(text)
        if new != text:
            stale.append(os.path.relpath(path, ROOT))
            if not check:
                open(path, "w").write(new)
                print(f"{os.path.relpath(path, ROOT)}: tables updated")
    if check and stale:
        print("benchmark tables differ from benchmarks/results in: " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
