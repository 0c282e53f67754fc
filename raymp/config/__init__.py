"""Run configuration: pydantic models loaded from YAML, with dotted command-line overrides.

Every check that can be made before any actor starts is made here, so a bad config fails in
milliseconds with the field's dotted name and the fix, instead of minutes later inside a worker.
"""

from raymp.config.loading import (
                                  apply_overrides,
                                  config_from_dict,
                                  derived,
                                  flatten,
                                  load_config,
                                  parse_override,
                                  read_config_file,
                                  resolved_dict,
)
from raymp.config.rules import CPU_OFFLOAD_ON_CPU
from raymp.config.schema import (
                                  CheckpointConfig,
                                  ClusterConfig,
                                  ConfigError,
                                  DataConfig,
                                  ElasticConfig,
                                  ModelConfig,
                                  OptimizerConfig,
                                  ParallelConfig,
                                  ResourcesConfig,
                                  RunConfig,
                                  TrackingConfig,
                                  TrainingConfig,
)

__all__ = [
    "CPU_OFFLOAD_ON_CPU",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "ElasticConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "ResourcesConfig",
    "RunConfig",
    "TrackingConfig",
    "TrainingConfig",
    "apply_overrides",
    "config_from_dict",
    "derived",
    "flatten",
    "load_config",
    "parse_override",
    "read_config_file",
    "resolved_dict",
]
