"""Engine side of every weight transport, one method per SGLang-style endpoint.

The HTTP front routes `/init_weights_update_group`, `/update_weights_from_distributed`,
`/update_weights_from_tensor`, `/update_weights_from_disk`, `/pull_weights`,
`/update_weight_version`, `/weights_checker` and the LoRA endpoints (`/load_lora_adapter_from_distributed`,
`/load_lora_adapter_from_tensors`, `/unload_lora_adapter`) here, and the embedded engine's front also the
miles-only `/miles/export_weight_buffer` and `/miles/install_weight_buffer` (direct colocated updates). Blocking work (rendezvous, receiving a
bucket, patching a disk-delta copy) runs in a thread so the engine's event loop keeps serving
other requests, and each group receives its buckets one at a time in arrival order.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Protocol

import torch

from miles.weights import verify
from miles.weights.disk_delta import DeltaRefusedError, LocalCheckpoint, adopt_base, is_full_version, pull_version
from miles.weights.groups import SyncGroup, create_sync_group, dtype_from_name
from miles.weights.tensor_ipc import open_payload

logger = logging.getLogger(__name__)

# pull_weights(target_version=MATERIALISE_BASE): write the engine's startup weights as the host copy.
MATERIALISE_BASE = -1
SGLANG_GROUP_NAME = "weight_update_group"  # SGLang's default group_name when a payload names none


class WeightTarget(Protocol):
    """What the receiver needs from an engine (EmbeddedEngine implements it)."""

    weight_version: int

    def load_weights(self, named: Any) -> None: ...
    def named_weights(self) -> Any: ...
    def flush_cache(self) -> bool: ...


class WeightReceiver:
    def __init__(self, engine: WeightTarget, *, timeout_s: float = 300.0, device: str | None = None) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self._device = device
        self._groups: dict[str, SyncGroup] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._joining: dict[str, asyncio.Event] = {}
        self._snapshot: dict[str, torch.Tensor] = {}

    # -- process groups -----------------------------------------------------------------------

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = SGLANG_GROUP_NAME,
        backend: str = "gloo",
        **_: Any,
    ) -> None:
        """Join as rank `rank_offset` (one device: the embedded engine's whole TP group, as SGLang's rank
        `rank_offset + tp_rank` with tp_size 1)."""
        if group_name in self._groups:
            await self.destroy_weights_update_group(group_name)
        # A sender may post its first bucket as soon as the rendezvous completes, before this
        # handler resumes; _group() waits on this event instead of refusing the bucket.
        joined = self._joining[group_name] = asyncio.Event()
        try:
            group = await asyncio.to_thread(
                create_sync_group,
                backend,
                master_address,
                int(master_port),
                int(world_size),
                int(rank_offset),
                group_name,
                self.timeout_s,
            )
            self._groups[group_name] = group
            self._locks[group_name] = asyncio.Lock()
        finally:
            joined.set()
            self._joining.pop(group_name, None)

    async def destroy_weights_update_group(self, group_name: str = SGLANG_GROUP_NAME, **_: Any) -> None:
        group = self._groups.pop(group_name, None)
        self._locks.pop(group_name, None)
        if group is not None:
            group.destroy()

    async def _group(self, group_name: str) -> SyncGroup:
        joining = self._joining.get(group_name)
        if joining is not None:
            await asyncio.wait_for(joining.wait(), self.timeout_s)
        group = self._groups.get(group_name)
        if group is None:
            raise ValueError(
                f"no weight-update group {group_name!r} on this engine (have {sorted(self._groups)}); "
                "call /init_weights_update_group first"
            )
        return group

    # -- transports ----------------------------------------------------------------------------

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = SGLANG_GROUP_NAME,
        weight_version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
        **_: Any,
    ) -> None:
        """Receive one bucket: one broadcast per tensor from group rank 0, as SGLang receives it."""
        if load_format is not None:
            raise ValueError(
                f"update_weights_from_distributed load_format={load_format!r} is not supported by the embedded "
                "engine (one broadcast per tensor); send load_format null"
            )
        named = await self._receive(names, dtypes, shapes, group_name)
        self.engine.load_weights(named)
        self._finish(weight_version, flush_cache)

    async def _receive(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str
    ) -> list[tuple[str, torch.Tensor]]:
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        group = await self._group(group_name)
        buffers = [
            torch.empty(s, dtype=dtype_from_name(d), device=group.device) for d, s in zip(dtypes, shapes, strict=True)
        ]

        def receive() -> None:
            for name, work in zip(names, group.broadcast(buffers, 0), strict=True):
                group.wait(work, f"receiving {name!r}")

        async with self._locks[group_name]:
            await asyncio.to_thread(receive)
        return list(zip(names, buffers, strict=True))

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        **_: Any,
    ) -> None:
        """SGLang's payload: one entry per TP rank (the embedded engine is TP rank 0), each the base64 pickle of
        [(name, tensor), ...] (see colocated.py)."""
        if not serialized_named_tensors:
            raise ValueError("serialized_named_tensors is empty")
        if load_format is not None:
            raise ValueError(
                f"update_weights_from_tensor load_format={load_format!r} is not supported by the embedded engine; "
                "send load_format null with [(name, tensor), ...] per TP rank"
            )
        with open_payload(serialized_named_tensors[0]) as named:
            self.engine.load_weights(named)
            if named and named[0][1].is_cuda:
                # Every copy out of the trainer's buffer is done (on whichever stream the engine used)
                # before the mapping is dropped and the trainer is told it may reuse the memory.
                torch.cuda.synchronize(named[0][1].device)
        self._finish(weight_version, flush_cache)

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        load_format: str | None = None,
        **_: Any,
    ) -> None:
        local = LocalCheckpoint(model_path)
        if local.exists():
            held = local.read_index()["version"]
            if weight_version is not None and _parse_version(weight_version) != held:
                # Never label old weights with a new version: a refused pull leaves the copy behind.
                raise ValueError(
                    f"the disk-delta copy at {model_path} holds v{held}, not v{weight_version}; "
                    "pull_weights must accept that version before the engine reloads it"
                )
            named = await asyncio.to_thread(lambda: list(local.iter_tensors()))
        else:
            named = await asyncio.to_thread(_read_safetensors_dir, Path(model_path))
        self.engine.load_weights(named)
        self._finish(weight_version, flush_cache=True)

    async def pull_weights(
        self, local_checkpoint_dir: str, source_dir: str, target_version: int, digest: str = "xxh3-128", **_: Any
    ) -> dict:
        """Disk-delta: bring this host's copy to `target_version` (patch + verify); does not reload the engine.

        Answers `{"version": v}` with the version the copy now holds. A version this host cannot apply
        (wrong base, missing or corrupt file, digest failure) is refused without changing anything:
        `{"success": False, "refused": True, "message": why, "version": the version still held}`, so
        the trainer learns what this host holds and can publish something it can apply next.
        """
        local = LocalCheckpoint(local_checkpoint_dir)
        target_version = int(target_version)
        if target_version == MATERIALISE_BASE:
            if local.exists():
                return {"version": local.read_index()["version"], "materialised": False}
            named = [(n, t.detach().cpu().clone()) for n, t in self.engine.named_weights()]
            await asyncio.to_thread(local.materialise, named, MATERIALISE_BASE, digest)
            return {"version": MATERIALISE_BASE, "materialised": True}
        try:
            at_start = local.exists() and local.read_index()["version"] == MATERIALISE_BASE
            # A host still at its startup weights adopts the base, unless this version is a full re-base.
            if at_start and not is_full_version(source_dir, target_version):
                return await asyncio.to_thread(adopt_base, local, source_dir, target_version)
            return await asyncio.to_thread(pull_version, local, source_dir, target_version)
        except DeltaRefusedError as exc:
            held = local.read_index()["version"] if local.exists() else None
            logger.warning("refused disk-delta v%d (this host keeps v%s): %s", target_version, held, exc)
            return {"success": False, "refused": True, "message": str(exc), "version": held}

    # -- LoRA adapters (SGLang's endpoints; the embedded engine merges the adapter, see engines/embedded/lora.py) --

    async def load_lora_adapter_from_distributed(
        self,
        lora_name: str,
        config_dict: dict,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "miles",
        weight_version: str | None = None,
        **_: Any,
    ) -> None:
        """The whole adapter in one call: its tensors arrive by broadcast from rank 0 of the group."""
        load = self._adapter_method("load_lora_adapter")
        named = await self._receive(names, dtypes, shapes, group_name)
        load(named, config_dict, lora_name)
        self._finish(weight_version, flush_cache=False)

    async def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict,
        serialized_tensors: str,
        weight_version: str | None = None,
        **_: Any,
    ) -> None:
        """The whole adapter handed over on the same device (the colocated payload of colocated.py)."""
        load = self._adapter_method("load_lora_adapter")
        with open_payload(serialized_tensors) as named:
            load(named, config_dict, lora_name)
            if named and named[0][1].is_cuda:
                torch.cuda.synchronize(named[0][1].device)  # copied out before the trainer may reuse the buffer
        self._finish(weight_version, flush_cache=False)

    async def unload_lora_adapter(self, lora_name: str, **_: Any) -> None:
        self._adapter_method("unload_lora_adapter")(lora_name)

    def _adapter_method(self, method: str) -> Any:
        fn = getattr(self.engine, method, None)
        if fn is None:
            raise ValueError(f"{type(self.engine).__name__} serves no LoRA adapters ({method})")
        return fn

    # -- direct colocated updates (miles-only endpoints; see colocated_direct.py) ---------------

    async def export_weight_buffer(self, generation: int | None = None, for_mapping: bool = False, **_: Any) -> dict:
        """The engine's shared weight buffer: handle (on CUDA only `for_mapping`: the caller will open it),
        generation, and each HF name's offset/shape/stride/dtype (only `{generation, unchanged: true}` when the
        caller already maps the current `generation`)."""
        known = None if generation is None else int(generation)
        return self._direct("export_weight_buffer")(known, for_mapping=bool(for_mapping))

    async def install_weight_buffer(
        self, generation: int, weight_version: str | None = None, ready_event: str | None = None, **_: Any
    ) -> None:
        """The trainer wrote into buffer `generation` (its copies end at `ready_event` on CUDA): drop stale
        KV and take the version."""
        self._direct("install_weight_buffer")(
            int(generation), _parse_version(weight_version or self.engine.weight_version), ready_event
        )

    def _direct(self, method: str) -> Any:
        fn = getattr(self.engine, method, None)
        if fn is None:
            raise ValueError(
                f"{type(self.engine).__name__} has no shared weight buffer ({method}); "
                "use the per-bucket colocated handoff"
            )
        return fn

    async def update_weight_version(self, new_version: str, **_: Any) -> None:
        self.engine.weight_version = _parse_version(new_version)

    # -- verification --------------------------------------------------------------------------

    async def weights_checker(self, action: str, **kw: Any) -> dict:
        """fill_noise(seed) | snapshot | compare(digests, digest, skip_tensor_list) | compare(sketches,
        skip_tensor_list): within quantization error | compare(atol) vs the snapshot."""
        named = list(self.engine.named_weights())
        if action == "fill_noise":
            return {"filled": verify.fill_noise(named, int(kw.get("seed", 1234)))}
        if action == "snapshot":
            self._snapshot = {n: t.detach().cpu().clone() for n, t in named}
            return {"tensors": len(self._snapshot)}
        if action == "compare":
            skip = kw.get("skip_tensor_list") or []
            if kw.get("sketches") is not None:  # --check-weight-update-allow-quant-error
                dequantized = getattr(self.engine, "dequantized_weights", None)
                values = dequantized() if dequantized else ((n, t, None) for n, t in named)
                return await asyncio.to_thread(verify.compare_with_sketches, values, kw["sketches"], skip)
            if kw.get("digests") is not None:
                algo = kw.get("digest", "xxh3-128")
                return await asyncio.to_thread(verify.compare_with_digests, named, kw["digests"], algo, skip)
            if not self._snapshot:
                raise ValueError("weights_checker compare: pass digests, or take a snapshot first")
            return verify.compare_with_snapshot(named, self._snapshot, float(kw.get("atol", 0.0)))
        raise ValueError(f"weights_checker action={action!r}; use fill_noise, snapshot or compare")

    def _finish(self, weight_version: str | None, flush_cache: bool) -> None:
        if flush_cache:
            self.engine.flush_cache()
        if weight_version is not None:
            self.engine.weight_version = _parse_version(weight_version)

    async def close(self) -> None:
        for name in list(self._groups):
            await self.destroy_weights_update_group(name)


def _parse_version(v: str | int) -> int:
    try:
        return int(v)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"weight_version={v!r} is not an integer") from exc


def _read_safetensors_dir(path: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds neither a miles disk-delta copy (index.json) nor *.safetensors files")
    named: list[tuple[str, torch.Tensor]] = []
    for f in files:
        named.extend(load_file(str(f)).items())
    return named
