"""One sink API for per-step metrics: JSONL always, TensorBoard and Weights & Biases optionally.

A W&B run logs the resolved config and keeps one run across restarts: its id is written to
`wandb_run_id` in the run directory and beside the checkpoints (the `--save` root), and a run
started with `--load` finds it there and resumes that W&B run (`resume="allow"`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from typing import Any

logger = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    """JSON-safe scalar: numpy/torch scalars become floats, NaN/inf become None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


WANDB_ID_FILE = "wandb_run_id"


def _read_wandb_id(directories: list[str]) -> str | None:
    for directory in directories:
        path = os.path.join(directory, WANDB_ID_FILE)
        if os.path.isfile(path):
            with open(path) as f:
                run_id = f.read().strip()
            if run_id:
                return run_id
    return None


def resumed_wandb_id(load: str | None, run_dir: str) -> str | None:
    """The W&B run a `--load` continues: its id beside the checkpoint (`--load` is a `--save` root or one
    of its iter_* directories) or in the run directory; None without `--load` or without a stored id."""
    if not load:
        return None
    load = os.path.abspath(load)
    return _read_wandb_id([load, os.path.dirname(load), run_dir])


def _write_wandb_id(run_id: str, directories: list[str]) -> None:
    for directory in dict.fromkeys(d for d in directories if d):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, WANDB_ID_FILE), "w") as f:
            f.write(run_id + "\n")


class MetricsSink:
    """Writes one JSON object per step to `<run_dir>/metrics.jsonl`, mirrored to TensorBoard / W&B."""

    def __init__(
        self,
        run_dir: str,
        *,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        wandb_group: str | None = None,
        run_name: str | None = None,
        config: dict | None = None,
        wandb_mode: str | None = None,
        resume_from: str | None = None,
        checkpoint_root: str | None = None,
    ):
        """`resume_from` is `--load` (a W&B run id stored there is resumed), `checkpoint_root` the `--save`
        root the id is written beside; `config` is the resolved config, secrets already blanked."""
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        self._wandb = None
        if tensorboard:
            try:
                self._tb = ScalarEvents(os.path.join(run_dir, "tensorboard"))
            except ImportError:
                logger.warning(
                    "no TensorBoard event files: tensorboard is not installed (pip install "
                    "'miles[tensorboard]', or --no-use-tensorboard); metrics.jsonl has every metric"
                )
            except Exception as e:  # noqa: BLE001 - TensorBoard is optional at run time
                logger.warning("TensorBoard disabled: %s", e)
        if wandb_project:
            self._wandb = self._start_wandb(
                wandb_project, wandb_group, run_name, config, wandb_mode, resume_from, checkpoint_root
            )

    def _start_wandb(
        self,
        project: str,
        group: str | None,
        run_name: str | None,
        config: dict | None,
        mode: str | None,
        resume_from: str | None,
        checkpoint_root: str | None,
    ) -> Any:
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError("--use-wandb needs the wandb package: pip install wandb") from e
        run_id = resumed_wandb_id(resume_from, self.run_dir)
        if run_id:
            logger.info("resuming W&B run %s (its id was stored beside --load %s)", run_id, resume_from)
        run_id = run_id or uuid.uuid4().hex[:12]
        kwargs: dict[str, Any] = {"mode": mode} if mode else {}
        run = wandb.init(
            project=project,
            group=group,
            name=run_name,
            config=config,
            dir=self.run_dir,
            id=run_id,
            resume="allow",
            **kwargs,
        )
        _write_wandb_id(run_id, [self.run_dir, checkpoint_root])
        return run

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            numbers.pop("step")
            self._tb.add_scalars(numbers, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class ScalarEvents:
    """TensorBoard scalars through tensorboard's own event-file writer: the event files torch's
    `SummaryWriter` writes, without importing torch into the controller (seconds at start-up)."""

    def __init__(self, logdir: str) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._writer = EventFileWriter(logdir)

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        """One event for the step's scalars (an event per scalar cost ~3.5 ms a step of 60 metrics)."""
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
        self._writer.add_event(self._event(summary=summary, step=step, wall_time=time.time()))

    def close(self) -> None:
        self._writer.close()


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
