"""The FSDP trainer's models, built (`--train-backend fsdp`).

A `ModelBuilder` holds what every model of one run shares: the device mesh, the compute dtype and its
mixed-precision policy, the attention kernel, and the flags that make the policy's forward compute as the
engine's does (`--fp32-residual-connection`, `--fp8-format`). From a HF checkpoint it builds the trainable
policy or critic (LoRA, gradient checkpointing, sharding, the optimizer where `--optimizer-cpu-offload`
puts it, the LR schedule) and the frozen reference.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from miles.config import ModelConfig, TrainConfig
from miles.trainer.fp8_forward import use_fp8_forward
from miles.trainer.fsdp_shard import adamw_kernels, cast_parameters, shard_model
from miles.trainer.hf_io import load_causal_lm, load_value_model
from miles.trainer.lora import LoraSettings, apply_lora, trainable_parameters, use_merged_forward
from miles.trainer.lr_schedule import LRSchedule, LRScheduler
from miles.trainer.offload_optim import build_adamw, optimizer_placement
from miles.trainer.residual_stream import keep_fp32_residual
from miles.utils.timer import PhaseClock

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelBuilder:
    model_cfg: ModelConfig
    train_cfg: TrainConfig
    lora: LoraSettings | None  # None: every policy parameter trains
    mesh: DeviceMesh
    device: torch.device
    compute_dtype: torch.dtype
    attn_impl: str

    def __post_init__(self) -> None:
        if self.train_cfg.compile and (self.fp32_residual or self.train_cfg.fp8_format):
            # compiled blocks round where the eager ops (and the engine) round, instead of fusing the casts away:
            # on CPU that took the stream's train/rollout gap from 1.3e-3 back to 4e-5
            import torch._inductor.config as inductor_config

            inductor_config.emulate_precision_casts = True

    @property
    def fp32_residual(self) -> bool:
        """--fp32-residual-connection where it changes anything: a compute dtype below fp32."""
        return self.train_cfg.fp32_residual_connection and self.compute_dtype != torch.float32

    @property
    def mp_policy(self) -> MixedPrecisionPolicy | None:
        """Parameters gathered in the compute dtype, gradients reduced in fp32; with the fp32 stream the blocks
        take their inputs as they come (FSDP would cast the stream down). None in full precision."""
        if self.compute_dtype == torch.float32:
            return None
        return MixedPrecisionPolicy(
            param_dtype=self.compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=not self.fp32_residual
        )

    def load(self, path: str, critic: bool = False) -> nn.Module:
        """The HF model at `path`; the policy and its reference score as the engine does, where asked."""
        load = load_value_model if critic else load_causal_lm
        model = load(path, attn_implementation=self.attn_impl, trust_remote_code=self.model_cfg.trust_remote_code)
        if not critic:
            if self.fp32_residual:
                keep_fp32_residual(model, self.compute_dtype)
            if self.train_cfg.fp8_format is not None:
                use_fp8_forward(model, self.train_cfg.fp8_recipe)
        return model

    def trainable(
        self, path: str, lr: float, critic: bool = False
    ) -> tuple[nn.Module, torch.optim.Optimizer, LRScheduler]:
        """The sharded model in train mode, its AdamW and its LR schedule."""
        clock = PhaseClock()
        model = self.load(path, critic)
        clock.mark("checkpoint")
        if self.lora is not None and not critic:
            apply_lora(model, self.lora)  # in place: only the adapter trains
            if self.train_cfg.lora_merged_forward:
                use_merged_forward(model)
        t = self.train_cfg
        if t.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        placement = optimizer_placement(t)
        if placement == "cpu":  # the optimizer copies the fp32 masters before the weights drop to compute dtype
            optimizer = build_adamw(trainable_parameters(model), t, lr, {})
            cast_parameters(shard_model(model, self.mesh, None, compile_blocks=t.compile), self.compute_dtype)
        else:
            reshard = True if placement else None
            shard_model(model, self.mesh, self.mp_policy, compile_blocks=t.compile, reshard_after_forward=reshard)
            optimizer = build_adamw(trainable_parameters(model), t, lr, adamw_kernels(model, self.device))
        model.train()
        clock.mark("shard+optimizer")
        logger.info("%s built in %s", "critic" if critic else "actor", clock.summary())
        schedule = LRSchedule(
            lr=lr,
            min_lr=t.min_lr,
            warmup_iters=t.lr_warmup_iters,
            decay_style=t.lr_decay_style,
            decay_iters=t.lr_decay_iters,
        )
        return model, optimizer, LRScheduler(optimizer, schedule)

    def frozen(self, path: str) -> nn.Module:
        """The sharded model in eval mode, without gradients (the reference policy)."""
        model = self.load(path)
        model.requires_grad_(False)
        shard_model(model, self.mesh, self.mp_policy)
        return model.eval()
