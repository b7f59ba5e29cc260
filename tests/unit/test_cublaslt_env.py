"""Every worker of a run on CUDA gets the same cuBLASLt workspace (miles/utils/cublaslt.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from miles.utils import cublaslt


def test_the_workers_get_the_engines_size_or_the_users(monkeypatch):
    monkeypatch.delenv(cublaslt.ENV, raising=False)
    assert cublaslt.workspace_env("cuda") == {"CUBLASLT_WORKSPACE_SIZE": "32768"}
    assert cublaslt.workspace_env("cpu") == {}
    monkeypatch.setenv(cublaslt.ENV, "4096")
    assert cublaslt.workspace_env("cuda") == {"CUBLASLT_WORKSPACE_SIZE": "4096"}
    monkeypatch.setenv(cublaslt.ENV, "32M")  # refused where the run starts, not in a worker's import
    with pytest.raises(ValueError, match="CUBLASLT_WORKSPACE_SIZE='32M': KiB as a whole number"):
        cublaslt.workspace_env("cuda")


def test_the_engine_sets_the_same_default_where_none_is_set():
    """In a process of its own (torch reads the variable once, at the first cuBLASLt call): the engine's FP8 module
    sets the default before any GEMM, and keeps a value that was set."""
    code = "import os; from miles.engines.embedded import fp8; print(fp8.CUBLASLT_WORKSPACE_KIB, os.environ['CUBLASLT_WORKSPACE_SIZE'])"
    env = {k: v for k, v in os.environ.items() if k != cublaslt.ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["32768", "32768"]
    out = subprocess.run(
        [sys.executable, "-c", code], env={**env, cublaslt.ENV: "2048"}, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["2048", "2048"]
    bad = subprocess.run(
        [sys.executable, "-c", code], env={**env, cublaslt.ENV: "32M"}, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode != 0 and "CUBLASLT_WORKSPACE_SIZE='32M': KiB as a whole number" in bad.stderr


def test_a_bad_size_is_a_placement_error_before_any_worker(monkeypatch):
    from miles.config import load_config
    from miles.controller.placement import PlacementError, plan_placement

    monkeypatch.setenv(cublaslt.ENV, "lots")
    cfg = load_config(["--config", "launch/configs/demo_cpu.yaml"])
    with pytest.raises(PlacementError, match="CUBLASLT_WORKSPACE_SIZE='lots'"):
        plan_placement(cfg, device="cuda", num_nodes=1, gpus_per_node=2, master_port=29500)
    assert plan_placement(cfg, device="cpu", master_port=29500).trainer_specs  # off CUDA it is not read
