"""Start-up checks: checkpoint paths, plug-in paths, the prompt-length limit, stale control sockets, stop messages,
and the one-line error of a save that ran out of disk."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import socket
import tempfile
from pathlib import Path

import pytest

from miles.config import FIELDS, NOT_IMPLEMENTED, load_config
from miles.controller.control_socket import remove_stale_sockets
from miles.controller.placement import plan_placement
from miles.controller.preflight import (
    PLUGIN_FIELDS,
    PreflightError,
    check_checkpoint_paths,
    check_plugin_paths,
    prompt_limit,
)
from miles.controller.signals import StopRequest
from miles.errors import as_run_failure
from miles.trainer.checkpoint import COMPLETE_MARKER, CheckpointWriteError, checkpoint_dir

from harness import minimal_train_args  # isort: skip


def _checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    path = Path(checkpoint_dir(str(root), step))
    path.mkdir(parents=True)
    if complete:
        (path / COMPLETE_MARKER).write_text("ok\n")
    return path


# ---- --load / --save ----------------------------------------------------------------------------


def test_load_that_does_not_exist_is_refused_naming_the_path_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(PreflightError) as info:
        check_checkpoint_paths(str(tmp_path / "nope"), None, None)
    message = str(info.value)
    assert f"--load '{tmp_path / 'nope'}' does not exist" in message
    assert "drop --load to start from --hf-checkpoint" in message and "\n" not in message


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ("empty", "holds no complete checkpoint"),
        ("incomplete_root", "holds no complete checkpoint"),
        ("incomplete_iter", f"has no {COMPLETE_MARKER} marker"),
        ("file", "is a file"),
    ],
)
def test_load_without_a_complete_checkpoint_is_refused(tmp_path: Path, layout: str, expected: str) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    load = root
    if layout == "incomplete_root":
        _checkpoint(root, 3, complete=False)
    elif layout == "incomplete_iter":
        load = _checkpoint(root, 3, complete=False)
    elif layout == "file":
        load = root / "model.pt"
        load.write_text("")
    with pytest.raises(PreflightError, match=expected):
        check_checkpoint_paths(str(load), None, None)


def test_load_of_a_complete_checkpoint_or_its_root_passes(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _checkpoint(root, 1)
    _checkpoint(root, 2, complete=False)
    check_checkpoint_paths(str(root), None, None)
    check_checkpoint_paths(checkpoint_dir(str(root), 1), None, None)


def test_load_equal_to_save_may_be_empty_on_the_first_job(tmp_path: Path) -> None:
    """Miles' requeue idiom `--load X --save X`: the first job of the chain finds nothing yet."""
    same = str(tmp_path / "ckpt")
    check_checkpoint_paths(same, same, None)
    assert os.path.isdir(same)  # --save was created and written to
    assert os.listdir(same) == []  # the write probe left nothing behind


def test_save_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(PreflightError) as info:
        check_checkpoint_paths(None, str(blocker / "ckpt"), None)
    assert f"--save '{blocker / 'ckpt'}' is not writable" in str(info.value)
    with pytest.raises(PreflightError, match="--save-hf"):
        check_checkpoint_paths(None, None, str(blocker / "hf" / "step_{rollout_id}"))


def test_read_only_save_is_refused(tmp_path: Path, monkeypatch) -> None:
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)  # as root, mode bits would not stop the write
    with pytest.raises(PreflightError) as info:
        check_checkpoint_paths(None, str(tmp_path), None)
    assert f"--save '{tmp_path}' is not writable (Read-only file system)" in str(info.value)


# ---- plug-in paths ------------------------------------------------------------------------------


def test_every_plugin_path_flag_is_imported_at_start_up_or_refused() -> None:
    path_fields = {name for name in FIELDS if name.endswith("_path")}
    assert path_fields == set(PLUGIN_FIELDS) | (path_fields & set(NOT_IMPLEMENTED))
    assert not set(PLUGIN_FIELDS) & set(NOT_IMPLEMENTED)


@pytest.mark.parametrize("name", PLUGIN_FIELDS)
@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("nope.mod:fn", "No module named 'nope'"),
        ("miles.rollout.filters:no_such_fn", "has no attribute 'no_such_fn'"),
        ("json:__doc__", "resolved to a str, which cannot be called"),
    ],
)
def test_bad_plugin_path_is_refused_naming_the_flag_and_the_path(
    tmp_path: Path, name: str, path: str, reason: str
) -> None:
    cfg = _cfg(tmp_path)
    cfg.set(name, path)
    with pytest.raises(PreflightError) as info:
        check_plugin_paths(cfg)
    message = str(info.value)
    assert message.startswith(f"{FIELDS[name].flag} {path!r} ") and reason in message
    assert "\n" not in message


