"""Errors that end a run with one line: what went wrong, at which step, and what to change.

`miles train` prints a `RunFailed` without a traceback and exits with status 1 (`miles.cli.one_line`).
Raise one where the cause is known and the traceback would only hide it (every group dropped, a
non-finite loss); a bug keeps its traceback. One raised in a worker reaches the controller as an RPC error
carrying its type name; `as_run_failure` turns it back into the same kind.
"""

from __future__ import annotations


class RunFailed(RuntimeError):
    """The run cannot go on; the message says why and what to change."""


class RolloutStalled(RunFailed):
    """Generation kept dropping every group (reward failures, aborts, filter rejections)."""


class NonFiniteTraining(RunFailed):
    """A loss or gradient norm was NaN or infinite; the update was not applied."""


_KINDS = {kind.__name__: kind for kind in (RunFailed, RolloutStalled, NonFiniteTraining)}


def as_run_failure(exc: BaseException) -> RunFailed | None:
    """`exc` as a RunFailed: itself, or one a worker raised (an RPC error with `exc_type`); else None."""
    if isinstance(exc, RunFailed):
        return exc
    kind = _KINDS.get(getattr(exc, "exc_type", None))
    return kind(getattr(exc, "remote_message", str(exc))) if kind is not None else None
