"""The documentation cannot drift from the code: every Python block of README.md and docs/*.md
runs here, and every benchmark table in them is the one its script wrote.

The blocks of one page run in order in one namespace, as a reader would paste them. A block whose
first line is ``# needs: <what>`` (``cuda``, ``simt``, ``transformers``) is skipped where that is
missing. The notebooks run through the Jupyter route the README documents: a kernel registered
under the name ``fusedllm`` and ``jupyter execute``.
"""

import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import readme_tables  # noqa: E402

DOCUMENTS = readme_tables.documents()
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path):
    return FENCE.findall(open(path).read())


def needs(block):
    first = block.lstrip().split("\n", 1)[0]
    match = re.match(r"#\s*needs:\s*(.*)", first)
    found = {word.strip() for word in match.group(1).split(",")} if match else set()
    if re.search(r"""autocast\(\s*["']cuda|GradScaler\(\s*["']cuda|device=["']cuda|\.cuda\(\)""", block):
        found.add("cuda")  # a block written for a GPU, without the marker line
    if "transformers" in block:
        found.add("transformers")
    return found


# What a page's blocks take as given and do not build themselves (a page another document
# introduces): run before that page's first block.
PRELUDES = {
    "docs/mixed-precision.md": """
import torch
import fusedllm
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).cuda()
ids = labels = torch.randint(0, 128, (2, 16), device="cuda")
""",
}


def missing(requirement):
    """Why a block needing `requirement` cannot run here, or None."""
    if requirement == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device"
    if requirement == "simt":
        try:
            import fusedllm.simt
            fusedllm.simt._load()
        except Exception as error:  # not built: make test builds it
            return f"the CUDA emulator is not built ({error})"
        return None
    if requirement == "transformers":
        try:
            import transformers  # noqa: F401
        except ImportError:
            return "transformers is not installed"
        return None
    raise AssertionError(f"unknown requirement {requirement!r} in a doc block")


PAGES = [path for path in DOCUMENTS if python_blocks(path)]


def test_every_page_is_collected():
    names = {os.path.relpath(path, ROOT) for path in PAGES}
    assert "README.md" in names
    assert len(names) >= 10, names


@pytest.mark.parametrize("path", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_python_blocks_run(path, monkeypatch, tmp_path):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__doc_block__"}
    ran = 0
    prelude = PRELUDES.get(os.path.relpath(path, ROOT))
    for index, block in enumerate(python_blocks(path)):
        reasons = [why for why in map(missing, needs(block) | (needs(prelude) if prelude else set())) if why]
        if reasons:
            continue
        if prelude:
            exec(prelude, namespace)
            prelude = None
        code = compile(block, f"{os.path.relpath(path, ROOT)}[block {index}]", "exec")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            exec(code, namespace)
        ran += 1
    if not ran:
        pytest.skip("every block of this page needs something missing here")


def test_blocks_counted():
    """How many blocks there are, and how many can run on this machine (printed with -s)."""
    blocks = [(path, block) for path in PAGES for block in python_blocks(path)]
    runnable = [1 for path, block in blocks if not [why for why in map(missing, needs(block)) if why]]
    print(f"{len(blocks)} Python blocks in {len(PAGES)} pages, {len(runnable)} runnable here")
    assert len(blocks) >= 15


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: os.path.relpath(p, ROOT))
def test_benchmark_tables_are_the_scripts(path):
    """Each `<!-- bench:<name> -->` block equals benchmarks/results/<name>.md, and each summary
    block what benchmarks/readme_tables.py makes of those tables now."""
    text = open(path).read()
    for name in re.findall(r"<!-- bench:(\w+) -->", text):
        assert os.path.exists(os.path.join(readme_tables.RESULTS, f"{name}.md")), \
            f"{os.path.relpath(path, ROOT)} has a bench:{name} block but no benchmarks/results/{name}.md"
    assert readme_tables.rewrite(text) == text, (
        f"a benchmark table in {os.path.relpath(path, ROOT)} is not the one in benchmarks/results/: "
        "run `python benchmarks/readme_tables.py`")


def test_benchmark_markers_are_paired_and_the_readme_has_summaries():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "<!-- bench-summary:cpu -->" in readme and "<!-- bench-summary:cuda -->" in readme
    for path in DOCUMENTS:
        text = open(path).read()
        for kind, name in re.findall(r"<!-- (bench|bench-summary):(\w+) -->", text):
            assert f"<!-- /{kind}:{name} -->" in text, f"{path}: {kind}:{name} is not closed"


def test_summary_rows_name_machine_and_date():
    for device in readme_tables.SUMMARY:
        for line in readme_tables.summary(device).splitlines()[2:]:
            assert re.search(r"\d{4}-\d{2}-\d{2} \|$", line), line


def test_readme_is_short_and_links_resolve():
    readme = os.path.join(ROOT, "README.md")
    assert len(open(readme).read().splitlines()) <= 300
    for path in DOCUMENTS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", open(path).read()):
            if "://" in target:
                continue
            assert os.path.exists(os.path.join(os.path.dirname(path), target)), f"{path}: {target}"


def test_notebooks_name_the_fusedllm_kernel():
    notebooks = sorted(os.listdir(os.path.join(ROOT, "notebooks")))
    for name in notebooks:
        if name.endswith(".ipynb"):
            meta = json.load(open(os.path.join(ROOT, "notebooks", name)))["metadata"]
            assert meta["kernelspec"]["name"] == "fusedllm", name
            assert meta["kernelspec"]["language"] == "python", name


def test_compat_notebook_names_and_old_aliases():
    import fusedllm.compat as compat
    from fusedllm.compat import gpt2_to_llama, modern_components, normalization_lab, original_vs_modern_block
    assert (gpt2_to_llama, modern_components, normalization_lab, original_vs_modern_block) == \
        (compat.nb003, compat.nb000, compat.nb002, compat.nb001)
    from fusedllm.compat.gpt2_to_llama import LLaMAModel
    from fusedllm.compat.nb003 import LLaMAModel as old
    assert LLaMAModel is old


@pytest.mark.slow
def test_jupyter_route(tmp_path):
    """What the README says after `make jupyter`: a kernel named fusedllm for this user, then
    `jupyter execute` on a notebook (its metadata names that kernel), and `--kernel_name=fusedllm`.
    The kernel goes into a scratch Jupyter data directory instead of the user's."""
    jupyter = os.path.join(os.path.dirname(sys.executable), "jupyter")
    if not os.path.exists(jupyter):
        pytest.skip("no jupyter command next to this Python (make jupyter installs it)")
    env = dict(os.environ, JUPYTER_DATA_DIR=str(tmp_path / "data"), JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), FUSEDLLM_NOTEBOOK_SIZE="small", MPLBACKEND="Agg")
    env.pop("FUSEDLLM_NOTEBOOK_SMALL", None)
    subprocess.run([sys.executable, "-m", "ipykernel", "install", "--user", "--name", "fusedllm",
                    "--display-name", "Python (fusedllm)"], env=env, check=True, capture_output=True)
    notebook = os.path.join(ROOT, "notebooks", "00_fused_rmsnorm.ipynb")
    for extra in ([], ["--kernel_name=fusedllm"]):
        run = subprocess.run([jupyter, "execute", *extra, notebook], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
