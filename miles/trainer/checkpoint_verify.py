"""Is a checkpoint whole and sane? Read before any worker starts, so `--load` fails in one line.

A checkpoint (layout in `miles/trainer/checkpoint.py`) passes when it has its COMPLETE marker, a
`meta.json` whose `extra_state` (the run's position) holds an integer `rollout_id`, a `data_source`
object and, when present, an integer `weight_version`, a `model/` directory with DCP metadata that reads without running code (`safe_load.py`)
and whose every shard file holds the bytes the metadata points at, and, with `scan_weights`, model
parameters that are all finite. The scan reads one stored tensor at a time (memory: the largest one)
and skips optimizer state; megatron-core checkpoints (their own sharded format) get the marker,
metadata and file checks only.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

from miles.trainer.checkpoint_layout import COMPLETE_MARKER, is_complete

_MODEL_DIR = "model"
_DCP_METADATA = ".metadata"
_MEGATRON_METADATA = "metadata.json"  # megatron-core dist_checkpointing writes it beside its shards
_NAMES_SHOWN = 3


class CheckpointInvalid(ValueError):
    """The checkpoint cannot be resumed from; the message names the checkpoint and what is wrong."""


def verify_checkpoint(path: str, *, scan_weights: bool = True) -> dict[str, Any]:
    """Check the checkpoint directory `path` (an `iter_*`); its meta.json, or CheckpointInvalid."""
    if not is_complete(path):
        raise CheckpointInvalid(f"checkpoint {path!r} has no {COMPLETE_MARKER} marker (missing or interrupted save)")
    meta = _read_meta(path)
    model_dir = os.path.join(path, _MODEL_DIR)
    if not os.path.isdir(model_dir):
        raise CheckpointInvalid(f"checkpoint {path!r} has no {_MODEL_DIR}/ directory (its weights are missing)")
    if os.path.isfile(os.path.join(model_dir, _DCP_METADATA)):
        _check_dcp(path, model_dir, scan_weights)
    elif not os.path.isfile(os.path.join(model_dir, _MEGATRON_METADATA)):
        raise CheckpointInvalid(
            f"checkpoint {path!r}: {_MODEL_DIR}/ holds no checkpoint metadata ({_DCP_METADATA} or "
            f"{_MEGATRON_METADATA}); its weights were never written whole"
        )
    return meta


def _read_meta(path: str) -> dict[str, Any]:
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointInvalid(f"checkpoint {path!r} has no meta.json (its step and data position)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointInvalid(f"checkpoint {path!r}: meta.json does not read as JSON ({e})") from None
    run_state = meta.get("extra_state") if isinstance(meta, dict) else None
    if not isinstance(run_state, dict):
        raise CheckpointInvalid(f"checkpoint {path!r}: meta.json holds no extra_state object (the run's position)")
    for key, required in (("rollout_id", True), ("weight_version", False)):
        value = run_state.get(key)
        if (value is None and required) or (value is not None and (type(value) is not int or value < 0)):
            raise CheckpointInvalid(
                f"checkpoint {path!r}: meta.json extra_state.{key}={value!r}; a checkpoint records it as an "
                "integer >= 0"
            )
    if not isinstance(run_state.get("data_source"), dict):
        raise CheckpointInvalid(f"checkpoint {path!r}: meta.json extra_state has no data_source (the data position)")
    return meta


def _check_dcp(path: str, model_dir: str, scan_weights: bool) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from miles.trainer.safe_load import UnsafeCheckpointError, read_safe_metadata

    try:
        metadata = read_safe_metadata(os.path.join(model_dir, _DCP_METADATA))
    except UnsafeCheckpointError as e:
        raise CheckpointInvalid(f"checkpoint {path!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: any unpickling error
        raise CheckpointInvalid(
            f"checkpoint {path!r}: {_MODEL_DIR}/{_DCP_METADATA} does not read ({type(e).__name__}: {e})"
        ) from None
    storage = metadata.storage_data or {}
    _check_files(path, model_dir, storage)
    if not scan_weights:
        return
    params = {fqn for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    bad = _non_finite(model_dir, storage, {fqn for fqn in params if _is_model_param(fqn)})
    if bad:
        shown = ", ".join(bad[:_NAMES_SHOWN]) + (
            f" and {len(bad) - _NAMES_SHOWN} more" if len(bad) > _NAMES_SHOWN else ""
        )
        raise CheckpointInvalid(
            f"checkpoint {path!r} holds NaN or inf in {len(bad)} parameter(s) ({shown}); "
            "resume from an earlier checkpoint"
        )


def _is_model_param(fqn: str) -> bool:
    """`actor.model.<name>` (or critic): parameters, not `actor.optim.*` optimizer state."""
    parts = fqn.split(".", 2)
    return len(parts) == 3 and parts[1] == "model"


def _check_files(path: str, model_dir: str, storage: dict) -> None:
    """Every shard file the metadata names exists and is long enough for every entry in it."""
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = os.path.join(model_dir, name)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have is None or have < size:
            state = "is missing" if have is None else f"has {have} bytes, its metadata points {size}"
            raise CheckpointInvalid(f"checkpoint {path!r}: shard {_MODEL_DIR}/{name} {state} (a cut-short copy?)")


def _non_finite(model_dir: str, storage: dict, fqns: set[str]) -> list[str]:
    """Names of the parameters in `fqns` with a non-finite value, reading one stored chunk at a time."""
    import torch

    bad: set[str] = set()
    for index, info in sorted(storage.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        if index.fqn not in fqns or index.fqn in bad or getattr(info, "transform_descriptors", None):
            continue
        with open(os.path.join(model_dir, info.relative_path), "rb") as f:
            f.seek(info.offset)
            chunk = f.read(info.length)
        tensor = torch.load(io.BytesIO(chunk), map_location="cpu", weights_only=True)
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad.add(index.fqn)
    return sorted(bad)
