"""Bad input met at start, through the Python API on the session's Ray: a tracking store MLflow
cannot use or reach, an output_dir, data.cache_dir or checkpoint.dir that cannot be written, a
model too large for the cluster's memory. Each is one line that names the field and the fix,
comes before any actor is placed, and leaves nothing behind (no run directory, config.yaml or
MLflow database)."""

from __future__ import annotations

import socket

import pytest

from raymp.checkpoint.store import CheckpointError
from raymp.config import ConfigError
from raymp.data import DataError
from raymp.trainer import Trainer
from helpers.cli import assert_nothing_left
from helpers.ports import free_port


@pytest.fixture
def listener():
    """A server that accepts connections and never answers (a hung tracking server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _refused_port() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


@pytest.mark.parametrize("case", ["unknown scheme", "refused", "never answers", "sqlite dir"])
def test_a_tracking_store_that_cannot_be_used_fails_before_anything_starts(
    case, tiny_cfg, tmp_path, listener
):
    uri, expected = {
        "unknown scheme": ("foo://bar", r"tracking.tracking_uri foo://bar: MLflow cannot use it \(it has no "
                                        r"store for foo:// URIs\); use sqlite:///<path>.db"),
        "refused": (_refused_port(), r"the MLflow server did not answer \(.*refused.*; waited at most 1 s\); "
                                     r"start it"),
        "never answers": (listener, r"the MLflow server did not answer \(.*timed out.*waited at most 1 s\)"),
        "sqlite dir": ("sqlite:////proc/raymp-no/x.db", r"tracking.tracking_uri: cannot create the MLflow "
                                                        r"database's directory /proc/raymp-no"),
    }[case]
    cfg = tiny_cfg(tracking={"enabled": True, "tracking_uri": uri, "connect_timeout_s": 1})
    with pytest.raises(ConfigError, match=expected):
        Trainer(cfg, progress=False).setup()
    assert_nothing_left(tmp_path / "runs")


def test_an_output_dir_that_cannot_be_written_is_named(tiny_cfg):
    cfg = tiny_cfg(output_dir="/proc/raymp-no/runs")
    with pytest.raises(
        ConfigError, match=r"output_dir /proc/raymp-no/runs is not writable \(.*\); set output_dir"
    ):
        Trainer(cfg, progress=False).setup()


def test_a_cache_dir_that_cannot_be_written_is_named(tiny_cfg, tmp_path, ray_local):
    cfg = tiny_cfg(data={"source": "kjv", "tokenizer": "byte", "cache_dir": "/proc/raymp-no/cache"})
    with pytest.raises(DataError, match=r"data.cache_dir /proc/raymp-no/cache: cannot create .*; set "
                                        r"data.cache_dir to a place this user can write"):
        Trainer(cfg, progress=False).setup()
    assert_nothing_left(tmp_path / "runs")


def test_an_unwritable_checkpoint_dir_fails_before_the_data_is_prepared(tiny_cfg, tmp_path):
    cfg = tiny_cfg(checkpoint={"every": 2, "dir": "/proc/raymp-no/checkpoints"},
                   data={"source": "kjv", "tokenizer": "byte", "cache_dir": str(tmp_path / "never-made")})
    with pytest.raises(CheckpointError, match=r"checkpoint.dir /proc/raymp-no/checkpoints is not writable"):
        Trainer(cfg, progress=False).setup()
    assert not (tmp_path / "never-made").exists()  # nothing was prepared


def test_a_model_too_large_for_the_cluster_is_refused_before_any_actor(tiny_cfg, tmp_path, ray_local):
    cfg = tiny_cfg(model={"preset": "llama-8b", "vocab_size": None, "max_seq_len": 64})
    placed = len(ray_local.util.placement_group_table())
    with pytest.raises(
        ConfigError,
        match=r"the model does not fit in memory: the planner estimates [\d.,]+ GiB per "
        r"rank .* but the largest node has [\d.,]+ GiB .*; shard it",
    ):
        Trainer(cfg, progress=False).setup()
    assert len(ray_local.util.placement_group_table()) == placed  # no actor was placed
    assert_nothing_left(tmp_path / "runs")
