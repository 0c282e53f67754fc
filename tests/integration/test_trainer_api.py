"""The Python API a notebook uses: step and inspect, then fit; and what lands in MLflow."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from raymp.runtime.actor_group import ActorGroup, PlacementError
from raymp.trainer import Trainer


def test_step_inspect_fit_and_mlflow_run(group2, tiny_cfg, tmp_path):
    cfg = tiny_cfg(parallel={"dp": 2, "zero": 3, "micro_batch_size": 2},
                   tracking={"enabled": True, "experiment": "api-test", "flush_every": 2})
    with Trainer(cfg, actor_group=group2, progress=False) as trainer:
        first = trainer.step()
        assert first["step"] == 0 and first["loss"] > 0 and first["tokens_per_s"] > 0
        assert len(first["per_rank"]) == 2 and {r["rank"] for r in first["per_rank"]} == {0, 1}
        layout = trainer.layout()
        assert [(r["rank"], r["dp"], r["pp"], r["tp"]) for r in layout] == [(0, 0, 0, 0), (1, 1, 0, 0)]
        assert all(r["node_id"] and r["pid"] and r["threads"] == 1 for r in layout)
        assert layout[0]["pid"] != layout[1]["pid"]
        mem = trainer.memory()
        assert mem[0]["param_bytes"] * 2 == trainer.num_params * 4  # zero 3: half the fp32 weights
        history = trainer.fit()  # continues from step 1 to train.steps
        assert [m["step"] for m in history] == [0, 1, 2, 3, 4]
        run_id, uri = trainer.tracker.run_id, trainer.tracker.uri
        assert (Path(trainer.run_dir) / "config.yaml").is_file()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["parallel.dp"] == "2" and run.data.params["parallel.zero"] == "3"
    assert run.data.params["model.dim"] == "64"  # resolved from the preset
    assert run.data.tags["raymp.layout"] == "dp2-pp1-tp1-zero3"
    losses = client.get_metric_history(run_id, "fit/loss")
    assert [m.step for m in sorted(losses, key=lambda m: m.step)] == [0, 1, 2, 3, 4]
    assert [m.value for m in sorted(losses, key=lambda m: m.step)] == pytest.approx(
        [h["loss"] for h in history]
    )
    for key in ("fit/grad_norm", "fit/lr", "speed/tok_s", "speed/step_s", "mem/peak_mb", "mem/rank1_mb"):
        assert len(client.get_metric_history(run_id, key)) == 5, key
    artifacts = [a.path for a in client.list_artifacts(run_id)]
    assert "config.yaml" in artifacts
    # Artifacts live beside the embedded database, never in ./mlruns of the working directory.
    out = (tmp_path / "runs").resolve()
    assert run.info.artifact_uri.startswith(out.as_uri()), run.info.artifact_uri
    assert (out / "mlartifacts").is_dir()


def test_dispatch_ahead_trains_the_same_steps_and_crosses_a_save_only_where_it_rides_on_the_step(
        group2, tiny_cfg, tmp_path):
    """Issues 22 and 44: fit() queues step k+1 before it reads step k's results, except where
    something must happen on the actors in between: a validation (after steps 2, 5, 7), or a save
    (after steps 1, 3, 5, 7) that could not ride on step k's own call because the save before it
    was not yet reported done when step k was queued. Saves written in the step's call
    (async_save off) make that order exact: saves after 1 and 3 ride, after 5 (ordered when step
    5 went early, before step 4 reported save 4 done) and 7 do not; so 1, 2, 4, 5 and 7 go early.
    The losses and samples are step-by-step dispatch's, and so are the checkpoints committed."""
    runs = {}
    for ahead in (False, True):
        cfg = tiny_cfg(parallel={"dp": 2, "zero": 2, "micro_batch_size": 2},
                       train={"steps": 8, "eval_every": 3, "eval_batches": 1, "dispatch_ahead": ahead},
                       checkpoint={"every": 2, "async_save": False, "dir": str(tmp_path / f"ckpt-{ahead}")})
        with Trainer(cfg, actor_group=group2, progress=False) as trainer:
            history = trainer.fit()
            runs[ahead] = (history, trainer.session.calls.queued_early,
                           [c.step for c in trainer.session.checkpoints.committed])
    (plain, none_early, plain_saves), (ahead, early, saves) = runs[False], runs[True]
    assert none_early == [] and early == [1, 2, 4, 5, 7], early
    assert saves == plain_saves == [2, 4, 6, 8]
    assert [m["loss"] for m in ahead] == [m["loss"] for m in plain]
    assert [m.get("val_loss") for m in ahead] == [m.get("val_loss") for m in plain]
    assert [m["sample_ids"].tolist() for m in ahead] == [m["sample_ids"].tolist() for m in plain]


