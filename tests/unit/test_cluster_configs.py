"""Cluster artefacts are checked without a cloud: launcher YAMLs against the JSON schema that ships
inside the ray package, KubeRay manifests for the fields KubeRay requires, and the GPU configs
against the planner (each must fit its own cluster section)."""

from __future__ import annotations

import re
import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from raymp.config import load_config
from raymp.models import model_args
from raymp.layout import Layout
from raymp.planner import estimate
from raymp.step_time import cluster_from_config
from helpers.cli import ROOT

LAUNCHER = sorted((ROOT / "cluster" / "launcher").glob("*.yaml"))

STOP_WAIT_S = 60  # cluster/README.md: what the shipped cluster configs give `ray job stop`

GPU_CONFIGS = ["gpt2-124m-8gpu.yaml", "llama-8b-2x8.yaml", "llama-70b-8x8.yaml"]


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_config_matches_rays_schema(path):
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load(path.read_text())
    jsonschema.validate(config, schema)
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    gpu = [t for t in types.values() if t["resources"].get("GPU")]
    assert gpu and all(t["min_workers"] <= t["max_workers"] <= config["max_workers"] for t in gpu)
    assert types[config["head_node_type"]]["resources"]["CPU"] == 0  # no training actor on the head
    # ray job stop's SIGKILL comes this long after SIGTERM: time to commit the save in flight
    assert any(c.startswith(f"RAY_JOB_STOP_WAIT_TIME_S={STOP_WAIT_S} ray start --head")
               for c in config["head_start_ray_commands"])


def test_launcher_schema_check_can_fail():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load(LAUNCHER[0].read_text())
    config["max_workers"] = "eight"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, schema)


def _containers(template):
    return template["spec"]["containers"]


def _check_cluster_spec(spec):
    assert spec["rayVersion"].startswith("2.")
    head = spec["headGroupSpec"]
    # The images: test_kuberay_pods_run_an_image_with_raymp_at_the_tested_ray_version.
    assert "rayStartParams" in head
    # The job manager on the head reads it (ray job stop: SIGKILL this long after SIGTERM).
    assert {"name": "RAY_JOB_STOP_WAIT_TIME_S", "value": str(STOP_WAIT_S)} in _containers(head["template"])[
        0
    ]["env"]
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"] and "rayStartParams" in group
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        limits = _containers(group["template"])[0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1


def test_kuberay_raycluster_manifest():
    doc = yaml.safe_load((ROOT / "cluster" / "kuberay" / "raycluster.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster" and doc["metadata"]["name"]
    _check_cluster_spec(doc["spec"])


def test_kuberay_rayjob_manifest_runs_a_shipped_config():
    doc = yaml.safe_load((ROOT / "cluster" / "kuberay" / "rayjob.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob" and doc["metadata"]["name"]
    spec = doc["spec"]
    _check_cluster_spec(spec["rayClusterSpec"])
    assert spec["shutdownAfterJobFinishes"] is True
    entry = spec["entrypoint"].split()
    assert entry[:2] == ["raymp", "train"] and "output_dir=/mnt/shared/runs" in entry
    assert load_config(ROOT / entry[2]).resources.device == "cuda"


def test_kuberay_pods_run_an_image_with_raymp_at_the_tested_ray_version():
    """A stock Ray image has no raymp (`raymp: not found`): every pod runs the image the
    Dockerfile builds, FROM Ray's image of the version pyproject.toml pins."""
    docker = (ROOT / "cluster" / "kuberay" / "Dockerfile").read_text()
    base = next(line.split()[1] for line in docker.splitlines() if line.startswith("FROM "))
    pinned = re.search(r'"ray\[[a-z,]+\]>=(\d+\.\d+)', (ROOT / "pyproject.toml").read_text()).group(1)
    assert (
        base.startswith(f"rayproject/ray:{pinned}.")
        and "pip install" in docker
        and "/home/ray/raymp" in docker
    )
    for name in ("raycluster.yaml", "rayjob.yaml"):
        doc = yaml.safe_load((ROOT / "cluster" / "kuberay" / name).read_text())
        spec = doc["spec"].get("rayClusterSpec", doc["spec"])
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        assert {c["image"] for g in groups for c in _containers(g["template"])} == {
            "YOUR-REGISTRY/raymp:0.1.0"
        }


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_configs_fit_their_cluster_by_the_planner(name):
    cfg = load_config(ROOT / "configs" / name)
    p, cluster = cfg.parallel, cluster_from_config(cfg.cluster)
    assert p.world_size == cluster.world, "the layout must use the whole cluster it documents"
    assert p.tp <= cluster.gpus_per_node
    ranks = estimate(model_args(cfg.model, 50257), Layout.of(p), cfg.train.global_batch_size,
                     cfg.train.seq_len, cfg.precision == "bf16")
    peak = max(r.total_bytes for r in ranks)
    assert peak <= 0.9 * cluster.gpu_memory_gb * 1e9, f"{name}: {peak / 1e9:.1f} GB"
    # cluster/README.md's table quotes this estimate: it must be the planner's, not an old one.
    row = next(line for line in (ROOT / "cluster" / "README.md").read_text().splitlines()
               if line.startswith(f"| `{name}` |"))
    assert row.rstrip(" |").endswith(f"{peak / 1e9:.1f} GB"), (row, f"{peak / 1e9:.1f} GB")
