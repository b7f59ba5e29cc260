"""The rollout plug-in layers and the session server: combinations where a flag would do nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.fields import FIELDS

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig

# Built-in rollout features a --rollout-function-path replaces: given with one, they would do nothing.
_BUILT_IN_ROLLOUT_ONLY = (
    "dynamic_sampling_filter_path",
    "rollout_sample_filter_path",
    "partial_rollout",
    "recompute_logprobs_via_prefill",
    "reward_phase",
)


def check_agentic(cfg: MilesConfig) -> list[str]:
    """The three plug-in layers and the session server: combinations where a flag would do nothing."""
    e, r = [], cfg.rollout
    if r.custom_agent_function_path and not r.use_session_server:
        e.append(
            "--custom-agent-function-path needs --use-session-server: the session server records the agent's "
            "tokens; add --use-session-server (v1 linear, v2 branching)"
        )
    if r.custom_agent_function_path and cfg.data.apply_chat_template:
        e.append(
            "--apply-chat-template with --custom-agent-function-path: the agent gets the prompt's messages and "
            "the session server applies the chat template; drop --apply-chat-template"
        )
    if not r.use_session_server:
        for name in ("session_message_matcher", "tito_model"):
            if cfg.get(name) != FIELDS[name].default:
                e.append(
                    f"{FIELDS[name].flag}={cfg.get(name)!r} applies to the session server only; add "
                    f"--use-session-server or drop {FIELDS[name].flag}"
                )
    plugins = r.rollout_function_path or r.custom_generate_function_path or r.custom_agent_function_path
    if r.session_server_port and not (r.use_session_server or plugins):
        e.append(
            f"--session-server-port={r.session_server_port}: no session server or plug-in gateway starts "
            "without --use-session-server or a custom rollout/generate/agent function; drop it"
        )
    if r.partial_rollout and (r.custom_generate_function_path or r.custom_agent_function_path):
        e.append(
            "--partial-rollout resumes samples in the built-in generate only; a custom generate or agent "
            "function would get half-finished samples: drop --partial-rollout"
        )
    if r.rollout_function_path:
        if cfg.async_.fully_async:
            e.append(
                "--rollout-function-path replaces the sync rollout; --fully-async runs its own producer (Miles "
                "refuses the pair too): drop one, or plug in at --custom-generate-function-path"
            )
        for name in _BUILT_IN_ROLLOUT_ONLY:
            if cfg.get(name) != FIELDS[name].default:
                e.append(
                    f"{FIELDS[name].flag} belongs to the built-in rollout, which --rollout-function-path "
                    "replaces; drop it, or do the same inside the rollout function"
                )
    if r.generate_max_turns < 1:
        e.append(f"--generate-max-turns={r.generate_max_turns} must be at least 1")
    return e
