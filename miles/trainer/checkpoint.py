"""Trainer checkpoints with torch Distributed Checkpoint (DCP).

Layout of one checkpoint directory (`<save>/iter_{step:07d}`):
    model/          DCP shards of the policy (and critic) parameters and optimizer states
    rng/rank_{r}.pt RNG states of rank r (torch, CUDA, numpy, python)
    meta.json       step, LR-schedule states and the caller's extra state (e.g. data-source state)
    COMPLETE        written last (atomically), by rank 0, once every rank wrote its part: only then is
                    it a checkpoint

A directory without COMPLETE (a crash mid-save) is ignored by `latest_complete_checkpoint`.
`--max-checkpoints N` keeps the newest N complete checkpoints (`prune_checkpoints`): older complete ones
lose their marker first, then their files, so a deletion cut short never leaves a directory that looks
loadable; incomplete directories are left for inspection. A save
that fails on any rank (a full disk, say) raises `CheckpointWriteError` on every rank, naming the
directory; the partial directory is removed and never gets its marker. `miles train` prints that
one line and exits 1.

Asynchronous saves (`--async-save`, the FSDP default): `BackgroundWriter` snapshots the state to host
memory (every tensor on the training device is copied, on CUDA by copies queued on a stream of their own
that the next optimizer step or offload waits for on the GPU; state that already lives on the host, such
as an offloaded optimizer's moments, is referenced and the next optimizer step waits for the write),
writes meta.json and the RNG files, and returns; a thread then writes the DCP shards over a gloo group
of its own and, once every rank's shards are durable, rank 0 writes COMPLETE. On CUDA the snapshot lives in
shared memory and a process of its own serializes the shards (`shard_writer.py`), so that the write never
holds the training loop's GIL. At most one save is in
flight: the next save (and a load, and the end of the run) first waits for it, and a failure of the
background write is raised there, on every rank, as CheckpointWriteError.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from miles.trainer.checkpoint_layout import (  # noqa: F401 - the layout's names, re-exported
    COMPLETE_MARKER,
    CheckpointWriteError,
    checkpoint_dir,
    complete_checkpoint_steps,
    is_complete,
    latest_complete_checkpoint,
    prune_checkpoints,
    remove_checkpoint_dir,
    resolve_load_path,
)
from miles.trainer.safe_load import SafeLoadPlanner, SafeReader
from miles.trainer.shard_writer import ShardFileWriter, ShardWriterProcess, SnapshotArena

logger = logging.getLogger(__name__)

# torch.save reports a short write without its errno ("unexpected pos 704 vs 598"): with less free
# space than this left on the device, a failed write is taken to be a full disk.
_DISK_FULL_FREE_BYTES = 64 * 1024**2
# DCP raises CheckpointException, a BaseException: caught beside Exception, so every save failure is shared
_SAVE_ERRORS = (Exception, CheckpointException)


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "python": random.getstate(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def _model_optim_state(
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]], save_optim: bool, trainable_only: bool
) -> dict[str, Any]:
    """`trainable_only` (LoRA): frozen parameters are left out; they are the run's --hf-checkpoint."""
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    state: dict[str, Any] = {}
    for key, (model, optim) in models.items():
        if optim is not None and save_optim:
            msd, osd = get_state_dict(model, optim, options=options)
            state[key] = {"model": msd, "optim": osd}
        else:
            state[key] = {"model": get_state_dict(model, [], options=options)[0]}
        if trainable_only:  # a tied weight's second name (lm_head.weight) escapes ignore_frozen_params
            trains = {name for name, p in model.named_parameters() if p.requires_grad}
            state[key]["model"] = {k: v for k, v in state[key]["model"].items() if k in trains}
    return state


