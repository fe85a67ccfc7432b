"""The errors a user of jax_mlpo catches: a config that cannot run, a state that is not current."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class StaleStateError(RuntimeError):
    """The optimizer state handed to update is not the one the host state was last advanced to."""


class EngineFailedError(RuntimeError):
    """A previous update failed midway; the host state is not consistent any more."""
