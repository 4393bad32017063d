"""Every notebook in notebooks/ runs top to bottom (small sizes) without an error."""

import glob
import os
import re

import pytest

# Jupyter's packages come with requirements-dev.txt; a GPU machine running benchmarks/gpu_check.py may lack them.
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "*.ipynb")))


EXPECTED = ["00_fused_rmsnorm", "01_modern_components", "02_gpt2_to_llama", "03_normalization_lab",
            "04_original_vs_modern_block"]


def first_code_cell(path):
    return next(cell.source for cell in nbformat.read(path, as_version=4).cells
                if cell.cell_type == "code")


def test_there_are_notebooks():
    names = [os.path.splitext(os.path.basename(p))[0] for p in NOTEBOOKS]
    assert set(EXPECTED) <= set(names), f"missing: {sorted(set(EXPECTED) - set(names))}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_shape(path):
    """Outputs cleared, the size setting, and a closing eager-vs-fused measurement with a plot."""
    nb = nbformat.read(path, as_version=4)
    code = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    assert all(not cell.get("outputs") and cell.get("execution_count") is None
               for cell in nb.cells if cell.cell_type == "code"), "outputs must be cleared"
    assert "FUSEDLLM_NOTEBOOK_SIZE" in code[0] and "FUSEDLLM_NOTEBOOK_SMALL" in code[0], \
        "the first code cell reads the size setting"
    assert "FUSEDLLM_NOTEBOOK_SIZE=large" in nb.cells[0].source, \
        "the introduction says how to get the large sizes"
    plots = "plt.show()" in code[-1] or "plot_comparison(" in code[-1]
    assert plots and "fusedllm" in code[-1].lower(), \
        "the last cell measures eager against fused and plots it"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
@pytest.mark.parametrize("env, size", [
    ({}, "default"),
    ({"FUSEDLLM_NOTEBOOK_SMALL": "1"}, "small"),
    ({"FUSEDLLM_NOTEBOOK_SIZE": "small"}, "small"),
    ({"FUSEDLLM_NOTEBOOK_SIZE": "large"}, "large"),
    ({"FUSEDLLM_NOTEBOOK_SIZE": "large", "FUSEDLLM_NOTEBOOK_SMALL": "1"}, "large"),
])
def test_size_setting(path, env, size, monkeypatch):
    """The first code cell reads FUSEDLLM_NOTEBOOK_SIZE; FUSEDLLM_NOTEBOOK_SMALL=1 means small."""
    monkeypatch.delenv("FUSEDLLM_NOTEBOOK_SIZE", raising=False)
    monkeypatch.delenv("FUSEDLLM_NOTEBOOK_SMALL", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    first = first_code_cell(path)
    namespace = {}
    exec(first, namespace)
    assert namespace["SIZE"] == size
    assert namespace["by_size"]("s", "d", "l") == size[0]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_size_setting_rejects_unknown(path, monkeypatch):
    monkeypatch.setenv("FUSEDLLM_NOTEBOOK_SIZE", "huge")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    first = first_code_cell(path)
    with pytest.raises(ValueError, match="^" + re.escape(
            "FUSEDLLM_NOTEBOOK_SIZE='huge': use small, default or large") + "$"):
        exec(first, {})


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch, tmp_path):
    """Small sizes, top to bottom, without an error and without anything on stderr (warnings, or
    log lines from libraries such as the profiler's trace collector)."""
    monkeypatch.delenv("FUSEDLLM_NOTEBOOK_SMALL", raising=False)
    monkeypatch.setenv("FUSEDLLM_NOTEBOOK_SIZE", "small")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), \
        "notebooks are stored with outputs cleared"
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    stderr = [(index, output.text) for index, cell in enumerate(nb.cells)
              for output in cell.get("outputs", [])
              if output.output_type == "stream" and output.name == "stderr"]
    assert not stderr, f"cells wrote to stderr: {stderr}"
