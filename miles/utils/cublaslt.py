"""cuBLASLt's workspace for every process of a run on CUDA: the same size in the engines and the trainers.

torch reads `CUBLASLT_WORKSPACE_SIZE` (KiB) once per process, at its first cuBLASLt call; unset, torch 2.11 gives
it 1 MiB. The embedded engine's FP8 GEMMs want 32 MiB (miles/engines/embedded/fp8.py, where it is set at import
for an engine in any process). cuBLASLt picks its algorithm within the workspace it has, so processes that must
compute alike (`--true-on-policy-mode`: the engine's re-scoring and the trainer's forward, bit for bit) get the
same size: the controller puts it in the environment of every worker it spawns on CUDA. A size the user set in
the controller's environment is kept.
"""

from __future__ import annotations

import os

ENV = "CUBLASLT_WORKSPACE_SIZE"
DEFAULT_KIB = 32 * 1024


def _checked(value: str) -> str:
    if not value.isdigit():
        raise ValueError(f"{ENV}={value!r}: KiB as a whole number (unset: {DEFAULT_KIB}); fix or unset it")
    return value


def workspace_env(device: str) -> dict[str, str]:
    """The variable for a worker on `device` ({} off CUDA): the controller's own value, else the default."""
    return {ENV: _checked(os.environ.get(ENV, str(DEFAULT_KIB)))} if device == "cuda" else {}


def set_default() -> int:
    """This process's size in KiB, the default put in its environment where none is set (call it before the
    process's first GEMM: torch reads the variable once)."""
    return int(_checked(os.environ.setdefault(ENV, str(DEFAULT_KIB))))
