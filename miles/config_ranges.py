"""The range of every numeric flag, checked at start-up and listed in docs/config.md.

`NUMBER_RANGES` maps each int and float field (and each list of numbers, element by element) to
its range and what the number means. A range is an interval, `"[" "]"` including and `"(" ")"`
excluding its bound, optionally with single values allowed besides it: `"-1 or [1, inf)"`. Every
float must also be finite. A numeric field without an entry here fails tests/unit's coverage test.

`MACHINE_LIMITS`: sizes bounded by the machine the controller runs on (host memory), refused with
the limit when they cannot fit. Counts the controller materialises in memory every step (samples
of a rollout step) have a fixed ceiling, `MAX_SAMPLES_PER_STEP`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

MAX_SAMPLES_PER_STEP = 2**20  # rollout_batch_size x n_samples_per_prompt (Sample objects held at once)
MAX_GROUP_SIZE = 2**16
_SEED = "[0, 4294967295]"  # numpy's seed range, the narrowest of the generators seeded from it
_PORT = "[0, 65535]"

# field -> (range, what it means)
NUMBER_RANGES: dict[str, tuple[str, str]] = {
    # ---- data and the batch knobs
    "rollout_seed": (_SEED, "a seed"),
    "rollout_max_prompt_len": ("[1, inf)", "tokens"),
    "num_epoch": ("[1, inf)", "passes over the prompt data"),
    "rollout_batch_size": (f"[1, {MAX_SAMPLES_PER_STEP}]", "prompt groups per rollout step"),
    "n_samples_per_prompt": (f"[1, {MAX_GROUP_SIZE}]", "trajectories per prompt"),
    "global_batch_size": (f"[1, {MAX_SAMPLES_PER_STEP}]", "samples per optimizer step"),
    "num_steps_per_rollout": (f"[1, {MAX_SAMPLES_PER_STEP}]", "optimizer steps per rollout step"),
    "num_rollout": ("[0, inf)", "rollout steps"),
    "start_rollout_id": ("[0, inf)", "a step index"),
    "over_sampling_batch_size": (f"[1, {MAX_SAMPLES_PER_STEP}]", "groups submitted per refill"),
    "async_max_concurrent_samples": (f"[1, {MAX_SAMPLES_PER_STEP}]", "trajectories generating at once"),
    "async_data_buffer_capacity_factor": ("(0, 1024]", "a multiple of --rollout-batch-size"),
    "max_weight_staleness": ("[0, inf)", "weight versions"),
    # ---- sampling
    "rollout_temperature": ("[0, inf)", "0 is greedy"),
    "eval_temperature": ("[0, inf)", "0 is greedy"),
    "rollout_top_p": ("(0, 1]", "a probability mass"),
    "eval_top_p": ("(0, 1]", "a probability mass"),
    "rollout_top_k": ("-1 or [1, inf)", "-1 is off"),
    "eval_top_k": ("-1 or [1, inf)", "-1 is off"),
    "rollout_min_p": ("[0, 1]", "a probability"),
    "rollout_max_response_len": ("[1, inf)", "new tokens"),
    "eval_max_response_len": ("[1, inf)", "new tokens"),
    "rollout_max_context_len": ("[2, inf)", "prompt + response tokens"),
    "rollout_stop_token_ids": ("[0, inf)", "token ids"),
    "rollout_max_consecutive_drops": ("[1, inf)", "groups dropped in a row before the run stops"),
    "generate_max_turns": ("[1, 65536]", "model turns of one trajectory"),
    "n_samples_per_eval_prompt": (f"[1, {MAX_GROUP_SIZE}]", "samples per eval prompt"),
    # ---- serving and rewards
    "sglang_server_concurrency": ("[1, 1048576]", "requests in flight per engine"),
    "session_server_port": (_PORT, "a TCP port; 0 picks a free one"),
    "controller_port": (_PORT, "a TCP port; 0 picks a free one"),
    "rm_concurrency": ("[1, 65536]", "remote reward calls in flight"),
    "rm_timeout_s": ("(0, inf)", "seconds"),
    "rm_max_retries": ("[0, 1000]", "retries"),
    "rm_retry_backoff_s": ("[0, 3600]", "seconds"),
    "max_running_requests": ("[1, 65536]", "requests in the embedded engine's running batch"),
    "max_total_tokens": ("[2, inf)", "KV cache tokens; also bounded by the engine's device memory"),
    "http_max_body_mb": ("(0, inf)", "MiB; also bounded by host memory"),
    # ---- objective
    "eps_clip": ("[0, inf)", "the PPO clip range"),
    "eps_clip_high": ("[0, inf)", "the PPO clip range"),
    "eps_clip_c": ("(1, inf)", "the dual-clip constant"),
    "kl_loss_coef": ("[0, inf)", "a coefficient"),
    "kl_coef": ("[0, inf)", "a coefficient"),
    "entropy_coef": ("(-inf, inf)", "a coefficient (negative penalises entropy)"),
    "gamma": ("[0, 1]", "a discount"),
    "lambd": ("[0, 1]", "the GAE lambda"),
    "value_clip": ("[0, inf)", "the value clip range"),
    "tis_clip": ("(0, inf)", "the TIS upper bound"),
    "tis_clip_low": ("[0, inf)", "the TIS lower bound"),
    "opd_kl_coef": ("[0, inf)", "a coefficient"),
    "opd_log_prob_top_k": ("[0, 1024]", "candidate tokens per position (the engines return at most 1024)"),
    # ---- optimizer
    "lr": ("[0, inf)", "a negative learning rate climbs the loss; typical values are 1e-6 to 1e-5"),
    "min_lr": ("[0, inf)", "the floor of the decay schedule"),
    "critic_lr": ("[0, inf)", "the critic's learning rate"),
    "lr_warmup_iters": ("[0, inf)", "optimizer steps"),
    "lr_decay_iters": ("[1, inf)", "optimizer steps"),
    "weight_decay": ("[0, inf)", "AdamW's decoupled decay"),
    "adam_beta1": ("[0, 1)", "a moving-average factor, e.g. 0.9"),
    "adam_beta2": ("[0, 1)", "a moving-average factor, e.g. 0.95"),
    "adam_eps": ("(0, inf)", "e.g. 1e-8"),
    "clip_grad": ("[0, inf)", "the max grad norm; 0 turns clipping off"),
    "seed": (_SEED, "a seed"),
    "num_critic_only_steps": ("[0, inf)", "steps"),
    # ---- layout
    "micro_batch_size": (f"[1, {MAX_SAMPLES_PER_STEP}]", "samples"),
    "max_tokens_per_gpu": ("[1, inf)", "tokens"),
    "actor_num_nodes": ("[1, 4096]", "nodes"),
    "actor_num_gpus_per_node": ("[1, 1024]", "ranks per node"),
    "tensor_model_parallel_size": ("[1, 1024]", "ranks"),
    "pipeline_model_parallel_size": ("[1, 1024]", "stages"),
    "expert_model_parallel_size": ("[1, 1024]", "ranks"),
    "expert_tensor_parallel_size": ("[1, 1024]", "ranks"),
    "context_parallel_size": ("[1, 1024]", "ranks"),
    "rollout_num_engines": ("[0, 4096]", "engines"),
    "rollout_num_gpus_per_engine": ("[1, 1024]", "GPUs"),
    "rollout_num_gpus": ("[1, inf)", "GPUs"),
    "eval_num_engines": ("[0, 4096]", "engines"),
    "num_nodes": ("[1, 4096]", "nodes"),
    "num_gpus_per_node": ("[0, 1024]", "GPUs; 0 is a CPU plan"),
    # ---- checkpoints, weights, cadence
    "save_interval": ("[1, inf)", "rollout steps"),
    "max_checkpoints": ("[1, inf)", "complete checkpoints kept under --save; leave it unset to keep all"),
    "lora_rank": ("[0, 65536]", "0 trains every parameter"),
    "lora_alpha": ("[1, inf)", "the adapter's scale numerator"),
    "lora_dropout": ("[0, 1)", "a probability"),
    "update_weight_buffer_size": ("[1, inf)", "bytes; also bounded by host memory"),
    "offload_train_disk_chunk_mb": ("[1, 65536]", "MiB per host-to-disk copy and optimizer bucket"),
    "update_weights_interval": ("[1, inf)", "rollout steps"),
    "weight_sync_timeout_s": ("(0, inf)", "seconds"),
    "eval_interval": ("[0, inf)", "rollout steps; 0 is off"),
    "eval_max_in_flight": ("[1, 1024]", "outstanding evaluations"),
    # ---- runtime
    "heartbeat_interval_s": ("(0, 3600]", "seconds"),
    "heartbeat_timeout_s": ("(0, inf)", "seconds"),
    "rpc_timeout_s": ("(0, inf)", "seconds"),
    "profile_steps": ("[0, inf)", "step indices"),
}


# ranges stated here but checked, with a fuller message, where the value is used
CHECKED_ELSEWHERE = frozenset({"eps_clip_c", "num_nodes"})  # check_algo; placement (resolve_machine)


def in_range(value: float, spec: str) -> bool:
    """Whether `value` lies in `spec` ("[a, b)" intervals and single values joined by " or ")."""
    if isinstance(value, float) and not math.isfinite(value):
        return False
    for part in spec.split(" or "):
        part = part.strip()
        if part[0] in "[(":
            low, high = (float(x) for x in part[1:-1].split(","))
            above = value > low if part[0] == "(" else value >= low
            below = value < high if part[-1] == ")" else value <= high
            if above and below:
                return True
        elif value == float(part):
            return True
    return False


def _host_memory_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


# field -> (its value in bytes, given the field's value) for the sizes bounded by host memory
MACHINE_LIMITS: dict[str, Callable[[float], float]] = {
    "update_weight_buffer_size": lambda v: v,  # the trainer stages one bucket in host memory
    "http_max_body_mb": lambda v: v * 2**20,  # a request body is held whole before parsing
}


def machine_errors(values: dict[str, float | None], flag: Callable[[str], str]) -> list[str]:
    """One line per size in `values` that cannot fit this host's memory, naming the limit."""
    total = _host_memory_bytes()
    errors = []
    for name, to_bytes in MACHINE_LIMITS.items():
        value = values.get(name)
        if value is not None and to_bytes(value) > total:
            errors.append(
                f"{flag(name)}={value:g} needs {to_bytes(value) / 2**30:.1f} GiB, more than this host's "
                f"{total / 2**30:.1f} GiB of memory; give a smaller size"
            )
    return errors


def ranged(kind: type, spec: str) -> Callable[[str], float]:
    """An argparse `type` for the serving commands' numeric flags: `kind` within `spec`, else a usage error."""
    import argparse

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not in_range(value, spec):
            raise argparse.ArgumentTypeError(f"{text} is outside {spec}")
        return value

    return parse
