"""Per-worker CPU / RSS (psutil) and GPU utilisation / memory (nvidia-ml-py), sampled into step metrics."""

from __future__ import annotations

import logging

import psutil

logger = logging.getLogger(__name__)


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
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVIDIA driver: GPU metrics are simply absent
            self._nvml = None

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, p in self._procs.items():
            try:
                with p.oneshot():
                    rss = p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
                    out[f"sys/{name}/cpu_percent"] = p.cpu_percent(None)
                    out[f"sys/{name}/rss_gb"] = rss / 1024**3
            except psutil.Error:
                continue
        if self._nvml is not None:
            nv = self._nvml
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                util = nv.nvmlDeviceGetUtilizationRates(h)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                out[f"sys/gpu{i}/util_percent"] = float(util.gpu)
                out[f"sys/gpu{i}/mem_used_gb"] = mem.used / 1024**3
        return out
