"""slurm/train.sbatch and slurm/sweep.sbatch on a real (one-node) Slurm cluster.

CI starts the cluster with `.ci/slurm_setup.sh` (Debian's slurm-wlm + munge). Without `sbatch` or a
node that answers, these tests skip with the reason; with CI=true and MILES_REQUIRE_SLURM=1 they fail.
Jobs run this interpreter (MILES_PYTHON) with this checkout on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from harness import REPO as REPO_ROOT
from harness import SMALL_RUN as TINY
from harness import train_env

pytestmark = pytest.mark.exec_workers  # a Slurm step's workers belong to the step, not to a fork server

ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


def _slurmctld_refuses() -> str | None:
    """Why slurmctld cannot be up: its host (slurm.conf) refuses a TCP connection on its port; else None.

    `sinfo` retries a refused connection for its whole message time-out (about 10 s) before it gives up;
    a refused connect answers the same question at once. Anything else (no conf, a name that does not
    resolve, a connect that times out) leaves the verdict to `sinfo`."""
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
    keys: dict[str, list[str]] = {}
    if conf.is_file():
        for line in conf.read_text(errors="replace").splitlines():
            key, _, value = line.split("#", 1)[0].strip().partition("=")
            keys.setdefault(key.strip().lower(), []).append(value.strip())
    hosts = keys.get("slurmctldhost") or keys.get("controlmachine") or []
    if len(hosts) != 1:  # none named, or a backup controller that may answer: ask sinfo
        return None
    host = hosts[0]
    name, _, addr = host.partition("(")
    port = int(keys.get("slurmctldport", ["6817"])[0].split("-")[0])
    try:
        socket.create_connection((addr.rstrip(")") or name, port), timeout=2).close()
    except ConnectionRefusedError:
        return f"slurmctld is not running: {host}:{port} (from {conf}) refuses connections; run .ci/slurm_setup.sh"
    except OSError:
        pass
    return None


def _slurm_problem() -> str | None:
    """None when a Slurm node is up and idle enough to take jobs, else why not."""
    for tool in ("sbatch", "scontrol", "sinfo", "scancel"):
        if shutil.which(tool) is None:
            return f"{tool} not on PATH (CI installs Slurm with .ci/slurm_setup.sh)"
    if (refused := _slurmctld_refuses()) is not None:
        return refused
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 20 s: slurmctld is not running"
    states = out.stdout.split()
    if out.returncode != 0 or not states:
        return f"sinfo failed (exit {out.returncode}): {out.stderr.strip() or 'no nodes'}; run .ci/slurm_setup.sh"
    if not any(s.rstrip("*~#") in ("idle", "mix", "alloc") for s in states):
        return f"no Slurm node takes jobs (states {states}); see /var/log/slurm/slurmd.log"
    return None


@pytest.fixture(scope="module")
def slurm() -> None:
    problem = _slurm_problem()
    if problem is None:
        return
    if os.environ.get("CI") == "true" and os.environ.get("MILES_REQUIRE_SLURM") == "1":
        pytest.fail(f"MILES_REQUIRE_SLURM=1 but Slurm is not working: {problem}")
    pytest.skip(problem)


def _job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return train_env(**{"MILES_PYTHON": sys.executable, "SBATCH_OUTPUT": str(tmp_path / "%x-%j.out"), **extra})


def _submit(cmd: list[str], env: dict[str, str]) -> str:
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{' '.join(cmd)} failed: {out.stdout}{out.stderr}"
    job_id = out.stdout.strip().splitlines()[-1].split(";")[0]
    assert job_id.isdigit(), out.stdout
    return job_id


def _records(job_id: str) -> list[dict[str, str]]:
    """One dict per job (or array task) from `scontrol -o show job`."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    records = []
    for line in out.stdout.splitlines():
        fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        if fields:
            records.append(fields)
    return records


def _wait_done(job_ids: list[str], timeout_s: float, on_pending=None) -> dict[str, list[dict[str, str]]]:
    deadline = time.monotonic() + timeout_s
    while True:
        records = {j: _records(j) for j in job_ids}
        states = [r["JobState"] for rs in records.values() for r in rs]
        if states and not ACTIVE_STATES & set(states):
            return records
        if on_pending is not None:
            on_pending(records)
        if time.monotonic() > deadline:
            subprocess.run(["scancel", *job_ids], check=False)
            pytest.fail(f"Slurm jobs {job_ids} not done after {timeout_s:.0f} s: states {states}")
        time.sleep(1.0)


def _train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:  # the line being written
            continue
        if m.get("step", -1) >= 0 and "train/loss" in m:
            steps.append(m["step"])
    return steps


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"== {p}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.rglob("*.out")))


