"""Grid sweeps: one YAML file -> K `miles train` runs, one per Slurm array task.

    name: lr-sweep                      # optional; default: the file name without .yaml
    base: launch/configs/demo_cpu.yaml  # a config file, or an inline mapping of flags
    sweep_dir: runs/sweeps/lr-sweep     # optional; default runs/sweeps/<name>
    grid:
      lr: [1.0e-6, 3.0e-6]
      n-samples-per-prompt: [4, 8]

Points are the cartesian product of the grid in the order the keys are written, the last key
varying fastest, so an index names the same point on every machine. Point N trains into
<sweep_dir>/<name>-<N>.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from miles.config import FIELDS, ConfigError, closest_flag

logger = logging.getLogger(__name__)

SBATCH_SCRIPT = Path("slurm/sweep.sbatch")
SWEEP_KEYS = {"name", "base", "grid", "sweep_dir"}
# (miles train argv, base flags of an inline `base:` mapping or None) -> exit status
TrainCommand = Callable[[list[str], "dict[str, Any] | None"], int]


@dataclass(slots=True)
class Sweep:
    path: Path
    name: str
    base: str | dict[str, Any]  # config file path (resolved) or inline flags
    grid: dict[str, list[Any]]
    sweep_dir: Path
    points: list[dict[str, Any]] = field(default_factory=list)


def expand(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Cartesian product in key order, last key fastest."""
    keys = list(grid)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(grid[k] for k in keys))]


def _resolve_base(base: Any, sweep_path: Path) -> str | dict[str, Any]:
    if isinstance(base, dict):
        return base
    if not isinstance(base, str):
        raise ConfigError(f"{sweep_path}: 'base' must be a config file path or a mapping of flags, got {base!r}")
    candidate = Path(base)
    if not candidate.is_absolute() and not candidate.is_file() and (sweep_path.parent / candidate).is_file():
        candidate = sweep_path.parent / candidate  # relative to the sweep file when not found from here
    if not candidate.is_file():
        raise ConfigError(
            f"{sweep_path}: base config {base!r} not found (relative to the working directory or the sweep file)"
        )
    return str(candidate)


def _check_grid(grid: Any, sweep_path: Path) -> dict[str, list[Any]]:
    if not isinstance(grid, dict) or not grid:
        raise ConfigError(f"{sweep_path}: 'grid' must be a non-empty mapping of flag: [values...]")
    errors, out = [], {}
    for key, values in grid.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in FIELDS or not FIELDS[name].cli:
            near = closest_flag("--" + name.replace("_", "-"))
            errors.append(
                f"{sweep_path}: grid key {key!r} is not a flag" + (f"; closest valid flag: {near}" if near else "")
            )
        elif not isinstance(values, list) or not values:
            errors.append(f"{sweep_path}: grid key {key!r} needs a non-empty list of values, got {values!r}")
        else:
            out[name] = values
    if errors:
        raise ConfigError(errors)
    return out


def load_sweep(path: str | Path) -> Sweep:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file {path} not found")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a sweep file is a mapping with base: and grid:")
    unknown = set(data) - SWEEP_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown sweep keys {sorted(unknown)}; allowed: {sorted(SWEEP_KEYS)}")
    name = str(data.get("name") or path.stem)
    grid = _check_grid(data.get("grid"), path)
    base = _resolve_base(data.get("base", {}), path)
    sweep_dir = Path(data.get("sweep_dir") or f"runs/sweeps/{name}")
    return Sweep(path=path, name=name, base=base, grid=grid, sweep_dir=sweep_dir, points=expand(grid))


def override_argv(overrides: dict[str, Any]) -> list[str]:
    """{field: value} -> command-line flags as `miles train` takes them."""
    argv: list[str] = []
    for name, value in overrides.items():
        flag = FIELDS[name].flag
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, "none" if value is None else str(value)]
    return argv


def point_argv(sweep: Sweep, index: int) -> list[str]:
    """The `miles train` arguments of point `index` (base config file, overrides, output dir)."""
    if not 0 <= index < len(sweep.points):
        raise ConfigError(
            f"--task-id={index} is out of range: {sweep.path} has {len(sweep.points)} points (0..{len(sweep.points) - 1})"
        )
    argv = ["--config", sweep.base] if isinstance(sweep.base, str) else []
    argv += override_argv(sweep.points[index])
    return argv + ["--output-dir", str(sweep.sweep_dir / f"{sweep.name}-{index}")]


