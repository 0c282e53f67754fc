"""Sharded checkpoints on the session's Ray: saved under one layout, loaded under another with the
same weights and the same next-step loss; a crash in the middle of a write leaves the previous
checkpoint loadable; keep-last, URI output dirs, the writer process, the wrong model refused,
export, the Python API and the CLI list, and MLflow runs across resumes."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import ray
import torch

from raymp import Trainer
from raymp.checkpoint.store import MARKER, CheckpointError, CheckpointStore, read_marker
from raymp.config import ConfigError
from raymp.runtime.actor_group import ActorGroup, WorkerLostError
from helpers.checkpoint_runs import STEPS, run_cfg

SAVE_AT = 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory, data_cache, group4):
    """A dp=2 x pp=2 ZeRO-1 run (optimizer state split over dp) that saves at step 3 and at the
    end, asynchronously; its losses, and its full weights at step 3."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg = run_cfg(root, data_cache, root / "checkpoints", every=SAVE_AT, dp=2, pp=2, zero=1)
    with Trainer(cfg, actor_group=group4, progress=False) as t:
        t.fit(SAVE_AT)
        weights = t.state_dict()
        history = t.fit()
    return {"root": root, "dir": root / "checkpoints", "history": history, "weights": weights}


LOAD_LAYOUTS = {
    "dp1-pp2": (2, dict(dp=1, pp=2)),
    "dp4": (4, dict(dp=4)),
    "tp2": (2, dict(dp=1, tp=2)),
    "dp2-zero3": (2, dict(dp=2, zero=3)),
    "dp2-tp2-zero2-sp": (4, dict(dp=2, tp=2, zero=2, sequence_parallel=True)),
    "dp2-cp2-zero3": (4, dict(dp=2, cp=2, zero=3)),
    "hsdp2x2-zero3": (4, dict(dp=4, dp_replicate=2, zero=3)),
}


@pytest.mark.parametrize("name", list(LOAD_LAYOUTS))
def test_checkpoint_loads_into_another_layout(saved, data_cache, group2, group4, name):
    world, parallel = LOAD_LAYOUTS[name]
    group = {2: group2, 4: group4}[world]
    path = f"{saved['dir']}/step-{SAVE_AT:08d}"
    cfg = run_cfg(saved["root"] / name, data_cache, saved["dir"], resume=path, **parallel)
    with Trainer(cfg, actor_group=group, progress=False) as t:
        assert t.setup().global_step == SAVE_AT
        assert t.data_position().step == SAVE_AT
        weights = t.state_dict()
        assert weights.keys() == saved["weights"].keys()
        for key, value in saved["weights"].items():
            assert torch.equal(weights[key], value), key  # a copy, bit for bit
        rest = t.fit()
    expected = saved["history"][SAVE_AT:]
    assert [m["step"] for m in rest] == [m["step"] for m in expected]
    for got, want in zip(rest, expected):
        # Same global batch and data order; the optimizer's moments and the LR schedule restored
        # (the second step after the load would differ without them).
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-9)
        assert got["sample_ids"].tolist() == want["sample_ids"].tolist()


def test_checkpoint_dir_layout_and_keep_last(saved):
    store = CheckpointStore(str(saved["dir"]), keep_last=2)
    assert [c.step for c in store.committed()] == [SAVE_AT, STEPS]
    latest = store.latest()
    assert latest.step == STEPS and latest.meta["layout"] == {
        "dp": 2,
        "dp_replicate": 1,
        "cp": 1,
        "pp": 2,
        "tp": 1,
        "zero": 1,
        "world_size": 4,
        "ep": 1,
    }
    assert latest.data_position["step"] == STEPS and latest.data_position["consumed"] == STEPS * 8
    files = sorted(os.listdir(latest.path))
    assert files == sorted([".metadata", MARKER] + [f"__{r}_0.distcp" for r in range(4)])