def test_actor_group_size_must_match_layout(group2, tiny_cfg):
    cfg = tiny_cfg(parallel={"dp": 4, "zero": 0, "micro_batch_size": 1})
    with pytest.raises(ValueError, match="has 2 actors but the layout needs dp\\*cp\\*pp\\*tp = 4"):
        Trainer(cfg, actor_group=group2, progress=False).setup()


@pytest.mark.timeout(120)  # the bound: a wait that ignored placement_timeout_s would pass it
def test_unplaceable_layout_fails_after_bounded_wait(ray_local):
    t0 = time.perf_counter()
    with pytest.raises(PlacementError, match=r"could not place 2 actors .*CPU.: 64.*placement_timeout_s"):
        ActorGroup(2, "cpu", cpus_per_actor=64, placement_timeout_s=2)
    # It did wait for the knob's time (a lower bound holds on any machine).
    assert time.perf_counter() - t0 >= 2
    # The pending placement group was removed: nothing is left reserved.
    assert ray_local.available_resources().get("CPU", 0) >= 0


@pytest.mark.timeout(300)
def test_dead_actor_stops_the_run_with_a_clear_error_not_a_hang(ray_local, tiny_cfg):
    from raymp.runtime.actor_group import WorkerLostError

    # A collective timeout far past this test's own (the timeout mark): the death must be learned
    # from Ray's actor-death signal, which the error's kind says too.
    group = ActorGroup(2, "cpu", placement_timeout_s=60, collective_timeout_s=900)
    try:
        trainer = Trainer(tiny_cfg(parallel={"dp": 2, "zero": 2, "micro_batch_size": 2}),
                          actor_group=group, progress=False)
        trainer.step()
        ray_local.kill(group.workers[1])
        with pytest.raises(WorkerLostError, match=r"step 1: rank 1 on node .* died") as err:
            trainer.step()
        assert err.value.step == 1 and err.value.kind == "died"
    finally:
        group.shutdown()


def test_cuda_asked_of_a_cluster_without_gpus_is_one_config_error(ray_local):
    from raymp.config import ConfigError
    from raymp.runtime.cluster import resolve_device

    with pytest.raises(
        ConfigError,
        match=r"resources.device=cuda needs a GPU for each of the 2 actors, but the "
        r"cluster has 0; set resources.device=cpu",
    ):
        resolve_device("cuda", 2)
    assert resolve_device("auto", 2) == "cpu"


def test_no_progress_still_prints_the_outcome_and_the_mlflow_run(tiny_cfg, tmp_path, capsys):
    """The command line in this process (its Ray is the session's): per-step lines off, the
    summary and the MLflow run still printed."""
    import signal

    import yaml

    from raymp.cli import main

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg(train={"steps": 2, "global_batch_size": 8, "seq_len": 32},
                                            tracking={"enabled": True})))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["train", str(path), "--no-progress"]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    out = capsys.readouterr().out
    assert "step     1/2" not in out and out.startswith("done: 2 steps") and "MLflow run " in out, out
