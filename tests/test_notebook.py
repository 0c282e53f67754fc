"""The example notebook runs headless, top to bottom, through a real kernel (nbclient), and its
outputs hold the loss plot, the pipeline timeline and the layout table."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def test_example_notebook_executes(tmp_path):
    nb = nbformat.read(ROOT / "examples" / "train_tiny.ipynb", as_version=4)
    env_before = dict(os.environ)
    # The kernel inherits the environment: its own local Ray, a short run, outputs in tmp.
    os.environ.update({"RAY_ADDRESS": "", "RAYMP_NOTEBOOK_OUT": str(tmp_path), "RAYMP_NOTEBOOK_STEPS": "8"})
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(ROOT / "examples")}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    # Clean: no warning a notebook user cannot act on (tqdm, ipywidgets, Ray's auth, ...).
    streams = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert not [w for w in ("Warning", "WARNING", "warn(", "INFO") if w in streams], streams
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2, "expected the loss plot and the timeline"
    # Progress: plain stream lines, or rich's rendering as display data inside Jupyter.
    text = "".join(
        o.get("text", "") + o.get("data", {}).get("text/plain", "") + o.get("data", {}).get("text/html", "")
        for o in outputs
    )
    assert "step     8/8" in text and "dp=2 pp=2 tp=1 zero=2" in text  # live progress was shown
    tables = [o for o in outputs if "text/html" in o.get("data", {})]
    assert any("node_ip" in t["data"]["text/html"] for t in tables)
    assert (tmp_path / "mlflow.db").is_file()
    # The sweep's trials, from MLflow: both completed, their learning rates and losses.
    assert "params.optimizer.lr" in tables[-1]["data"]["text/html"] and "completed (best)" in text
    assert tables[-1]["data"]["text/html"].count("FINISHED") == 2
