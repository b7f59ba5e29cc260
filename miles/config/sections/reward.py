"""The `reward` section: built-in, remote and custom rewards."""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.option import option


@dataclass
class RewardConfig:
    """Built-in, remote and custom rewards."""

    rm_type: str | None = option(None, "built-in reward: math, gsm8k, deepscaler, f1, exact, remote_rm, boxed_* ...")
    rm_url: str | None = option(None, "URL of the remote reward model")
    reward_key: str | None = option(None, "key selecting the scalar when a reward is a dict")
    custom_rm_path: str | None = option(None, "import path of a custom reward fn(args, sample)")
    group_rm: bool = option(False, "score whole groups with --custom-rm-path called on a list")
    group_reward_path: str | None = option(
        None, "import path of fn(args, samples)->list[float] seeing the whole group"
    )
    rm_concurrency: int = option(
        64, "max concurrent remote reward calls", range="[1, 65536]", unit="remote reward calls in flight"
    )
    rm_timeout_s: float = option(30.0, "timeout of one remote reward call", range="(0, inf)", unit="seconds")
    rm_max_retries: int = option(
        3,
        "retries of a failing remote reward call before the sample is marked failed",
        range="[0, 1000]",
        unit="retries",
    )
    rm_retry_backoff_s: float = option(
        0.5,
        "first wait before retrying a failing remote reward call (doubles each retry)",
        range="[0, 3600]",
        unit="seconds",
    )
