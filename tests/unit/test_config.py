"""Config loading: presets resolve, overrides apply, and each kind of bad config fails at load with
one message that names the field."""

from __future__ import annotations

import pytest

from raymp.config import ConfigError, config_from_dict, load_config, parse_override, resolved_dict
from helpers.cli import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.parallel.world_size >= 1


def test_preset_fills_unset_fields_and_explicit_fields_win():
    cfg = config_from_dict({"model": {"preset": "tiny", "n_layers": 2}})
    assert cfg.model.dim == 64 and cfg.model.n_layers == 2


def test_output_dir_holds_the_prepared_data_unless_the_cache_is_set_apart():
    """Issue 24: one place to make durable on a cluster (output_dir), the data cache included."""
    assert (
        config_from_dict({"output_dir": "/mnt/shared/runs"}).data.cache_dir == "/mnt/shared/runs/data-cache"
    )
    apart = config_from_dict({"output_dir": "/mnt/shared/runs", "data": {"cache_dir": "s3://bucket/cache"}})
    assert apart.data.cache_dir == "s3://bucket/cache"
    assert config_from_dict(resolved_dict(apart)).data.cache_dir == "s3://bucket/cache"


def test_a_uri_output_dir_is_the_runs_storage_and_needs_a_tracking_server():
    """Issue 24: output_dir may be a URI (like Ray Train's storage_path); MLflow's embedded sqlite
    store cannot live there, so tracking must name a server (or be off)."""
    with pytest.raises(
        ConfigError, match=r"output_dir 's3://bucket/runs' is a URI.*set tracking.tracking_uri"
    ):
        config_from_dict({"output_dir": "s3://bucket/runs"})
    cfg = config_from_dict(
        {"output_dir": "s3://bucket/runs", "tracking": {"tracking_uri": "http://mlflow:5000"}}
    )
    assert cfg.data.cache_dir == "s3://bucket/runs/data-cache"
    assert (
        config_from_dict({"output_dir": "gs://b/r", "tracking": {"enabled": False}}).output_dir == "gs://b/r"
    )


def test_storage_locations_keep_their_scheme_and_stage_files_for_a_uri(tmp_path):
    from raymp import storage

    assert storage.join("s3://bucket/runs", "a", "config.yaml") == "s3://bucket/runs/a/config.yaml"
    assert storage.join("runs", "a") == "runs/a"
    with storage.staged(f"file://{tmp_path}/store/run") as local:  # a URI: a temporary directory, uploaded
        assert tmp_path not in local.parents
        (local / "timeline.json").write_text("{}")
    assert (tmp_path / "store" / "run" / "timeline.json").read_text() == "{}"
    storage.remove_if_empty(f"file://{tmp_path}/store/run")  # not empty: kept
    assert (tmp_path / "store" / "run").is_dir()
    storage.make_dirs(f"file://{tmp_path}/store/empty")
    storage.remove_if_empty(f"file://{tmp_path}/store/empty")
    assert not (tmp_path / "store" / "empty").exists()


def test_dotted_overrides_parse_yaml_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("parallel: {dp: 2, micro_batch_size: 2}\ntrain: {global_batch_size: 8}\n")
    cfg = load_config(path, ["parallel.zero=3", "optimizer.lr=1e-3", "optimizer.grad_clip=null",
                             "parallel.activation_checkpointing=true"])
    assert cfg.parallel.zero == 3 and cfg.optimizer.lr == 1e-3
    assert cfg.optimizer.grad_clip is None and cfg.parallel.activation_checkpointing is True


def test_parse_override_splits_path_and_value():
    assert parse_override("a.b.c=4") == (["a", "b", "c"], 4)
    assert parse_override("name=x=y") == (["name"], "x=y")


