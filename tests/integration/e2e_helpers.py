"""Run `miles train` as a user would (a subprocess) and read its metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "launch" / "configs" / "demo_cpu.yaml"


def train_command(out_dir: Path, *flags: str) -> list[str]:
    """`miles train` on the CPU demo config into `out_dir`, with `flags` last (they win)."""
    return [
        sys.executable,
        "-m",
        "miles.cli",
        "train",
        "--config",
        str(DEMO),
        "--output-dir",
        str(out_dir),
        "--no-progress-bar",
        *flags,
    ]


def run_train(out_dir: Path, *flags: str, timeout_s: float = 600, env: dict | None = None) -> list[dict]:
    """Run the CPU demo config with `flags`; return metrics.jsonl rows. Fails with the run's output tail."""
    cmd = train_command(out_dir, *flags)
    full_env = {**os.environ, "MILES_TORCH_THREADS": "1", "PYTHONPATH": python_path(), **(env or {})}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the workers notice their controller is gone and exit
        stdout, stderr = proc.communicate()
        raise AssertionError(f"miles train did not finish in {timeout_s}s:\n{stderr[-5000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"miles train failed ({proc.returncode}):\n{stdout[-3000:]}\n{stderr[-5000:]}")
    return read_rows(out_dir)


def read_rows(out_dir: Path) -> list[dict]:
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def python_path() -> str:
    """The repository first, then whatever PYTHONPATH the tests run with (packages installed off site-packages)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def leftover_processes(marker: str) -> list[str]:
    """Processes whose command line mentions `marker` (a run directory), other than this one."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            text = " ".join(p.info["cmdline"] or []) + " " + " ".join((p.info["environ"] or {}).values())
        except (psutil.Error, TypeError):
            continue
        if marker in text and p.pid != os.getpid():
            found.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:200]}")
    return found
