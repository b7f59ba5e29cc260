"""MoE routing replay: where --use-(rollout-)routing-replay cannot act."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig


def check_routing_replay(cfg: MilesConfig) -> list[str]:
    """Where --use-(rollout-)routing-replay cannot act (a dense model is refused once its config is read)."""
    t = cfg.train
    if not t.use_routing_replay:
        return []
    why = "--use-rollout-routing-replay" if t.use_rollout_routing_replay else "--use-routing-replay"
    e = []
    if t.train_backend == "megatron":
        e += [
            f"{why} with {flag}: {reason}; drop one"
            for flag, on, reason in (
                ("--pipeline-model-parallel-size > 1", t.pipeline_model_parallel_size > 1, "replay needs every layer"),
                ("--tensor-model-parallel-size > 1", t.tensor_model_parallel_size > 1, "routers see a sequence shard"),
                ("--gradient-checkpointing", t.gradient_checkpointing, "a recomputed router would not replay"),
            )
            if on
        ]
    if t.true_on_policy_mode:
        e.append(f"{why} with --true-on-policy-mode: the reference forward routes by itself; drop one")
    if not t.use_rollout_routing_replay and cfg.algo.use_rollout_logprobs:
        e.append(
            "--use-routing-replay records routing in the old log-prob forward, which --use-rollout-logprobs skips; "
            "drop --use-rollout-logprobs, or use --use-rollout-routing-replay"
        )
    if cfg.algo.loss_type == "sft_loss":
        e.append(f"{why} replays a rollout's routing; SFT has no rollout: drop it")
    return e
