"""Calls plug-ins make to the rollout gateway: the router's /generate and the session lifecycle."""

from __future__ import annotations

from typing import Any

import aiohttp

from miles.agent.plugins import auth_headers, gateway_url
from miles.engines.client import ROUTING_KEY_HEADER
from miles.rollout.generate import parse_output


class GatewayError(RuntimeError):
    """The gateway answered with an error status."""

    def __init__(self, status: int, what: str, body: str) -> None:
        self.status = status
        super().__init__(f"{what} answered HTTP {status}: {body[:500]}")


async def _post(http: aiohttp.ClientSession, url: str, body: dict, headers: dict[str, str]) -> Any:
    async with http.post(url, json=body, headers=headers) as resp:
        text = await resp.text()
        if resp.status >= 300:
            raise GatewayError(resp.status, f"POST {url}", text)
        return await resp.json(content_type=None)


async def generate_tokens(
    http: aiohttp.ClientSession, args: Any, input_ids: list[int], sampling_params: dict, *, routing_key: str
) -> tuple[list[int], list[float], list[int], str]:
    """One engine turn through the router: (output ids, log-probs, weight versions, finish type)."""
    payload = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True}
    headers = {**auth_headers(args), ROUTING_KEY_HEADER: routing_key}
    return parse_output(await _post(http, f"{gateway_url(args)}/generate", payload, headers))


async def create_session(http: aiohttp.ClientSession, args: Any, *, max_turns: int) -> str:
    out = await _post(http, f"{gateway_url(args)}/sessions", {"max_turns": max_turns}, auth_headers(args))
    return out["session_id"]


async def collect_samples(
    http: aiohttp.ClientSession, base_url: str, *, max_seq_len: int | None, metadata: dict | None = None
) -> list[dict]:
    body = {"max_seq_len": max_seq_len, "metadata": metadata or {}}
    return (await _post(http, f"{base_url}/samples", body, {}))["samples"]


async def delete_session(http: aiohttp.ClientSession, base_url: str) -> None:
    async with http.delete(base_url) as resp:
        await resp.read()
