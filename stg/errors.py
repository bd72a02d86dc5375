"""Typed errors. Each names the field, tensor or axis and the numbers involved.

The CLI turns any StgError into a one-line message and exit code 2 (bad input);
`assert` is kept for internal invariants only.
"""


class StgError(Exception):
    """Bad input that the user can fix; the message says what and why."""


class ModelSpecError(StgError):
    """A model description (zoo name, YAML, dict) is unknown, malformed or inconsistent."""


class PlanError(StgError):
    """A parallelism plan is malformed or does not fit the model."""


class LayoutError(StgError):
    """A layout does not divide a tensor dimension, or layouts conflict."""


class GraphError(StgError):
    """A graph is malformed: unknown tensor, shape mismatch, cycle, unused parameter."""


class OutputError(StgError):
    """The output location cannot be written."""


class ViewError(StgError):
    """A timeline, plot or report cannot be made from the given trace set or options."""


class RangeError(StgError):
    """A number is not finite, not positive, or too large for the field it must fit."""
