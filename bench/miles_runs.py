"""What the benches that launch whole runs share: the `miles train` command line and the run's metrics.

    from miles_runs import train_command, metrics_rows   # a bench in this folder

A run of a bench is `miles train` in its own process (its start-up is part of what is measured), into its
own output directory, without the progress bar; the figures come from the run's metrics.jsonl.
"""

from __future__ import annotations

import sys
from pathlib import Path

from miles.utils.metrics import read_metrics


def train_command(flags: list[str], out_dir: str | Path) -> list[str]:
    """`miles train FLAGS` into `out_dir`, run by this interpreter."""
    return [sys.executable, "-m", "miles.cli", "train", *flags, "--output-dir", str(out_dir), "--no-progress-bar"]


def metrics_rows(out_dir: str | Path) -> list[dict]:
    """The run's metrics.jsonl rows; none when it wrote no file (it failed before its first step)."""
    return read_metrics(str(out_dir)) if (Path(out_dir) / "metrics.jsonl").is_file() else []
