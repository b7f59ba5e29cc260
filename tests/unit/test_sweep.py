"""Grid sweeps: expansion order, listing, task selection, submission."""

from __future__ import annotations

import os
import stat
import sys
import types

import pytest
import yaml

from miles.cli import main
from miles.sweep import expand, load_sweep

BASE = {"hf_checkpoint": "/m", "prompt_data": "p.jsonl", "rm_type": "math", "num_rollout": 2, "rollout_batch_size": 4}


def write_sweep(tmp_path, **body) -> str:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return str(path)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default run directories (runs/...) land here
    (tmp_path / "p.jsonl").write_text("")  # BASE's prompts: a path that names no file is refused at start-up


@pytest.fixture
def trained(monkeypatch):
    """Replace the training loop by a recorder of the configs it is given (BASE's model is not resolved)."""
    seen = []
    monkeypatch.setitem(
        sys.modules, "miles.controller.loop_sync", types.SimpleNamespace(run=lambda cfg: seen.append(cfg) or 0)
    )
    monkeypatch.setattr("miles.models.resolve.resolve_model_paths", lambda model, seed: False)
    return seen


def test_expand_is_the_cartesian_product_last_key_fastest():
    points = expand({"lr": [1, 2], "n_samples_per_prompt": [4, 8, 16]})
    assert points == [
        {"lr": 1, "n_samples_per_prompt": 4},
        {"lr": 1, "n_samples_per_prompt": 8},
        {"lr": 1, "n_samples_per_prompt": 16},
        {"lr": 2, "n_samples_per_prompt": 4},
        {"lr": 2, "n_samples_per_prompt": 8},
        {"lr": 2, "n_samples_per_prompt": 16},
    ]


def test_list_prints_index_and_overrides(tmp_path, capsys):
    path = write_sweep(tmp_path, base=BASE, grid={"lr": ["1.0e-6", "3.0e-6"], "colocate": [False, True]})
    assert main(["sweep", path, "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "0\t--lr 1.0e-6 --no-colocate",
        "1\t--lr 1.0e-6 --colocate",
        "2\t--lr 3.0e-6 --no-colocate",
        "3\t--lr 3.0e-6 --colocate",
    ]


def test_task_id_runs_that_point_into_its_own_dir(tmp_path, trained):
    path = write_sweep(tmp_path, name="lrs", base=BASE, sweep_dir=str(tmp_path / "sw"),
                       grid={"lr": [0.1, 0.2], "n-samples-per-prompt": [2, 4, 8]})  # fmt: skip
    assert main(["sweep", path, "--task-id", "4"]) == 0  # lr=0.2 (second), n=4 (second): index 1*3 + 1
    cfg = trained[-1]
    assert (cfg.train.lr, cfg.rollout.n_samples_per_prompt) == (0.2, 4)
    assert cfg.rollout.global_batch_size == 16  # 4 prompts × 4 samples, one step
    assert cfg.runtime.output_dir == str(tmp_path / "sw" / "lrs-4")


def test_extra_flags_override_every_point(tmp_path, trained):
    path = write_sweep(tmp_path, base=BASE, grid={"lr": [0.1, 0.2]})
    assert main(["sweep", path, "--task-id", "0", "--lr", "0.7", "--num-rollout", "9"]) == 0
    assert (trained[-1].train.lr, trained[-1].rollout.num_rollout) == (0.7, 9)


def test_task_id_defaults_to_slurm_array_index(tmp_path, trained, monkeypatch):
    path = write_sweep(tmp_path, base=BASE, grid={"lr": [0.1, 0.2, 0.3]})
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    assert main(["sweep", path]) == 0
    assert trained[-1].train.lr == 0.3
    assert trained[-1].runtime.output_dir == os.path.join("runs", "sweeps", "sweep", "sweep-2")


def test_base_config_file_relative_to_the_sweep_file(tmp_path, trained, monkeypatch):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({**BASE, "prompt_data": str(tmp_path / "p.jsonl"), "lr": 0.5}))
    path = write_sweep(tmp_path, base="base.yaml", grid={"eps_clip": [0.1, 0.3]})
    monkeypatch.chdir(tmp_path.parent)  # not where the base file is
    assert main(["sweep", path, "--task-id", "1"]) == 0
    assert (trained[-1].train.lr, trained[-1].algo.eps_clip) == (0.5, 0.3)


def test_out_of_range_task_and_bad_grid_key(tmp_path, capsys):
    path = write_sweep(tmp_path, base=BASE, grid={"lr": [0.1, 0.2]})
    assert main(["sweep", path, "--task-id", "2"]) == 2
    assert "has 2 points" in capsys.readouterr().err
    path = write_sweep(tmp_path, base=BASE, grid={"rollout_batch": [1, 2]})
    assert main(["sweep", path, "--list"]) == 2
    assert "closest valid flag: --rollout-batch-size" in capsys.readouterr().err


def test_no_mode_and_no_slurm_index_is_an_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    path = write_sweep(tmp_path, base=BASE, grid={"lr": [0.1]})
    assert main(["sweep", path]) == 2
    assert "--task-id" in capsys.readouterr().err


def test_submit_calls_sbatch_with_one_task_per_point(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "sbatch_args"
    fake = bin_dir / "sbatch"
    fake.write_text(f'#!/bin/sh\necho "$@" > {log}\necho "4242;cluster"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    script = tmp_path / "sweep.sbatch"
    script.write_text("#!/bin/bash\n")
    path = write_sweep(tmp_path, base=BASE, grid={"lr": [0.1, 0.2, 0.3], "eps_clip": [0.1, 0.2]})
    assert main(["sweep", path, "--submit", "--sbatch-script", str(script), "--num-rollout", "5"]) == 0
    assert capsys.readouterr().out.strip() == "4242"
    assert log.read_text().split() == ["--parsable", "--array=0-5", str(script), path, "--num-rollout", "5"]
    assert len(load_sweep(path).points) == 6
