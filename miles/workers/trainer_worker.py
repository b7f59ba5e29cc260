"""A trainer rank: one process of the training world, owning a TrainBackend and the sending side of weight sync."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from miles.config import (
    GPU_AUTO_DTYPE,
    AlgoConfig,
    ModelConfig,
    RolloutConfig,
    TrainConfig,
    WeightsConfig,
    engine_dtype,
)
from miles.rollout.train_data import TrainBatch
from miles.utils.cuda_cache import give_back_cached_memory
from miles.utils.gc_freeze import freeze_heap
from miles.utils.profiling import WorkerProfiler, nvtx_range
from miles.utils.timer import PhaseClock, seconds_since_launch
from miles.wire.ports import free_port
from miles.workers.base import Worker

logger = logging.getLogger(__name__)


def push_dtype(dtype: str | None, device: str) -> torch.dtype | None:
    """The dtype weights travel to the engines in: the one they compute in (`engine_dtype`: --sglang-dtype,
    else --dtype; auto: bf16 on GPU, and on CPU the fp32 master as it is, None)."""
    if dtype not in (None, "auto"):
        return getattr(torch, dtype)
    return None if device == "cpu" else getattr(torch, GPU_AUTO_DTYPE)


def _all_gather_object(obj: Any) -> list[Any]:
    """Every trainer rank's `obj`, by rank (the colocated path exchanges its per-GPU payloads this way)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class TrainerWorker(Worker):
    stop_timeout_s = 900.0  # a checkpoint being written in the background (tens of GB) is let finish

    def __init__(self, ctx, *, sections: dict[str, dict[str, Any]], device: str = "cpu"):
        super().__init__(ctx)
        self.model_cfg = ModelConfig(**sections["model"])
        self.train_cfg = TrainConfig(**sections["train"])
        self.algo_cfg = AlgoConfig(**sections["algo"])
        self.rollout_cfg = RolloutConfig(**sections["rollout"])
        self.weights_cfg = WeightsConfig(**sections["weights"])
        engine = sections.get("engine", {})
        self.engine_api_key = engine.get("api_key")  # the run's key, for the weight updaters
        self.engine_dtype = engine_dtype(self.model_cfg.dtype, engine.get("sglang_args") or {})
        self.device = device
        self.backend = None
        self.updater = None
        self._flops_shape = None  # set at setup on CUDA (miles.trainer.flops)
        self._peak_flops: float | None = None
        self.profiler = WorkerProfiler(f"{ctx.role}_{ctx.rank}")
        self._setup_result: dict[str, Any] | None = None
        self._setup_error: BaseException | None = None
        self._froze_after_first_step = False

    # ---- lifecycle -------------------------------------------------------------------
    def warm_up(self) -> None:
        """Set up at once, on the thread the calls run on (torch.cuda.set_device is per thread): the model,
        FSDP and the optimizer are built while the controller reads the data and the engines load."""
        try:
            self.setup()
        except BaseException as e:  # noqa: BLE001 - kept for the controller's `setup` call, which raises it
            self._setup_error = e
            raise
        import miles.engines.client  # noqa: F401 - what connect_engines imports, off the critical path too
        import miles.weights.registry  # noqa: F401

    def setup(self) -> dict[str, Any]:
        """Join the training world (env set by the runtime) and build the backend, once: a second call
        (the controller's, after warm_up did it) returns the first one's result or raises its error."""
        if self._setup_error is not None:
            raise self._setup_error
        if self._setup_result is None:
            self._setup_result = self._setup()
        return self._setup_result

    def _setup(self) -> dict[str, Any]:
        started, clock = seconds_since_launch(), PhaseClock()
        torch.set_num_threads(max(1, int(os.environ.get("MILES_TORCH_THREADS", "1"))))
        if self.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device == "cuda" else "gloo")
        clock.mark("process group")
        from miles.trainer.backend import create_backend

        self.backend = create_backend(
            self.train_cfg.train_backend,
            model=self.model_cfg,
            train=self.train_cfg,
            algo=self.algo_cfg,
            rollout=self.rollout_cfg,
        )
        clock.mark("backend import")
        self.backend.setup()
        clock.mark("model and optimizer")
        if self.device == "cuda":  # what perf/train/mfu needs: the model's shape and the GPU's peak rate
            from miles.trainer.flops import model_shape, peak_flops

            self._flops_shape = model_shape(self.model_cfg.hf_checkpoint)
            self._peak_flops = peak_flops(torch.device("cuda", torch.cuda.current_device()))
        logger.info("trainer set up in %s, from %.1f s after its process started", clock.summary(), started)
        freeze_heap("trainer set up")
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}

    # ---- training --------------------------------------------------------------------
    def train(self, batch: dict[str, np.ndarray], rollout_id: int) -> dict[str, float]:
        shard = TrainBatch.from_dict(batch)
        with nvtx_range(f"train/{rollout_id}"):
            metrics = self.backend.train(shard, rollout_id)
        metrics.update(self._mfu(shard, metrics.get("perf/train/update_time", 0.0)))
        if not self._froze_after_first_step:  # what the first step built for good (compiled graphs, optimizer state)
            self._froze_after_first_step = True
            freeze_heap("trainer after its first step")
        return metrics

    def _mfu(self, shard: TrainBatch, update_s: float) -> dict[str, float]:
        """`perf/train/mfu`: this rank's shard over its update time, on the GPUs of one data-parallel replica
        (tensor / pipeline peers share the shard's FLOPs); absent off CUDA or on a GPU without a known peak."""
        from miles.trainer.flops import train_flops, update_mfu

        if self._flops_shape is None or self._peak_flops is None:
            return {}
        gpus_per_replica = max(1, dist.get_world_size() // self.backend.dp_size)
        # the trainer computes logits for the positions that predict a response token only
        flops = train_flops(shard.seq_lens, self._flops_shape, head_rows=shard.response_lengths)
        mfu = update_mfu(flops, update_s, self._peak_flops, gpus_per_replica)
        return {} if mfu is None else {"perf/train/mfu": mfu}

    def compute_log_probs(self, batch: dict[str, np.ndarray], which: str = "actor") -> dict[str, np.ndarray]:
        logp, ent = self.backend.compute_log_probs(TrainBatch.from_dict(batch), which)
        return {"log_probs": logp, "entropy": ent}

    # ---- weights ---------------------------------------------------------------------
    def connect_engines(
        self,
        engine_urls: list[str],
        *,
        colocated: bool = False,
        master_address: str | None = None,
        keep_weight_mapping: bool = True,
    ) -> dict[str, Any]:
        from miles.engines.client import EngineClient
        from miles.trainer.lora import lora_settings
        from miles.weights.registry import make_updater

        if master_address is None:  # the weight-sync group's rendezvous lives on this (source) rank's host
            multi_node = int(os.environ.get("MILES_NUM_NODES", "1")) > 1
            master_address = socket.gethostbyname(socket.gethostname()) if multi_node else "127.0.0.1"
        engines = [EngineClient(u, api_key=self.engine_api_key) for u in engine_urls]
        lora = lora_settings(self.train_cfg)  # LoRA: only the adapter moves; the engines keep their base
        self.updater = make_updater(
            self.weights_cfg,
            colocate=colocated,
            keep_mapping=keep_weight_mapping,
            lora_config=lora.engine_config() if lora else None,
        )
        # every trainer rank must agree on the weight-sync group's port (p2p has several senders)
        port = [free_port(master_address) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(port, src=0)
        self.updater.connect(
            engines,
            trainer_rank=dist.get_rank(),
            trainer_world_size=dist.get_world_size(),
            master_address=master_address,
            master_port=port[0],
            barrier=dist.barrier,
            all_gather=_all_gather_object,
        )
        return {"mode": self.updater.mode}

    def push_weights(self, version: int) -> dict[str, float]:
        from miles.utils.peak_memory import phase_peak

        start = time.perf_counter()
        dtype = push_dtype(self.engine_dtype, self.device)
        peaks: dict[str, float] = {}
        with nvtx_range(f"push_weights/{version}"), phase_peak(self.device, "update_weights", peaks):
            metrics = self.updater.update(self.backend.named_hf_tensors(dtype), version) or {}
        metrics.update(peaks)
        self.backend.weight_version = version
        metrics["perf/update_weights_time"] = time.perf_counter() - start
        metrics["perf/update_weights_bytes"] = metrics.get("weight_sync/bytes", 0.0)  # what this update moved
        return metrics

    def close_weights(self) -> None:
        if self.updater is not None:
            self.updater.close()

    # ---- state -----------------------------------------------------------------------
    def save(self, path: str, extra_state: dict[str, Any]) -> None:
        self.backend.save(path, extra_state)

    def finish_saves(self) -> None:
        """Collective: the checkpoint written in the background (--async-save) is complete."""
        self.backend.finish_saves()

    def load(self, path: str) -> dict[str, Any]:
        return self.backend.load(path)

    def export_hf(self, path: str) -> None:
        self.backend.export_hf(path)

    def offload(self) -> None:
        self.backend.offload()

    def onload(self) -> None:
        self.backend.onload()

    def release_cached_memory(self) -> dict[str, float]:
        """Give the allocator's cached, unused device memory back to the driver: a colocated engine is about
        to take its memory back, and what training left cached (up to a micro-batch's activations) would
        otherwise stay this process's, as would cuBLAS's workspaces. The GiB given back and the GiB still
        reserved."""
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return {"released_gb": 0.0, "reserved_gb": 0.0}
        before = torch.cuda.memory_reserved()
        give_back_cached_memory()
        after = torch.cuda.memory_reserved()
        return {"released_gb": (before - after) / 2**30, "reserved_gb": after / 2**30}

    def memory_plan(self) -> dict | None:
        """The backend's estimate of whether it trains beside its colocated engine without offload."""
        plan = getattr(self.backend, "memory_plan", None)
        return plan() if plan is not None else None

    # ---- profiling (runs on the same thread as train, so torch.profiler sees its ops) -------
    def start_profile(self, trace_dir: str, py_spy: bool = False) -> dict[str, str | None]:
        return self.profiler.start(trace_dir, py_spy=py_spy)

    def stop_profile(self) -> dict[str, str | None]:
        return self.profiler.stop()

    async def on_stop(self) -> None:
        # a SIGTERM lets a checkpoint being written in the background finish (it gets its COMPLETE marker)
        wait_local = getattr(self.backend, "finish_saves_local", None)
        if wait_local is not None:
            await asyncio.to_thread(wait_local)
        if dist.is_initialized():
            dist.destroy_process_group()
