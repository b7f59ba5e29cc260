"""A live progress line per step and the reward curve printed at the end of a run."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)


class StepProgress:
    """rich progress bar showing the latest reward and step time; plain log lines without a TTY."""

    def __init__(self, total: int, *, start: int = 0, enabled: bool = True) -> None:
        """`total` steps (`--num-rollout`), from step `start`; `enabled`: `--progress-bar` (off without a TTY)."""
        self.total = total
        self.start = start
        self.enabled = enabled and sys.stderr.isatty()
        self._progress = None
        self._task = None

    def __enter__(self) -> StepProgress:
        if self.enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.description}"),
                TimeRemainingColumn(),
            )
            self._progress.start()
            self._task = self._progress.add_task("", total=self.total, completed=self.start)
        return self

    def update(self, metrics: dict[str, float]) -> None:
        shown = "loss" if "rollout/reward_mean" not in metrics and "train/loss" in metrics else "reward"  # SFT: loss
        value = metrics.get("train/loss" if shown == "loss" else "rollout/reward_mean", float("nan"))
        desc = f"{shown} {value:.3f}  step {metrics.get('perf/step_time', 0.0):.1f}s"
        if self._progress is not None:
            self._progress.update(self._task, advance=1, description=desc)
        else:
            logger.info("%s", desc)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()


def print_reward_curve(run_dir: str, key: str = "rollout/reward_mean", *, plots: bool = True) -> None:
    """Print the reward curve in the terminal and (with `plots`) write PNG curves next to the metrics."""
    from miles.utils.metrics import read_metrics
    from miles.utils.plot import ascii_curve, plot_run

    rows = read_metrics(run_dir)
    values = [r[key] for r in rows if r.get(key) is not None]
    title = "reward curve" if key == "rollout/reward_mean" else "loss curve" if key == "train/loss" else "curve"
    print(f"\n{title} ({key}, {len(values)} steps) — run directory: {run_dir}")
    if values:
        print(ascii_curve(values, width=60, height=12))
        print(f"first {values[0]:.3f}  last {values[-1]:.3f}  max {max(values):.3f}")
    if not plots:
        return
    try:
        paths = plot_run(run_dir)
        print("plots: " + ", ".join(os.path.relpath(p) for p in paths))
    except Exception as e:  # noqa: BLE001 - plotting must not fail a finished run
        logger.warning("could not write plots: %s", e)
