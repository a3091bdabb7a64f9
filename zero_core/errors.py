"""Exceptions raised by zero-core. Every message says what was wrong and how to fix it."""


class ZeroCoreError(RuntimeError):
    """Base class of every error zero-core raises on purpose."""


class ConfigError(ZeroCoreError, ValueError):
    """A configuration key, value or combination that cannot work."""


class ConfigWarning(UserWarning):
    """A config key that DeepSpeed itself ignores (an unknown top-level key): named, not fatal."""


class PluginError(ZeroCoreError):
    """A plugin could not be found, loaded or selected."""


class BackendUnavailable(ZeroCoreError):
    """An accelerator or communicator was asked for but cannot run here."""


class CommError(ZeroCoreError):
    """A collective was called with arguments the backend cannot carry."""


class CommTimeoutError(CommError, TimeoutError):
    """A collective did not finish within the configured timeout (a peer died or hung)."""
