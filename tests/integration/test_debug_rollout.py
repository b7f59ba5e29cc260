"""The debug modes through `miles train`, on the CPU demo (tiny model, 4 groups of 4 a step).

A normal run saves each step's rollout (--save-debug-rollout-data); a --debug-train-only run fed
those files (--load-debug-rollout-data) starts no engine and must log the very same per-step metrics,
bit for bit: the trainer sees the same samples, tokens, rewards, log-probs and masks. A
--debug-rollout-only run starts no trainer and writes one file per step, all from the initial weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from e2e_helpers import DEMO, REPO, leftover_processes, python_path, run_train
from harness import SMALL_RUN

STEPS = 3
SMALL = (*SMALL_RUN, "--num-rollout", str(STEPS))
VOLATILE_PREFIXES = ("perf/", "sys/")  # time and machine load, not the computation


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE_PREFIXES)} for r in rows]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("debug_save")
    template = out / "rollouts" / "step_{rollout_id}.pt"
    rows = run_train(out / "run", *SMALL, "--save-debug-rollout-data", str(template))
    assert not leftover_processes(str(out)), "processes of the run are still alive"
    return template, rows


def test_a_saved_rollout_replays_into_the_same_training_steps(saved, tmp_path) -> None:
    template, want = saved
    got = run_train(tmp_path, *SMALL, "--debug-train-only", "--load-debug-rollout-data", str(template))
    assert not leftover_processes(str(tmp_path)), "processes of the run are still alive"
    assert [r["step"] for r in got] == list(range(STEPS))
    assert {"train/loss", "train/grad_norm", "train/pg_loss"} <= set(got[0])
    # every train metric (loss, grad norm, KL, clip fraction, ...) and the replayed rollout metrics, exactly
    assert _comparable(got) == _comparable(want)
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["trainer_0.log"], f"a train-only run started more than the trainer: {logs}"


def test_rollout_only_starts_no_trainer_and_saves_every_step(tmp_path) -> None:
    template = tmp_path / "rollouts" / "{rollout_id}.pt"
    rows = run_train(tmp_path / "run", *SMALL, "--debug-rollout-only", "--save-debug-rollout-data", str(template))
    assert not leftover_processes(str(tmp_path)), "processes of the run are still alive"
    logs = sorted(p.name for p in (tmp_path / "run" / "logs").iterdir())
    assert logs == ["rollout_0.log"], f"a rollout-only run started more than the engine: {logs}"
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert not any(k.startswith("train/") for r in rows for k in r), "a rollout-only run logged training"
    for step in range(STEPS):
        payload = torch.load(tmp_path / "rollouts" / f"{step}.pt", weights_only=True)
        assert payload["rollout_id"] == step
        assert len(payload["samples"]) == 16
        for s in payload["samples"]:
            n = s["response_length"]
            assert n > 0 and len(s["tokens"]) > n and isinstance(s["reward"], float)
            assert len(s["loss_mask"]) == len(s["rollout_log_probs"]) == n
            assert s["weight_versions"] == [0] * n, "weights changed in a rollout-only run"


def test_dump_details_writes_every_rollout_and_every_evaluation(tmp_path) -> None:
    """--dump-details DIR: the steps' rollouts as --save-debug-rollout-data writes them, and each evaluation's
    samples as eval_<weight version>, their set named in each sample's metadata and their scores beside them."""
    rows = run_train(tmp_path / "run", *SMALL, "--eval-interval", "2", "--dump-details", str(tmp_path / "dd"))
    saved = tmp_path / "dd" / "rollout_data"
    assert sorted(p.name for p in saved.iterdir()) == ["0.pt", "1.pt", "2.pt", "eval_0.pt", "eval_2.pt", "eval_3.pt"]
    logged = {r["step"]: r["eval/digit_copy/reward_mean"] for r in rows if "eval/digit_copy/reward_mean" in r}
    for version, step in ((0, -1), (2, 1), (3, 2)):  # an eval of weight version v is logged at step v - 1
        payload = torch.load(saved / f"eval_{version}.pt", weights_only=True)
        assert payload["rollout_id"] == f"eval_{version}" and len(payload["samples"]) == 50
        assert {s["metadata"]["eval_dataset"] for s in payload["samples"]} == {"digit_copy"}
        assert payload["metrics"]["eval/digit_copy/reward_mean"] == logged[step]
        assert all(set(s["weight_versions"]) == {version} for s in payload["samples"])


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--debug-train-only",), "--debug-train-only needs --load-debug-rollout-data"),
        (("--debug-rollout-only", "--debug-train-only"), "pick one"),
        (("--load-debug-rollout-data", "nowhere/{rollout_id}.pt"), "no saved rollout for the first step (0)"),
    ],
)
def test_impossible_combinations_stop_before_any_worker(tmp_path, flags, expected) -> None:
    cmd = [
        sys.executable,
        "-m",
        "miles.cli",
        "train",
        "--config",
        str(DEMO),
        "--output-dir",
        str(tmp_path / "run"),
        *SMALL,
        *flags,
    ]
    env = {**os.environ, "MILES_TORCH_THREADS": "1", "PYTHONPATH": python_path()}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "logs").exists(), "a worker was started"
