"""The `engine` section: rollout engines: kind, count, size, colocation; --sglang-* passthrough."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.option import option

EMBEDDED_MAX_RUNNING_REQUESTS = 64  # the embedded engine's running batch when --max-running-requests is unset
# The values of SGLang's --kv-cache-dtype (passed as --sglang-kv-cache-dtype) the embedded engine stores: auto (the
# model's dtype) and the two FP8 formats (miles/engines/embedded/kv_cache.py)
EMBEDDED_KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


@dataclass
class EngineConfig:
    """Rollout engines: kind, count, size, colocation; --sglang-* passthrough."""

    engine: Literal["embedded", "sglang"] = option("embedded", "{choices}")
    rollout_num_engines: int = option(1, "number of rollout engines", range="[0, 4096]", unit="engines")
    rollout_num_gpus_per_engine: int = option(1, "GPUs per engine (SGLang tp size)", range="[1, 1024]", unit="GPUs")
    rollout_num_gpus: int | None = option(
        None,
        "total rollout GPUs: sets --rollout-num-engines to this / --rollout-num-gpus-per-engine (with --colocate: the trainer's GPU count)",
        range="[1, inf)",
        unit="GPUs",
    )
    colocate: bool = option(False, "trainer and engines share devices")
    max_running_requests: int | None = option(
        None,
        f"max requests in an engine's running batch (embedded engine: {EMBEDDED_MAX_RUNNING_REQUESTS} when unset; "
        "--engine sglang: SGLang's --max-running-requests, its own default when unset)",
        range="[1, 65536]",
        unit="requests in the embedded engine's running batch",
    )
    max_total_tokens: int | None = option(
        None,
        "KV cache capacity in tokens (embedded engine: room for every running request's prompt and response when "
        "unset; --engine sglang: SGLang's --max-total-tokens)",
        range="[2, inf)",
        unit="KV cache tokens; also bounded by the engine's device memory",
    )
    deterministic: bool = option(
        False,
        "deterministic engine (fixed per-request seeds, batch-invariant ops; --engine sglang: "
        "SGLang's --enable-deterministic-inference)",
    )
    rollout_external_engine_addrs: list[str] = option([], "use already running engines at these URLs", nargs="*")
    api_key: str | None = option(
        None,
        "key every engine wants as 'Authorization: Bearer KEY' (as SGLang's --api-key); default: a fresh random key per run, given to the engines it starts; external engines need this one. Never written to the run's config.yaml",
        secret=True,
    )
    http_max_body_mb: float = option(
        64.0,
        "embedded engine and session server: largest HTTP request body in MiB (413 above); SGLang has no such limit",
        range="(0, inf)",
        unit="MiB; also bounded by host memory",
    )
    sglang_args: dict = option({}, "--sglang-* passthrough flags for sglang.launch_server", cli=False)