def test_crash_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path, data_cache, group2):
    from helpers.ckpt_workers import CrashDuringSaveWorker

    ckpt = tmp_path / "checkpoints"
    with Trainer(run_cfg(tmp_path / "ref", data_cache, tmp_path / "none", dp=2, steps=6),
                 actor_group=group2, progress=False) as t:
        uninterrupted = t.fit()

    group = ActorGroup(2, "cpu", placement_timeout_s=60, collective_timeout_s=60,
                       worker_cls=CrashDuringSaveWorker)
    try:
        group.call("arm_crash", 4, 1)  # rank 1 dies half-way through writing step 4's checkpoint
        # Through a URI: DCP's fsspec writer and reader, as for s3:// or gs:// storage.
        t = Trainer(
            run_cfg(tmp_path, data_cache, f"file://{ckpt}", every=2, dp=2, steps=6),
            actor_group=group,
            progress=False,
        )
        t.fit(2)
        weights_at_2 = t.state_dict()
        with pytest.raises(WorkerLostError, match="rank 1 .* died"):
            t.fit()
    finally:
        group.shutdown()
    store = CheckpointStore(str(ckpt))
    assert store.latest().step == 2
    half = ckpt / "step-00000004"
    assert "__1_0.distcp" in os.listdir(half)  # the dead rank's shard made it to disk ...
    assert MARKER not in os.listdir(half) and ".metadata" not in os.listdir(half)  # ... nothing else
    with pytest.raises(CheckpointError, match="never committed"):
        read_marker(str(half))

    with Trainer(run_cfg(tmp_path, data_cache, f"file://{ckpt}", every=2, dp=2, steps=6), actor_group=group2,
                 progress=False) as t:  # checkpoint.resume=auto: the latest committed one
        assert t.setup().global_step == 2
        assert all(torch.equal(t.state_dict()[k], v) for k, v in weights_at_2.items())
        rest = t.fit()
    assert [m["loss"] for m in rest] == pytest.approx([m["loss"] for m in uninterrupted[2:]], rel=1e-6)
    assert [c.step for c in store.committed()] == [4, 6]  # the retry of step 4 replaced the half write


def test_a_uri_output_dir_keeps_the_run_data_and_checkpoints_and_resumes(tmp_path, group2):
    """Issue 24: one storage location given as a URI (as s3:// or gs:// would be) holds the prepared
    data, config.yaml and the checkpoints, written and read through fsspec/pyarrow, and a run
    resumed from it goes on with the same losses and samples."""
    store = f"file://{tmp_path}/store"
    cfg = run_cfg(tmp_path, None, "unused", every=2, dp=2, steps=6)
    cfg.update(output_dir=store, tracking={"enabled": False, "run_name": "on-uri"})
    cfg["data"].pop("cache_dir")  # the default: <output_dir>/data-cache
    cfg["checkpoint"].pop("dir")  # the default: <output_dir>/<run>/checkpoints
    with Trainer(cfg, actor_group=group2, progress=False) as t:
        assert t.run_dir == f"{store}/on-uri"
        whole = t.fit()
        # The run says where everything is.
        assert (
            f"kept in {store}/on-uri (config.yaml), checkpoints in {store}/on-uri/checkpoints, prepared data "
            f"in {store}/data-cache" in t.describe()
        )
    run = tmp_path / "store" / "on-uri"
    assert (run / "config.yaml").is_file() and any((tmp_path / "store" / "data-cache").iterdir())
    assert [c.step for c in CheckpointStore(f"{store}/on-uri/checkpoints").committed()] == [4, 6]
    cfg["checkpoint"]["resume"] = f"{store}/on-uri/checkpoints/step-00000004"
    with Trainer(cfg, actor_group=group2, progress=False) as t:
        assert t.setup().global_step == 4
        rest = t.fit()
    assert [m["loss"] for m in rest] == pytest.approx([m["loss"] for m in whole[4:]], rel=1e-6)
    assert [m["sample_ids"].tolist() for m in rest] == [m["sample_ids"].tolist() for m in whole[4:]]


def test_a_writer_process_saves_sharded_state_that_resumes_exactly(tmp_path, data_cache, group2):
    """Issue 22: checkpoint.async_save=process hands the host copy to DCP's writer process (ZeRO-3:
    DTensor shards cross the pipe); training is unchanged and a resume goes on with the same steps."""
    cfg = run_cfg(tmp_path, data_cache, tmp_path / "ck", every=2, dp=2, zero=3, steps=4)
    cfg["checkpoint"]["async_save"] = "process"
    with Trainer(cfg, actor_group=group2, progress=False) as t:
        whole = t.fit()
    assert [c.step for c in CheckpointStore(str(tmp_path / "ck")).committed()] == [2, 4]
    # Each writer's log is in Ray's log directory of the session, beside the rank's own logs.
    context = ray.get_runtime_context()
    logs = Path(context.get_temp_dir(), context.get_session_name(), "logs")
    assert all((logs / f"raymp-checkpoint-writer-{n['pid']}.log").is_file() for n in group2.nodes)
    cfg["checkpoint"]["resume"] = str(tmp_path / "ck" / "step-00000002")
    with Trainer(cfg, actor_group=group2, progress=False) as t:
        assert t.setup().global_step == 2
        rest = t.fit()
    assert [m["loss"] for m in rest] == pytest.approx([m["loss"] for m in whole[2:]], rel=1e-6)
    assert [m["sample_ids"].tolist() for m in rest] == [m["sample_ids"].tolist() for m in whole[2:]]


