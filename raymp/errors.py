"""Which errors are the user's (a config, data, storage or cluster that cannot serve the run):
they end a command with their one line and exit status 2, and a sweep's trial with its reason,
never a traceback. Any other exception is a bug and shows its traceback."""

from __future__ import annotations

import sys

# The errors that end a command with one line and exit status 2, by where they are defined.
USER_ERRORS = (("raymp.config.schema", "ConfigError"), ("raymp.data", "DataError"),
               ("raymp.runtime.actor_group", "PlacementError"),
               ("raymp.runtime.actor_group", "WorkerLostError"), ("raymp.elastic", "ElasticError"),
               ("raymp.checkpoint.store", "CheckpointError"), ("raymp.driver.health", "NonFiniteError"),
               ("raymp.ray_connection", "RayStartError"))


def user_errors() -> tuple[type, ...]:
    """Those of USER_ERRORS whose module a command has imported: an error can only come from a
    module that was loaded, so a command pays for no import it did not need (`raymp config`
    would otherwise load torch's checkpointing, Ray and the worker only to name their errors)."""
    return tuple(getattr(sys.modules[module], name) for module, name in USER_ERRORS if module in sys.modules)