BAD = {
    "unknown top-level key": ({"paralel": {"dp": 2}}, ["paralel", "unknown key", "parallel"]),
    "unknown nested key": ({"parallel": {"dpp": 2}}, ["parallel.dpp", "unknown key", "dp,"]),
    "zero out of range": ({"parallel": {"zero": 4}}, ["parallel.zero"]),
    "tp does not divide heads": ({"parallel": {"tp": 3}}, ["parallel.tp (3)", "model.n_heads (4)"]),
    "tp does not divide kv heads": (
        {"model": {"n_heads": 8, "n_kv_heads": 2}, "parallel": {"tp": 4}},
        ["parallel.tp (4)", "model.n_kv_heads (2)"],
    ),
    "devices mismatch": (
        {"parallel": {"dp": 2}, "train": {"global_batch_size": 16}, "resources": {"devices": 4}},
        ["resources.devices (4)", "dp*cp*pp*tp"],
    ),
    "batch not divisible": (
        {"parallel": {"dp": 2, "micro_batch_size": 4}, "train": {"global_batch_size": 12}},
        ["train.global_batch_size (12)", "8 or 16"],
    ),
    "seq_len beyond context": (
        {"train": {"seq_len": 512}},
        ["train.seq_len (512)", "model.max_seq_len (256)"],
    ),
    "unknown preset": ({"model": {"preset": "gpt5"}}, ["model.preset", "tiny"]),
    "heads vs kv heads": (
        {"model": {"n_heads": 4, "n_kv_heads": 3}},
        ["model.n_heads (4)", "model.n_kv_heads (3)"],
    ),
    "dim vs heads": ({"model": {"dim": 66}}, ["model.dim (66)", "model.n_heads"]),
    "negative lr": ({"optimizer": {"lr": -1}}, ["optimizer.lr", "greater than 0"]),
    "offload without sharding": (
        {"optimizer": {"cpu_offload": True}},
        ["optimizer.cpu_offload", "parallel.zero"],
    ),
    "fp16 anywhere": (
        {"precision": "fp16", "resources": {"device": "cuda"}},
        ["fp16 is not supported", "bf16"],
    ),
    "fp8 on cpu": ({"precision": "fp8"}, ["precision fp8 needs CUDA", "resources.device=cuda"]),
    "fp8 under tp": (
        {"precision": "fp8", "resources": {"device": "cuda"}, "parallel": {"tp": 2}},
        ["parallel.tp > 1", "precision=bf16"],
    ),
    "fp8 with a Hugging Face model": (
        {
            "precision": "fp8",
            "resources": {"device": "cuda"},
            "model": {"hf_config": {"model_type": "llama"}},
        },
        ["built-in model"],
    ),
    "float8 rowwise all-gather": (
        {
            "precision": "fp8",
            "resources": {"device": "cuda"},
            "parallel": {"zero": 3},
            "float8": {"recipe": "rowwise", "fsdp_all_gather": True},
        },
        ["float8.fsdp_all_gather", "tensorwise"],
    ),
    "float8 all-gather without FSDP": (
        {"precision": "fp8", "resources": {"device": "cuda"}, "float8": {"fsdp_all_gather": True}},
        ["parallel.zero=0", "zero=2 or 3"],
    ),
    "float8 settings without fp8": (
        {"precision": "bf16", "float8": {"recipe": "rowwise"}},
        ["float8 settings apply to precision fp8"],
    ),
    "cpu offload on cpu actors": (
        {"parallel": {"zero": 2}, "resources": {"device": "cpu"}, "optimizer": {"cpu_offload": True}},
        ["optimizer.cpu_offload needs GPU"],
    ),
    "wrong type": ({"parallel": {"dp": "two"}}, ["parallel.dp", "integer"]),
    "no preset and missing fields": ({"model": {"preset": None, "dim": 64}}, ["model.n_layers"]),
    "vocab too small for gpt2": (
        {"model": {"vocab_size": 1000}, "data": {"tokenizer": "gpt2"}},
        ["model.vocab_size (1000)"],
    ),
    "more stages than layers": (
        {"parallel": {"pp": 8}},
        ["parallel.pp=8", "model.n_layers is 4", "at least one layer"],
    ),
    "interleaved stages beyond layers": (
        {"parallel": {"pp": 2, "schedule": "interleaved", "virtual_stages": 4}},
        ["8 pipeline stages", "parallel.virtual_stages"],
    ),
    "too few micro-batches": (
        {"parallel": {"pp": 2, "schedule": "zbv", "micro_batch_size": 2}, "train": {"global_batch_size": 4}},
        ["zbv", "at least 4 micro-batches", "train.global_batch_size to 8"],
    ),
    "virtual stages without interleaved": (
        {"parallel": {"pp": 2, "virtual_stages": 2}},
        ["parallel.virtual_stages", "interleaved"],
    ),
    "stage layers count": (
        {"parallel": {"pp": 2, "stage_layers": [[0, 1, 2, 3]]}},
        ["parallel.stage_layers", "2 non-empty stages"],
    ),
    "stage layers out of order": (
        {"parallel": {"pp": 2, "stage_layers": [[0, 2], [1, 3]]}},
        ["parallel.stage_layers", "consecutive"],
    ),
    "stage layers without pipeline": (
        {"parallel": {"stage_layers": [[0, 1, 2, 3]]}},
        ["parallel.stage_layers needs parallel.pp > 1"],
    ),
    "unknown schedule": ({"parallel": {"pp": 2, "schedule": "pipedream"}}, ["parallel.schedule", "1f1b"]),
    "tp does not divide ffn": (
        {"model": {"n_kv_heads": 4, "ffn_dim": 170}, "parallel": {"tp": 4}},
        ["parallel.tp (4)", "model.ffn_dim (170)"],
    ),
    "tp does not divide gpt2 vocab": (
        {"data": {"tokenizer": "gpt2"}, "parallel": {"tp": 2}},
        ["parallel.tp (2)", "50257", "gpt2 tokenizer", "model.vocab_size=50304"],
    ),
    "sequence parallel without tp": (
        {"parallel": {"sequence_parallel": True}},
        ["parallel.sequence_parallel", "tp > 1"],
    ),
    "sequence parallel seq_len": (
        {
            "parallel": {"tp": 4, "sequence_parallel": True},
            "model": {"n_kv_heads": 4},
            "train": {"seq_len": 30},
        },
        ["train.seq_len (30)", "multiple of 4"],
    ),
    "zero 1 with tp": ({"parallel": {"tp": 2, "zero": 1}}, ["parallel.zero=1", "parallel.zero=2"]),
    "unknown tokenizer": ({"data": {"tokenizer": "sentencepiece"}}, ["data.tokenizer"]),
    "restore without checkpoints": (
        {"train": {"on_nonfinite": "restore"}, "checkpoint": {"every": 0}},
        ["train.on_nonfinite=restore", "checkpoint.every=0", "set checkpoint.every"],
    ),
    "unknown nonfinite policy": (
        {"train": {"on_nonfinite": "ignore"}},
        ["train.on_nonfinite", "skip", "restore"],
    ),
    "straggler replacement without a report": (
        {"elastic": {"replace_stragglers": True, "straggler_factor": 0}},
        ["elastic.replace_stragglers", "elastic.straggler_factor=0", "above 1"],
    ),
    "straggler replacement without recovery": (
        {"elastic": {"replace_stragglers": True, "max_restarts": 0}},
        ["elastic.replace_stragglers", "elastic.max_restarts=0"],
    ),
    "straggler replacement without survivors": (
        {"parallel": {"dp": 2, "zero": 2}, "elastic": {"replace_stragglers": True}},
        ["elastic.replace_stragglers", "survivors keep", "parallel.zero=0"],
    ),
    "spares not whole copies of the state": (
        {"parallel": {"dp": 2, "pp": 2, "zero": 0}, "elastic": {"spares": 1}},
        ["elastic.spares (1)", "groups of 2 ranks", "multiple of 2"],
    ),
    "spares without growing back": (
        {"parallel": {"dp": 2, "zero": 0}, "elastic": {"spares": 1, "grow_back": False}},
        ["elastic.spares", "elastic.grow_back", "elastic.spares=0"],
    ),
    "spares without survivors": (
        {"parallel": {"dp": 2, "zero": 2}, "elastic": {"spares": 1}},
        ["elastic.spares", "survivors", "parallel.zero=0", "elastic.peer_copy_every"],
    ),
    "spares of a layout with peer copies not whole TP groups": (
        {"parallel": {"dp": 2, "tp": 2, "zero": 2}, "elastic": {"spares": 1, "peer_copy_every": 1}},
        ["elastic.spares (1)", "groups of 2 ranks", "TP group"],
    ),
    "straggler factor not above 1": (
        {"elastic": {"straggler_factor": 0.5}},
        ["elastic.straggler_factor", "above 1", "0 to turn the report off"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD), ids=str)
def test_bad_config_gets_one_clear_error(case):
    data, needles = BAD[case]
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    text = str(err.value)
    for needle in needles:
        assert needle in text, f"{case}: {needle!r} not in:\n{text}"


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(scalar)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match="not a text file"):
        load_config(binary)
    for text in ("", "# only a comment\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        with pytest.raises(
            ConfigError, match="empty.yaml: the file is empty; a run config sets at least one section"
        ):
            load_config(empty)


