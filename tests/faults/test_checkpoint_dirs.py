"""Checkpoints and run directories a careless or hostile user can hand a run: another run's `--save`,
links inside `--save`, malformed or NaN checkpoints at `--load`, an empty `--hf-checkpoint` directory.
Start-up checks, called as `miles train` calls them; nothing here starts a worker."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from miles.config import ModelConfig, load_config
from miles.controller.preflight import PreflightError, check_model_path, check_start
from miles.trainer.checkpoint_layout import (
    COMPLETE_MARKER,
    checkpoint_dir,
    latest_complete_checkpoint,
    prune_checkpoints,
)


def _cfg(tmp_path: Path, *flags: str):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    prompts = tmp_path / "p.jsonl"  # a prompt file that is not there is refused by check_start
    prompts.touch()
    base = ["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--rm-type", "math"]
    return load_config([*base, "--num-rollout", "1", "--rollout-batch-size", "4", *flags])


def _write_checkpoint(root: Path, step: int, *, nan: bool = False) -> Path:
    """A checkpoint in the trainer's layout (DCP shards, meta.json, COMPLETE), written in this process."""
    path = Path(checkpoint_dir(str(root), step))
    torch.manual_seed(step)
    weight = torch.randn(4, 4)
    if nan:
        weight[1, 2] = float("nan")
    state = {"actor": {"model": {"layer.weight": weight, "layer.bias": torch.zeros(4)}}}
    dcp.save(state, checkpoint_id=str(path / "model"), no_dist=True)
    run_state = {"rollout_id": step, "weight_version": step + 1, "data_source": {}}
    (path / "meta.json").write_text(json.dumps({"extra_state": run_state, "has_optim": False}))
    (path / COMPLETE_MARKER).write_text("ok\n")
    return path


def _refusal(cfg) -> str:
    with pytest.raises(PreflightError) as info:
        check_start(cfg)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---- another run's --save ------------------------------------------------------------------------


def test_a_fresh_run_into_another_runs_save_is_refused_in_one_line(tmp_path: Path) -> None:
    save = tmp_path / "ck"
    _write_checkpoint(save, 2)
    message = _refusal(_cfg(tmp_path, "--save", str(save)))
    assert f"--save {str(save)!r} already holds 1 checkpoint(s) of another run (iter_0000002)" in message
    assert "--auto-resume" in message and "--overwrite-save" in message
    elsewhere = _write_checkpoint(tmp_path / "other", 7)  # loading another lineage does not continue this one
    message = _refusal(_cfg(tmp_path, "--save", str(save), "--load", str(elsewhere)))
    assert f"(--load {str(elsewhere)!r} is outside it)" in message


def test_resume_or_overwrite_may_use_a_save_with_checkpoints(tmp_path: Path) -> None:
    from miles.controller.run_dirs import clear_save_dir

    save = tmp_path / "ck"
    _write_checkpoint(save, 2)
    (save / "iter_0000003").mkdir()  # an interrupted save of the old run
    check_start(_cfg(tmp_path, "--save", str(save), "--auto-resume"))
    check_start(_cfg(tmp_path, "--save", str(save), "--load", str(save)))
    cfg = _cfg(tmp_path, "--save", str(save), "--overwrite-save")
    check_start(cfg)
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000003"]  # the check deletes nothing
    clear_save_dir(cfg.train)  # what the run does once every check passed
    assert os.listdir(save) == []
    message = _refusal(_cfg(tmp_path, "--save", str(save), "--overwrite-save", "--auto-resume"))
    assert message.startswith("--overwrite-save deletes the checkpoints")


class _RecordingRuntime:
    def __init__(self) -> None:
        self.saved: list[str] = []

    async def call_all(self, role: str, method: str, *args, **kwargs):
        if method == "save":
            self.saved.append(args[0])
        return [None]


def _run_saving_into(cfg):
    from miles.controller.run import MilesRun
    from miles.controller.trainers import TrainerGroup
    from miles.utils.timer import StepTimers

    run = MilesRun.__new__(MilesRun)  # only what maybe_save reads
    run.cfg, runtime = cfg, _RecordingRuntime()
    run.trainers = TrainerGroup(runtime)
    run.data_source = type("Source", (), {"state_dict": lambda self: {}})()
    run.pending_state_fn, run.weight_version, run.timers, run._worker_wait_s = None, 0, StepTimers(), 0.0
    run.trained_version, run._saved_steps = 0, set()
    return run, runtime


