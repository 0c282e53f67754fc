"""The example notebook runs headless, top to bottom, through a real kernel (nbclient), and its
outputs hold the loss plot, the pipeline timeline and the layout table."""

from __future__ import annotations

import os

import nbformat
from nbclient import NotebookClient

from helpers.cli import ROOT


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


def test_a_kernel_sent_sigterm_ends_without_ray_s_stack_dump(tmp_path):
    """jupyter_client sends SIGTERM to a kernel that has not exited within seconds of its
    shutdown request (Ray's teardown of a local instance on a busy machine does not): the kernel
    that raymp connected to Ray then ends at once, without the stack dump Ray's handler prints."""
    import signal

    from jupyter_client import KernelManager

    with open(tmp_path / "kernel.err", "w") as err:
        km = KernelManager(kernel_name="python3")
        km.start_kernel(stderr=err, env={**os.environ, "RAY_ADDRESS": ""}, cwd=str(ROOT))
        try:
            kc = km.client()
            kc.start_channels()
            kc.wait_for_ready(timeout=120)
            reply = kc.execute_interactive("from raymp.ray_connection import connect; connect(None, 1)",
                                           timeout=300)
            kc.stop_channels()
            assert reply["content"]["status"] == "ok"
            os.kill(km.provisioner.pid, signal.SIGTERM)
            assert km.provisioner.process.wait(timeout=120) == 128 + signal.SIGTERM
        finally:
            if km.is_alive():  # the handler failed: no kernel left behind
                km.shutdown_kernel(now=True)
            km.cleanup_resources()
    assert "SIGTERM received" not in (tmp_path / "kernel.err").read_text()
