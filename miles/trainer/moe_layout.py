"""The megatron backend's expert layout checked against a mixture-of-experts model, without torch.

`check_megatron_model` runs in the controller before any worker starts (the controller imports no torch
until then); `mcore_convert` / the backend run the same checks once the model is loaded.
"""

from __future__ import annotations

import json
import os


def check_moe_layout(num_experts: int, *, tp: int, sequence_parallel: bool, ep: int, etp: int) -> None:
    """What megatron-core's MoE layers need of the parallel layout, refused in one line naming the flag."""
    if not num_experts and ep * etp > 1:
        raise ValueError(
            f"--expert-model-parallel-size={ep} / --expert-tensor-parallel-size={etp}: the model is dense (no "
            "experts to split); set both to 1"
        )
    if num_experts and tp > 1 and not sequence_parallel:
        raise ValueError(
            f"--tensor-model-parallel-size={tp} on an MoE model needs --sequence-parallel (megatron-core's MoE "
            "layer trains with tensor parallelism only over sequence-parallel activations); add it"
        )


def check_megatron_model(train, hf_checkpoint: str | None) -> None:
    """Start-up check, before any worker starts, of the megatron expert layout against the model's config.json
    (`train`: the TrainConfig); raises ValueError naming the flag. Nothing to check for FSDP or a Hub id."""
    path = os.path.join(hf_checkpoint or "", "config.json")
    if train.train_backend != "megatron" or not os.path.isfile(path):
        return
    with open(path) as f:
        cfg = json.load(f)
    experts = int(cfg.get("num_experts") or 0) if cfg.get("model_type") == "qwen3_moe" else 0
    ep, etp = train.expert_model_parallel_size, train.expert_tensor_parallel_size
    tp, sp = train.tensor_model_parallel_size, train.sequence_parallel
    check_moe_layout(experts, tp=tp, sequence_parallel=sp, ep=ep, etp=etp)
    if experts:
        check_expert_parallel(experts, ep, int(cfg.get("moe_intermediate_size") or 0), etp)


def check_expert_parallel(num_experts: int, ep_size: int, moe_ffn: int, etp_size: int) -> None:
    if num_experts % ep_size:
        raise ValueError(
            f"--expert-model-parallel-size={ep_size} must divide the model's {num_experts} experts; pick a divisor"
        )
    if moe_ffn % etp_size:
        raise ValueError(
            f"--expert-tensor-parallel-size={etp_size} must divide the experts' width moe_intermediate_size={moe_ffn}"
        )
