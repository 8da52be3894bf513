"""The notebooks run top to bottom from a clean kernel (issue 6 §3).

Each notebook runs in a fresh kernel with a temporary working directory; a failing cell fails
the test with that cell's traceback.
"""

from __future__ import annotations

import pathlib
import time

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
BUDGET_S = 120  # per notebook; each is written to take well under a minute on a laptop CPU


def test_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "taming_loss_spikes.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="the [test] extra installs nbformat")
    nbclient = pytest.importorskip("nbclient", reason="the [test] extra installs nbclient")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:  # from a clean state: ignore whatever outputs were saved
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    # allow_errors: every cell runs, so an error in any of them (also one tagged
    # raises-exception, which nbclient would let pass) is collected and reported below.
    client = nbclient.NotebookClient(notebook, timeout=BUDGET_S, kernel_name="python3",
                                     allow_errors=True,
                                     resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    errors = [f"cell {i}: {o.ename}: {o.evalue}" for i, c in enumerate(notebook.cells)
              if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name} raised in " + "; ".join(errors)
    assert elapsed < BUDGET_S, f"{path.name} took {elapsed:.0f} s"
