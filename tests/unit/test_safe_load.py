"""--load reads checkpoints without running code from them (miles/trainer/safe_load.py)."""

import os
import pickle
import traceback

import pytest
import torch
import torch.distributed.checkpoint as dcp

from miles.trainer.safe_load import SafeLoadPlanner, SafeReader


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def _save(tmp_path, extra) -> str:
    path = str(tmp_path / "ckpt")
    state = {"model": {"w": torch.randn(3, 4)}, "optim": {"step": 3, "lr": 1e-3, "betas": (0.9, 0.99)}, "extra": extra}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


def _refusal(path: str, extra=None) -> str:
    """The text of the error loading `path` raises (DCP wraps the reader's error in its own)."""
    with pytest.raises(BaseException) as info:  # CheckpointException is a BaseException
        _load(path, extra)
    e = info.value
    return "".join(traceback.format_exception(e)) + "".join(map(str, getattr(e, "failures", {}).values()))


def _load(path: str, extra=None) -> dict:
    state = {"model": {"w": torch.zeros(3, 4)}, "optim": {"step": 0, "lr": 0.0, "betas": (0.0, 0.0)}, "extra": extra}
    dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=True)
    return state


def test_a_checkpoint_of_tensors_and_plain_data_loads(tmp_path):
    path = _save(tmp_path, {"rollout_id": 7, "name": "x"})
    state = _load(path, {"rollout_id": 0, "name": ""})
    assert state["optim"] == {"step": 3, "lr": 1e-3, "betas": (0.9, 0.99)}
    assert state["extra"] == {"rollout_id": 7, "name": "x"}
    assert state["model"]["w"].abs().sum() > 0


def test_code_in_the_metadata_is_refused_without_running(tmp_path, monkeypatch):
    path = _save(tmp_path, {"rollout_id": 7})
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Boom(), f)
    monkeypatch.chdir(tmp_path)
    assert "which a checkpoint does not need" in _refusal(path, {"rollout_id": 0})
    assert not (tmp_path / "pwned").exists()


def test_code_in_a_byte_entry_is_refused_without_running(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _save(tmp_path, _Boom())  # saving pickles the object; nothing runs until it is loaded
    assert "checkpoint entry 'extra' is not plain data" in _refusal(path)
    assert not (tmp_path / "pwned").exists()
