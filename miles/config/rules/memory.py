"""Start-up checks of the memory levers: optimizer state off the GPU, trainer state on disk, async saves.

`--optimizer-cpu-offload`, `--offload-optimizer-states` and `--stream-optimizer-state-to-disk` replace the
FSDP trainer's AdamW with one that keeps its state off the GPU (`miles/trainer/offload_optim.py`). They
run on one trainer rank of the FSDP backend: the megatron backend's optimizer is megatron-core's own, and
with several ranks the state would be sharded DTensors this optimizer does not keep. Everywhere else
they are refused here, by name, as are the flags that only shape one of them when it is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.fields import flag

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig

OPTIMIZER_LEVERS = ("optimizer_cpu_offload", "offload_optimizer_states", "stream_optimizer_state_to_disk")


def _optimizer_levers(cfg: MilesConfig) -> list[str]:
    t = cfg.train
    on = [name for name in OPTIMIZER_LEVERS if getattr(t, name)]
    e = []
    if len(on) > 1:
        e.append(f"{' and '.join(map(flag, on))} each place the optimizer state somewhere else; keep one")
    for name in on:
        if t.train_backend != "fsdp":
            e.append(
                f"{flag(name)} is implemented by the FSDP trainer (megatron-core's optimizer is not wired to it "
                "here); use --train-backend fsdp, or drop the flag"
            )
        elif cfg.trainer_world_size > 1:
            e.append(
                f"{flag(name)} runs on one trainer rank ({cfg.trainer_world_size} given); set "
                "--actor-num-gpus-per-node 1 --actor-num-nodes 1, or drop the flag"
            )
        if t.lora_rank:
            e.append(f"{flag(name)} with --lora-rank: the adapter's optimizer state is small; drop the flag")
    if t.stream_optimizer_state_to_disk and not t.offload_train_disk_dir:
        e.append("--stream-optimizer-state-to-disk needs --offload-train-disk-dir DIR (where the moments live)")
    if t.stream_optimizer_state_moment_dtype != "fp32" and not t.stream_optimizer_state_to_disk:
        e.append(
            f"--stream-optimizer-state-moment-dtype={t.stream_optimizer_state_moment_dtype} shapes only "
            "--stream-optimizer-state-to-disk; add it, or drop the dtype"
        )
    return e


def _disk_target(cfg: MilesConfig) -> list[str]:
    t, e = cfg.train, []
    if t.offload_train_target == "disk":
        if not t.offload_train_disk_dir:
            e.append("--offload-train-target disk needs --offload-train-disk-dir DIR (where the state is written)")
        if t.offload_train is False:
            e.append(
                "--offload-train-target disk: nothing is offloaded without --offload-train (colocated runs "
                "offload by default); add --colocate or --offload-train, or drop the target"
            )
        if t.train_backend != "fsdp":
            e.append("--offload-train-target disk is implemented by the FSDP trainer; use --train-backend fsdp")
    if t.offload_train_disk_dir and not (t.offload_train_target == "disk" or t.stream_optimizer_state_to_disk):
        e.append(
            "--offload-train-disk-dir is used by --offload-train-target disk and --stream-optimizer-state-to-disk "
            "only; add one of them, or drop the directory"
        )
    if t.offload_train_disk_chunk_mb < 1:
        e.append(f"--offload-train-disk-chunk-mb={t.offload_train_disk_chunk_mb} must be at least 1")
    return e


def check_memory_levers(cfg: MilesConfig) -> list[str]:
    """Every problem with the memory flags, one line each."""
    e = _optimizer_levers(cfg) + _disk_target(cfg)
    if cfg.train.async_save and cfg.train.train_backend != "fsdp":
        e.append(
            "--async-save is implemented by the FSDP trainer (megatron-core's checkpoints are written "
            "synchronously here); drop it, or use --train-backend fsdp"
        )
    return e