def test_malformed_override():
    with pytest.raises(ConfigError, match="key.path=value"):
        config_from_dict({}, ["parallel.dp"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        config_from_dict({"seed": 1}, ["seed.x=1"])


def test_a_tokenizer_that_cannot_be_imported_is_refused_at_config_time():
    with pytest.raises(ConfigError, match=r"data.tokenizer 'no_such_module:Thing': cannot load"):
        config_from_dict({"data": {"tokenizer": "no_such_module:Thing"}})


def test_compilation_is_on_by_default_on_cuda_only_where_the_layout_allows_it():
    from raymp.config.rules import compiles

    plain = config_from_dict({})
    assert compiles(plain, "cuda") and not compiles(plain, "cpu")
    sp = config_from_dict(
        {"parallel": {"tp": 2, "sequence_parallel": True}, "train": {"global_batch_size": 16}}
    )
    assert not compiles(sp, "cuda")  # torch miscompiles it: left off, not refused, when unset
    assert compiles(config_from_dict({"train": {"compile": True}}), "cpu")
    assert not compiles(config_from_dict({"train": {"compile": False}}), "cuda")


def test_a_run_shorter_than_its_warmup_is_said_not_refused():
    from raymp.optim import warmup_note

    cfg = config_from_dict({"train": {"steps": 2}, "optimizer": {"warmup_steps": 10}})
    assert warmup_note(cfg.optimizer, cfg.train.steps) == (
        "note: optimizer.warmup_steps (10) is not below train.steps (2): the whole run warms up, its last step "
        "at 20% of optimizer.lr"
    )
    assert warmup_note(config_from_dict({}).optimizer, 100) is None


def test_a_new_experiments_artifacts_go_where_the_run_says(tmp_path, monkeypatch):
    """A database keeps no artifacts: MLflow would put them in ./mlruns of the driver's working
    directory. raymp puts a sqlite store's beside its file, another database's under output_dir;
    a server and a file store keep their own root."""
    from raymp.tracking import artifact_location

    monkeypatch.chdir(tmp_path)
    assert (
        artifact_location(f"sqlite:///{tmp_path}/db/m.db", "/out")
        == (tmp_path / "db" / "mlartifacts").as_uri()
    )
    assert artifact_location("sqlite:///rel/m.db", "/out") == (tmp_path / "rel" / "mlartifacts").as_uri()
    assert artifact_location("postgresql://u@host/mlflow", "/out") == "file:///out/mlartifacts"
    assert artifact_location("http://mlflow:5000", "/out") is None
    assert artifact_location(str(tmp_path / "mlruns"), "/out") is None