def run_point(sweep: Sweep, index: int, train: TrainCommand, extra: list[str] | None = None) -> int:
    """Train point `index` with `train` (`miles train`); `extra` flags come last, so they override the grid."""
    argv = point_argv(sweep, index) + list(extra or [])
    logger.info("sweep %s point %d/%d: miles train %s", sweep.name, index, len(sweep.points), " ".join(argv))
    return train(argv, sweep.base if isinstance(sweep.base, dict) else None)


def invalid_points(sweep: Sweep, extra: list[str] | None = None) -> dict[int, str]:
    """{index: why} for the points whose config does not pass `miles train`'s start-up checks."""
    from miles.config import load_config

    bad = {}
    quiet = logging.getLogger("miles.config.checks")
    level, quiet.level = quiet.level, logging.WARNING  # the derivations are logged again when a point runs
    for index in range(len(sweep.points)):
        try:
            load_config(
                point_argv(sweep, index) + list(extra or []), base=sweep.base if isinstance(sweep.base, dict) else None
            )
        except ConfigError as e:
            bad[index] = str(e).replace("\n", " ")
    quiet.level = level
    return bad


def submit(sweep: Sweep, script: Path, extra: list[str] | None = None) -> str:
    """sbatch an array of len(points) tasks running this sweep; returns the job id."""
    repo_copy = Path(__file__).resolve().parents[1] / script
    if not script.is_file() and not script.is_absolute() and repo_copy.is_file():
        script = repo_copy  # run from outside the checkout
    if not script.is_file():
        raise ConfigError(
            f"--submit needs the array job script {script}; run from the repository root or pass --sbatch-script"
        )
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError(
            "--submit needs Slurm's sbatch on PATH; on a machine without Slurm use --task-id N per point"
        )
    cmd = [sbatch, "--parsable", f"--array=0-{len(sweep.points) - 1}", str(script), str(sweep.path), *(extra or [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ConfigError(f"sbatch failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]  # --parsable prints "jobid[;cluster]"


EXIT_INVALID = 2  # --list found invalid points


def main(argv: list[str], train: TrainCommand) -> int:
    """`miles sweep`; `train` runs one point (the `miles train` command, passed in by `miles.cli`)."""
    parser = argparse.ArgumentParser(
        prog="miles sweep",
        description="Expand, list, run or submit a grid sweep. Other --flags are passed to every point's miles train.",
    )
    parser.add_argument("sweep_file", help="sweep YAML (name:, base:, grid:, sweep_dir:)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="print each point's index and overrides")
    mode.add_argument("--task-id", type=int, default=None, help="run point N (default: $SLURM_ARRAY_TASK_ID)")
    mode.add_argument("--submit", action="store_true", help="sbatch one array task per point")
    parser.add_argument("--sbatch-script", type=Path, default=SBATCH_SCRIPT, help="array job script for --submit")
    args, extra = parser.parse_known_args(argv)  # the rest: `miles train` flags applied to every point
    sweep = load_sweep(args.sweep_file)
    if args.list or args.submit:
        bad = invalid_points(sweep, extra)
    if args.list:
        for index, point in enumerate(sweep.points):
            note = f"\tINVALID: {bad[index]}" if index in bad else ""
            print(f"{index}\t{' '.join(override_argv(point))}{note}")
        return EXIT_INVALID if bad else 0
    if args.submit:
        if bad:  # an array whose tasks fail at start-up wastes the allocation
            first = min(bad)
            raise ConfigError(
                f"{len(bad)} of {len(sweep.points)} points of {sweep.path} are invalid (e.g. point {first}: "
                f"{bad[first]}); fix the grid or the base config (miles sweep {sweep.path} --list shows each)"
            )
        job_id = submit(sweep, args.sbatch_script, extra)
        print(job_id)
        return 0
    task = args.task_id
    if task is None and os.environ.get("SLURM_ARRAY_TASK_ID", "").strip():
        task = int(os.environ["SLURM_ARRAY_TASK_ID"])
    if task is None:
        raise ConfigError("miles sweep: give --list, --submit, or --task-id N (or run inside a Slurm array job)")
    return run_point(sweep, task, train, extra)
