"""Sweeps of the tiny model on the session's Ray whose trials are checked in MLflow: parameters,
statuses, the stop reason of the trials ASHA stopped, the best trial, a trial killed mid-way that
goes on from its checkpoint with the loss curve of one that was not, a rank lost inside a trial,
the layout search, and Optuna."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raymp.sweeps import sweep


def _sweep_base(tiny_cfg, **train) -> dict:
    cfg = tiny_cfg(train={"steps": 12, "global_batch_size": 8, "seq_len": 32, "log_every": 1, **train})
    cfg["optimizer"]["warmup_steps"] = 2
    cfg["tracking"] = {"enabled": True}
    return cfg


def _children(uri: str, parent_run_id: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_run(parent_run_id).info.experiment_id],
                              f"tags.mlflow.parentRunId = '{parent_run_id}'")
    return client, {r.info.run_id: r for r in runs}


def test_sweep_with_asha_nests_its_trials_in_mlflow(tiny_cfg):
    base = _sweep_base(tiny_cfg)
    result = sweep({"name": "lr-zero", "max_concurrent": 1, "metric": "loss", "mode": "min",
                    "space": {"optimizer.lr": {"grid": [3e-3, 1e-5]}, "parallel.zero": {"grid": [0, 1]}},
                    "asha": {"grace_period": 4, "reduction_factor": 2}}, base=base, log=lambda *_: None)
    assert len(result.trials) == 4
    stopped = [t for t in result.trials if t.status == "stopped early"]
    assert stopped and all(t.params["optimizer.lr"] == 1e-5 and t.steps < 12 for t in stopped)
    assert all(t.status == "completed" and t.steps == 12 for t in result.trials if t not in stopped)

    client, children = _children(f"sqlite:///{base['output_dir']}/mlflow.db", result.parent_run_id)
    assert set(children) == {t.run_id for t in result.trials}
    last = {}
    for t in result.trials:
        run = children[t.run_id]
        assert float(run.data.params["optimizer.lr"]) == t.params["optimizer.lr"]
        assert int(run.data.params["parallel.zero"]) == t.params["parallel.zero"]
        history = client.get_metric_history(t.run_id, "fit/loss")
        assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(t.steps))
        last[t.run_id] = max(history, key=lambda m: m.step).value
        assert last[t.run_id] == pytest.approx(t.value, rel=1e-6)
        if t in stopped:
            assert run.info.status == "KILLED" and "stopped early" in run.data.tags["raymp.trial_stop"]
        else:  # ended as a run's fit() ends it
            assert run.info.status == "FINISHED" and "raymp.trial_stop" not in run.data.tags
            assert "speed/tok_s_med" in run.data.metrics
            assert "loss_curve.png" in {a.path for a in client.list_artifacts(t.run_id)}
    best_by_mlflow = min(last, key=last.get)
    assert last[result.best.run_id] == last[best_by_mlflow]
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["raymp.best_run_id"] == result.best.run_id
    assert parent.data.metrics["best/loss"] == pytest.approx(result.best.value)
    artifacts = {a.path for a in client.list_artifacts(result.parent_run_id)}
    assert {"trials.txt", "metric_by_field.png"} <= artifacts


def test_a_killed_trial_goes_on_from_its_checkpoint(tiny_cfg, tmp_path):
    """Two trials of one config; the first to reach step 6 has its process killed (its actors go
    with it). Tune restarts it from the checkpoint of step 4 (checkpoint.every): its MLflow run
    goes on, and its losses at every step equal the other trial's, which was never killed."""
    from helpers.sweep_trials import DIE_AFTER_STEP, DiesOnceTrial

    base = _sweep_base(tiny_cfg)
    base["checkpoint"] = {"every": 4}
    result = sweep({"name": "killed", "max_concurrent": 1, "samples": 2, "retries": 1, "asha": None,
                    "space": {"optimizer.lr": {"grid": [3e-3]}}}, base=base, log=lambda *_: None,
                   trial_cls=DiesOnceTrial)
    assert [t.status for t in result.trials] == ["completed", "completed"]
    died = Path(base["output_dir"], "trial-died").read_text()
    assert DIE_AFTER_STEP < 12 and died in {t.trial_id for t in result.trials}
    client, children = _children(f"sqlite:///{base['output_dir']}/mlflow.db", result.parent_run_id)
    curves = {t.trial_id: sorted(client.get_metric_history(t.run_id, "fit/loss"), key=lambda m: m.step)
              for t in result.trials}
    for curve in curves.values():
        assert [m.step for m in curve] == list(range(12))  # every step once: the redone ones replaced
    killed, clean = curves[died], next(c for tid, c in curves.items() if tid != died)
    for a, b in zip(killed, clean):
        assert a.value == pytest.approx(b.value, rel=1e-5), (a.step, a.value, b.value)
    killed_run = children[next(t.run_id for t in result.trials if t.trial_id == died)]
    assert killed_run.info.status == "FINISHED" and killed_run.data.tags["raymp.events"] == "1"
    event = json.loads(Path(client.download_artifacts(killed_run.info.run_id, "events/resume-1.json",
                                                      str(tmp_path))).read_text())
    assert event["step"] == 4  # from the checkpoint of step 4, not from the start


