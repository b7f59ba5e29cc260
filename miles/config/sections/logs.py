"""The `logs` section: tensorBoard, Weights & Biases, progress bar, end-of-run plots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.option import option


@dataclass
class LoggingConfig:
    """TensorBoard, Weights & Biases, progress bar, end-of-run plots."""

    use_wandb: bool = option(False, "log to Weights & Biases")
    wandb_project: str | None = option(None, "W&B project")
    wandb_group: str | None = option(None, "W&B group")
    wandb_mode: Literal["online", "offline", "disabled"] | None = option(
        None,
        "{choices}; unset: WANDB_MODE, else online",
        notes={"offline": "logs kept under the run directory, `wandb sync` later"},
    )
    use_tensorboard: bool = option(True, "TensorBoard event files in the run directory")
    progress_bar: bool = option(True, "live progress bar")
    plot_curves: bool = option(
        True,
        "PNG curves of the metrics under <output-dir>/plots when the run ends (the plot extra; `miles plot RUN_DIR` "
        "draws them later); --no-plot-curves skips them, as sweeps of many runs may: metrics.jsonl and the "
        "printed reward curve stay",
    )
