"""Exceptions raised by ucm_patch's core."""

from __future__ import annotations


class UCMPatchError(Exception):
    """Base class for ucm_patch errors."""


class ConfigError(UCMPatchError, ValueError):
    """Bad user input: an environment variable, config-file key or value.

    The message always names the variable or key, the bad value and what is accepted.
    """


class PatchFailed(UCMPatchError, RuntimeError):
    """A patch could not be applied (raised only in strict mode)."""
