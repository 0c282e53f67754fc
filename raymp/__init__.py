"""raymp: elastic distributed training of large models on Ray actors."""

__version__ = "0.1.0"

from raymp.config import ConfigError, RunConfig, load_config  # noqa: E402


def __getattr__(name):
    # Trainer pulls in Ray and torch; import it lazily so `raymp config` stays fast.
    if name == "Trainer":
        from raymp.trainer import Trainer

        return Trainer
    raise AttributeError(name)


__all__ = ["Trainer", "RunConfig", "ConfigError", "load_config", "__version__"]
