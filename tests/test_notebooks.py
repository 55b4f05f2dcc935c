"""The quickstart notebook executes (small sizes) and draws its figures; its jupytext source
and the .ipynb hold the same code."""

from __future__ import annotations

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

import linattn_jax as la  # noqa: E402

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
QUICKSTART = NOTEBOOKS / "quickstart.ipynb"


def _outputs(nb, kind):
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if kind == "image" and "image/png" in out.get("data", {}):
                yield out
            if kind == "text" and out.get("output_type") == "stream":
                yield out["text"]


def test_quickstart_executes_small_and_draws_figures(monkeypatch, tmp_path):
    monkeypatch.setenv("LINATTN_NOTEBOOK_SMALL", "1")
    nb = nbformat.read(QUICKSTART, as_version=4)
    # "python3" resolves to ipykernel of the running interpreter (jupyter_client swaps the
    # kernelspec's "python" for sys.executable), so the notebook sees this environment.
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError on any failing cell
    text = "".join(_outputs(nb, "text"))
    assert "small run" in text
    first_words = {line.split()[0] for line in text.splitlines() if line.split()}
    for name in la.names():  # every registered mechanism is run and reported
        assert name in first_words, name
    # Figures: the attention maps, the causal maps, the fidelity curve, the learned spectrum.
    assert len(list(_outputs(nb, "image"))) >= 4
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


def test_quickstart_source_and_notebook_in_sync():
    jupytext = pytest.importorskip("jupytext")
    source = jupytext.read(NOTEBOOKS / "quickstart.py")
    nb = nbformat.read(QUICKSTART, as_version=4)
    pair = [(c.cell_type, c.source.strip()) for c in source.cells]
    assert pair == [(c.cell_type, c.source.strip()) for c in nb.cells]
