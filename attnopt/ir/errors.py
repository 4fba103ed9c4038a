"""Every error attnopt raises on purpose, in one place: each names the problem and the fix in one line."""

from __future__ import annotations


class PolicyError(ValueError):
    """A policy names an unknown form, field or value. The message names the allowed values."""


class SiteUnsupported(ValueError):
    """A planned form cannot be built for this site by this rewrite mechanism; the message says why."""


class KeptByPlan(SiteUnsupported):
    """The form's own plan keeps this site exact (a reuse anchor, or a layer its measurement leaves
    exact): the site is kept on purpose, not refused; the message says what it does instead."""


class CaptureError(RuntimeError):
    """The model could not be traced into a graph; the message says why and what to try."""


class SpecializedInputError(CaptureError, AssertionError):
    """A captured graph was called with a non-tensor input other than the one it was captured with.

    torch.export bakes Python floats / ints / bools / strings / None into the graph; this names the
    argument instead of the raw `Guard failed: sc == 0.3` (or no error at all). Also an
    AssertionError, which is what the guard raised before."""


class SaveError(ValueError):
    """attnopt.save / attnopt.load cannot proceed; the message says why in one line."""


class CalibrationError(ValueError):
    """attnopt.calibrate cannot proceed; the message names the problem and the fix in one line."""


class ParityError(RuntimeError):
    """An exported file computes something else than the torch model; the message names the site."""


class SpecializedShapeError(SpecializedInputError, ValueError):
    """A captured graph was called with a tensor size it was not captured for.

    torch.export fixes a dim at its example size where the model's code needs it (or where the
    example's size is 1); the message names the input, the dim and the size the graph holds,
    instead of a raw guard assertion or a reshape error deep inside the graph."""
