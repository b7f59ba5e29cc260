"""AdamW with its state off the GPU: `--offload-optimizer-states`, `--stream-optimizer-state-to-disk`,
`--optimizer-cpu-offload`.

`OffloadedAdamW` is a `torch.optim.Optimizer` over the model's own parameters, so checkpoints (DCP's
`get_state_dict`) name its state by the parameters' names as for torch's AdamW. Its state is allocated
at construction, in one flat buffer per kind, and lives where the placement says:

- `host`  the two moments in host memory (page-locked on CUDA); the step streams them through the
          parameters' device bucket by bucket and writes them back, running torch's own AdamW kernel
          (`torch.optim.adamw.adamw`, same fused/foreach flags) on each bucket. AdamW is elementwise,
          so the result is bit-identical to resident moments.
- `disk`  the same, with the moments in files under a directory (memory-mapped), in fp32 (bit-identical
          to resident) or bf16 (half the bytes; the moments are rounded to bf16 after every step).
- `cpu`   the fp32 master weights and the moments in host memory, and the step on the CPU (torch's
          fused CPU AdamW). The model's parameters stay on the device in the compute dtype; gradients
          are accumulated in fp32 on the device (one buffer per parameter, filled by a hook after each
          backward) and copied to host bucket by bucket at the step, the updated masters copied back.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw

logger = logging.getLogger(__name__)

PLACEMENTS = ("host", "disk", "cpu")
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def pin_host(t: torch.Tensor) -> torch.Tensor:
    """Page-lock a host tensor in place (cudaHostRegister: no power-of-two rounding, unlike pin_memory())."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return t
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(rc) != 0:
        logger.warning("could not page-lock %.1f GiB of host memory (%s): copies run slower", t.nbytes / 2**30, rc)
    else:  # unlocked before the memory goes back to the allocator
        weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


