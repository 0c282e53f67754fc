"""raymp: elastic distributed training of large models on Ray actors."""

from raymp.config import ConfigError, RunConfig, load_config
from raymp.version import __version__


def __getattr__(name):
    # Trainer pulls in Ray and torch; import it lazily so `raymp config` stays fast.
    if name == "Trainer":
        from raymp.trainer import Trainer

        return Trainer
    raise AttributeError(name)


__all__ = ["Trainer", "RunConfig", "ConfigError", "load_config", "__version__"]
