"""`--max-checkpoints N`: the newest N complete checkpoints stay, older ones go, the newest complete never."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from miles.config import ConfigError, load_config
from miles.controller.run import MilesRun
from miles.trainer.checkpoint import COMPLETE_MARKER, latest_complete_checkpoint, prune_checkpoints

from harness import minimal_train_args  # isort: skip


def _checkpoint(save: Path, step: int, *, complete: bool = True) -> Path:
    path = save / f"iter_{step:07d}"
    (path / "model").mkdir(parents=True)
    (path / "model" / "shard.distcp").write_bytes(b"\0" * 64)
    if complete:
        (path / COMPLETE_MARKER).write_text("ok\n")
    return path


def _names(save: Path) -> list[str]:
    return sorted(os.listdir(save))


def test_keeps_the_newest_n_complete_and_leaves_incomplete_ones(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 6, complete=False)  # a crash mid-save: not a checkpoint, not counted, not deleted
    (tmp_path / "notes.txt").write_text("mine")
    removed = prune_checkpoints(str(tmp_path), keep=2)
    assert [Path(p).name for p in removed] == ["iter_0000001", "iter_0000002", "iter_0000003"]
    assert _names(tmp_path) == ["iter_0000004", "iter_0000005", "iter_0000006", "notes.txt"]
    assert latest_complete_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000005")


def test_the_newest_complete_survives_when_a_newer_save_is_incomplete(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 20)
    _checkpoint(tmp_path, 30, complete=False)
    prune_checkpoints(str(tmp_path), keep=1)
    assert _names(tmp_path) == ["iter_0000020", "iter_0000030"]


def test_fewer_than_n_is_left_alone_and_zero_is_refused(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 1)
    assert prune_checkpoints(str(tmp_path), keep=3) == []
    assert prune_checkpoints(str(tmp_path / "missing"), keep=1) == []
    with pytest.raises(ValueError, match="keep=0"):
        prune_checkpoints(str(tmp_path), keep=0)
    assert _names(tmp_path) == ["iter_0000001"]


BASE = minimal_train_args(num_rollout=2)


def test_the_flag_is_parsed_and_zero_is_refused_at_start_up() -> None:
    assert load_config(BASE).train.max_checkpoints is None  # default: keep every checkpoint
    assert load_config([*BASE, "--max-checkpoints", "3"]).train.max_checkpoints == 3
    with pytest.raises(ConfigError, match=r"--max-checkpoints=0 is outside \[1, inf\)"):
        load_config([*BASE, "--max-checkpoints", "0"])


def _fake_run(save: Path, max_checkpoints: int | None) -> SimpleNamespace:
    """What MilesRun.maybe_save reads, with trainers whose `save` writes a complete checkpoint."""

    async def save_on_trainers(path: str, extra: dict) -> None:
        _checkpoint(Path(path).parent, extra["rollout_id"])

    async def wait(_name: str, aw):
        return await aw

    cfg = SimpleNamespace(
        train=SimpleNamespace(save=str(save), save_interval=1, save_hf=None, max_checkpoints=max_checkpoints),
        rollout=SimpleNamespace(num_rollout=100),
        runtime=SimpleNamespace(rpc_timeout_s=10.0),
    )
    run = SimpleNamespace(
        cfg=cfg,
        trainers=SimpleNamespace(save=save_on_trainers),
        timed=wait,
        weight_version=0,
        trained_version=0,
        _saved_steps=set(),
        data_source=SimpleNamespace(state_dict=dict),
        pending_state_fn=None,
    )
    run._ckpt_dir = lambda step: MilesRun._ckpt_dir(run, step)
    run._save_checkpoint = lambda step: MilesRun._save_checkpoint(run, step)
    return run


@pytest.mark.parametrize(("max_checkpoints", "kept"), [(2, ["iter_0000002", "iter_0000003"]), (None, None)])
def test_each_save_prunes_older_checkpoints(tmp_path: Path, max_checkpoints, kept) -> None:
    run = _fake_run(tmp_path, max_checkpoints)
    for step in range(4):
        asyncio.run(MilesRun.maybe_save(run, step))
    assert _names(tmp_path) == (kept or [f"iter_{s:07d}" for s in range(4)])
