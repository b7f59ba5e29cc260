"""One sink API for per-step metrics: JSONL always, TensorBoard and Weights & Biases optionally."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

logger = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    """JSON-safe scalar: numpy/torch scalars become floats, NaN/inf become None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsSink:
    """Writes one JSON object per step to `<run_dir>/metrics.jsonl`, mirrored to TensorBoard / W&B."""

    def __init__(self, run_dir: str, *, tensorboard: bool = True, wandb_project: str | None = None,
                 wandb_group: str | None = None, run_name: str | None = None, config: dict | None = None):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
            except Exception as e:  # noqa: BLE001 - TensorBoard is optional at run time
                logger.warning("TensorBoard disabled: %s", e)
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("--use-wandb needs the wandb package: pip install wandb") from e
            self._wandb = wandb.init(project=wandb_project, group=wandb_group, name=run_name, config=config, dir=run_dir)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
