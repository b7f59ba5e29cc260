"""`run_processes` finds a run's processes by MILES_RUN_ID, one caught in the middle of an exec included."""

from __future__ import annotations

import os

import psutil

from miles.wire import procs


class _Proc:
    """A process whose environment reads empty on its first read (exec under way), then as launched."""

    def __init__(self, pid: int, env: dict, reads_empty_first: bool) -> None:
        self.pid, self.info, self._env, self._empty = pid, {"uids": psutil.Process().uids()}, env, reads_empty_first

    def environ(self) -> dict:
        if self._empty:
            self._empty = False
            return {}
        return self._env

    def status(self) -> str:
        return psutil.STATUS_SLEEPING


def test_a_process_mid_exec_is_read_again(monkeypatch) -> None:
    ours, mid_exec, other = (
        _Proc(os.getpid() + 1, {"MILES_RUN_ID": "r1"}, False),
        _Proc(os.getpid() + 2, {"MILES_RUN_ID": "r1"}, True),
        _Proc(os.getpid() + 3, {"MILES_RUN_ID": "r2"}, True),
    )
    monkeypatch.setattr(procs.psutil, "process_iter", lambda attrs: iter([ours, mid_exec, other]))
    assert [p.pid for p in procs.run_processes("r1")] == [ours.pid, mid_exec.pid]
