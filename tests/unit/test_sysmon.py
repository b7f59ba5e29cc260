"""sys/<worker>/* metrics: a worker's RSS counts its descendants, found in one pass over the process table at
most every CHILDREN_REFRESH_S, and a worker that is gone drops out of the sample."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from miles.utils import sysmon
from miles.utils.sysmon import SystemMonitor

# a parent whose child holds ~200 MB, so the child's share of the RSS is unmistakable
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', "
    "'b = bytearray(200 * 2**20); b[::4096] = b\"x\" * len(b[::4096]); import time; time.sleep(60)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def worker():
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = int(proc.stdout.readline())
    deadline = time.monotonic() + 20
    while psutil.Process(child_pid).memory_info().rss < 150 * 2**20:  # the child has touched its pages
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield proc, child_pid
    for pid in (child_pid, proc.pid):
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    proc.wait()


def test_a_workers_rss_counts_its_children_from_one_pass_over_the_table(worker, monkeypatch):
    proc, child_pid = worker
    passes = []
    real_iter = psutil.process_iter
    monkeypatch.setattr(sysmon.psutil, "process_iter", lambda *a, **k: passes.append(1) or real_iter(*a, **k))
    mon = SystemMonitor({"rollout_0": proc.pid})
    rows = [mon.sample() for _ in range(5)]
    own = psutil.Process(proc.pid).memory_info().rss
    assert all(r["sys/rollout_0/rss_gb"] * 2**30 > own + 150 * 2**20 for r in rows)  # the child's 200 MB too
    assert "sys/rollout_0/cpu_percent" in rows[0]
    assert len(passes) == 1  # five samples inside CHILDREN_REFRESH_S: the table was walked once

    child = psutil.Process(child_pid)
    child.kill()
    deadline = time.monotonic() + 10
    while child.is_running() and child.status() != psutil.STATUS_ZOMBIE:  # its parent does not reap it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    monkeypatch.setattr(sysmon, "CHILDREN_REFRESH_S", 0.0)
    assert mon.sample()["sys/rollout_0/rss_gb"] * 2**30 < own + 50 * 2**20  # refreshed: the child is gone
    assert len(passes) == 2


def test_a_worker_that_is_gone_drops_out_of_the_sample(worker):
    proc, _ = worker
    mon = SystemMonitor({"trainer_0": proc.pid, "rollout_0": psutil.Process().pid})
    proc.kill()
    proc.wait()
    out = mon.sample()
    assert "sys/trainer_0/rss_gb" not in out and "sys/rollout_0/rss_gb" in out


class _FakeNvml:
    """Two GPUs; the driver lists the worker on both and a stranger on the second."""

    def __init__(self, worker_pid: int, child_pid: int, supported: bool = True):
        self.running = [
            [SimpleNamespace(pid=worker_pid, usedGpuMemory=3 * 2**30)],
            [SimpleNamespace(pid=child_pid, usedGpuMemory=2**30), SimpleNamespace(pid=1, usedGpuMemory=5 * 2**30)],
        ]
        self.supported = supported

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=50)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=10 * 2**30)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        if not self.supported:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.running[h]


def test_a_workers_gpu_memory_is_the_drivers_count_for_it_and_its_children(worker, monkeypatch):
    proc, child_pid = worker
    monkeypatch.setattr(sysmon, "_init_nvml", lambda: _FakeNvml(proc.pid, child_pid))
    row = SystemMonitor({"rollout_0": proc.pid}).sample()
    assert row["sys/rollout_0/gpu_mem_gb"] == 4.0  # 3 GiB on GPU 0 and its child's 1 GiB on GPU 1
    assert row["sys/gpu1/mem_used_gb"] == 10.0 and not any("pid" in k for k in row)  # the stranger: no key

    monkeypatch.setattr(sysmon, "_init_nvml", lambda: _FakeNvml(proc.pid, child_pid, supported=False))
    mon = SystemMonitor({"rollout_0": proc.pid})
    row = mon.sample()
    assert "sys/rollout_0/gpu_mem_gb" not in row and row["sys/gpu0/util_percent"] == 50.0  # the rest stays
