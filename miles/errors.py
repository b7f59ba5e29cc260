"""Errors that end a run with one line: what went wrong, at which step, and what to change.

`miles train` prints a `RunFailed` without a traceback and exits with status 1 (`miles.cli.one_line`).
Raise one where the cause is known and the traceback would only hide it (every group dropped, a
non-finite loss); a bug keeps its traceback. One raised in a worker reaches the controller as an RPC error
carrying its type name; `as_run_failure` turns it back into the same kind.
"""

from __future__ import annotations

import re
from typing import Any


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


_OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory")
_OOM_ACCOUNT = ("Tried to allocate", "is free", "memory in use")  # torch's sentences worth the line
_OOM_HINT = (
    "to fit: lower --max-tokens-per-gpu or turn on --gradient-checkpointing (the trainer's activations), give "
    "the engine a smaller KV cache (--max-running-requests, --rollout-max-context-len), or with --colocate "
    "pass --offload-train and --offload-rollout"
)


def out_of_memory_hint(cfg: Any = None) -> str:
    """What to change to fit, leaving out what the run already does (`cfg`: the run's config as the run
    resolved it, colocated offload included; None: every lever)."""
    if cfg is None:
        return _OOM_HINT
    t = cfg.train
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu:
        levers = [f"lower --max-tokens-per-gpu (now {t.max_tokens_per_gpu})"]
    else:
        levers = [
            f"lower --micro-batch-size (now {t.micro_batch_size}) or bound micro-batches with --max-tokens-per-gpu"
        ]
    if not t.gradient_checkpointing:
        levers.append("turn on --gradient-checkpointing")
    levers.append("give the engine a smaller KV cache (--max-running-requests, --rollout-max-context-len)")
    if cfg.engine.colocate and not (t.offload_train and t.offload_rollout):
        levers.append("pass --offload-train and --offload-rollout")
    hint = f"to fit: {', '.join(levers[:-1])} or {levers[-1]}"
    if cfg.engine.colocate and t.offload_train and t.offload_rollout:
        hint += " (offload is on: each engine's log says what it keeps after a release)"
    return hint


def out_of_memory_line(exc: BaseException, cfg: Any = None) -> str | None:
    """One line for a worker or an engine that ran out of GPU memory: who, doing what, torch's own account
    (how much it tried, how much was free, who held the rest) and what to change (`out_of_memory_hint`); else
    None."""
    if getattr(exc, "exc_type", None) == "OutOfMemoryError":  # a worker's RPC error
        who, message = f"{exc.peer}.{exc.method}()", exc.remote_message
    elif hasattr(exc, "endpoint") and any(m in getattr(exc, "body", "") for m in _OOM_MARKERS):  # an engine's answer
        who, message = f"engine {exc.url} on {exc.endpoint}", str(exc).split(f"{exc.endpoint}: ", 1)[-1]
    else:
        return None
    sentences = re.split(r"(?<=\.)\s+", message.replace("\n", " "))
    account = "; ".join(s.rstrip(".") for s in sentences if any(k in s for k in _OOM_ACCOUNT))
    return f"{who} ran out of GPU memory ({account or message[:200]}); {out_of_memory_hint(cfg)}"
