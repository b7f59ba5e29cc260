"""The generate function that runs an agent function against the session server.

For each sample: open a session, call the agent with `base_url = {gateway}/sessions/{id}` (it
talks to `{base_url}/v1/chat/completions`), then, whether the agent returned or raised, collect
the session's trajectories as samples (the server assembled them from the engine's own tokens)
and end the session. The agent's returned dict is merged into each sample's metadata;
`agent_metrics.total_tool_time` becomes `non_generation_time`. A session with no completed turn
gives an ABORTED sample, which the rollout hands back like any aborted one.

This is the generate function whenever `--custom-agent-function-path` is set and
`--custom-generate-function-path` is not (Miles' `agentic_tool_call.generate`).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import aiohttp

from miles.agent.gateway_client import collect_samples, create_session, delete_session
from miles.agent.plugins import check_agent, gateway_url
from miles.rollout.sample import Sample, SampleStatus
from miles.utils.misc import load_function

logger = logging.getLogger(__name__)

# sampling parameter -> chat completions field (the rest keep their names)
_CHAT_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
_CHAT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "seed", "stop", "stop_token_ids")


def request_kwargs(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """The run's sampling parameters under their chat-completions names (what the agent should send)."""
    renamed = {_CHAT_NAMES.get(k, k): v for k, v in sampling_params.items()}
    return {k: renamed[k] for k in _CHAT_FIELDS if renamed.get(k) not in (None, [], ())}


async def generate(
    args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Sample]:
    agent = load_function(args.custom_agent_function_path)
    check_agent(agent)
    max_turns = int(args.generate_max_turns)
    max_seq_len = args.rollout_max_context_len
    async with aiohttp.ClientSession() as http:
        session_id = await create_session(http, args, max_turns=max_turns)
        base_url = f"{gateway_url(args)}/sessions/{session_id}"
        metadata = {
            **copy.deepcopy(sample.metadata),
            "max_seq_len": max_seq_len,
            "max_turns": max_turns,
            "session_id": session_id,
            "evaluation": evaluation,
        }
        result: dict[str, Any] = {}
        try:
            result = (
                await agent(base_url, copy.deepcopy(sample.prompt), request_kwargs(sampling_params), metadata) or {}
            )
        except Exception as e:  # noqa: BLE001 - the turns it completed are still a trajectory
            logger.warning(
                "agent %s failed on sample %s: %s: %s",
                args.custom_agent_function_path,
                sample.index,
                type(e).__name__,
                e,
            )
            result = {"agent_error": f"{type(e).__name__}: {e}"}
        finally:
            collected = await collect_samples(http, base_url, max_seq_len=max_seq_len)
            await delete_session(http, base_url)
    return _merge(sample, [Sample.from_dict(d) for d in collected], result)


def _merge(original: Sample, trajectories: list[Sample], result: dict[str, Any]) -> list[Sample]:
    """The session's trajectories under the original sample's identity (prompt, label, group, index)."""
    if not isinstance(result, dict):
        result = {"agent_result": result}
    tool_time = float((result.get("agent_metrics") or {}).get("total_tool_time", 0.0))
    if not trajectories:
        original.status = SampleStatus.ABORTED
        original.metadata.update(result)
        return [original]
    out = []
    for t in trajectories:
        s = copy.deepcopy(original)
        s.tokens, s.response, s.response_length = t.tokens, t.response, t.response_length
        s.loss_mask, s.rollout_log_probs, s.weight_versions = t.loss_mask, t.rollout_log_probs, t.weight_versions
        s.status, s.non_generation_time = t.status, tool_time
        s.metadata.update(t.metadata)
        s.metadata.update(result)
        out.append(s)
    return out
