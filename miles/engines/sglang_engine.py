"""SGLang backend: run `python -m sglang.launch_server` as a tracked child process.

The rollout worker builds the command line from the engine section (`--sglang-*` passthrough
flags land in `sglang_args`), starts the server in its own process group, waits until
`/health_generate` answers, and then drives it with the same `EngineClient` as the embedded
engine. Not verified against a real SGLang install on these machines (see docs/engines.md);
the lifecycle is tested with a stand-in `sglang` package serving our own HTTP front.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Any

from miles.config import GPU_AUTO_DTYPE
from miles.engines.client import EngineClient
from miles.engines.doors import auth_headers, redact

logger = logging.getLogger(__name__)

# Set by SGLangServer itself; passing them in sglang_args would give SGLang two conflicting values.
RESERVED_ARGS = frozenset({"model_path", "host", "port", "tp_size", "tp", "api_key"})
# Miles' launcher skips SGLang's warm-up request: wait_healthy() sends a real generation anyway.
DEFAULT_SGLANG_ARGS: dict[str, Any] = {"skip_server_warmup": True}


def normalize_sglang_args(sglang_args: dict[str, Any] | None) -> dict[str, Any]:
    """Keys as SGLang ServerArgs names: drop a leading `sglang_`/`sglang-` and turn dashes into underscores."""
    out: dict[str, Any] = {}
    for raw_key, value in (sglang_args or {}).items():
        key = raw_key.lstrip("-").replace("-", "_")
        if key.startswith("sglang_"):
            key = key[len("sglang_") :]
        if key == "api_key":
            raise ValueError(f"sglang_args[{raw_key!r}]: give the engines' key with --api-key (api_key=...)")
        if key in RESERVED_ARGS:
            raise ValueError(
                f"sglang_args[{raw_key!r}] is set by the launcher; pass it as SGLangServer("
                f"{'tp_size' if key.startswith('tp') else key}=...) instead"
            )
        out[key] = value
    return out


def with_engine_dtype(sglang_args: dict[str, Any] | None, dtype: str | None) -> dict[str, Any]:
    """`sglang_args` with SGLang's --dtype set to what the trainers push weights in, unless the user gave one.

    `dtype` is the run's engine dtype (`engine_dtype`: --sglang-dtype, else --dtype). SGLang's own `auto`
    computes an fp32 checkpoint in float16, while the trainers send bf16 on GPU when the dtype is `auto`
    (`push_dtype`): the engine would run in another precision than the one documented and pushed."""
    args = normalize_sglang_args(sglang_args)
    if args.get("dtype") is None:
        args["dtype"] = GPU_AUTO_DTYPE if dtype in (None, "auto") else dtype
    return args


def sglang_flags(args: dict[str, Any]) -> list[str]:
    """ServerArgs dict -> CLI tokens: True is a bare flag, False/None is omitted, lists repeat values."""
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            flags.append(flag)
            flags.extend(str(v) for v in value)
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def build_sglang_command(
    model_path: str,
    port: int,
    host: str = "127.0.0.1",
    sglang_args: dict[str, Any] | None = None,
    tp_size: int = 1,
    python: str = sys.executable,
    api_key: str | None = None,
) -> list[str]:
    if tp_size < 1:
        raise ValueError(f"tp_size={tp_size} must be >= 1 (it is --rollout-num-gpus-per-engine)")
    merged = {**DEFAULT_SGLANG_ARGS, **normalize_sglang_args(sglang_args)}
    head = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host]
    key = ["--api-key", api_key] if api_key else []
    return head + ["--port", str(port), "--tp-size", str(tp_size), *key, *sglang_flags(merged)]


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class SGLangServer:
    """One `sglang.launch_server` process: start(), wait_healthy(timeout), stop()."""

    def __init__(
        self,
        model_path: str,
        port: int,
        host: str = "127.0.0.1",
        sglang_args: dict[str, Any] | None = None,
        tp_size: int = 1,
        env: dict[str, str] | None = None,
        *,
        log_path: str | Path | None = None,
        python: str = sys.executable,
        api_key: str | None = None,
    ) -> None:
        self.model_path = model_path
        self.host = host
        self.port = port
        self.env = dict(env or {})
        self.log_path = Path(log_path) if log_path is not None else None
        self.api_key = api_key
        self.command = build_sglang_command(model_path, port, host, sglang_args, tp_size, python, api_key)
        self.process: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def client(self, **kw: Any) -> EngineClient:
        return EngineClient(self.url, api_key=self.api_key, **kw)

    @property
    def command_text(self) -> str:
        """The command line as logs and errors show it (the API key redacted)."""
        return redact(" ".join(self.command), self.api_key)

    def start(self) -> None:
        if self.process is not None:
            raise RuntimeError(f"SGLang server on {self.url} was already started (pid {self.process.pid})")
        env = {**os.environ, **self.env}
        out = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115 (child owns it)
        logger.info("starting SGLang: %s", self.command_text)
        try:
            # Own process group: SGLang forks scheduler/detokenizer children; stop() ends them all.
            self.process = subprocess.Popen(
                self.command, env=env, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True
            )
        finally:
            if out is not None:
                out.close()
        # Ends the group even when the owner forgets stop() or the interpreter exits.
        self._finalizer = weakref.finalize(self, _kill_group, self.process.pid, signal.SIGKILL)

    def _log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log file; pass log_path= to keep the server output)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _probe(self, timeout_s: float) -> bool:
        try:
            probe = urllib.request.Request(self.url + "/health_generate", headers=auth_headers(self.api_key))
            with urllib.request.urlopen(probe, timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_healthy(self, timeout: float = 600.0, poll_s: float = 0.5) -> None:
        """Block until /health_generate answers 200, then flush the cache (as Miles' launcher does)."""
        if self.process is None:
            raise RuntimeError("wait_healthy() before start()")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"SGLang server exited with code {code} before becoming healthy; command: "
                    f"{self.command_text}\n{self._log_tail()}"
                )
            if self._probe(timeout_s=min(30.0, max(1.0, deadline - time.monotonic()))):
                self._flush_cache()
                logger.info("SGLang server healthy on %s", self.url)
                return
            time.sleep(poll_s)
        raise TimeoutError(
            f"SGLang server on {self.url} not healthy after {timeout}s; raise the timeout or check the log:\n"
            f"{self._log_tail()}"
        )

    async def wait_healthy_async(self, timeout: float = 600.0, poll_s: float = 0.5) -> None:
        """wait_healthy() for callers on an event loop (the polling runs in a thread)."""
        await asyncio.to_thread(self.wait_healthy, timeout, poll_s)

    def _flush_cache(self) -> None:
        try:
            flush = urllib.request.Request(self.url + "/flush_cache", headers=auth_headers(self.api_key))
            with urllib.request.urlopen(flush, timeout=30):
                pass
        except (urllib.error.URLError, OSError) as exc:
            logger.warning("flush_cache after boot failed on %s: %s", self.url, exc)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL after `timeout`; returns the exit code (None if never started)."""
        if self.process is None:
            return None
        pid = self.process.pid
        if self.process.poll() is None:
            _kill_group(pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("SGLang server pid %d ignored SIGTERM for %.0fs; killing", pid, timeout)
                _kill_group(pid, signal.SIGKILL)
                self.process.wait()
        # Children that outlived the leader (same group) go too.
        _kill_group(pid, signal.SIGKILL)
        if self._finalizer is not None:
            self._finalizer.detach()
        return self.process.returncode

    def __enter__(self) -> SGLangServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