def test_a_step_saved_by_another_run_is_saved_again_not_skipped(tmp_path: Path) -> None:
    save = tmp_path / "ck"
    _write_checkpoint(save, 0)  # another run's weights at the same step
    run, runtime = _run_saving_into(_cfg(tmp_path, "--save", str(save)))
    asyncio.run(run.maybe_save(0, force=True))
    assert runtime.saved == [checkpoint_dir(str(save), 0)]
    asyncio.run(run.maybe_save(0, force=True))  # a stop right after the scheduled save: this run's, skipped
    assert runtime.saved == [checkpoint_dir(str(save), 0)]


# ---- links inside --save -------------------------------------------------------------------------


def test_pruning_never_deletes_through_a_link(tmp_path: Path) -> None:
    save, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    kept = _write_checkpoint(elsewhere, 1)
    save.mkdir()
    os.symlink(kept, save / "iter_0000001")
    for step in (2, 3):
        _write_checkpoint(save, step)
    marker_link = save / "iter_0000004"
    marker_link.mkdir()
    os.symlink(kept / COMPLETE_MARKER, marker_link / COMPLETE_MARKER)
    _write_checkpoint(save, 5)
    removed = prune_checkpoints(str(save), 1)
    assert removed == [checkpoint_dir(str(save), s) for s in (2, 3)]
    assert sorted(p.name for p in kept.iterdir()) == [COMPLETE_MARKER, "meta.json", "model"]  # untouched
    assert latest_complete_checkpoint(str(save)) == checkpoint_dir(str(save), 5)


# ---- --load validated before any worker starts ---------------------------------------------------


def test_a_nan_checkpoint_is_refused_at_load_naming_the_parameter(tmp_path: Path) -> None:
    save = tmp_path / "ck"
    _write_checkpoint(save, 1)
    _write_checkpoint(save, 4, nan=True)
    check_start(_cfg(tmp_path, "--load", str(save / "iter_0000001")))  # a good one passes
    for flags in (("--load", str(save)), ("--save", str(save), "--auto-resume")):
        message = _refusal(_cfg(tmp_path, *flags))
        assert "iter_0000004" in message and "holds NaN or inf in 1 parameter(s) (actor.model.layer.weight)" in message


def _break(path: Path, how: str) -> str:
    """Damage a checkpoint as a crash, a bad copy or a hand edit would; the words the refusal must say."""
    if how == "meta_garbage":
        (path / "meta.json").write_text("{not json")
        return "meta.json does not read as JSON"
    if how == "meta_no_step":
        (path / "meta.json").write_text(json.dumps({"extra_state": {"weight_version": 3, "data_source": {}}}))
        return "meta.json extra_state.rollout_id=None"
    if how == "meta_missing":
        (path / "meta.json").unlink()
        return "has no meta.json"
    if how == "no_model_metadata":
        (path / "model" / ".metadata").unlink()
        return "model/ holds no checkpoint metadata"
    if how == "metadata_garbage":
        (path / "model" / ".metadata").write_bytes(b"\x80\x04garbage")
        return "model/.metadata does not read"
    shard = next(p for p in (path / "model").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:40])  # "truncated": a cut-short copy
    return f"shard model/{shard.name} has 40 bytes"


@pytest.mark.parametrize(
    "how", ["meta_garbage", "meta_no_step", "meta_missing", "no_model_metadata", "metadata_garbage", "truncated"]
)
def test_a_malformed_checkpoint_is_refused_at_load_naming_what_is_wrong(tmp_path: Path, how: str) -> None:
    path = _write_checkpoint(tmp_path / "ck", 3)
    said = _break(path, how)
    message = _refusal(_cfg(tmp_path, "--load", str(path)))
    assert message.startswith(f"--load: checkpoint {str(path)!r}") and said in message, message


# ---- --hf-checkpoint -----------------------------------------------------------------------------


def test_an_empty_hf_checkpoint_directory_is_named_as_such(tmp_path: Path) -> None:
    empty = tmp_path / "model"
    empty.mkdir()
    with pytest.raises(PreflightError, match=r"--hf-checkpoint '.*model' is an empty directory; point it at"):
        check_model_path(ModelConfig(hf_checkpoint=str(empty)))
    (empty / "tokenizer.json").write_text("{}")
    with pytest.raises(PreflightError, match=r"has no config.json"):
        check_model_path(ModelConfig(hf_checkpoint=str(empty)))
