"""A headless-Chromium screenshot of the MLflow UI comparing an experiment's raymp runs in the
chart view, plus the rendered page's DOM (so a test can check what the page shows).

    python scripts/mlflow_ui_screenshot.py --tracking-uri sqlite:///runs/mlflow.db --experiment raymp
    python scripts/mlflow_ui_screenshot.py --tracking-uri http://127.0.0.1:5000 --experiment raymp
    # a sweep's trials (its child runs) compared, and the sweep's own run:
    python scripts/mlflow_ui_screenshot.py --filter "tags.mlflow.parentRunId = '<id>'"
    python scripts/mlflow_ui_screenshot.py --run <id>

With a database URI, an `mlflow server --workers 1` is started on a free local port for the
shot and stopped after. Needs Chromium (Debian: apt-get install -y chromium).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, seconds: float, server=None) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return
        except OSError:
            if server is not None and server.poll() is not None:
                raise RuntimeError("mlflow server exited before answering")
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {seconds:g}s")


def experiment_id(url: str, name: str) -> str:
    query = urllib.parse.urlencode({"experiment_name": name})
    with urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/get-by-name?{query}", timeout=30) as r:
        return json.loads(r.read())["experiment"]["experiment_id"]


def rendered_charts(dom: str) -> list[str]:
    """The titles of the metric charts the page has drawn (a plotly plot inside each card)."""
    if "js-plotly-plot" not in dom:
        return []
    import re

    return re.findall(r'title="([A-Za-z0-9_/.]+)"', dom)


def run_name(url: str, run_id: str) -> str:
    with urllib.request.urlopen(f"{url}/api/2.0/mlflow/runs/get?run_id={run_id}", timeout=30) as r:
        return json.loads(r.read())["run"]["info"]["run_name"]


def shoot(url: str, experiment: str, out: Path, wait_s: float = 180, search: str | None = None,
          run_id: str | None = None, compare: list[str] | None = None) -> tuple[Path, str]:
    """(screenshot path, rendered DOM) of the experiment's runs in chart-compare mode (those
    `search` matches: a filter in MLflow's search syntax), of one run's page (`run_id`) or of MLflow's
    page comparing the runs `compare` names (params, metrics, plots), once it
    is drawn: the page first shows loading spinners (the charts came ~25 s later here), so it is
    loaded again with a doubled virtual-time budget until its DOM holds plotly charts (the run's
    name, for a run's page), for at most `wait_s` seconds."""
    browser = find_browser()
    if browser is None:
        raise RuntimeError("no Chromium found; install it (Debian: apt-get install -y chromium)")
    exp = experiment_id(url, experiment)
    runs = f"{url}/#/experiments/{exp}/runs"
    if compare:
        names = [run_name(url, r) for r in compare]
        query = urllib.parse.urlencode({"runs": json.dumps(compare), "experiments": json.dumps([exp])},
                                       quote_via=urllib.parse.quote)
        page = f"{url}/#/compare-runs?{query}"
        drawn = lambda dom: all(n in dom for n in names) and "js-plotly-plot" in dom  # noqa: E731
    elif run_id is not None:
        page, name = f"{runs}/{run_id}", run_name(url, run_id)
        drawn = lambda dom: name in dom and "Parameters" in dom  # noqa: E731
    else:
        query = {"workflowType": "machine_learning", "compareRunsMode": "CHART",
                 **({"searchFilter": search} if search else {})}
        page, drawn = f"{runs}?{urllib.parse.urlencode(query, quote_via=urllib.parse.quote)}", rendered_charts
    out.parent.mkdir(parents=True, exist_ok=True)
    deadline, budget_ms = time.time() + wait_s, 5000
    while True:
        common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--hide-scrollbars", "--window-size=1600,1000", f"--virtual-time-budget={budget_ms}"]
        dom = subprocess.run(common + ["--dump-dom", page], check=True, capture_output=True, text=True,
                             timeout=180).stdout
        if drawn(dom):
            break
        if time.time() > deadline:
            raise RuntimeError(f"the MLflow UI drew no chart within {wait_s:g} s (shoot's wait_s)")
        budget_ms = min(2 * budget_ms, 120_000)
    subprocess.run(common + [f"--screenshot={out}", page], check=True, capture_output=True, timeout=180)
    return out, dom


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", default="sqlite:///runs/mlflow.db")
    parser.add_argument("--experiment", default="raymp")
    parser.add_argument(
        "--out", default="runs/mlflow-ui.png", help="screenshot path (the DOM goes beside it)"
    )
    parser.add_argument(
        "--filter",
        help="compare only the runs this MLflow search matches (a sweep's trials: "
        "\"tags.mlflow.parentRunId = '<id>'\")",
    )
    parser.add_argument("--run", help="shoot this run's page instead of the comparison")
    parser.add_argument("--compare", nargs="+", help="shoot MLflow's compare page of these run ids")
    args = parser.parse_args(argv)
    server = None
    url = args.tracking_uri
    if not url.startswith("http"):
        port = _free_port()
        workdir = tempfile.mkdtemp(prefix="mlflow-ui-")
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--workers", "1", "--host", "127.0.0.1",
             "--port", str(port), "--backend-store-uri", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir)
        url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, 120, server)
        out, dom = shoot(url, args.experiment, Path(args.out), search=args.filter, run_id=args.run,
                         compare=args.compare)
        dom_path = out.with_suffix(".html")
        dom_path.write_text(dom)
        print(f"screenshot: {out}\nrendered page: {dom_path}")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
