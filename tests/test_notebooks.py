"""Every notebook in notebooks/ runs top to bottom (small sizes) without an error."""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "*.ipynb")))


EXPECTED = ["00_fused_rmsnorm", "01_modern_components", "02_gpt2_to_llama", "03_normalization_lab",
            "04_original_vs_modern_block"]


def test_there_are_notebooks():
    names = [os.path.splitext(os.path.basename(p))[0] for p in NOTEBOOKS]
    assert set(EXPECTED) <= set(names), f"missing: {sorted(set(EXPECTED) - set(names))}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_shape(path):
    """Outputs cleared, a small-size mode, and a closing eager-vs-fused measurement with a plot."""
    nb = nbformat.read(path, as_version=4)
    code = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    assert all(not cell.get("outputs") and cell.get("execution_count") is None
               for cell in nb.cells if cell.cell_type == "code"), "outputs must be cleared"
    assert any("FUSEDLLM_NOTEBOOK_SMALL" in source for source in code)
    plots = "plt.show()" in code[-1] or "plot_comparison(" in code[-1]
    assert plots and "fusedllm" in code[-1].lower(), \
        "the last cell measures eager against fused and plots it"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEDLLM_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), \
        "notebooks are stored with outputs cleared"
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
