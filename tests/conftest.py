"""Shared fixtures: one local Ray instance for the whole session and actor groups reused across
tests (Ray start-up costs ~5 s and each actor ~1-2 s here)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Tiers: a test's folder is its tier and its marker (`pytest tests/unit` is `pytest -m unit`).
# unit/ uses no Ray. integration/ uses the session's Ray and its actors (the fixtures below).
# system/ drives raymp from outside: subprocesses (the CLI, `ray job submit`, a notebook kernel, an
# MLflow server, a browser) or simulated multi-node clusters.
TIERS = ("unit", "integration", "system")
RAY_FIXTURES = {"ray_local", "data_cache", "group2", "group4", "group8", "tiny_cfg"}


def pytest_collection_modifyitems(config, items):
    misplaced = []
    for item in items:
        tier = item.path.parent.name
        uses_ray = bool(RAY_FIXTURES & set(getattr(item, "fixturenames", ())))
        if tier not in TIERS or (tier == "unit" and uses_ray) or (tier == "integration" and not uses_ray):
            misplaced.append(f"{item.nodeid} (uses the session's Ray: {uses_ray})")
        else:
            item.add_marker(getattr(pytest.mark, tier))
    if misplaced:
        raise pytest.UsageError("tests outside the folder of their tier (tests/unit: no Ray; "
                                "tests/integration: the session's Ray): " + ", ".join(misplaced))


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory, ray_local):
    """Preparing data runs Ray Data tasks: on the session's Ray instance, not one of its own."""
    return str(tmp_path_factory.mktemp("raymp_cache"))


@pytest.fixture(scope="session")
def ray_local():
    import ray

    if not ray.is_initialized():
        # Logical CPUs, not cores: shared groups (2 + 4 + 8 actors) stay up while tests start their own.
        # address="local": a Ray of its own, even while another one runs on this machine. Ray's
        # workers import tests/helpers by name (a factory model, a tokenizer, failing workers).
        helpers = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
        ray.init(address="local", num_cpus=32, include_dashboard=False, log_to_driver=False,
                 runtime_env={"py_modules": [helpers]})
    yield ray
    ray.shutdown()


def _group(world_size):
    from raymp.runtime.actor_group import ActorGroup

    return ActorGroup(world_size, "cpu", cpus_per_actor=1, placement_timeout_s=60, collective_timeout_s=120)


@pytest.fixture(scope="session")
def group2(ray_local):
    g = _group(2)
    yield g
    g.shutdown()


@pytest.fixture(scope="session")
def group4(ray_local):
    g = _group(4)
    yield g
    g.shutdown()


@pytest.fixture(scope="session")
def group8(ray_local):
    g = _group(8)
    yield g
    g.shutdown()


@pytest.fixture
def tiny_cfg(data_cache, tmp_path):
    """A small, fast run: the tiny model on KJV bytes, 5 steps, clipping active."""

    def make(**sections) -> dict:
        cfg = {
            "name": "test",
            "seed": 7,
            "output_dir": str(tmp_path / "runs"),
            "model": {"preset": "tiny", "max_seq_len": 64},
            "parallel": {"dp": 2, "zero": 0, "micro_batch_size": 2},
            "train": {"steps": 5, "global_batch_size": 8, "seq_len": 32, "log_every": 1},
            "optimizer": {"lr": 1e-2, "warmup_steps": 1, "grad_clip": 1.0},
            "data": {"source": "kjv", "tokenizer": "byte", "cache_dir": data_cache},
            "tracking": {"enabled": False},
        }
        for section, values in sections.items():
            if isinstance(values, dict):
                cfg.setdefault(section, {}).update(values)
            else:
                cfg[section] = values
        return cfg

    return make