def test_train_and_sweep_jobs_finish(slurm, tmp_path) -> None:
    train_dir = tmp_path / "train"
    train_job = _submit(
        ["sbatch", "--parsable", "slurm/train.sbatch", "launch/configs/demo_cpu.yaml", "--num-rollout", "2", *TINY],
        _job_env(tmp_path, MILES_RUN_DIR=str(train_dir)),
    )
    sweep_file = tmp_path / "lr.yaml"
    lrs = [0.001, 0.002, 0.005]
    sweep_file.write_text(
        yaml.safe_dump(
            {
                "name": "lr",
                "base": str(REPO_ROOT / "launch/configs/demo_cpu.yaml"),
                "sweep_dir": str(tmp_path / "sweep"),
                "grid": {"lr": lrs},
            }
        )
    )
    sweep_job = _submit(
        [sys.executable, "-m", "miles.cli", "sweep", str(sweep_file), "--submit", "--num-rollout", "2", *TINY],
        _job_env(tmp_path, SBATCH_OUTPUT=str(tmp_path / "%x-%A_%a.out")),
    )

    records = _wait_done([train_job, sweep_job], timeout_s=600)
    for rs in records.values():
        for r in rs:
            assert (r["JobState"], r["ExitCode"]) == ("COMPLETED", "0:0"), f"job {r['JobId']}: {r}\n{_logs(tmp_path)}"
    assert sorted(int(r["ArrayTaskId"]) for r in records[sweep_job]) == [0, 1, 2]

    assert _train_steps(train_dir) == [0, 1], _logs(tmp_path)
    assert (train_dir / "ckpt").is_dir() and list((train_dir / "slurm").glob("node-*.log"))
    for i, lr in enumerate(lrs):
        run_dir = tmp_path / "sweep" / f"lr-{i}"
        assert _train_steps(run_dir) == [0, 1], f"sweep point {i}\n{_logs(tmp_path)}"
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["lr"] == lr


def test_usr1_checkpoints_and_the_requeued_job_resumes(slurm, tmp_path) -> None:
    """The pre-timeout signal path of train.sbatch: USR1 to the batch shell -> every launcher task ->
    checkpoint at the step boundary -> `scontrol requeue` -> the same job starts again and resumes."""
    run_dir = tmp_path / "train"
    num_rollout = 6  # the demo's batch sizes: about a second a step, so the signal lands mid-run
    job = _submit(
        [
            "sbatch",
            "--parsable",
            "slurm/train.sbatch",
            "launch/configs/demo_cpu.yaml",
            "--num-rollout",
            str(num_rollout),
            "--eval-interval",
            "none",
        ],
        _job_env(tmp_path, MILES_RUN_DIR=str(run_dir)),
    )
    deadline = time.monotonic() + 300
    while not _train_steps(run_dir):
        assert time.monotonic() < deadline, f"no step logged in 300 s\n{_logs(tmp_path)}"
        assert _records(job)[0]["JobState"] in ACTIVE_STATES, _logs(tmp_path)
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, timeout=30)

    pending_since: list[float] = []

    def release_requeued(records) -> None:
        # a requeued job waits (about 2 min) before it may start again; let it start after a few seconds
        # (not at once: slurmd refuses a credential issued in the same second the old one was revoked)
        if not (records[job] and records[job][0]["JobState"] == "PENDING"):
            return
        pending_since.append(time.monotonic())
        if pending_since[-1] - pending_since[0] >= 3.0:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=False, capture_output=True)

    (record,) = _wait_done([job], timeout_s=600, on_pending=release_requeued)[job]
    logs = _logs(tmp_path)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), f"{record}\n{logs}"
    assert int(record["Restarts"]) == 1, f"the job was not requeued: {record}\n{logs}"
    node_log = "\n".join(p.read_text() for p in (run_dir / "slurm").glob("node-*.log"))
    assert "received SIGUSR1" in node_log
    resumed = [line for line in node_log.splitlines() if "resumed from" in line]
    assert len(resumed) == 1, node_log[-4000:]
    # every step trained exactly once across the two starts, and the second start began after the checkpoint
    steps = _train_steps(run_dir)
    assert steps == list(range(num_rollout)), steps
    stopped_at = int(resumed[0].rsplit("at rollout ", 1)[1]) - 1
    assert 0 <= stopped_at < num_rollout - 1, f"the run ended before the signal took effect: {resumed[0]}"
    assert (run_dir / "ckpt" / f"iter_{stopped_at:07d}").is_dir()
