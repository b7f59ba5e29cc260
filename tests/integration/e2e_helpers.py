"""Run `miles train` as a user would (a subprocess) and read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "launch" / "configs" / "demo_cpu.yaml"


def run_train(out_dir: Path, *flags: str, timeout_s: float = 600, env: dict | None = None) -> list[dict]:
    """Run the CPU demo config with `flags`; return metrics.jsonl rows. Fails with the run's output tail."""
    cmd = [sys.executable, "-m", "miles.cli", "train", "--config", str(DEMO), "--output-dir", str(out_dir),
           "--no-progress-bar", *flags]
    full_env = {**os.environ, "MILES_TORCH_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(f"miles train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return read_rows(out_dir)


def read_rows(out_dir: Path) -> list[dict]:
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


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
