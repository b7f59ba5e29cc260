"""Requeue without Slurm: SIGTERM mid-run -> checkpoint at the step boundary, clean exit; the same
command again (`--save DIR --auto-resume`) continues at the next step."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from miles.trainer.checkpoint import latest_complete_checkpoint

from harness import REPO as REPO_ROOT  # isort: skip
from harness import SMALL_RUN, train_command, train_env  # isort: skip

NUM_ROLLOUT = 6


def _train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:  # a line still being written
            continue
        if m.get("step", -1) >= 0 and "train/loss" in m:
            steps.append(m["step"])
    return steps


def _train_cmd(run_dir: Path, save_dir: Path) -> list[str]:
    flags = ("--num-rollout", str(NUM_ROLLOUT), "--save", str(save_dir), "--auto-resume")
    return train_command(run_dir, *SMALL_RUN, *flags)


@pytest.mark.exec_workers  # the workers must be the controller's children: it checks they all ended
def test_sigterm_checkpoints_and_the_next_run_resumes(tmp_path) -> None:
    save_dir = tmp_path / "ckpt"
    first = subprocess.Popen(
        _train_cmd(tmp_path / "run1", save_dir),
        cwd=REPO_ROOT,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    descendants: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while len(_train_steps(tmp_path / "run1")) < 2:
            assert first.poll() is None, f"the first run ended early:\n{first.stdout.read()[-4000:]}"
            assert time.monotonic() < deadline, "the first run logged fewer than 2 steps in 240 s"
            time.sleep(0.05)
        descendants = psutil.Process(first.pid).children(recursive=True)
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=180)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, out[-4000:]
    assert "received SIGTERM" in out

    steps1 = _train_steps(tmp_path / "run1")
    stopped_at = steps1[-1]
    assert stopped_at < NUM_ROLLOUT - 1, f"the run finished ({steps1}) before the signal took effect"
    assert steps1 == list(range(stopped_at + 1))
    ckpt = latest_complete_checkpoint(str(save_dir))
    assert ckpt is not None and Path(ckpt).name == f"iter_{stopped_at:07d}"
    assert not [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    second = subprocess.run(
        _train_cmd(tmp_path / "run2", save_dir),
        cwd=REPO_ROOT,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0, second.stderr[-4000:]
    assert f"resumed from {ckpt} at rollout {stopped_at + 1}" in second.stderr
    assert _train_steps(tmp_path / "run2") == list(range(stopped_at + 1, NUM_ROLLOUT))
    assert Path(latest_complete_checkpoint(str(save_dir))).name == f"iter_{NUM_ROLLOUT - 1:07d}"
