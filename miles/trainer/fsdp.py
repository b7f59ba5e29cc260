"""FSDP2 trainer backend (`--train-backend fsdp`).

Every decoder layer and then the root module are wrapped with `fully_shard`; parameters are
kept in fp32 (the optimizer's master copy) and, on GPU, gathered in bf16 for compute with fp32
gradient reduction. A single rank in full precision keeps the model a plain module. Losses arrive already divided by step-wide denominators, so gradients are
*summed* over data-parallel ranks (FSDP's divide factor set to 1), which makes a DP run equal
to one process training on the concatenated batch.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from miles.config import AlgoConfig, ModelConfig, RolloutConfig, TrainConfig
from miles.errors import NonFiniteTraining
from miles.rollout.train_data import TrainBatch
from miles.trainer import checkpoint as ckpt
from miles.trainer.backend import MicroBatchLoss, register_backend
from miles.trainer.checkpoint_async import BackgroundWriter
from miles.trainer.forward import dummy_batch, forward_micro_batch, model_layout, response_values, token_index
from miles.trainer.fsdp_build import ModelBuilder
from miles.trainer.fsdp_shard import clip_sharded_grad_norm
from miles.trainer.hf_io import resolve_compute_dtype, source_dtype, trainer_attention, write_hf_dir
from miles.trainer.lora import adapter_tensors, export_lora_hf, lora_settings
from miles.trainer.lr_schedule import LRScheduler
from miles.trainer.offload import DiskOffloader, HostOffloader, module_onloaded, module_tensors, optimizer_tensors
from miles.trainer.offload_optim import OffloadedAdamW
from miles.trainer.packing import layout_for, pack_sequences, plan_micro_batches
from miles.trainer.routing_replay import RoutingReplay, replay_scope
from miles.trainer.train_loop import run_rl_step
from miles.utils.moe_names import per_expert_tensors

logger = logging.getLogger(__name__)


def _all_reduce(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


@register_backend("fsdp")
class FSDPBackend:
    def __init__(self, *, model: ModelConfig, train: TrainConfig, algo: AlgoConfig, rollout: RolloutConfig) -> None:
        self.model_cfg, self.train_cfg, self.algo, self.rollout = model, train, algo, rollout
        self.weight_version = 0
        self.actor: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: LRScheduler | None = None
        self.ref: nn.Module | None = None
        self.critic: nn.Module | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self.critic_scheduler: LRScheduler | None = None
        self._offloaders: dict[str, HostOffloader | DiskOffloader] = {}
        self._saver: BackgroundWriter | None = None  # --async-save (default): set up with the device
        self.lora = lora_settings(train)  # None: every policy parameter trains
        self.replay: RoutingReplay | None = None

    # ---- setup ------------------------------------------------------------------------------------
    @property
    def needs_ref(self) -> bool:
        return self.algo.use_kl_loss or self.algo.kl_coef != 0.0

    @property
    def needs_critic(self) -> bool:
        return self.algo.advantage_estimator == "ppo"

    @property
    def has_ref(self) -> bool:
        return self.ref is not None

    @property
    def has_critic(self) -> bool:
        return self.critic is not None

    def setup(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; the trainer worker must call init_process_group first"
            )
        if not self.model_cfg.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required: the FSDP backend loads the policy from a HF directory")
        # The process group decides: NCCL -> this rank's GPU, gloo -> CPU (also on a GPU host).
        on_gpu = torch.cuda.is_available() and dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.dp_size, self.dp_rank = dist.get_world_size(), dist.get_rank()
        self.dp_group = dist.group.WORLD
        self.mesh = init_device_mesh(self.device.type, (self.dp_size,))
        if self.train_cfg.async_save is not False:
            self._saver = BackgroundWriter(self.device)
        torch.manual_seed(self.train_cfg.seed)
        self.compute_dtype = resolve_compute_dtype(self.model_cfg.dtype, self.device.type)
        self.true_on_policy = self.train_cfg.true_on_policy_mode
        self.attn_impl = trainer_attention(self.device, self.compute_dtype, self.model_cfg, self.train_cfg)
        self.build = ModelBuilder(
            self.model_cfg, self.train_cfg, self.lora, self.mesh, self.device, self.compute_dtype, self.attn_impl
        )
        self.actor, self.optimizer, self.scheduler = self.build.trainable(
            self.model_cfg.hf_checkpoint, self.train_cfg.lr
        )
        self.replay = (  # --use-(rollout-)routing-replay: the actor's MoE routers replay (routing_replay.py)
            RoutingReplay(self.actor, mode="rollout" if self.train_cfg.use_rollout_routing_replay else "self")
            if self.train_cfg.use_routing_replay
            else None
        )
        if self.needs_ref:
            self.ref = self.build.frozen(self.model_cfg.ref_load or self.model_cfg.hf_checkpoint)
        if self.needs_critic:
            path = self.model_cfg.critic_load or self.model_cfg.hf_checkpoint
            lr = self.train_cfg.critic_lr if self.train_cfg.critic_lr is not None else self.train_cfg.lr
            self.critic, self.critic_optimizer, self.critic_scheduler = self.build.trainable(path, lr, critic=True)
        logger.info(
            "FSDP backend ready: dp=%d device=%s compute=%s attn=%s ref=%s critic=%s",
            self.dp_size,
            self.device,
            self.compute_dtype,
            self.attn_impl,
            self.ref is not None,
            self.critic is not None,
        )

    # ---- forward-only -----------------------------------------------------------------------------
    def _schedule(self, batch: TrainBatch) -> list[list[int] | None]:
        """Micro-batches of `batch`, padded with None (dummy passes) to the max count over ranks."""
        t = self.train_cfg
        mbs: list[list[int] | None] = list(
            plan_micro_batches(
                batch.seq_lens,
                micro_batch_size=t.micro_batch_size,
                use_dynamic_batch_size=t.use_dynamic_batch_size,
                max_tokens_per_gpu=t.max_tokens_per_gpu,
                layout=layout_for(self.attn_impl),
            )
        )
        n_max = int(_all_reduce([len(mbs)], self.device, dist.ReduceOp.MAX)[0])
        return mbs + [None] * (n_max - len(mbs))

    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, which: str = "actor") -> tuple[np.ndarray, np.ndarray]:
        model = {"actor": self.actor, "ref": self.ref}.get(which)
        if model is None:
            raise ValueError(
                f"compute_log_probs(which={which!r}): no such model here (actor, or ref when a KL term is on)"
            )
        was_training = model.training
        model.eval()
        n_tok = int(batch.response_lengths.sum())
        log_probs, entropy = np.zeros(n_tok, np.float32), np.zeros(n_tok, np.float32)
        replay = self.replay if which == "actor" else None
        with self._onloaded(which):
            for idx in self._schedule(batch):
                sub = batch.select(idx) if idx is not None else dummy_batch()
                with replay_scope(replay, sub if idx is not None else None, model_layout(model), first_pass=True):
                    lp, ent, _ = forward_micro_batch(
                        model,
                        sub,
                        self.device,
                        self.rollout.rollout_temperature,
                        compiled=self.train_cfg.compile,
                        true_on_policy=self.true_on_policy,
                    )
                if idx is not None:
                    pos = token_index(batch.response_lengths, idx)
                    log_probs[pos], entropy[pos] = lp.cpu().numpy(), ent.cpu().numpy()
        model.train(was_training)
        if replay is not None:
            replay.end_pass(first_pass=True)
        return log_probs, entropy

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> np.ndarray:
        values = np.zeros(int(batch.response_lengths.sum()), np.float32)
        self.critic.eval()
        for idx in self._schedule(batch):
            sub = batch.select(idx) if idx is not None else dummy_batch()
            v = response_values(self.critic, pack_sequences(sub, model_layout(self.critic)).to(self.device))
            if idx is not None:
                values[token_index(batch.response_lengths, idx)] = v.cpu().numpy()
        self.critic.train()
        return values

    def _onloaded(self, which: str) -> contextlib.AbstractContextManager[None]:
        """The ref model lives on host between uses once `offload_ref()` was called."""
        off = self._offloaders.get("ref") if which == "ref" else None
        return module_onloaded(off, self.ref, before_offload=lambda: self._reshard_all(self.ref))

    def offload_ref(self) -> None:
        """Keep the frozen reference model on host; it is brought back only for its forward."""
        if self.ref is not None and "ref" not in self._offloaders:
            self._reshard_all(self.ref)
            self._offloaders["ref"] = self._new_offloader("ref")
            self._offloaders["ref"].offload(module_tensors(self.ref))

    # ---- training ---------------------------------------------------------------------------------
    def train(self, batch: TrainBatch, rollout_id: int) -> dict[str, float]:
        if self.replay is None:
            return run_rl_step(self, batch, rollout_id)
        self.replay.begin_step()
        metrics = run_rl_step(self, batch, rollout_id)
        return {**metrics, **self.replay.metrics(self.device, self.dp_group)}

    def _trainable(self, critic: bool) -> tuple[nn.Module, torch.optim.Optimizer, LRScheduler]:
        if critic:
            return self.critic, self.critic_optimizer, self.critic_scheduler
        return self.actor, self.optimizer, self.scheduler

    def forward_backward(
        self, step_batch: TrainBatch, loss_fn: MicroBatchLoss, *, critic: bool, entropy: str
    ) -> dict[str, torch.Tensor]:
        model = self._trainable(critic)[0]
        sums: dict[str, torch.Tensor] = {}
        for idx in self._schedule(step_batch):
            sub = step_batch.select(idx) if idx is not None else dummy_batch()
            if critic:
                out, ent = response_values(model, pack_sequences(sub, model_layout(model)).to(self.device)), None
            else:
                real = sub if idx is not None else None
                with replay_scope(self.replay, real, model_layout(model), first_pass=False):
                    out, ent, _ = forward_micro_batch(
                        model,
                        sub,
                        self.device,
                        self.rollout.rollout_temperature,
                        entropy=entropy,
                        compiled=self.train_cfg.compile,
                        true_on_policy=self.true_on_policy,
                    )
            if idx is None:
                # Matches the other ranks' collectives; contributes exactly zero to loss and gradients.
                (out.sum() * 0.0).backward()
                continue
            loss, parts = loss_fn(idx, out, ent)
            loss.backward()
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v.detach().double()
        if self.replay is not None and not critic:
            self.replay.end_pass(first_pass=True)  # a fused old-log-prob step measured here
        return sums

    def clip_grad_norm(self, *, critic: bool) -> float:
        model, optimizer, _ = self._trainable(critic)
        grads = optimizer.grad_tensors() if isinstance(optimizer, OffloadedAdamW) else None
        return clip_sharded_grad_norm(model, self.train_cfg.clip_grad, self.device, grads)

    def optimizer_step(self, *, critic: bool) -> None:
        _, optimizer, scheduler = self._trainable(critic)
        if self._saver is not None:
            self._saver.fence()  # the checkpoint's snapshot is copied before the step changes the weights
            if self._saver.references_live_state:
                self._saver.wait_local()  # the checkpoint being written reads this host state: let it finish first
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    def zero_grad(self, *, critic: bool) -> None:
        self._trainable(critic)[1].zero_grad(set_to_none=True)

    def current_lr(self) -> float:
        return self.scheduler.current_lr

    # ---- weights out --------------------------------------------------------------------------------
    def named_hf_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        if self.lora is not None:  # the engines keep the base; only the adapter moves
            yield from adapter_tensors(self.actor, dtype)
            return
        for name, p in self.actor.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            # fused 3-D MoE experts travel under their per-expert checkpoint names (what engines load)
            yield from per_expert_tensors(name, (full.to(dtype) if dtype is not None else full).detach())

    def export_hf(self, path: str) -> None:
        cfg = self.actor.config
        dtype = source_dtype(self.model_cfg.hf_checkpoint)
        if self.lora is not None:  # the merged model, plain HF; the adapter itself in PATH/adapter
            export_lora_hf(
                path,
                self.actor,
                self.lora,
                dtype=dtype,
                source_dir=self.model_cfg.hf_checkpoint,
                write=self.dp_rank == 0,
            )
        else:
            tensors = [(n, t.cpu()) for n, t in self.named_hf_tensors(dtype)]
            if self.dp_rank == 0:
                write_hf_dir(path, tensors, config=cfg, source_dir=self.model_cfg.hf_checkpoint)
        dist.barrier()

    # ---- checkpoints ----------------------------------------------------------------------------------
    def _ckpt_models(self) -> dict:
        models = {"actor": (self.actor, self.optimizer)}
        if self.critic is not None:
            models["critic"] = (self.critic, self.critic_optimizer)
        return models

    def save(self, path: str, extra_state: dict) -> None:
        self._refuse_non_finite_weights(path)
        meta = {
            "extra_state": extra_state,
            "weight_version": self.weight_version,
            "lr_schedule": self.scheduler.state_dict(),
            "critic_lr_schedule": self.critic_scheduler.state_dict() if self.critic_scheduler else None,
        }
        ckpt.save_checkpoint(
            path,
            self._ckpt_models(),
            meta,
            save_optim=not self.train_cfg.no_save_optim,
            trainable_only=self.lora is not None,
            background=self._saver,
        )

    def finish_saves(self) -> None:
        """Collective: the checkpoint written in the background (if any) is complete, or its failure is raised."""
        if self._saver is not None:
            self._saver.wait()

    def finish_saves_local(self) -> None:
        """This rank's background write is done (on the way out; no collective)."""
        if self._saver is not None:
            self._saver.wait_local()

    def _refuse_non_finite_weights(self, path: str) -> None:
        """No checkpoint of NaN or inf weights: every rank checks its shards, and all agree before raising."""
        named = [
            (f"{key}.{name}", p._local_tensor if isinstance(p, DTensor) else p)
            for key, (model, _) in self._ckpt_models().items()
            for name, p in model.named_parameters()
        ]
        named = [(n, t) for n, t in named if t.numel()]
        finite = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist() if named else []  # one sync
        local_bad = [n for (n, _), ok in zip(named, finite, strict=True) if not ok]
        total_bad = int(_all_reduce([float(len(local_bad))], self.device)[0])
        if total_bad:
            raise NonFiniteTraining(
                f"refusing to save {path}: {total_bad} parameter shard(s) hold NaN or inf "
                f"(on this rank: {local_bad[:3]}); the last complete checkpoint is kept"
            )

    def load(self, path: str) -> dict:
        self.finish_saves()
        resolved = ckpt.resolve_load_path(path)
        if resolved is None:
            raise FileNotFoundError(
                f"no complete checkpoint under {path!r} (looked for iter_*/{ckpt.COMPLETE_MARKER})"
            )
        meta = ckpt.load_checkpoint(resolved, self._ckpt_models(), trainable_only=self.lora is not None)
        self.scheduler.load_state_dict(meta["lr_schedule"])
        if self.critic_scheduler and meta.get("critic_lr_schedule"):
            self.critic_scheduler.load_state_dict(meta["critic_lr_schedule"])
        return meta.get("extra_state", {})

    # ---- offload ------------------------------------------------------------------------------------
    @staticmethod
    def _reshard_all(model: nn.Module) -> None:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def offload(self) -> None:
        """Weights, gradients and optimizer states of actor (and critic) to host memory.

        The frozen reference model moves to host as well and from then on is brought back only
        for its own forward pass (`compute_log_probs(which="ref")`).
        """
        self.offload_ref()
        if self._saver is not None:
            self._saver.fence()  # a checkpoint's snapshot is copied before the weights' memory is freed
        for key, model, optim in (
            ("actor", self.actor, self.optimizer),
            ("critic", self.critic, self.critic_optimizer),
        ):
            if model is None:
                continue
            self._reshard_all(model)
            if key not in self._offloaders:
                self._offloaders[key] = self._new_offloader(key)
            off = self._offloaders[key]
            off.offload([*module_tensors(model), *optimizer_tensors(optim)])

    def _new_offloader(self, name: str) -> HostOffloader | DiskOffloader:
        """Host memory, or files under --offload-train-disk-dir with --offload-train-target disk."""
        t = self.train_cfg
        if t.offload_train_target == "disk":
            return DiskOffloader(name, t.offload_train_disk_dir, t.offload_train_disk_chunk_mb * 2**20)
        return HostOffloader(name)

    def onload(self) -> None:
        for key in ("actor", "critic"):
            if key in self._offloaders and self._offloaders[key].is_offloaded:
                self._offloaders[key].onload()

    def memory_plan(self) -> dict | None:
        """Whether this rank trains without offloading beside its colocated engine (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        from miles.trainer.memory_plan import activation_bytes, micro_batch_tokens, pending_state_bytes, plan

        t = self.train_cfg
        tokens = micro_batch_tokens(t, self.rollout)
        models = [(m, o) for m, o in ((self.actor, self.optimizer), (self.critic, self.critic_optimizer)) if m]
        pending = sum(pending_state_bytes(m, o) for m, o in models)
        acts = activation_bytes(self.actor.config, tokens, checkpointing=t.gradient_checkpointing)
        return plan(self.device, pending, acts, tokens).to_dict()

    # ---- metrics helpers ---------------------------------------------------------------------------
    def peak_mem_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB

    @staticmethod
    def now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()
