"""The embedded engine's KV cache is sized from the run (context limit x the requests one step sends),
never from the model's own context length."""

from __future__ import annotations

from miles.config import load_config
from miles.controller.placement import plan_placement

BASE = "--hf-checkpoint /m --prompt-data /p.jsonl --rm-type math --num-rollout 2 --colocate"


def engine_kwargs(flags: str, role: str = "rollout") -> dict:
    cfg = load_config([*BASE.split(), *flags.split()])
    plan = plan_placement(cfg, device="cuda", num_nodes=1, gpus_per_node=1, master_port=29500)
    (spec,) = [s for s in plan.specs if s.role == role]
    return spec.init_kwargs


def test_kv_cache_is_context_limit_times_one_steps_requests() -> None:
    kw = engine_kwargs(
        "--rollout-batch-size 32 --n-samples-per-prompt 8 --max-running-requests 1024 "
        "--rollout-max-context-len 1536 --rollout-max-response-len 1024"
    )
    assert kw["max_running_requests"] == 256  # 32 x 8: a step never runs more at once
    assert kw["max_total_tokens"] == 256 * 1536
    assert kw["max_total_tokens"] // kw["max_running_requests"] == 1536  # per-request context = the run's limit


def test_fewer_slots_than_the_batch_and_explicit_capacity_are_kept() -> None:
    kw = engine_kwargs("--rollout-batch-size 32 --n-samples-per-prompt 8 --max-running-requests 64 "
                       "--rollout-max-response-len 512 --rollout-max-prompt-len 300")  # fmt: skip
    assert (kw["max_running_requests"], kw["max_total_tokens"]) == (64, 64 * (300 + 512))
    kw = engine_kwargs(
        "--rollout-batch-size 4 --n-samples-per-prompt 2 --max-running-requests 64 --max-total-tokens 4096"
    )
    assert (kw["max_running_requests"], kw["max_total_tokens"]) == (64, 4096)  # the user's own sizing
