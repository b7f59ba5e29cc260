"""Bad input and faults a new user meets, each refused or reported in one line naming the fix.

Refused at start-up (`miles train` exits 2): before any worker starts (no worker log exists), a
`--load` that does not exist, a `--save` that cannot be written, prompt or eval data that names no file,
a plug-in path that does not import;
while the workers start (data is read beside their start-up, and they are stopped: none is left),
prompt or eval data that is not UTF-8 and a prompt over the limit with `--refuse-long-prompts`. Handled in a run: too-long prompts
and huge rows are skipped and counted (the run goes past the step that would have drawn them),
malformed rows with `--skip-bad-rows` too, and a stale control socket of a killed run is removed.
SIGINT without `--save` says no checkpoint follows. A full disk during a save (an ENOSPC injected at
the write layer on one of two gloo ranks) raises the same one-line error on every rank, naming
the checkpoint, and leaves no directory that could pass for a checkpoint.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from _trainer_harness import run_ranks  # isort: skip
from e2e_helpers import REPO, leftover_processes, python_path, read_rows, train_command  # isort: skip

from miles.trainer import checkpoint as ckpt

SMALL = [
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--global-batch-size",
    "4",
    "--eval-interval",
    "none",
    "--actor-num-gpus-per-node",
    "1",
]


def _train(out_dir: Path, *flags: str) -> subprocess.Popen:
    cmd = train_command(out_dir, *SMALL, *flags)
    env = {**os.environ, "MILES_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path()}
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _finish(proc: subprocess.Popen, timeout_s: float = 300) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"miles train did not finish in {timeout_s}s:\n{err[-4000:]}") from None


def _jsonl(path: Path, rows: list) -> Path:
    path.write_bytes(b"".join(r if isinstance(r, bytes) else json.dumps(r).encode() + b"\n" for r in rows))
    return path


def _digits(n: int) -> list[dict]:
    return [{"input": f"copy {i % 10} :", "label": str(i % 10)} for i in range(n)]


# ---- refused at start-up -------------------------------------------------------------------------


def _refusal_case(case: str, tmp: Path) -> tuple[list[str], str]:
    """Flags of one bad start, and the text its one-line refusal must hold."""
    if case == "load_missing":
        return ["--load", "/does/not/exist"], "--load '/does/not/exist' does not exist; point it at a checkpoint"
    if case == "save_not_creatable":
        (tmp / "file").write_text("")
        return ["--save", str(tmp / "file" / "ckpt")], f"--save '{tmp / 'file' / 'ckpt'}' is not writable"
    if case == "prompt_not_utf8":
        data = _jsonl(tmp / "x.jsonl", [*_digits(16), b'{"input": "c\xffopy 1 :", "label": "1"}\n'])
        return ["--prompt-data", str(data)], (
            f"{data}:17: not UTF-8 (byte 0xff at column 13); fix the file or pass --skip-bad-rows"
        )
    if case == "eval_not_utf8":
        data = _jsonl(tmp / "eval.jsonl", [b'\xfe{"input": "copy 1 :", "label": "1"}\n'])
        return [
            "--eval-interval",
            "5",
            "--eval-prompt-data",
            "digits",
            str(data),
        ], f"{data}:1: not UTF-8 (byte 0xfe at column 1)"
    if case == "prompt_missing":
        return ["--prompt-data", str(tmp / "none.jsonl")], f"prompt data '{tmp / 'none.jsonl'}' does not exist"
    if case == "eval_missing":
        flags = ["--eval-interval", "5", "--eval-prompt-data", "digits", str(tmp / "none.jsonl")]
        return flags, f"eval data 'digits': '{tmp / 'none.jsonl'}' does not exist or is not a file; check the path"
    if case in ("reward_plugin_missing", "loss_plugin_missing"):  # one loaded by the controller, one by the trainer
        flag = "--custom-rm-path" if case == "reward_plugin_missing" else "--custom-loss-function-path"
        return [flag, "nope.mod:fn"], f"{flag} 'nope.mod:fn' does not load: cannot import module 'nope.mod'"
    data = _jsonl(tmp / "long.jsonl", [*_digits(4), {"input": "copy " + "7 " * 2000 + ":", "label": "7"}])
    return [
        "--prompt-data",
        str(data),
        "--refuse-long-prompts",
    ], f"{data}:5: the prompt has 4006 tokens (more than the 1029-token limit of the engine's 1030-token context"


DATA_CASES = ("prompt_not_utf8", "eval_not_utf8", "long_prompt_refused")


@pytest.mark.parametrize(
    "case",
    [
        "load_missing",
        "save_not_creatable",
        "prompt_missing",
        "eval_missing",
        "prompt_not_utf8",
        "eval_not_utf8",
        "long_prompt_refused",
        "reward_plugin_missing",
        "loss_plugin_missing",
    ],
)
def test_bad_start_is_refused_in_one_line_before_training(tmp_path: Path, case: str) -> None:
    flags, expected = _refusal_case(case, tmp_path)
    out_dir = tmp_path / "run"
    out, err = _finish(_train(out_dir, "--num-rollout", "2", *flags), timeout_s=120)
    last = err.strip().splitlines()[-1]
    assert last.startswith("miles train: ") and expected in last, err[-3000:]
    assert "Traceback" not in err
    if case in DATA_CASES:  # read while the workers start: they were stopped
        assert not leftover_processes(str(out_dir)), "a worker outlived the refusal"
        assert not (out_dir / "metrics.jsonl").exists()
    else:
        assert not (out_dir / "logs").exists(), "a worker was started before the refusal"


# ---- handled in a run -----------------------------------------------------------------------------


def _stale_socket(run_dir: Path) -> Path:
    run_dir.mkdir(parents=True)
    path = run_dir / ".ctl-0123456789ab.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))  # a controller bound it and was SIGKILLed: the file stays, nobody listens
    s.close()
    return path


def test_long_huge_and_malformed_rows_are_skipped_and_counted(tmp_path: Path) -> None:
    rows = (
        _digits(2)
        + [
            {"input": "copy " + "7 " * 2000 + ":", "label": "7"},  # would be drawn at step 1: the engine refuses it
            b'{"input": "copy \xff :", "label": "1"}\n',
            {"input": "copy " + "9" * 4_000_000, "label": "9"},  # 4 MB: judged by its characters, never tokenised
        ]
        + _digits(3)
    )
    data = _jsonl(tmp_path / "mixed.jsonl", rows)
    out_dir = tmp_path / "run"
    stale = _stale_socket(out_dir)
    out, err = _finish(_train(out_dir, "--prompt-data", str(data), "--skip-bad-rows", "--num-rollout", "3"))
    assert "Traceback" not in err, err[-4000:]
    assert f"{data}:4: not UTF-8 (byte 0xff at column 17)" in err
    assert f"{data}: skipped 1 malformed rows (--skip-bad-rows)" in err
    assert (
        f"{data}: skipped 2 prompts longer than the 1029-token limit of the engine's 1030-token context per request"
    ) in err
    assert "the longest has 4000005 characters (line 5)" in err
    assert [r["step"] for r in read_rows(out_dir) if r["step"] >= 0] == [0, 1, 2]
    assert not stale.exists() and not list(out_dir.glob(".ctl-*.sock"))
    assert not leftover_processes(str(out_dir))


def test_sigint_without_save_says_no_checkpoint_follows(tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    proc = _train(out_dir, "--num-rollout", "1000")
    try:
        deadline = time.monotonic() + 240
        while not (out_dir / "metrics.jsonl").exists() or not read_rows(out_dir):
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "no step logged in 240 s"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = _finish(proc, timeout_s=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-4000:]
    assert "received SIGINT: no --save: stopping at the end of this step without a checkpoint" in err
    assert "checkpointing" not in err
    assert len(read_rows(out_dir)) < 1000
    assert not leftover_processes(str(out_dir))


# ---- a full disk during a save --------------------------------------------------------------------


def _models():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    return {"actor": (model, optim)}


def _inject(mode: str, rank: int) -> None:
    """Make one rank's writes fail the way a full disk makes them fail (files only: DCP also
    torch.saves into memory buffers)."""
    save = torch.save
    if mode == "enospc" and rank == 1:

        def torch_save(obj, f, *args, **kwargs):
            if not isinstance(f, (str, os.PathLike)):
                return save(obj, f, *args, **kwargs)
            with open(f, "wb") as out:
                out.write(b"PK\x03\x04")  # what got written before the device filled up
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))

        torch.save = torch_save
    elif mode == "short_write" and rank == 0:  # torch's own report of a full disk: no errno

        def torch_save(obj, f, *args, **kwargs):
            if not isinstance(f, (str, os.PathLike)):
                return save(obj, f, *args, **kwargs)
            raise RuntimeError(
                "[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing "
                "file data/0: unexpected pos 704 vs 598"
            )

        torch.save = torch_save
        shutil.disk_usage = lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096)
    elif mode == "dcp_enospc" and rank == 1:  # DCP's own shard writer: its failure is a BaseException
        from torch.distributed.checkpoint import filesystem

        create_stream = filesystem.FileSystem.create_stream

        @contextlib.contextmanager
        def full_stream(self, path, mode):
            with create_stream(self, path, mode) as stream:
                yield _FullFile(stream) if "w" in mode else stream

        filesystem.FileSystem.create_stream = full_stream
    elif mode == "marker" and rank == 0:  # the last few bytes: the marker file is created, its text never lands
        real_open = builtins.open

        def full_open(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            return _FullFile(f) if "w" in mode and os.path.basename(str(file)).startswith("COMPLETE") else f

        builtins.open = full_open


class _FullFile:
    """An open file on a device with no space left: writes fail."""

    def __init__(self, f) -> None:
        self._f = f

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self) -> _FullFile:
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def __getattr__(self, name: str):
        return getattr(self._f, name)


def _save_on_a_full_disk(rank: int, world: int, root: str, mode: str) -> None:
    models = _models()
    ckpt.save_checkpoint(ckpt.checkpoint_dir(root, 0), models, {"step": 0})  # a good one before the disk filled
    _inject(mode, rank)
    try:
        ckpt.save_checkpoint(ckpt.checkpoint_dir(root, 1), models, {"step": 1})
        message = "no error"
    except ckpt.CheckpointWriteError as e:
        message = str(e)
    Path(root, f"error_{rank}.txt").write_text(message)


@pytest.mark.parametrize("mode", ["enospc", "short_write", "marker", "dcp_enospc"])
def test_full_disk_during_save_names_the_checkpoint_and_leaves_no_checkpoint(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "ckpt"
    run_ranks(_save_on_a_full_disk, 2, str(root), mode)
    messages = {(root / f"error_{r}.txt").read_text() for r in range(2)}
    assert len(messages) == 1, messages  # every rank raised, with the same reason: none waits in a barrier
    message = messages.pop()
    failed = ckpt.checkpoint_dir(str(root), 1)
    assert message.startswith(
        f"disk full (ENOSPC) while saving checkpoint {failed}; free space or point --save elsewhere"
    ), message
    assert "unexpected pos" not in message
    assert not os.path.exists(failed)
    assert ckpt.latest_complete_checkpoint(str(root)) == ckpt.checkpoint_dir(str(root), 0)


def _save_into_a_linked_step(rank: int, world: int, root: str) -> None:
    path = ckpt.checkpoint_dir(root, 1)
    ckpt.save_checkpoint(path, _models(), {"step": 1})
    shard = next(p for p in Path(path, "model").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:40])  # then cut short: DCP's failure to read it is a BaseException
    try:
        ckpt.load_checkpoint(path, _models())
        message = "loaded"
    except RuntimeError as e:  # an error the worker reports to the controller, not one it dies of
        message = str(e)
    Path(root, "load_error.txt").write_text(message)


def test_a_save_replaces_a_linked_step_and_a_cut_short_one_fails_to_load_in_one_line(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "weights.bin").write_bytes(b"someone else's")
    root.mkdir()
    os.symlink(elsewhere, root / "iter_0000001")  # a link inside --save, to a directory outside it
    run_ranks(_save_into_a_linked_step, 1, str(root))
    assert (elsewhere / "weights.bin").read_bytes() == b"someone else's" and len(list(elsewhere.iterdir())) == 1
    saved = Path(ckpt.checkpoint_dir(str(root), 1))
    assert not saved.is_symlink() and ckpt.is_complete(str(saved))
    message = (root / "load_error.txt").read_text()
    assert message.startswith(f"reading checkpoint {saved} failed: ") and "\n" not in message, message


def _save_onto(rank: int, world: int, root: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)  # 16 KiB of weights, twice that of Adam state: more than the device holds
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    optim.step()
    try:
        ckpt.save_checkpoint(ckpt.checkpoint_dir(root, 0), {"actor": (model, optim)}, {"step": 0})
        message = "no error"
    except ckpt.CheckpointWriteError as e:
        message = str(e)
    Path(root).parent.parent.joinpath("error.txt").write_text(message)  # beside the full device


def test_a_save_onto_a_really_full_device_ends_in_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """A real full device (a 16 KiB tmpfs; root only): torch's own short-write error inside DCP's writer."""
    mount = tmp_path / "fs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], check=False).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run_ranks(_save_onto, 1, str(mount / "ck"))
        message = (tmp_path / "error.txt").read_text()
        assert message == (
            f"disk full (ENOSPC) while saving checkpoint {mount / 'ck' / 'iter_0000000'}; free space or point "
            "--save elsewhere (the partial checkpoint was removed)"
        )
        assert os.listdir(mount / "ck") == []
    finally:
        subprocess.run(["umount", str(mount)], check=False)
