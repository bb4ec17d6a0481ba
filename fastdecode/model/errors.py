"""The model's own error: raised by the config, its checks and the weights' loaders alike."""
from __future__ import annotations


class ConfigError(ValueError):
    """The model cannot be served: missing files, unknown architecture, unsupported option."""
