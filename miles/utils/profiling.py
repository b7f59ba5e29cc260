"""Profiling from the command line: `--profile-steps 3,4` and `--py-spy`.

Worker side, `WorkerProfiler`: torch.profiler around a window of steps, written as one Chrome
trace per worker (`<trace_dir>/<role>_<rank>.pt.trace.json`, open in chrome://tracing or
Perfetto); with py-spy on PATH, a py-spy sampler on the worker's own process for the same window
(`<role>_<rank>.py-spy.json`, speedscope format). `nvtx_range` marks phases for Nsight on GPU.

Controller side, `ProfileSchedule`: which steps open and close a window. Consecutive steps form
one window (3,4 -> one trace covering both; 3,5 -> two traces), written under
`<output_dir>/profile/steps_<first>-<last>/`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PY_SPY_ATTACH_S = 10.0  # the most a profile window's start waits for py-spy to sample


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """An NVTX range when CUDA is up (seen by Nsight Systems); nothing on CPU."""
    import torch

    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


class WorkerProfiler:
    """One trace window at a time inside a worker process."""

    def __init__(self, name: str) -> None:
        self.name = name  # file stem, e.g. "trainer_0"
        self._torch_prof = None
        self._py_spy: subprocess.Popen | None = None
        self._py_spy_out = ""
        self._trace_dir: str | None = None

    @property
    def active(self) -> bool:
        return self._trace_dir is not None

    def start(self, trace_dir: str, *, py_spy: bool = False) -> dict[str, str | None]:
        if self.active:
            raise RuntimeError(f"{self.name}: a profile into {self._trace_dir} is still open; stop it first")
        import torch
        from torch.profiler import ProfilerActivity, profile

        os.makedirs(trace_dir, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._torch_prof = profile(activities=activities, experimental_config=_all_threads_config())
        self._torch_prof.__enter__()
        self._trace_dir = trace_dir
        py_spy_path = self._start_py_spy(trace_dir) if py_spy else None
        return {"trace_dir": trace_dir, "py_spy": py_spy_path}

    def stop(self) -> dict[str, str | None]:
        """Close the window; returns the files written."""
        if not self.active:
            return {"trace": None, "py_spy": None}
        trace = os.path.join(self._trace_dir, f"{self.name}.pt.trace.json")
        prof, self._torch_prof = self._torch_prof, None
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(trace)
        py_spy_path = self._stop_py_spy()
        self._trace_dir = None
        logger.info("%s: wrote %s", self.name, trace)
        return {"trace": trace, "py_spy": py_spy_path}

    def _start_py_spy(self, trace_dir: str) -> str | None:
        exe = shutil.which("py-spy")
        if exe is None:
            logger.warning("%s: --py-spy given but py-spy is not on PATH (pip install py-spy); skipping", self.name)
            return None
        out = os.path.join(trace_dir, f"{self.name}.py-spy.json")
        cmd = [
            exe,
            "record",
            "--pid",
            str(os.getpid()),
            "--format",
            "speedscope",
            "--output",
            out,
            "--rate",
            "100",
            "--nonblocking",
        ]
        self._py_spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._py_spy_out = out
        _wait_sampling(self._py_spy, PY_SPY_ATTACH_S)
        return out

    def _stop_py_spy(self) -> str | None:
        proc, self._py_spy = self._py_spy, None
        if proc is None:
            return None
        proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if not os.path.exists(self._py_spy_out):
            logger.warning("%s: py-spy wrote nothing (exit %s): %s", self.name, proc.returncode, (err or "")[-500:])
            return None
        return self._py_spy_out


def _wait_sampling(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until py-spy says it samples (its first stderr line) or `timeout_s`, so that the window's first
    steps are sampled too: attaching takes a while, and on a busy machine a short window could end first."""
    ready, _, _ = select.select([proc.stderr], [], [], timeout_s)
    if not ready:
        return False
    line = proc.stderr.readline()
    if "Sampling" not in line:
        logger.warning("py-spy: %s", line.strip())
        return False
    return True


def _all_threads_config():
    """Record ops from every thread (the embedded engine computes in worker threads), where torch has it."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):  # older torch: only the thread that started the profiler is recorded
        return None


@dataclass(slots=True)
class ProfileWindow:
    first: int
    last: int

    @property
    def dirname(self) -> str:
        return f"steps_{self.first}-{self.last}"


class ProfileSchedule:
    """Turns `--profile-steps` into windows of consecutive steps."""

    def __init__(self, steps: list[int], output_dir: str) -> None:
        if any(s < 0 for s in steps):
            raise ValueError(f"--profile-steps {steps}: steps are rollout ids >= 0")
        self.windows: list[ProfileWindow] = []
        for s in sorted(set(steps)):
            if self.windows and self.windows[-1].last == s - 1:
                self.windows[-1].last = s
            else:
                self.windows.append(ProfileWindow(s, s))
        self.root = os.path.join(output_dir, "profile")

    def __bool__(self) -> bool:
        return bool(self.windows)

    def starts_at(self, rollout_id: int) -> str | None:
        """Trace directory of the window opening at this step, else None."""
        for w in self.windows:
            if w.first == rollout_id:
                return os.path.join(self.root, w.dirname)
        return None

    def ends_at(self, rollout_id: int) -> bool:
        return any(w.last == rollout_id for w in self.windows)