def save_checkpoint(
    path: str,
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]],
    meta: dict[str, Any],
    *,
    save_optim: bool = True,
    write_model: Callable[[str], None] | None = None,
    trainable_only: bool = False,
    background: BackgroundWriter | None = None,
) -> None:
    """Collective: every rank writes its shards; rank 0 writes meta.json and then COMPLETE.

    `write_model(model_dir)` replaces the DCP save of `models` for a backend with its own sharded
    format (megatron-core's dist_checkpointing); the rest of the layout is the same.
    `trainable_only`: only parameters that train (a LoRA adapter) and their optimizer state are written.
    Any rank's write failure is shared with every rank (none is left waiting in a barrier), and all
    raise the same CheckpointWriteError. `background`: the shards and COMPLETE are written by that writer's
    thread, after this returns (see the module doc).
    """
    if background is not None:
        background.wait()  # at most one save in flight; the previous one's failure is raised here
        background.ensure_group()
    rank = dist.get_rank()
    error = None
    try:
        if rank == 0:
            remove_checkpoint_dir(path)  # a stale or partial save of the same step (a link: only the link)
            os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    except _SAVE_ERRORS as e:  # shared with every rank below
        error = _write_error(path, e)
    _raise_first(path, error)  # nothing to write into: every rank stops here
    try:
        if write_model is not None:
            write_model(os.path.join(path, "model"))
        else:
            state = _model_optim_state(models, save_optim, trainable_only)
            if background is None:
                dcp.save(state, checkpoint_id=os.path.join(path, "model"))
        torch.save(_rng_state(), os.path.join(path, "rng", f"rank_{rank}.pt"))
        if rank == 0:
            _write_json(
                os.path.join(path, "meta.json"), {**meta, "has_optim": save_optim, "trainable_only": trainable_only}
            )
        if background is not None:
            background.stage(path, state)
    except _SAVE_ERRORS as e:  # shared with every rank below
        error = _write_error(path, e)
    _raise_first(path, error)  # every rank's shards and RNG file exist before the marker
    if background is not None:  # every rank staged its snapshot: the threads' collectives all take place
        background.launch()
        logger.info("writing checkpoint %s in the background", path)
        return
    try:
        if rank == 0:
            _write_marker(path)
    except _SAVE_ERRORS as e:  # shared with every rank below
        error = _write_error(path, e)
    _raise_first(path, error)
    logger.info("saved checkpoint %s", path)


def _write_marker(path: str) -> None:
    """COMPLETE appears whole or not at all: written beside, synced, renamed into place."""
    marker = os.path.join(path, COMPLETE_MARKER)
    with open(marker + ".tmp", "w") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker + ".tmp", marker)
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _raise_first(path: str, local_error: str | None) -> None:
    """Collective: every rank learns every rank's error; with any, the partial save is removed and all raise."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local_error)
    errors = [e for e in gathered if e]
    if not errors:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)  # frees what was written; without COMPLETE it was never usable
    raise CheckpointWriteError(errors[0])


def _write_error(path: str, exc: BaseException) -> str:
    """One line naming the checkpoint and the cause; a full disk is said so, whatever layer noticed it."""
    if _is_disk_full(exc, path):
        return (
            f"disk full (ENOSPC) while saving checkpoint {path}; free space or point --save elsewhere "
            f"(the partial checkpoint was removed)"
        )
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: name the first rank's cause
    if isinstance(failures, dict) and failures:
        exc = _unwrapped(next(iter(failures.values())))
    reason = " ".join(str(exc).split())  # one line, whatever the layer below printed
    return f"writing checkpoint {path} failed: {type(exc).__name__}: {reason} (the partial checkpoint was removed)"


def _is_disk_full(exc: BaseException, path: str) -> bool:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict) and any(
            isinstance(f, BaseException) and _is_disk_full(f, path) for f in map(_unwrapped, failures.values())
        ):
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return _free_bytes(path) < _DISK_FULL_FREE_BYTES


def _unwrapped(failure: Any) -> Any:
    """DCP wraps each rank's exception with its traceback summary: the exception itself."""
    return failure[0] if isinstance(failure, tuple) and failure else failure


