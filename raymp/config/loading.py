"""Reading a run config: YAML files, `key.path=value` overrides, `parallel: auto`, and pydantic's
errors turned into one line per field."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from raymp.config.schema import (
    BF16_COMPUTE,
    ClusterConfig,
    ConfigError,
    ModelConfig,
    RunConfig,
    TrainingConfig,
)
from raymp.models import model_args
from raymp.models.shape import TOKENIZER_VOCAB, model_shape, probed_shape
from raymp.calibration import planning_cluster
from raymp.planner import plan


def _valid_keys(loc: tuple) -> list[str]:
    """The field names allowed at the parent of `loc`, for 'unknown key' messages."""
    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return sorted(model.model_fields)


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            keys = _valid_keys(e["loc"])
            lines.append(f"  {where}: unknown key; valid keys here: {', '.join(keys)}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        shown = e.get("input")
        got = "" if isinstance(shown, dict) else f" (got {shown!r})"
        lines.append(f"  {where}: {msg}{got}" if e["loc"] else f"  {msg}")
    return "\n".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], value parsed as YAML so 2, 1e-3, true, null work)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value, e.g. parallel.dp=2")
    key, raw = item.split("=", 1)
    path = [k for k in key.strip().split(".") if k]
    if not path:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: cannot parse value: {exc}") from None
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = copy.deepcopy(data)
    for item in overrides:
        path, value = parse_override(item)
        _set_at(data, path, value, f"override {item!r}")
    return data


def _set_at(data: dict, path: list[str], value: Any, what: str) -> None:
    """Set `value` at the dotted `path` of nested sections (made where missing); `what` names
    the change in the ConfigError when the path runs through a value."""
    node = data
    for k in path[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{what}: {k} is a value, not a section")
        node = child
    node[path[-1]] = value


def config_from_dict(data: dict, overrides: list[str] | None = None, source: str = "<dict>") -> RunConfig:
    data = apply_overrides(data or {}, overrides or [])
    try:
        data = {**data, "model": with_model_shape(data.get("model") or {})}
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None
    except ValueError as err:  # the model's shape could not be read
        raise ConfigError(f"invalid config ({source}):\n  model: {err}") from None
    try:
        if data.get("parallel") == "search":
            raise ConfigError(
                "search is a measurement, not a layout: run `raymp sweep --layouts N CONFIG` (it trains "
                "the planner's N best layouts a few steps each and saves what it measured), then set "
                "parallel: auto (planned with those prices) or the layout it found fastest"
            )
        if data.get("parallel") == "auto":
            data = _resolve_auto_layout(data)
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None
    except ConfigError as err:  # parallel: auto could not plan
        raise ConfigError(f"invalid config ({source}):\n  parallel: {err}") from None


def derived(cfg: RunConfig, changes: dict[str, Any], source: str = "derived config") -> RunConfig:
    """`cfg` with `changes` ({"parallel.dp": 2, ...}, dotted keys) applied: the one way raymp
    itself changes a config it has loaded (elastic re-planning, the pipeline's stage split, a
    short look). Validated once by every rule; nothing is read or planned again, since `cfg`
    was resolved when it was loaded (its model's shape read, `parallel: auto` decided), so a
    re-plan never probes the user's model. ConfigError if a rule refuses the change."""
    data = cfg.model_dump(mode="json")
    for key, value in changes.items():
        _set_at(data, key.split("."), value, f"{source}: {key}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def with_model_shape(model: dict) -> dict:
    """A `model` section with the shape fields of the Hugging Face model or factory module it
    names read off the model; other sections as they are (a preset fills them in the schema)."""
    sources = [k for k in ("hf", "hf_config", "factory") if model.get(k) is not None]
    if len(sources) != 1 or (sources[0] == "factory" and model.get("preset", "tiny") is not None):
        return model  # several sources: the schema says so; a factory with a preset: its shape
    fields = probed_shape(model)
    if model.get("moe") is not None and "moe" not in fields:
        raise ValueError(
            f"model.moe builds the built-in model's MoE blocks; the model.{sources[0]} model is not "
            "a mixture of experts, or brings its own: remove model.moe"
        )
    if sources[0] == "factory":
        return {**fields, **{k: v for k, v in model.items() if v is not None}, "preset": None}
    set_by_hand = [k for k, v in fields.items() if model.get(k) is not None and model[k] != v]
    if set_by_hand:
        raise ValueError(f"model.{', model.'.join(set_by_hand)} come from the Hugging Face config; change "
                         "them there (model.hf_config, or the directory's config.json), not here")
    return {**model, **fields, "preset": None}


def _resolve_auto_layout(data: dict) -> dict:
    """`parallel: auto`: the planner's best layout for `cluster` replaces it (priced as a layout
    search measured this cluster, when one saved its calibration under the run's output_dir)."""
    if not data.get("cluster"):
        raise ConfigError(
            "auto needs a cluster section to plan for (cluster.nodes, "
            "cluster.gpus_per_node, cluster.gpu_memory_gb, ...); or set parallel.dp/pp/tp yourself"
        )
    model = ModelConfig.model_validate(data["model"])
    train = TrainingConfig.model_validate(data.get("train", {}))
    cluster = ClusterConfig.model_validate(data["cluster"])
    tokenizer = (data.get("data") or {}).get("tokenizer", "byte")
    vocab = TOKENIZER_VOCAB.get(tokenizer)
    priced, _ = planning_cluster(
        cluster, data.get("output_dir") or RunConfig.model_fields["output_dir"].default
    )
    best = plan(
        model_args(model, vocab or 256),
        priced,
        train.global_batch_size,
        train.seq_len,
        bf16=data.get("precision") in BF16_COMPUTE,
        shape=model_shape(model, vocab, tokenizer),
    ).best
    if best is None:
        raise ConfigError(
            f"auto found no layout of {cluster.nodes} x {cluster.gpus_per_node} devices "
            f"with {cluster.gpu_memory_gb:g} GB that fits; run `raymp plan` on this config to see why"
        )
    return {**data, "parallel": best.layout.as_parallel()}


def read_config_file(path: str | os.PathLike) -> dict:
    """A YAML config file's sections, or one ConfigError line saying what is wrong with the file."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config path {str(p)!r} is a directory; give a YAML file (e.g. configs/tiny.yaml)")
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found (looked in {Path.cwd()})")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a text file (a YAML run config is UTF-8 text)") from None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"{p}: not valid YAML{_where(exc)}: {getattr(exc, 'problem', None) or exc}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections (model:, parallel:, ...)")
    if not data:  # a run of all defaults is rarely meant; `raymp config` prints them
        raise ConfigError(f"{p}: the file is empty; a run config sets at least one section (see "
                          "configs/tiny.yaml)")
    return data


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML run config (None: the defaults) and apply `key.path=value` overrides."""
    if path is None:
        return config_from_dict({}, overrides)
    return config_from_dict(read_config_file(path), overrides, source=str(path))


def resolved_dict(cfg: RunConfig) -> dict:
    """The fully resolved config (presets expanded) as plain data, for logging and artifacts."""
    return cfg.model_dump(mode="json")


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _where(exc: Exception) -> str:
    """' at line L, column C' of a YAML error (1-based, as editors count), when it knows."""
    mark = getattr(exc, "problem_mark", None)
    return "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