def test_resume_never_refuses_a_dir_with_checkpoints(saved, data_cache, group4):
    cfg = run_cfg(saved["root"] / "never", data_cache, saved["dir"], every=2, resume="never", dp=2, pp=2)
    with pytest.raises(ConfigError, match="already holds checkpoints .*checkpoint.resume=auto"):
        Trainer(cfg, actor_group=group4, progress=False).setup()


def test_wrong_model_is_refused_with_the_field(saved, data_cache, group2):
    cfg = run_cfg(saved["root"] / "wrong", data_cache, saved["dir"], dp=2,
                  resume=f"{saved['dir']}/step-{SAVE_AT:08d}")
    cfg["model"]["dim"] = 96
    with pytest.raises(Exception, match="different model"):
        Trainer(cfg, actor_group=group2, progress=False).setup()


def test_export_consolidates_to_one_file(saved, tmp_path):
    from safetensors.torch import load_file

    from raymp.cli import main
    from raymp.models import build_model, model_args
    from raymp.config import config_from_dict

    out = tmp_path / "model.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing a user cannot act on (torch's one-process notice)
        assert main(["checkpoint", "export", f"{saved['dir']}/step-{SAVE_AT:08d}", "--out", str(out)]) == 0
    weights = load_file(str(out))
    assert weights.keys() == saved["weights"].keys()
    assert all(torch.equal(weights[k], v) for k, v in saved["weights"].items())
    # Loads into the plain, unparallelized model.
    meta = read_marker(f"{saved['dir']}/step-{SAVE_AT:08d}").meta
    cfg = config_from_dict(meta["config"])
    model = build_model(model_args(cfg.model, 256), cfg.seed, torch.device("cpu"))
    model.load_state_dict({k: v for k, v in weights.items()})
    torch_out = tmp_path / "model.pt"
    assert main(["checkpoint", "export", str(saved["dir"]), "--out", str(torch_out)]) == 0  # latest
    assert torch.load(torch_out).keys() == weights.keys()


def test_python_api_loads_and_saves_and_cli_lists(saved, data_cache, group4, tmp_path, capsys):
    from raymp.cli import main

    cfg = run_cfg(tmp_path, data_cache, tmp_path / "mine", dp=2, pp=2, zero=3)
    with Trainer(cfg, actor_group=group4, progress=False) as t:
        assert t.setup().global_step == 0  # nothing in its own checkpoint.dir yet
        t.load_checkpoint(f"{saved['dir']}/step-{SAVE_AT:08d}")
        assert t.global_step == SAVE_AT
        assert all(torch.equal(t.state_dict()[k], v) for k, v in saved["weights"].items())
        committed = t.save_checkpoint()  # into its own dir, re-sharded as ZeRO-3
        assert committed.step == SAVE_AT and committed.meta["layout"]["zero"] == 3
    assert main(["checkpoint", "list", str(tmp_path / "mine")]) == 0
    listing = capsys.readouterr().out
    assert f"step {SAVE_AT}  dp=2 pp=2 tp=1 zero=3" in listing and "epoch 0" in listing


def test_auto_resume_continues_the_mlflow_run_a_path_starts_a_new_one(data_cache, group2, tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = run_cfg(tmp_path, data_cache, tmp_path / "ck", every=2, dp=2, steps=4)
    cfg["tracking"] = {"enabled": True, "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"}
    with Trainer(cfg, actor_group=group2, progress=False) as t:
        t.fit(2)
        first = t.tracker.run_id
    with Trainer(cfg, actor_group=group2, progress=False) as t:  # checkpoint.resume=auto
        t.fit()
        assert t.tracker.resumed and t.tracker.run_id == first
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert sorted(m.step for m in client.get_metric_history(first, "fit/loss")) == [0, 1, 2, 3]
    assert client.get_run(first).info.status == "FINISHED"
    warm = dict(cfg, checkpoint={**cfg["checkpoint"], "dir": str(tmp_path / "ck2"),
                                 "resume": f"{tmp_path}/ck/step-00000002"})
    with Trainer(warm, actor_group=group2, progress=False) as t:
        assert t.setup().global_step == 2
        assert t.tracker.run_id != first and not t.tracker.resumed
        assert client.get_run(t.tracker.run_id).data.tags["raymp.resumed_from"].endswith("step-00000002")
