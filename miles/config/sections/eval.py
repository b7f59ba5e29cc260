"""The `eval` section: evaluation data, cadence and sampling overrides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.option import MAX_GROUP_SIZE, option


@dataclass
class EvalConfig:
    """Evaluation data, cadence and sampling overrides."""

    eval_interval: int | None = option(
        None, "evaluate every N steps", range="[0, inf)", unit="rollout steps; 0 is off"
    )
    eval_prompt_data: list[str] = option([], "name path [name path ...] (JSONL or parquet)", nargs="*")
    n_samples_per_eval_prompt: int = option(
        1, "samples per eval prompt", range=f"[1, {MAX_GROUP_SIZE}]", unit="samples per eval prompt"
    )
    eval_temperature: float | None = option(
        None, "eval sampling temperature (default rollout's)", range="[0, inf)", unit="0 is greedy"
    )
    eval_top_p: float | None = option(None, "eval top-p", range="(0, 1]", unit="a probability mass")
    eval_top_k: int | None = option(None, "eval top-k", range="-1 or [1, inf)", unit="-1 is off")
    eval_max_response_len: int | None = option(None, "eval max new tokens", range="[1, inf)", unit="new tokens")
    skip_eval_before_train: bool = option(False, "no eval at step 0")
    eval_mode: Literal["shared", "dedicated", "external"] = option(
        "shared", "{choices}", notes={"external": "fully async"}
    )
    eval_num_engines: int = option(0, "dedicated eval engines", range="[0, 4096]", unit="engines")
    eval_external_command: str | None = option(None, "external eval command, given a checkpoint directory")
    eval_max_in_flight: int = option(
        2, "outstanding async evals before new ones are skipped", range="[1, 1024]", unit="outstanding evaluations"
    )