def test_a_rank_lost_inside_a_trial_is_recovered_and_the_trial_trains_the_same(tiny_cfg):
    """Two trials of one config; the first loses rank 1's actor after step 2 (its process lives
    on). Its next step recovers as a single run does (dp=2 ZeRO-0: rank 0 goes on with its state,
    and the lost replica joins back from it); both trials then log the same loss at every step,
    once, and both recovery events are in MLflow."""
    from helpers.sweep_trials import LosesARankOnceTrial

    base = _sweep_base(tiny_cfg, steps=5)
    result = sweep({"name": "lost-rank", "max_concurrent": 1, "samples": 2, "asha": None,
                    "space": {"optimizer.lr": {"grid": [3e-3]}}}, base=base, log=lambda *_: None,
                   trial_cls=LosesARankOnceTrial)
    assert [t.status for t in result.trials] == ["completed", "completed"]
    lost = Path(base["output_dir"], "rank-lost").read_text()
    client, children = _children(f"sqlite:///{base['output_dir']}/mlflow.db", result.parent_run_id)
    curves = {t.trial_id: sorted(client.get_metric_history(t.run_id, "fit/loss"), key=lambda m: m.step)
              for t in result.trials}
    for curve in curves.values():
        assert [m.step for m in curve] == list(range(5))
    recovered, clean = curves[lost], next(c for tid, c in curves.items() if tid != lost)
    assert [m.value for m in recovered] == pytest.approx([m.value for m in clean], rel=1e-5)
    restarts = {t.trial_id: children[t.run_id].data.tags.get("raymp.restarts", "0") for t in result.trials}
    assert restarts[lost] == "2" and set(restarts.values()) == {"0", "2"}  # survivors, then the join


def test_a_layout_search_picks_the_fastest_measured_layout_and_the_next_plan_uses_its_prices(
    tiny_cfg, tmp_path, capsys
):
    """The planner's 3 best layouts of 4 CPU actors (the config's cluster: 1 x 4), 4 steps each,
    one at a time: the pick is the fastest measured, every layout trained the same thing (equal
    losses), and the compute rate and cost factors measured are saved, then used by `raymp plan`."""
    import yaml

    from raymp.calibration import load_calibration
    from raymp.cli import main
    from raymp.sweeps import search_layouts

    base = _sweep_base(tiny_cfg, steps=4)
    base["cluster"] = {"nodes": 1, "gpus_per_node": 4, "gpu_memory_gb": 4}
    found = search_layouts(base, layouts=3, steps=4, log=lambda *_: None)
    assert [m.status for m in found.layouts] == ["completed"] * 3
    assert len({m.layout for m in found.layouts}) == 3 and all(
        m.layout.world_size == 4 for m in found.layouts
    )
    assert found.best is min(found.layouts, key=lambda m: m.measured_s)
    losses = [m.loss for m in found.layouts]
    assert losses == pytest.approx([losses[0]] * 3, rel=1e-5)
    saved = load_calibration(base["output_dir"])
    assert (
        saved.compute_tflops == pytest.approx(found.compute_tflops)
        and saved.cost_factors == found.cost_factors
    )
    assert found.cost_factors and set(found.cost_factors) <= {"ddp", "fsdp", "tp", "sp", "cp", "pp"}
    table = found.table()
    assert "(fastest)" in table and table.count("completed") == 3
    client, children = _children(f"sqlite:///{base['output_dir']}/mlflow.db", found.parent_run_id)
    assert len(children) == 3 and client.download_artifacts(found.parent_run_id, "layouts.txt", str(tmp_path))
    parent = client.get_run(found.parent_run_id)
    assert parent.data.tags["raymp.fastest_layout"] == found.best.layout.text(detail=True)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(base))
    assert main(["plan", str(path)]) == 0
    assert "priced as measured on this cluster" in capsys.readouterr().out


def test_a_trial_that_cannot_run_ends_with_its_reason_and_the_sweep_goes_on(tiny_cfg, tmp_path):
    """Data a trial cannot read is found when the trial starts (the config takes any source): that
    trial fails with the data error's one line, the other trial runs to the end."""
    base = _sweep_base(tiny_cfg, steps=2)
    missing = str(tmp_path / "no-such-corpus.txt")
    result = sweep({"name": "bad-data", "max_concurrent": 1, "asha": None,
                    "space": {"data.source": {"grid": [missing, "kjv"]}}}, base=base, log=lambda *_: None)
    by_source = {t.params["data.source"]: t for t in result.trials}
    assert by_source["kjv"].status == "completed" and result.best is by_source["kjv"]
    failed = by_source[missing]
    assert failed.status == "failed" and missing in failed.error and "\n" not in failed.error, failed.error
    assert "Traceback" not in failed.error and "File \"" not in failed.error


def test_optuna_proposes_each_trial_from_the_results_so_far(tiny_cfg):
    """`search: optuna`: Tune's OptunaSearch (TPE, seeded by the base config's seed) draws each
    trial's learning rate inside the range, one trial after another."""
    base = _sweep_base(tiny_cfg, steps=3)
    result = sweep({"name": "tpe", "search": "optuna", "samples": 3, "max_concurrent": 1, "asha": None,
                    "space": {"optimizer.lr": {"loguniform": [1e-4, 1e-2]}}}, base=base, log=lambda *_: None)
    lrs = [t.params["optimizer.lr"] for t in result.trials]
    assert len(set(lrs)) == 3 and all(1e-4 <= lr <= 1e-2 for lr in lrs), lrs
    assert all(t.status == "completed" and t.steps == 3 for t in result.trials)
    assert result.best is min(result.trials, key=lambda t: t.value)