def test_plugin_whose_import_fails_is_refused_in_one_line(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "broken_rm.py").write_text(
        "def reward(args, sample):\n    return 1.0\nraise RuntimeError('no GPU here\\nsecond line')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _cfg(tmp_path, "--custom-rm-path", "broken_rm:reward")
    with pytest.raises(PreflightError) as info:
        check_plugin_paths(cfg)
    assert "--custom-rm-path 'broken_rm:reward' does not load: " in str(info.value)
    assert "RuntimeError: no GPU here second line" in str(info.value) and "\n" not in str(info.value)


def test_good_plugin_paths_pass(tmp_path: Path) -> None:
    cfg = _cfg(
        tmp_path,
        "--dynamic-sampling-filter-path",
        "miles.rollout.filters.check_reward_nonzero_std",
        "--custom-rm-path",
        "miles.rollout.rm_hub:grade",
    )
    check_plugin_paths(cfg)


# ---- the prompt-length limit --------------------------------------------------------------------


def _cfg(tmp_path: Path, *flags: str):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return load_config(minimal_train_args(*flags, num_rollout=1, hf_checkpoint=str(model), prompt_data="p.jsonl"))


def test_prompt_limit_is_what_every_planned_engine_fits(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "--max-running-requests", "8", "--max-total-tokens", "4000")
    limit = prompt_limit(cfg, plan_placement(cfg, device="cpu"))
    assert limit.max_tokens == 4000 // 8 - 1  # the engine refuses a prompt that leaves no room to generate
    assert "500-token context per request" in limit.source


def test_prompt_limit_default_follows_the_default_kv_budget(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "--rollout-max-response-len", "6")
    limit = prompt_limit(cfg, plan_placement(cfg, device="cpu"))
    assert limit.max_tokens == 1024 + 6 - 1  # placement sizes the KV for 1024 prompt + 6 response tokens


def test_prompt_limit_flag_wins_and_model_positions_bound_the_rest(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "--rollout-max-prompt-len", "77")
    assert prompt_limit(cfg, plan_placement(cfg, device="cpu")).max_tokens == 77
    cfg = _cfg(tmp_path, "--max-running-requests", "1", "--max-total-tokens", "100000")
    limit = prompt_limit(cfg, plan_placement(cfg, device="cpu"))
    assert limit.max_tokens == 4095 and "max_position_embeddings=4096" in limit.source


# ---- stale control sockets ----------------------------------------------------------------------


def test_stale_control_sockets_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    stale = tmp_path / ".ctl-dead.sock"
    left = socket.socket(socket.AF_UNIX)
    left.bind(str(stale))  # bound, then the process "died": the file stays, nobody listens
    left.close()
    live_path = tmp_path / ".ctl-live.sock"
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(live_path))
    live.listen(1)
    try:
        assert remove_stale_sockets(str(tmp_path)) == [str(stale)]
        assert not stale.exists() and live_path.exists()
    finally:
        live.close()


# ---- stop signals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("saves", "said", "not_said"),
    [
        (True, "checkpointing at the end of this step", "no --save"),
        (False, "no --save: stopping at the end of this step without a checkpoint", "checkpointing"),
    ],
)
def test_stop_message_says_whether_a_checkpoint_follows(caplog, saves: bool, said: str, not_said: str) -> None:
    stop = StopRequest(saves=saves)
    with caplog.at_level(logging.WARNING):
        stop._on_signal(signal.SIGINT)
    assert stop.requested
    assert said in caplog.text and not_said not in caplog.text


# ---- a save that fails on the trainers ------------------------------------------------------------


class _FailingSaveRuntime:
    def __init__(self, error: Exception) -> None:
        self.error = error

    async def call_all(self, role: str, method: str, *args, **kwargs):
        raise self.error


def _run_saving_into(tmp_path: Path, error: Exception):
    from miles.controller.run import MilesRun
    from miles.controller.trainers import TrainerGroup
    from miles.utils.timer import StepTimers

    run = MilesRun.__new__(MilesRun)  # only what maybe_save reads
    run.cfg = _cfg(tmp_path, "--save", str(tmp_path / "ckpt"))
    run.trainers = TrainerGroup(_FailingSaveRuntime(error))
    run.data_source = type("Source", (), {"state_dict": lambda self: {}})()
    run.pending_state_fn, run.weight_version, run.timers, run._worker_wait_s = None, 0, StepTimers(), 0.0
    run.trained_version, run._saved_steps = 0, set()
    return run


def test_a_failed_save_is_raised_as_its_one_line_reason(tmp_path: Path) -> None:
    from miles.wire.rpc import RemoteError

    reason = "disk full (ENOSPC) while saving checkpoint /c/iter_0000000; free space or point --save elsewhere"
    remote = RemoteError(
        "trainer:0", "save", "CheckpointWriteError", reason, "Traceback...\nunexpected pos 704 vs 598"
    )
    with pytest.raises(CheckpointWriteError) as info:
        asyncio.run(_run_saving_into(tmp_path, remote).maybe_save(0, force=True))
    assert str(info.value) == reason  # no remote traceback, no "unexpected pos"
    assert as_run_failure(info.value) is info.value  # `miles train` prints it as one line, exit 1
    other = RemoteError("trainer:0", "save", "ValueError", "something else", "tb")
    with pytest.raises(RemoteError):
        asyncio.run(_run_saving_into(tmp_path, other).maybe_save(0, force=True))