def _free_bytes(path: str) -> int:
    """Free bytes on the device of `path` (or of its nearest existing parent); unknown is plenty."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return _DISK_FULL_FREE_BYTES


def load_checkpoint(
    path: str,
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]],
    *,
    read_model: Callable[[str, bool], None] | None = None,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Collective: restore model/optimizer shards and this rank's RNG; returns meta.json.

    `read_model(model_dir, has_optim)` replaces the DCP load of `models` (see `save_checkpoint`).
    `trainable_only` (LoRA): only the parameters that train are read; the frozen ones keep the
    values the model was built with (its --hf-checkpoint)."""
    if not is_complete(path):
        raise FileNotFoundError(
            f"checkpoint {path!r} has no {COMPLETE_MARKER} marker (missing or interrupted save); "
            "point --load at a complete iter_* directory or at the save root for the latest complete one"
        )
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if bool(meta.get("trainable_only", False)) != trainable_only:
        saved = "only trainable parameters (a LoRA adapter)" if meta.get("trainable_only") else "every parameter"
        raise ValueError(f"checkpoint {path!r} holds {saved}; resume it with the --lora-rank it was saved with")
    model_dir = os.path.join(path, "model")
    if read_model is not None:
        read_model(model_dir, meta.get("has_optim", True))
    else:
        try:
            _load_dcp(model_dir, models, meta.get("has_optim", True), trainable_only)
        except CheckpointException as e:  # a BaseException: made an error the worker reports, not one it dies of
            cause = _unwrapped(next(iter(e.failures.values()))) if e.failures else e
            reason = " ".join(str(cause).split())
            raise RuntimeError(f"reading checkpoint {path} failed: {type(cause).__name__}: {reason}") from None
    rng_file = os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt")
    if os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        logger.warning(
            "no RNG state for rank %d in %s (different world size?); RNG not restored", dist.get_rank(), path
        )
    dist.barrier()
    logger.info("loaded checkpoint %s", path)
    return meta


def _load_dcp(
    model_dir: str,
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]],
    has_optim: bool,
    trainable_only: bool,
) -> None:
    state = _model_optim_state(models, has_optim, trainable_only)
    # read without unpickling arbitrary objects (safe_load.py)
    dcp.load(state, storage_reader=SafeReader(model_dir), planner=SafeLoadPlanner())
    options = StateDictOptions(strict=not trainable_only)  # LoRA: the frozen base is absent by design
    for key, (model, optim) in models.items():
        if "optim" in state[key]:
            set_state_dict(
                model,
                optim,
                model_state_dict=state[key]["model"],
                optim_state_dict=state[key]["optim"],
                options=options,
            )
        else:
            set_state_dict(model, [], model_state_dict=state[key]["model"], optim_state_dict={}, options=options)


