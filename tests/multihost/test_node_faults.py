"""A whole host lost, or cut off, in the middle of a two-host torchrun run.

Node loss: every process on host 1 (torchrun, its node agent, trainer rank 1) is SIGKILLed at once,
as when a machine dies. Link cut: host 1's cable is pulled (`ip link set ... down` at both ends), so
its processes live on but nothing reaches them. Either way the controller on host 0 must stop the run
within the heartbeat time-out with one `miles train:` line naming node 1, leave no process on host 0,
and (link cut) host 1's agent must notice the silent controller and end its workers too. With
``--save`` a relaunch resumes from the last complete checkpoint.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from multihost_run import TWO_NODE_DEMO, NodeRun, job_env, outputs, start_torchrun, train_rows, wait_all, wait_for_step
from netns_hosts import Host

from miles.trainer.checkpoint_layout import complete_checkpoint_steps

pytestmark = [
    pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH"),
    pytest.mark.exec_workers,  # the hosts are network namespaces: no fork server there
]

# The property is "the loss is detected and node 1 named", not "it takes N seconds": a short time-out keeps
# the test's wait short. Workers import and build off their event loop, so a healthy worker's heartbeat holes
# stay far below this even on a loaded 2-core machine.
HEARTBEAT_TIMEOUT_S = 8.0
# time for the processes to start their teardown after the time-out (a loaded 2-core CI machine)
SLACK_S = 30.0
# every node takes its heartbeat from the same `miles train` args (node agents included)
HEARTBEAT = ["--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S), "--heartbeat-interval-s", "0.5"]


def _start_long_run(hosts: list[Host], out_dir: Path, *extra: str) -> list[NodeRun]:
    flags = [*TWO_NODE_DEMO, *HEARTBEAT, "--num-rollout", "200", *extra]
    runs = start_torchrun(hosts, out_dir, flags, job_env())
    wait_for_step(out_dir, 1, runs, timeout_s=300)
    return runs


def _failure_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("miles train:")]


def _wait_empty(host: Host, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (pids := host.pids()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids


def _assert_stopped_naming_node1(runs: list[NodeRun], since: float) -> float:
    """Node 0's launcher exits non-zero within the time-out with one line naming node 1; returns seconds."""
    (code,) = wait_all(runs[:1], timeout_s=HEARTBEAT_TIMEOUT_S + SLACK_S)
    stop_s = time.monotonic() - since
    text = outputs(runs)
    assert code not in (None, 0), f"node 0 still running or exited 0 ({code}) {stop_s:.1f} s after\n{text}"
    lines = _failure_lines(runs[0].output())
    assert len(lines) == 1, f"want one `miles train:` line, got {lines}\n{text}"
    assert "node 1)" in lines[0], lines[0]
    assert _wait_empty(runs[0].host, 15) == [], f"processes left on host 0\n{text}"
    return stop_s


def test_lost_node_stops_the_run_and_the_relaunch_resumes(hosts, tmp_path) -> None:
    h0, h1 = hosts
    out_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    save = ["--save", str(ckpt), "--save-interval", "1"]
    runs = _start_long_run(hosts, out_dir, *save)
    # the property needs a complete checkpoint to resume from before the node is lost
    deadline = time.monotonic() + 120
    while not complete_checkpoint_steps(str(ckpt)):
        assert time.monotonic() < deadline, f"no complete checkpoint in 120 s\n{outputs(runs)}"
        time.sleep(0.1)
    killed_at = time.monotonic()
    assert h1.kill_all(), "no process on host 1 to kill"
    stop_s = _assert_stopped_naming_node1(runs, killed_at)
    trained = [r["step"] for r in train_rows(out_dir)]
    # a step is saved before its row is logged (save, push, eval, row), so the last complete checkpoint may be
    # of a step whose row the loss cut off
    last_saved = complete_checkpoint_steps(str(ckpt))[-1]

    # the relaunch (what a requeue does) resumes from the last complete checkpoint and finishes
    total = max(trained[-1], last_saved) + 3
    flags = [*TWO_NODE_DEMO, *HEARTBEAT, "--num-rollout", str(total), *save, "--auto-resume"]
    runs2 = start_torchrun(hosts, out_dir, flags, job_env())
    assert wait_all(runs2, timeout_s=300) == [0, 0], outputs(runs2)
    resumed = [line for line in runs2[0].output().splitlines() if "resumed from" in line]
    assert len(resumed) == 1, outputs(runs2)
    start = int(resumed[0].rsplit("at rollout ", 1)[1])
    assert start == last_saved + 1 and start <= trained[-1] + 2, resumed[0]
    after = [r["step"] for r in train_rows(out_dir)][len(trained) :]
    assert after == list(range(start, total)), after
    print(f"node lost: stopped {stop_s:.1f} s after the kill (heartbeat time-out {HEARTBEAT_TIMEOUT_S} s)")


def test_cut_link_stops_the_run_and_both_hosts_empty(hosts, tmp_path) -> None:
    h0, h1 = hosts
    runs = _start_long_run(hosts, tmp_path / "run")
    cut_at = time.monotonic()
    h1.set_link(False)
    stop_s = _assert_stopped_naming_node1(runs, cut_at)
    # host 1 hears nothing from the controller: its agent leaves after the time-out and ends its workers
    assert _wait_empty(h1, HEARTBEAT_TIMEOUT_S + SLACK_S) == [], f"processes left on host 1\n{outputs(runs)}"
    empty_s = time.monotonic() - cut_at
    print(f"link cut: node 0 stopped {stop_s:.1f} s, host 1 empty {empty_s:.1f} s after the cut")