class _FlatStore:
    """One flat host tensor per state kind; per-parameter views into it. `disk`: memory-mapped files."""

    def __init__(self, numels: list[int], dtype: torch.dtype, kinds: tuple[str, ...], disk_dir: str | None) -> None:
        total = sum(numels)
        self.dir = tempfile.mkdtemp(prefix="optim-", dir=disk_dir) if disk_dir else None
        if self.dir:  # the files go when this store does (and with the process, at the latest)
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.flat: dict[str, torch.Tensor] = {}
        for kind in kinds:
            if self.dir:
                path = os.path.join(self.dir, f"{kind}.bin")
                flat = torch.from_file(path, shared=True, size=total, dtype=dtype)
            else:
                flat = pin_host(torch.zeros(total, dtype=dtype))
            self.flat[kind] = flat
        self.offsets = offsets = [0]  # parameter i's elements: [offsets[i], offsets[i + 1]) of each flat tensor
        for n in numels:
            offsets.append(offsets[-1] + n)
        self.views = {
            kind: [flat[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
            for kind, flat in self.flat.items()
        }


def _wait(device: torch.device) -> None:
    """The host waits for the device's queued work (its copies into host memory)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _buckets(numels: list[int], bucket_numel: int) -> list[list[int]]:
    """Consecutive parameter indices, at most `bucket_numel` elements a bucket (a larger tensor: alone)."""
    out: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(numels):
        if out[-1] and size + n > bucket_numel:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return [b for b in out if b]


class OffloadedAdamW(torch.optim.Optimizer):
    """torch's AdamW (decoupled weight decay) with its state in host memory or on disk; see the module doc."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        placement: str,
        kernel: dict[str, bool],
        moment_dtype: torch.dtype = torch.float32,
        disk_dir: str | None = None,
        bucket_bytes: int = 256 * 2**20,
    ) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r}: use one of {', '.join(PLACEMENTS)}")
        if placement == "disk" and not disk_dir:
            raise ValueError("placement='disk' needs disk_dir (--offload-train-disk-dir)")
        super().__init__(list(params), dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.placement = placement
        self.kernel = {"fused": True} if placement == "cpu" else dict(kernel)
        self.moment_dtype = moment_dtype
        self._params = [p for g in self.param_groups for p in g["params"]]
        numels = [_local(p).numel() for p in self._params]
        self._buckets = _buckets(numels, max(1, bucket_bytes // 4))
        kinds = ("exp_avg", "exp_avg_sq") + (("master",) if placement == "cpu" else ())
        store_dtype = moment_dtype if placement == "disk" else torch.float32
        self._store = _FlatStore(numels, store_dtype, kinds, disk_dir if placement == "disk" else None)
        if placement == "cpu":
            self._store = self._with_fp32_masters(self._store)
        self._main_grads: list[torch.Tensor | None] = [None] * len(self._params)
        self._hooks = [self._hook_main_grad(i, p) for i, p in enumerate(self._params)] if placement == "cpu" else []
        step_device = lambda p: _local(p).device if self.kernel.get("fused") and placement != "cpu" else "cpu"  # noqa: E731
        for i, p in enumerate(self._params):
            state = self.state[p]
            state["step"] = torch.zeros((), dtype=torch.float32, device=step_device(p))
            for kind in kinds:
                state[kind] = self._store.views[kind][i].view(_local(p).shape)
        largest = max(sum(numels[i] for i in b) for b in self._buckets)
        self._staging = pin_host(torch.empty(largest if placement == "cpu" else 0, dtype=torch.float32))
        # disk: a bucket's moments pass between the mapped files and the device through page-locked buffers, one
        # contiguous copy per kind (the files' pages cannot be page-locked: they may be more than the host holds)
        self._io = {k: pin_host(torch.empty(largest, dtype=store_dtype)) for k in kinds} if placement == "disk" else {}

    def _with_fp32_masters(self, store: _FlatStore) -> _FlatStore:
        with torch.no_grad():
            for i, p in enumerate(self._params):
                store.views["master"][i].copy_(_local(p).detach().reshape(-1))
        return store

    # ---- gradients ----------------------------------------------------------------------------------
    def _hook_main_grad(self, i: int, p: torch.nn.Parameter):
        """`cpu`: each backward's gradient is added to an fp32 buffer on the device, then dropped."""

        def hook(param: torch.Tensor) -> None:
            g = param.grad
            if self._main_grads[i] is None:
                self._main_grads[i] = g.detach().to(torch.float32, copy=True)
            else:
                self._main_grads[i].add_(g)
            param.grad = None

        return p.register_post_accumulate_grad_hook(hook)

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradients the next step applies (for the global-norm clip): fp32 buffers under `cpu`."""
        if self.placement == "cpu":
            return [g for g in self._main_grads if g is not None]
        return [_local(p.grad) for p in self._params if p.grad is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._main_grads = [None] * len(self._params)

    def device_tensors(self) -> list[torch.Tensor]:
        """State on the parameters' device (for the colocated offload): none, it lives off the device."""
        return []

    # ---- the step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("OffloadedAdamW.step takes no closure")
        group = self.param_groups[0]
        hyper = dict(
            amsgrad=False,
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        for bucket in self._buckets:
            if self.placement == "cpu":
                self._step_on_cpu(bucket, hyper)
            else:
                self._step_streamed(bucket, hyper)
        if self.placement == "host" and self._params:
            _wait(_local(self._params[0]).device)  # the moments' copies back to host memory have landed

    def _step_streamed(self, bucket: list[int], hyper: dict) -> None:
        """A bucket's moments to the device in one copy per kind (fp32 there), torch's AdamW, moments back.

        The bucket's parameters are consecutive, so its moments are one slice of each flat store."""
        idx = [i for i in bucket if self._params[i].grad is not None]
        if not idx:
            return
        lo, hi = self._store.offsets[bucket[0]], self._store.offsets[bucket[-1] + 1]
        device = _local(self._params[idx[0]]).device
        moments = {kind: self._moments_in(kind, lo, hi, device) for kind in ("exp_avg", "exp_avg_sq")}

        def views(flat: torch.Tensor) -> list[torch.Tensor]:
            o = self._store.offsets
            return [flat[o[i] - lo : o[i + 1] - lo].view(_local(self._params[i]).shape) for i in idx]

        params = [_local(self._params[i]) for i in idx]
        grads = [_local(self._params[i].grad) for i in idx]
        steps = [self.state[self._params[i]]["step"] for i in idx]
        adamw(params, grads, views(moments["exp_avg"]), views(moments["exp_avg_sq"]), [], steps,
              **self.kernel, **hyper)  # fmt: skip
        for kind, flat in moments.items():
            self._moments_out(kind, lo, hi, flat)

    def _moments_in(self, kind: str, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        src = self._store.flat[kind][lo:hi]
        if kind in self._io:  # disk: the mapped file's slice into the page-locked buffer first
            stage = self._io[kind][: hi - lo]
            stage.copy_(src)
            src = stage
        return src.to(device, non_blocking=True).to(torch.float32)  # cast on the device

    def _moments_out(self, kind: str, lo: int, hi: int, flat: torch.Tensor) -> None:
        dst = self._store.flat[kind][lo:hi]
        if kind in self._io:  # cast on the device, one copy into the page-locked buffer, then into the file
            stage = self._io[kind][: hi - lo]
            if flat is not stage:
                stage.copy_(flat.to(stage.dtype), non_blocking=True)
                _wait(flat.device)
            dst.copy_(stage)
        elif flat is not dst:  # host: page-locked already; step() waits for these copies at its end
            dst.copy_(flat, non_blocking=True)

    def _step_on_cpu(self, bucket: list[int], hyper: dict) -> None:
        """Gradients of one bucket to host, torch's fused CPU AdamW on the masters, masters back."""
        idx = [i for i in bucket if self._main_grads[i] is not None]
        if not idx:
            return
        grads, offset = [], 0
        for i in idx:
            g = self._main_grads[i]
            host = self._staging[offset : offset + g.numel()].view(g.shape)
            host.copy_(g, non_blocking=True)
            grads.append(host)
            offset += g.numel()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        states = [self.state[self._params[i]] for i in idx]
        masters = [s["master"] for s in states]
        adamw(masters, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
              [s["step"] for s in states], **self.kernel, **hyper)  # fmt: skip
        for i, m in zip(idx, masters, strict=True):
            _local(self._params[i]).copy_(m)
            self._main_grads[i] = None  # applied: the device buffer goes now, not at zero_grad

    # ---- checkpoints --------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a saved state into the existing buffers (they stay where they live), by parameter order."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"saved optimizer has {len(saved_groups)} param groups, this one {len(self.param_groups)}"
            )
        ids = [pid for g in saved_groups for pid in g["params"]]
        if len(ids) != len(self._params):
            raise ValueError(f"saved optimizer holds {len(ids)} parameters, this one {len(self._params)}")
        with torch.no_grad():
            for pid, p in zip(ids, self._params, strict=True):
                saved = state_dict["state"].get(pid, {})
                for key, value in saved.items():
                    if key in self.state[p]:
                        self.state[p][key].copy_(value)
                if "master" in self.state[p] and "master" not in saved:
                    self.state[p]["master"].copy_(_local(p).reshape(self.state[p]["master"].shape))
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})


def optimizer_placement(train) -> str | None:
    """The placement the memory flags of `train` (a TrainConfig) ask for; None: torch's resident AdamW."""
    if train.optimizer_cpu_offload:
        return "cpu"
    if train.offload_optimizer_states:
        return "host"
    if train.stream_optimizer_state_to_disk:
        return "disk"
    return None


def build_adamw(
    params: Iterable[torch.nn.Parameter], train, lr: float, kernel: dict[str, bool]
) -> torch.optim.Optimizer:
    """torch's AdamW, or `OffloadedAdamW` where the memory flags of `train` (a TrainConfig) ask for it."""
    hyper = dict(
        lr=lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps, weight_decay=train.weight_decay
    )
    placement = optimizer_placement(train)
    if placement is None:
        return torch.optim.AdamW(params, **hyper, **kernel)
    optimizer = OffloadedAdamW(
        params,
        **hyper,
        placement=placement,
        kernel=kernel,
        moment_dtype=MOMENT_DTYPES[train.stream_optimizer_state_moment_dtype],
        disk_dir=train.offload_train_disk_dir,
        bucket_bytes=train.offload_train_disk_chunk_mb * 2**20,
    )
    logger.info("optimizer state placed on %s (%d buckets)", placement, len(optimizer._buckets))
    return optimizer
