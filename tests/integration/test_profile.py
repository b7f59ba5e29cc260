"""`--profile-steps` leaves one Chrome trace per worker; `sys/*` metrics come with every step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from miles.utils.profiling import ProfileSchedule

from harness import REPO, SMALL_RUN, train_command, train_env  # isort: skip


def test_schedule_groups_consecutive_steps_into_windows(tmp_path) -> None:
    sched = ProfileSchedule([5, 3, 4, 9], str(tmp_path))
    assert [(w.first, w.last) for w in sched.windows] == [(3, 5), (9, 9)]
    assert sched.starts_at(3) == os.path.join(str(tmp_path), "profile", "steps_3-5")
    assert sched.starts_at(4) is None and not sched.ends_at(4) and sched.ends_at(5) and sched.ends_at(9)
    assert not ProfileSchedule([], str(tmp_path))
    with pytest.raises(ValueError, match="rollout ids"):
        ProfileSchedule([-1], str(tmp_path))


def _run_train(out_dir: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = train_command(out_dir, *SMALL_RUN, *flags)
    return subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)


def test_profile_steps_write_one_trace_per_worker(tmp_path) -> None:
    out = tmp_path / "run"
    py_spy = shutil.which("py-spy") is not None
    proc = _run_train(str(out), "--num-rollout", "3", "--profile-steps", "1,2", *(["--py-spy"] if py_spy else []))
    assert proc.returncode == 0, proc.stderr[-4000:]

    window = out / "profile" / "steps_1-2"
    traces = sorted(p.name for p in window.glob("*.pt.trace.json"))
    assert traces == ["rollout_0.pt.trace.json", "trainer_0.pt.trace.json"]
    for name in traces:
        events = json.loads((window / name).read_text())["traceEvents"]
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        # the engine computes in worker threads: its ops are recorded too, not only the RPC thread's
        assert ops, f"{name} holds no torch ops ({len(events)} events)"
    trainer_ops = {e["name"] for e in json.loads((window / "trainer_0.pt.trace.json").read_text())["traceEvents"]}
    assert any("backward" in n.lower() for n in trainer_ops), "the trainer trace has no backward pass"
    if py_spy:
        for worker in ("trainer_0", "rollout_0"):
            profile = json.loads((window / f"{worker}.py-spy.json").read_text())
            assert profile["profiles"], f"py-spy recorded nothing for {worker}"
    assert not (out / "profile" / "steps_0-0").exists()

    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_steps = [m for m in steps if m["step"] >= 0 and "train/loss" in m]
    assert len(train_steps) == 3
    for m in train_steps:
        for worker in ("trainer_0", "rollout_0"):
            assert m[f"sys/{worker}/rss_gb"] > 0.05  # a torch process holds well over 50 MB
            assert m[f"sys/{worker}/cpu_percent"] >= 0.0
