"""Checkpoint loading that never runs code from the checkpoint.

torch.distributed.checkpoint reads its `.metadata` file with plain `pickle.load`, and non-tensor
entries (optimizer steps, hyper-parameters) with `torch.load(weights_only=False)`: a checkpoint from
someone else could run any code at `--load`. Here the metadata goes through an unpickler that only
builds DCP's own metadata records, torch sizes, dtypes and layouts and paths, and byte entries
through `torch.load(weights_only=True)` (tensors and plain containers). A checkpoint that needs
anything else is refused with the name of what it asked for.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a layout by name
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointError(ValueError):
    """The checkpoint's metadata asks to build an object that a checkpoint has no need for."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata asks for {module}.{name}, which a checkpoint does not need; "
            "refusing to load it (load only checkpoints you or your runs wrote)"
        )


def read_safe_metadata(path: str) -> Metadata:
    """A DCP `.metadata` file read with the restricted unpickler; UnsafeCheckpointError if it is anything else."""
    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}: not checkpoint metadata ({type(metadata).__name__})")
    return metadata


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path}: not checkpoint metadata ({type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"checkpoint entry {read_item.dest_index.fqn!r} is not plain data (tensors, numbers, "
                f"strings, containers): {e}"
            ) from None
        value = io.BytesIO()
        torch.save(obj, value)
        value.seek(0)
        super().load_bytes(read_item, value)
