"""The trainer harness's rank processes fork from the session's fork server, yet start as spawned ones did:
each a new process, with the test process's environment and working directory as they are at the call
(not as they were when the server started)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from _trainer_harness import start_ranks  # isort: skip


def _report(rank: int, out_dir: str) -> None:
    state = {"probe": os.environ.get("MILES_RANK_PROBE"), "cwd": os.getcwd(), "pid": os.getpid()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(state))


def _reports(out_dir: Path) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def test_ranks_see_the_environment_and_directory_of_the_call(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MILES_RANK_PROBE", raising=False)
    first = tmp_path / "first"
    first.mkdir()
    start_ranks(_report, (str(first),), 2)  # the fork server is up from here on, without the probe
    assert [r["probe"] for r in _reports(first)] == [None, None]

    probe, second = f"probe-{uuid.uuid4().hex}", tmp_path / "second"
    second.mkdir()
    monkeypatch.setenv("MILES_RANK_PROBE", probe)
    monkeypatch.chdir(second)
    start_ranks(_report, (str(second),), 2)
    reports = _reports(second)
    assert [r["probe"] for r in reports] == [probe, probe]
    assert [r["cwd"] for r in reports] == [str(second), str(second)]
    pids = {r["pid"] for r in reports} | {r["pid"] for r in _reports(first)}
    assert len(pids) == 4 and os.getpid() not in pids  # four new processes
