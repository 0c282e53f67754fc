"""raymp: elastic distributed training of large models on Ray actors."""

from raymp.version import __version__

# Everything else loads on first use (PEP 562): `raymp --version` and a mistyped command then cost
# no torch, pydantic or Ray import.
_LAZY = {"Trainer": "raymp.trainer", "RunConfig": "raymp.config", "ConfigError": "raymp.config",
         "load_config": "raymp.config", "sweep": "raymp.sweeps", "SweepSpec": "raymp.sweeps",
         "search_layouts": "raymp.sweeps"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raymp' has no attribute {name!r}")


__all__ = ["Trainer", "RunConfig", "ConfigError", "load_config", "sweep", "SweepSpec", "search_layouts",
           "__version__"]
