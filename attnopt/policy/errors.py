"""The one error every policy problem raises: an unknown form, field or value, named with the fix."""

from __future__ import annotations


class PolicyError(ValueError):
    """A policy names an unknown form, field or value. The message names the allowed values."""
