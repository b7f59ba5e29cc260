"""Curves of a finished (or running) run: PNGs from RUN_DIR/metrics.jsonl, and a terminal plot.

Each line of metrics.jsonl is one JSON object of metric name -> number for one step; the step
is read from "step" (or "rollout_id"), else the line number. Lines may carry different keys
(rollout, train and eval metrics logged separately), so every key gets its own (step, value)
series.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

EXACT_KEYS = (
    "rollout/reward_mean",
    "train/train_rollout_logprob_abs_diff",
    "train/train_rollout_kl",
    "rollout/fully_async/avg_staleness",
    "perf/step_time",
    "train/loss",
)
PREFIXES = ("train/kl",)
# eval/<dataset>/... carries bookkeeping too (sample counts, versions): plot the scores only
EVAL_SUFFIXES = ("/reward_mean", "/delay_steps")
STEP_KEYS = ("step", "rollout_id")


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to get it."""


def wanted(key: str) -> bool:
    if key.startswith("eval/"):
        return key.endswith(EVAL_SUFFIXES)
    return key in EXACT_KEYS or key.startswith(PREFIXES)


def read_series(metrics_path: str | Path) -> dict[str, tuple[list[float], list[float]]]:
    """{metric: (steps, values)} for the plotted metrics; malformed lines are skipped with a warning."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    with open(metrics_path) as f:
        for line_no, line in enumerate(f):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s:%d is not JSON; skipped", metrics_path, line_no + 1)
                continue
            step = next((record[k] for k in STEP_KEYS if isinstance(record.get(k), (int, float))), line_no)
            for key, value in record.items():
                if wanted(key) and isinstance(value, (int, float)) and not isinstance(value, bool):
                    xs, ys = series.setdefault(key, ([], []))
                    xs.append(float(step))
                    ys.append(float(value))
    return series


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write RUN_DIR/plots/<metric>.png for each plotted metric present; return the paths."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"miles plot: {metrics} not found (is {run_dir} a run directory?)")
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("PNG curves need matplotlib: pip install 'miles[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_series(metrics)
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, (xs, ys) in sorted(series.items()):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(xs, ys, marker="." if len(xs) < 50 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / (key.replace("/", "_") + ".png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def reward_curve(run_dir: str | Path, key: str = "rollout/reward_mean") -> str:
    """The run's reward as an ASCII plot ("" when the key was never logged)."""
    series = read_series(Path(run_dir) / "metrics.jsonl").get(key)
    return ascii_curve(series[1]) if series else ""


def ascii_curve(values: Sequence[float], width: int = 60, height: int = 12) -> str:
    """A terminal plot: `height` rows of `label |` + `width` columns, highest values on top.

    Values are averaged into `width` buckets (or spread over fewer columns when there are
    fewer values); each column gets one '*' at its scaled height. NaNs are ignored.
    """
    points = [float(v) for v in values if not math.isnan(float(v))]
    if not points or width < 1 or height < 1:
        return ""
    columns = _bucket_means(points, width)
    lo, hi = min(columns), max(columns)
    span = hi - lo or 1.0
    grid = [[" "] * len(columns) for _ in range(height)]
    for col, value in enumerate(columns):
        row = round((value - lo) / span * (height - 1))
        grid[height - 1 - row][col] = "*"
    labels = [f"{hi:.4g}"] + [""] * (height - 2) + [f"{lo:.4g}"] if height > 1 else [f"{hi:.4g}"]
    pad = max(len(label) for label in labels)
    return "\n".join(f"{label:>{pad}} |{''.join(row)}" for label, row in zip(labels, grid, strict=True))


def _bucket_means(points: list[float], width: int) -> list[float]:
    if len(points) <= width:
        return points
    out = []
    for col in range(width):
        start, stop = col * len(points) // width, (col + 1) * len(points) // width
        chunk = points[start:stop]
        out.append(sum(chunk) / len(chunk))
    return out
