"""Per-worker CPU / RSS (psutil) and GPU utilisation / memory (nvidia-ml-py), sampled into step metrics.

Keys: `sys/<role>_<rank>/cpu_percent` (100 = one core busy, averaged since the previous sample),
`sys/<role>_<rank>/rss_gb` (the worker and its children, e.g. an SGLang server),
`sys/<role>_<rank>/gpu_mem_gb` (the GPU memory the driver counts for the worker and its children, on every
visible GPU: where a colocated engine's memory goes after its releases, which torch's own counters inside the
process do not show), and per visible GPU `sys/gpu<i>/util_percent`, `sys/gpu<i>/mem_used_gb`. Only processes
on the controller's node are sampled; GPU figures are those of the controller's node.

A sample runs on the controller's event loop between steps, so it reads no more than it must: the
workers' descendants are found in one pass over the process table, at most every
`CHILDREN_REFRESH_S` (a worker's children, such as an SGLang server's, start with it and stay), and
each sample reads the known processes' own counters (about 1.3 ms a sample for two workers before,
when every worker walked the whole table on every step).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

import psutil

logger = logging.getLogger(__name__)

CHILDREN_REFRESH_S = 10.0


def _init_nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no nvidia-ml-py or no NVIDIA driver: GPU metrics are simply absent
        return None


class SystemMonitor:
    def __init__(self, workers: dict[str, int]):
        """`workers`: name (e.g. "trainer_0") -> pid."""
        self._procs: dict[str, psutil.Process] = {}
        for name, pid in workers.items():
            try:
                p = psutil.Process(pid)
                p.cpu_percent(None)  # prime the counter: the next call reports usage since now
                self._procs[name] = p
            except psutil.Error:
                logger.debug("worker %s (pid %d) is gone", name, pid)
        self._nvml = _init_nvml()
        self._per_process = True  # the driver lists each process's GPU memory
        self._children: dict[str, list[psutil.Process]] = {}
        self._children_at = -float("inf")

    @classmethod
    def for_local_workers(cls, runtime: Any, roles: tuple[str, ...] = ("trainer", "rollout")) -> SystemMonitor:
        """The workers of `runtime` that run on the controller's node (node 0)."""
        workers = {
            f"{w.role}_{w.rank}": w.pid for role in roles for w in runtime.workers(role) if w.node == 0 and w.pid
        }
        return cls(workers)

    @property
    def names(self) -> list[str]:
        return sorted(self._procs)

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if time.monotonic() - self._children_at >= CHILDREN_REFRESH_S:
            self._children = self._descendants()
            self._children_at = time.monotonic()
        for name, p in self._procs.items():
            try:
                with p.oneshot():
                    rss = p.memory_info().rss + sum(_rss(c) for c in self._children.get(name, ()))
                    out[f"sys/{name}/cpu_percent"] = p.cpu_percent(None)
                    out[f"sys/{name}/rss_gb"] = rss / 1024**3
            except psutil.Error:
                continue
        out.update(self._gpu_sample())
        return out

    def _descendants(self) -> dict[str, list[psutil.Process]]:
        """Every worker's descendants, from one pass over the process table."""
        kids: dict[int, list[psutil.Process]] = defaultdict(list)
        for p in psutil.process_iter(["ppid"]):
            kids[p.info["ppid"]].append(p)
        out = {}
        for name, worker in self._procs.items():
            found, todo = [], list(kids.get(worker.pid, ()))
            while todo:
                child = todo.pop()
                found.append(child)
                todo += kids.get(child.pid, ())
            out[name] = found
        return out

    def _gpu_sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._nvml is None:
            return out
        nv = self._nvml
        used: dict[str, int] = defaultdict(int)
        owner = {p.pid: name for name, p in self._procs.items()}  # pid -> worker, its children included
        owner.update((c.pid, name) for name, kids in self._children.items() for c in kids)
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                util = nv.nvmlDeviceGetUtilizationRates(h)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                out[f"sys/gpu{i}/util_percent"] = float(util.gpu)
                out[f"sys/gpu{i}/mem_used_gb"] = mem.used / 1024**3
                self._worker_gpu_memory(h, owner, used)
        except Exception as e:  # noqa: BLE001 - a driver hiccup must not end the run; report once and stop
            logger.warning("GPU sampling failed (%s); no more sys/gpu* metrics this run", e)
            self._nvml = None
        for name, nbytes in used.items():
            out[f"sys/{name}/gpu_mem_gb"] = nbytes / 1024**3
        return out

    def _worker_gpu_memory(self, handle: Any, owner: dict[int, str], used: dict[str, int]) -> None:
        """Add each worker's (and its children's) GPU memory on one device to `used`. A driver that cannot list
        processes (or reports no per-process figure, as inside some containers) leaves it out, once and quietly."""
        if not self._per_process:
            return
        try:
            running = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:  # noqa: BLE001 - not supported here: per-worker GPU memory is simply absent
            self._per_process = False
            return
        for proc in running:
            name = owner.get(proc.pid)
            if name is not None and getattr(proc, "usedGpuMemory", None):
                used[name] += int(proc.usedGpuMemory)


def _rss(p: psutil.Process) -> int:
    try:
        return p.memory_info().rss
    except psutil.Error:  # a child that exited between listing and reading
        return 0
