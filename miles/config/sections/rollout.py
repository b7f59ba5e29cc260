"""The `rollout` section: the batch knobs, sampling, filters, rollout plug-ins and the session server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.option import MAX_GROUP_SIZE, MAX_SAMPLES_PER_STEP, PORT_RANGE, option


@dataclass
class RolloutConfig:
    """The batch knobs, sampling, filters, rollout plug-ins and the session server."""

    rollout_batch_size: int | None = option(
        None,
        "prompt groups per rollout step",
        range=f"[1, {MAX_SAMPLES_PER_STEP}]",
        unit="prompt groups per rollout step",
    )
    n_samples_per_prompt: int = option(
        1, "trajectories per prompt (group size)", range=f"[1, {MAX_GROUP_SIZE}]", unit="trajectories per prompt"
    )
    global_batch_size: int | None = option(
        None, "samples per optimizer step", range=f"[1, {MAX_SAMPLES_PER_STEP}]", unit="samples per optimizer step"
    )
    num_steps_per_rollout: int | None = option(
        None,
        "optimizer steps per rollout step",
        range=f"[1, {MAX_SAMPLES_PER_STEP}]",
        unit="optimizer steps per rollout step",
    )
    num_rollout: int | None = option(None, "number of rollout steps", range="[0, inf)", unit="rollout steps")
    start_rollout_id: int | None = option(
        None, "first step (default: from checkpoint or 0)", range="[0, inf)", unit="a step index"
    )
    rollout_temperature: float = option(1.0, "sampling temperature", range="[0, inf)", unit="0 is greedy")
    rollout_top_p: float = option(1.0, "nucleus sampling p", range="(0, 1]", unit="a probability mass")
    rollout_top_k: int = option(-1, "top-k (-1: off)", range="-1 or [1, inf)", unit="-1 is off")
    rollout_min_p: float = option(0.0, "min-p (0: off)", range="[0, 1]", unit="a probability")
    rollout_max_response_len: int = option(256, "max new tokens per response", range="[1, inf)", unit="new tokens")
    rollout_max_context_len: int | None = option(
        None, "cap prompt + response length", range="[2, inf)", unit="prompt + response tokens"
    )
    rollout_stop: list[str] = option([], "stop strings", nargs="*")
    rollout_stop_token_ids: list[int] = option([], "stop token ids", nargs="*", range="[0, inf)", unit="token ids")
    rollout_skip_special_tokens: bool = option(False, "skip special tokens when decoding")
    over_sampling_batch_size: int | None = option(
        None,
        "groups submitted per refill (default: rollout_batch_size)",
        range=f"[1, {MAX_SAMPLES_PER_STEP}]",
        unit="groups submitted per refill",
    )
    dynamic_sampling_filter_path: str | None = option(
        None, "import path of a group filter (e.g. miles.rollout.filters.check_reward_nonzero_std)"
    )
    rollout_max_consecutive_drops: int | None = option(
        None,
        "stop the run after this many dropped groups in a row: reward failed, aborted or filtered (default: 16 x over_sampling_batch_size)",
        range="[1, inf)",
        unit="groups dropped in a row before the run stops",
    )
    rollout_submission_granularity: Literal["group", "sample"] | None = option(
        None, "{choices} (default: group in sync, sample in fully async)"
    )
    rollout_function_path: str | None = option(
        None,
        "import path of a rollout class or function replacing the whole rollout (its own tasks, groups, rewards); see docs/agentic.md",
    )
    custom_generate_function_path: str | None = option(
        None,
        "import path of async generate(args, sample, sampling_params) -> Sample | list[Sample], replacing generation and token recording",
    )
    custom_agent_function_path: str | None = option(
        None,
        "import path of async agent(base_url, prompt, request_kwargs, metadata, **kw) talking to the session server (needs --use-session-server)",
    )
    generate_max_turns: int = option(
        16,
        "most model turns of one multi-turn trajectory (generate functions and agent sessions)",
        range="[1, 65536]",
        unit="model turns of one trajectory",
    )
    rollout_sample_filter_path: str | None = option(None, "fn(args, groups) marking remove_sample in place")
    partial_rollout: bool = option(False, "keep partial groups at abort and resume them next step")
    recompute_logprobs_via_prefill: bool = option(False, "re-score sampled tokens with a prefill pass")
    sglang_server_concurrency: int = option(
        512,
        "max requests in flight per engine (the rollout sends at most this x engines at once)",
        range="[1, 1048576]",
        unit="requests in flight per engine",
    )
    reward_phase: Literal["inline", "separate"] = option(
        "inline",
        "{choices}",
        notes={"inline": "score as each sample finishes", "separate": "generate all, then score"},
    )
    use_session_server: Literal["v1", "v2"] | None = option(
        None,
        "start the token-in-token-out session server: {choices}; every request carries a routing key",
        nargs="?",
        const="v1",
        notes={"v1": "linear, the bare flag", "v2": "branching"},
        sep=" or ",
    )
    session_server_port: int = option(
        0,
        "port of the session server on the controller host (0: a free one)",
        range=PORT_RANGE,
        unit="a TCP port; 0 picks a free one",
    )
    session_message_matcher: str = option(
        "strict",
        "when a replayed message counts as the stored one: strict | loose_tool_call | role_content_only | import path of fn(stored, replayed) -> bool",
    )
    tito_model: str = option(
        "default",
        "model family of the session server's tokenisation: chatml | default (the checkpoint's own template, unverified) | import path of a ModelFamily",
    )

    def derive(self) -> None:
        """The values this section derives from its own flags (an explicit value stays)."""
        if self.over_sampling_batch_size is None:
            self.over_sampling_batch_size = self.rollout_batch_size
