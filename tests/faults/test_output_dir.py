"""One run per `--output-dir`, and an output directory the run cannot write refused in one line.

`miles train` is called in-process with the training loop replaced by a stand-in: the lock, the
config written into the directory and the start-up checks are the real ones; no worker starts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from miles import cli
from miles.cli import UsageError, cmd_train

DEMO = Path(__file__).resolve().parents[2] / "launch" / "configs" / "demo_cpu.yaml"
LOCK = ".miles.lock"


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch) -> Path:
    """A model directory in place of the demo's tiny: spec (nothing is built; no worker reads it)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 512}')
    import miles.models.resolve as resolve

    monkeypatch.setattr(resolve, "resolve_model_paths", lambda model, seed: False)
    return model


def _argv(model: Path, out: Path) -> list[str]:
    return ["--config", str(DEMO), "--hf-checkpoint", str(model), "--output-dir", str(out), "--no-progress-bar"]


def _with_loop(monkeypatch, body) -> None:
    import miles.controller.loop_sync as loop_sync

    monkeypatch.setattr(loop_sync, "run", body)


def test_a_second_run_on_the_same_output_dir_is_refused_in_one_line(tmp_path: Path, model_dir: Path, monkeypatch):
    out = tmp_path / "run"
    seen: dict[str, object] = {}

    def first_run(cfg) -> int:  # while the first run trains, a second one starts on its directory
        if seen:
            return 0
        seen["lock"] = (out / LOCK).read_text() if (out / LOCK).exists() else None
        try:
            seen["second"] = cmd_train(_argv(model_dir, out))
        except UsageError as e:
            seen["second"] = str(e)
        return 0

    _with_loop(monkeypatch, first_run)
    assert cmd_train(_argv(model_dir, out)) == 0
    assert seen["lock"] is not None and seen["lock"].startswith(f"pid {os.getpid()} host ")
    second = seen["second"]
    assert isinstance(second, str) and "\n" not in second, second
    assert second.startswith(f"miles train: --output-dir {str(out)!r} is in use by another run (pid {os.getpid()} ")
    assert not (out / LOCK).exists()  # released at exit


def test_a_lock_left_by_a_dead_run_is_taken_over(tmp_path: Path, model_dir: Path, monkeypatch) -> None:
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a run that ended without removing its lock file
    (out / LOCK).write_text(f"pid {dead.pid} host gone\n")
    ran = []
    _with_loop(monkeypatch, lambda cfg: ran.append(cfg) or 0)
    assert cmd_train(_argv(model_dir, out)) == 0
    assert len(ran) == 1 and not (out / LOCK).exists()


def test_an_output_dir_under_a_file_is_refused_in_one_line(tmp_path: Path, model_dir: Path, monkeypatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _with_loop(monkeypatch, lambda cfg: pytest.fail("the run started"))
    with pytest.raises(UsageError) as info:
        cmd_train(_argv(model_dir, blocker / "run"))
    assert str(info.value) == (
        f"miles train: --output-dir {str(blocker / 'run')!r} is not writable (Not a directory); "
        "point --output-dir at a directory you can write"
    )


@pytest.fixture
def tiny_fs(tmp_path: Path):
    """A 64 KiB tmpfs (root only: skipped elsewhere), unmounted after the test."""
    mount = tmp_path / "fs"
    mount.mkdir()

    def mount_with(options: str) -> Path:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=64k,{options}", "tmpfs", str(mount)], check=False)
        if done.returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        return mount

    yield mount_with
    subprocess.run(["umount", str(mount)], check=False, capture_output=True)


def test_a_read_only_output_dir_is_refused_in_one_line(tmp_path, model_dir, tiny_fs, monkeypatch) -> None:
    mount = tiny_fs("ro")
    _with_loop(monkeypatch, lambda cfg: pytest.fail("the run started"))
    with pytest.raises(UsageError) as info:
        cmd_train(_argv(model_dir, mount / "run"))
    assert str(info.value) == (
        f"miles train: --output-dir {str(mount / 'run')!r} is not writable (Read-only file system); "
        "point --output-dir at a directory you can write"
    )


def test_a_full_output_dir_is_refused_in_one_line(tmp_path, model_dir, tiny_fs, monkeypatch) -> None:
    mount = tiny_fs("rw")
    (mount / "run").mkdir()
    with open(mount / "filler", "wb", buffering=0) as f:  # fill the device
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass
    _with_loop(monkeypatch, lambda cfg: pytest.fail("the run started"))
    with pytest.raises(UsageError) as info:
        cmd_train(_argv(model_dir, mount / "run"))
    assert str(info.value) == (
        f"miles train: --output-dir {str(mount / 'run')!r} is full (No space left on device); "
        "free space or point --output-dir elsewhere"
    )


def test_one_line_names_a_full_disk_met_during_the_run() -> None:
    line = cli.one_line(OSError(28, "No space left on device", "/runs/x/metrics.jsonl"))
    assert line is not None and line.startswith("No space left on device writing /runs/x/metrics.jsonl; free space")
