"""The megatron backend's model-parallel flags: only under --train-backend megatron, and only what it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig


def check_parallelism(cfg: MilesConfig) -> list[str]:
    """Megatron's model-parallel flags: only under --train-backend megatron, and only what it runs."""
    t, a = cfg.train, cfg.algo
    tp, pp, cp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size, t.context_parallel_size
    ep, etp = t.expert_model_parallel_size, t.expert_tensor_parallel_size
    if t.train_backend != "megatron":
        set_flags = [
            f
            for f, on in (
                ("--tensor-model-parallel-size", tp != 1),
                ("--pipeline-model-parallel-size", pp != 1),
                ("--context-parallel-size", cp != 1),
                ("--sequence-parallel", t.sequence_parallel),
                ("--expert-model-parallel-size", ep != 1),
                ("--expert-tensor-parallel-size", etp != 1),
            )
            if on
        ]
        return (
            [
                f"{', '.join(set_flags)} need --train-backend megatron (FSDP shards data-parallel only); "
                "add --train-backend megatron or drop them"
            ]
            if set_flags
            else []
        )
    e = []
    if min(tp, pp, cp) < 1 or cfg.trainer_world_size % (tp * pp * cp):
        e.append(
            f"--tensor-model-parallel-size={tp} x --pipeline-model-parallel-size={pp} x --context-parallel-size={cp} "
            f"must divide the {cfg.trainer_world_size} trainer GPUs (--actor-num-nodes x --actor-num-gpus-per-node); "
            "change one of them"
        )
    e += _expert_parallelism(cfg.trainer_world_size, pp, ep, etp)
    if cp != 1:
        e.append(
            f"--context-parallel-size={cp}: context parallelism needs Transformer Engine's attention, which the "
            "megatron backend does not use; set it to 1"
        )
    if t.sequence_parallel and tp == 1:
        e.append(
            "--sequence-parallel shards activations over tensor-parallel ranks and needs "
            "--tensor-model-parallel-size > 1; drop it or raise the TP size"
        )
    if a.advantage_estimator == "ppo":
        e.append(
            "--advantage-estimator ppo needs a critic, which the megatron backend does not train; "
            "use --train-backend fsdp for PPO"
        )
    if cfg.model.dtype == "float16" or cfg.model.dtype == "fp16":
        e.append("--dtype float16 needs a loss scaler, which the megatron backend does not run; use bfloat16")
    if t.compile:
        e.append("--compile compiles the HF model's blocks, which the megatron backend does not train; drop it")
    if t.attn_implementation != "auto":
        e.append(
            f"--attn-implementation {t.attn_implementation} picks the FSDP trainer's HF attention; the megatron "
            "backend runs megatron-core's own: drop it"
        )
    return e


def _expert_parallelism(world: int, pp: int, ep: int, etp: int) -> list[str]:
    """Megatron's MoE layout: expert ranks (EP x expert-TP) tile each pipeline stage's ranks; the expert count and
    width are checked against the model once its config is read (moe_layout.check_megatron_model)."""
    if min(ep, etp) < 1 or world % pp or (world // pp) % (ep * etp):
        return [
            f"--expert-model-parallel-size={ep} x --expert-tensor-parallel-size={etp} must divide the "
            f"{world // max(pp, 1)} trainer GPUs of each pipeline stage; change one of them"
        ]
    return []
