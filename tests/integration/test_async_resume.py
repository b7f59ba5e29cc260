"""Kill a fully async run with SIGKILL mid-run and resume it: every prompt is trained exactly once.

The data source serves one epoch only, so the count is exact: the rows of the killed run up to
its last complete checkpoint plus every row of the resumed run hold each prompt once. Training
after that checkpoint is rolled back by the resume; the groups that were generating or waiting
in the buffer at the checkpoint are regenerated from its saved prompts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from miles.config import load_config
from miles.controller import loop_async
from miles.models.resolve import resolve_model_paths
from miles.rollout.data_source import JsonlDataSource

REPO = Path(__file__).resolve().parents[2]
NUM_PROMPTS = 16
BATCH_GROUPS = 4
NUM_STEPS = NUM_PROMPTS // BATCH_GROUPS  # exactly one epoch
SAVE_INTERVAL = 2  # checkpoints after steps 1 and 3 (the last)


class OneEpochSource(JsonlDataSource):
    """Serves handed-back groups, then each prompt of the file once; then nothing."""

    def get_samples(self, num_groups: int):
        groups = []
        while self._buffer and len(groups) < num_groups:
            groups.append(self._buffer.popleft())
        while len(groups) < num_groups and self.epoch == 0 and self.offset < len(self._order):
            groups.append(self._make_group(self._next_row()))
        return groups


def _args(tmp: Path, out: str) -> list[str]:
    data = tmp / "prompts.jsonl"
    if not data.exists():
        data.write_text(
            "".join(json.dumps({"input": f"copy {i % 10} :", "label": str(i % 10)}) + "\n" for i in range(NUM_PROMPTS))
        )
    return [
        sys.executable,
        "-m",
        "miles.cli",
        "train",
        "--hf-checkpoint",
        "tiny:qwen2:2x64",
        "--prompt-data",
        str(data),
        "--input-key",
        "input",
        "--label-key",
        "label",
        "--custom-rm-path",
        "miles.recipes.digit_copy.reward",
        "--data-source-path",
        "tests.integration.test_async_resume:OneEpochSource",
        "--fully-async",
        "--num-rollout",
        str(NUM_STEPS),
        "--rollout-batch-size",
        str(BATCH_GROUPS),
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        str(2 * BATCH_GROUPS),
        "--rollout-max-response-len",
        "4",
        "--async-max-concurrent-samples",
        "16",
        "--async-unused-samples-handler",
        "retry",
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-engines",
        "1",
        "--save",
        str(tmp / "ckpt"),
        "--save-interval",
        str(SAVE_INTERVAL),
        "--auto-resume",
        "--output-dir",
        str(tmp / out),
    ]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "MILES_TORCH_THREADS": "1",
        "MILES_ENGINE_STEP_DELAY_S": "0.05",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    }


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "trained_prompts.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _last_complete_step(ckpt: Path) -> int | None:
    from miles.trainer.checkpoint import COMPLETE_MARKER

    done = [int(p.name.split("_")[1]) for p in ckpt.glob("iter_*") if (p / COMPLETE_MARKER).exists()]
    return max(done) if done else None


def _kill_after_checkpoint(proc: subprocess.Popen, tmp: Path, timeout_s: float = 150) -> list[psutil.Process]:
    """SIGKILL the controller once a checkpoint exists and a later step has started training."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"run 1 ended (rc={proc.returncode}) before it could be killed"
        saved = _last_complete_step(tmp / "ckpt")
        if saved is not None and any(r["step"] > saved for r in _rows(tmp / "run1")):
            workers = psutil.Process(proc.pid).children(recursive=True)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return workers
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("run 1 never reached a checkpoint followed by another step")


@pytest.mark.slow
@pytest.mark.exec_workers  # the workers must be the controller's children: it checks they outlive it not
def test_sigkill_and_resume_trains_every_prompt_once(tmp_path, monkeypatch) -> None:
    run1 = subprocess.Popen(
        _args(tmp_path, "run1"),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "run1.log").open("w"),
    )
    workers = _kill_after_checkpoint(run1, tmp_path)
    assert workers, "the controller had no worker processes"
    psutil.wait_procs(workers, timeout=60)
    assert not [w.pid for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE], (
        "workers outlived their SIGKILLed controller"
    )

    saved = _last_complete_step(tmp_path / "ckpt")
    assert saved is not None and saved < NUM_STEPS - 1
    rolled_back = [r for r in _rows(tmp_path / "run1") if r["step"] > saved]
    assert rolled_back, "no training happened after the checkpoint: the kill did not test the roll-back"

    # the resumed run in this process (no SIGKILL needed; saves the interpreter start-up)
    for key, value in _env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(REPO))
    cfg = load_config(_args(tmp_path, "run2")[4:])
    resolve_model_paths(cfg.model, seed=cfg.train.seed)  # as `miles train` does
    asyncio.run(loop_async.train(cfg))
    rows2 = _rows(tmp_path / "run2")
    assert [r["step"] for r in rows2] == list(range(saved + 1, NUM_STEPS))

    kept = [i for r in _rows(tmp_path / "run1") if r["step"] <= saved for i in r["group_index"]]
    counts = Counter(kept + [i for r in rows2 for i in r["group_index"]])
    assert sorted(counts) == list(range(NUM_PROMPTS)), f"missing prompts: {set(range(NUM_PROMPTS)) - set(counts)}"
    assert all(c == 1 for c in counts.values()), {i: c for i, c in counts.items() if c != 1}