def _write_json(path: str, obj: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BackgroundWriter:
    """Writes one checkpoint's DCP shards at a time in a thread, then its COMPLETE marker (see the module doc)."""

    def __init__(self, device: torch.device, shard_process: bool | None = None) -> None:
        self.device = device
        self._group = None  # gloo, created at the first save (collective): the thread's collectives use it
        self._host: dict[tuple, torch.Tensor] = {}  # snapshot buffers, reused by every save
        # CUDA (or when asked): the snapshot in one shared arena whose shards a process of their own serializes,
        # so that writing never holds this process's GIL (shard_writer.py); else they are written in the thread
        self.shard_process = device.type == "cuda" if shard_process is None else shard_process
        self._arena: SnapshotArena | None = None
        self._writer_process: ShardWriterProcess | None = None
        self._thread: threading.Thread | None = None
        self._path: str | None = None
        self._error: str | None = None
        self._staged: dict[str, Any] | None = None
        self.references_live_state = False  # the snapshot points at host state the next optimizer step changes
        # CUDA: the snapshot's copies run on a stream of their own, after the work queued so far, and the
        # event marks their end; the next change to the state waits for it on the GPU (`fence`), the writer
        # thread on the host
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._copied: torch.cuda.Event | None = None

    @property
    def pending(self) -> str | None:
        return self._path

    def ensure_group(self) -> None:
        """Collective (every rank, before anything of the save can fail): the writer threads' gloo group."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")

    def stage(self, path: str, state: dict[str, Any]) -> None:
        """Snapshot `state` to host memory for the checkpoint at `path`; `launch()` starts writing it.

        On CUDA the copies are queued, not waited for: whatever next changes or frees the state must first
        call `fence()` (the backend does before an optimizer step and an offload)."""
        if self._thread is not None:
            raise RuntimeError(f"a checkpoint is still being written ({self._path}); call wait() first")
        self.references_live_state = False
        if self.shard_process:
            self._use_arena(state)
        if self._copy_stream is None:
            self._staged = self._snapshot(state, ())
        else:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the state as of now
            with torch.cuda.stream(self._copy_stream):
                self._staged = self._snapshot(state, ())
            self._copied = torch.cuda.Event()
            self._copied.record(self._copy_stream)
        self._path, self._error = path, None

    def fence(self) -> None:
        """Work queued after this on the current stream (an optimizer step, an offload that frees the
        weights) runs after the snapshot's copies; the host does not wait."""
        if self._copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied)

    def _use_arena(self, state: dict[str, Any]) -> None:
        """The snapshot's buffers are the arena's views, laid out anew (with its writer process) when the
        state's layout changes; where no arena can be made, shards are written in the thread."""
        layout = list(self._device_tensors(state, ()))
        if self._arena is not None and self._arena.layout == layout:
            return
        self.close()
        try:
            self._arena = SnapshotArena(layout)
            self._writer_process = ShardWriterProcess(self._arena)
        except OSError as e:
            logger.warning("checkpoint shards are written in a thread of the trainer (no shared snapshot: %s)", e)
            self.shard_process, self._arena = False, None
            return
        self._host = dict(self._arena.views)

    def _device_tensors(self, value: Any, key: tuple):
        """(key, shape, dtype) of every tensor of `value` on the training device, in `_snapshot`'s order."""
        if isinstance(value, dict):
            for k, v in value.items():
                yield from self._device_tensors(v, (*key, k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                yield from self._device_tensors(v, (*key, i))
        elif isinstance(value, torch.Tensor):
            local = value._local_tensor if isinstance(value, DTensor) else value
            if local.device == self.device:
                yield key, tuple(local.shape), local.dtype

    def close(self) -> None:
        """Stop the shard writer process and free the arena (a save in flight is waited for first)."""
        self.wait_local()
        if self._writer_process is not None:
            self._writer_process.close()
        if self._arena is not None:
            self._arena.close()
        self._writer_process = self._arena = None
        self._host = {}

    def launch(self) -> None:
        snapshot, self._staged = self._staged, None
        self._thread = threading.Thread(target=self._write, args=(self._path, snapshot), name="checkpoint-writer")
        self._thread.start()

    def _snapshot(self, value: Any, key: tuple) -> Any:
        if isinstance(value, dict):
            return {k: self._snapshot(v, (*key, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._snapshot(v, (*key, i)) for i, v in enumerate(value))
        if not isinstance(value, torch.Tensor):
            return value
        local = value._local_tensor if isinstance(value, DTensor) else value
        if local.device != self.device:
            self.references_live_state = True
            return value
        host = self._host.get(key)
        if host is None or host.shape != local.shape or host.dtype != local.dtype:
            from miles.trainer.offload_optim import pin_host

            host = self._host[key] = pin_host(torch.empty(local.shape, dtype=local.dtype))
        if self._copy_stream is not None:
            local.record_stream(self._copy_stream)  # a temporary of the state dict is not reused before the copy
        host.copy_(local.detach(), non_blocking=True)
        if isinstance(value, DTensor):  # DTensor.from_local would copy the host tensor back to the mesh's device
            return DTensor(host, value._spec, requires_grad=False)
        return host

    def _write(self, path: str, snapshot: dict[str, Any]) -> None:
        try:
            if self._copied is not None:
                self._copied.synchronize()  # the snapshot's copies are in host memory
            rank = dist.get_rank()
            _fsync(os.path.join(path, "rng", f"rank_{rank}.pt"))  # durable before DCP's last step, hence the marker
            model_dir = os.path.join(path, "model")
            if self._writer_process is not None:  # fsyncs its files, as DCP's own writer does
                writer = ShardFileWriter(model_dir, self._arena, self._writer_process)
                dcp.save(snapshot, storage_writer=writer, process_group=self._group)
            else:
                dcp.save(snapshot, checkpoint_id=model_dir, process_group=self._group)  # fsyncs its files
            if rank == 0:  # every rank's shards are written (DCP's last step gathers them)
                _fsync(os.path.join(path, "meta.json"))
                _write_marker(path)
            logger.info("saved checkpoint %s", path)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; wait() raises it
            logger.exception("writing checkpoint %s failed", path)
            self._error = _write_error(path, e)

    def wait_local(self) -> None:
        """This rank's write is finished (no collective; a failure is raised by the next wait())."""
        if self._thread is not None:
            self._thread.join()

    def wait(self) -> None:
        """Collective: the checkpoint in flight is complete on every rank, or all raise its failure."""
        if self._thread is None:  # saves are collective: no rank has one in flight either
            return
        self.wait_local()
        path, error = self._path, self._error
        self._thread = self._path = self._error = self._copied = None
        _raise_first(path, error)
