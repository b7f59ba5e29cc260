"""Asynchronous checkpoints: the next step runs while the checkpoint is written, and resuming it is exact.

Run A saves after rollout 0 with the shard writer slowed down, so the save returns before COMPLETE
exists; rollout 1 trains while the write goes on; `finish_saves` then finds COMPLETE. A fresh
backend loads that checkpoint and trains rollout 1: every parameter must equal run A's after rollout 1,
which shows the snapshot held the state of the save's step, not of the step that ran beside it. A
write that fails on one rank is raised on every rank at the next wait, and leaves no directory.
"""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

from _trainer_harness import configs, make_batch, make_tiny_model, run_ranks, shard  # isort: skip

from miles.trainer.checkpoint import COMPLETE_MARKER, CheckpointWriteError, checkpoint_dir

CFG = dict(algo=dict(advantage_estimator="grpo"), train=dict(micro_batch_size=2), rollout=dict(global_batch_size=4))


def _backend(model_dir: str, **train):
    from miles.trainer.backend import create_backend

    be = create_backend("fsdp", **configs(model_dir, **{**CFG, "train": {**CFG["train"], **train}}))
    be.setup()
    return be


def _slow_shard_writes() -> None:
    """The background writer's DCP save takes a while."""
    from miles.trainer import checkpoint_async

    real = checkpoint_async.dcp.save

    class SlowDCP:
        def __getattr__(self, name):
            return getattr(checkpoint_async.torch.distributed.checkpoint, name)

        @staticmethod
        def save(*a, **kw):
            time.sleep(0.5)
            return real(*a, **kw)

    checkpoint_async.dcp = SlowDCP()


def _fail_shard_writes() -> None:
    """This rank's shard files cannot be written (a full disk)."""
    from torch.distributed.checkpoint import FileSystemWriter

    from miles.trainer.shard_writer import ShardFileWriter

    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    FileSystemWriter.write_data = ShardFileWriter.write_data = write_data


def _shards_in_a_process() -> None:
    """Shards serialized by the writer process on CPU too (the default on CUDA only)."""
    from miles.trainer import checkpoint_async

    init = checkpoint_async.BackgroundWriter.__init__
    checkpoint_async.BackgroundWriter.__init__ = lambda self, device, shard_process=None: init(self, device, True)


def _params(be) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in be.named_hf_tensors()}


def _run(rank: int, world: int, model_dir: str, root: str, lever: dict) -> None:
    _slow_shard_writes()
    lever = dict(lever)
    if lever.pop("shard_process", False):
        _shards_in_a_process()
    per = 4 // world * world
    a = _backend(model_dir, **lever)
    a.train(shard(make_batch(8, seed=30), rank, world, per), rollout_id=0)
    path = checkpoint_dir(os.path.join(root, "save"), 1)
    a.save(path, {"rollout_id": 0})
    writer = a._saver._writer_process
    shard_pid = writer._proc.pid if writer is not None else None
    returned_before_complete = not os.path.exists(os.path.join(path, COMPLETE_MARKER))
    a.train(shard(make_batch(8, seed=31), rank, world, per), rollout_id=1)  # runs while the write goes on
    a.finish_saves()
    out = {"early_return": returned_before_complete, "complete": os.path.exists(os.path.join(path, COMPLETE_MARKER))}
    out["shard_pid"] = shard_pid
    out["a"] = _params(a)
    del a
    b = _backend(model_dir, **lever)
    b.load(path)
    b.train(shard(make_batch(8, seed=31), rank, world, per), rollout_id=1)
    out["b"] = _params(b)
    if rank == world - 1:  # the next background write fails on the last rank only
        _fail_shard_writes()
    failed = checkpoint_dir(os.path.join(root, "save"), 2)
    b.save(failed, {"rollout_id": 1})
    try:
        b.finish_saves()
        out["raised"] = None
    except CheckpointWriteError as e:
        out["raised"] = str(e)
    torch.distributed.barrier()  # rank 0 removes the partial directory as it raises
    out["failed_dir_left"] = os.path.exists(failed)
    torch.save(out, os.path.join(root, f"out{rank}.pt"))


LEVERS = {
    "resident-2-ranks": (2, {}),
    "host-moments-1-rank": (1, {"offload_optimizer_states": True}),
    "shard-process-2-ranks": (2, {"shard_process": True}),
}


@pytest.fixture(scope="module", params=list(LEVERS))
def outcome(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    model_dir = make_tiny_model(str(root / "model"))
    world, lever = LEVERS[request.param]
    run_ranks(_run, world, model_dir, str(root), lever)
    return [torch.load(root / f"out{r}.pt", weights_only=False) for r in range(world)]


def test_save_returns_before_the_marker_and_completes_later(outcome):
    for out in outcome:
        assert out["early_return"] and out["complete"]


def test_shards_are_serialized_by_the_writer_process_where_asked(request, outcome):
    in_process = request.node.callspec.params["outcome"] == "shard-process-2-ranks"
    for out in outcome:
        assert (out["shard_pid"] is not None) == in_process
        if in_process:
            assert out["shard_pid"] != os.getpid()


def test_resuming_the_background_checkpoint_gives_identical_weights(outcome):
    for out in outcome:
        assert out["a"].keys() == out["b"].keys()
        assert all(torch.equal(out["a"][k], out["b"][k]) for k in out["a"])


def test_a_background_failure_on_one_rank_is_raised_on_every_rank_and_leaves_nothing(outcome):
    for out in outcome:
        assert out["raised"] is not None and "disk full" in out["raised"]
        assert not out["failed_dir_left"]
