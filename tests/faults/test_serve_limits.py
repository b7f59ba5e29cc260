"""The session server under hostile requests: large bodies, large messages, unknown roles, absurd parameters.

The server runs over a router double that answers every turn with one end-of-turn token, so each
test is about the server alone. The tokenizer double blocks on a marker in the text until the test
lets it go, which makes "a small request finishes while a large one is being tokenised" a property
of ordering, not of timing.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import aiohttp
import pytest

from miles.agent.families import FAMILIES
from miles.agent.gateway import Gateway
from miles.agent.openai_protocol import ChatDefaults
from miles.agent.server import start_gateway
from miles.agent.tito import TitoTokenizer
from miles.models.tiny import build_tokenizer

MARKER = "HOLD-THE-TOKENIZER"


class HoldingTokenizer:
    """The tiny tokenizer, except that encoding a text holding MARKER waits until `release` is set."""

    def __init__(self) -> None:
        self._inner = build_tokenizer()
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, text: str, **kwargs: Any) -> Any:
        if MARKER in text:
            self.entered.set()
            if not self.release.wait(timeout=30):
                raise RuntimeError("the test never released the tokenizer")
        return self._inner(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class OneTokenRouter:
    def __init__(self, eot: int) -> None:
        self.eot = eot

    async def generate(self, payload: dict, routing_key: str | None = None) -> dict:
        return {"output_ids": [self.eot], "meta_info": {"finish_reason": {"type": "stop"}, "weight_version": 0}}

    def release_key(self, key: str) -> None:
        pass


async def _post(url: str, body: Any = None, data: bytes | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body, data=data) as resp:
        return resp.status, await resp.json()


async def _serve(tokenizer: Any, *, context_len: int | None = 64, max_body_mb: float = 64.0):
    tito = TitoTokenizer(FAMILIES["chatml"], tokenizer)
    gw = Gateway(OneTokenRouter(tito.end_of_turn_id), tito, defaults=ChatDefaults(max_context_len=context_len))
    return await start_gateway(gw, max_body_mb=max_body_mb)


def _chat(text: str, **extra: Any) -> dict:
    return {"messages": [{"role": "user", "content": text}], **extra}


def test_a_large_request_holds_one_thread_while_a_small_one_finishes():
    async def main() -> None:
        tokenizer = HoldingTokenizer()
        handle = await _serve(tokenizer, context_len=None)
        try:
            big = asyncio.create_task(_post(f"{handle.url}/v1/chat/completions", _chat(MARKER + " x" * 1000)))
            assert await asyncio.to_thread(tokenizer.entered.wait, 10), "the large request never reached the tokenizer"
            # while the large request holds a tokenising thread, a small one is served to the end
            status, reply = await asyncio.wait_for(_post(f"{handle.url}/v1/chat/completions", _chat("hi")), 20)
            assert status == 200, reply
            assert not big.done()
            tokenizer.release.set()
            status, reply = await asyncio.wait_for(big, 20)
            assert status == 200, reply
        finally:
            tokenizer.release.set()
            await handle.stop()

    asyncio.run(main())


def test_a_body_over_the_limit_is_refused_with_413_naming_the_flag():
    async def main() -> None:
        handle = await _serve(build_tokenizer(), max_body_mb=0.01)
        try:
            status, reply = await _post(f"{handle.url}/v1/chat/completions", _chat("x" * 20_000))
            assert status == 413
            assert "--http-max-body-mb" in reply["error"]
        finally:
            await handle.stop()

    asyncio.run(main())


def test_more_text_than_the_context_can_hold_is_refused_before_tokenising():
    async def main() -> None:
        tokenizer = HoldingTokenizer()  # never released: tokenising the message would hang the request
        handle = await _serve(tokenizer, context_len=64)
        try:
            longest = max(len(t) for t in tokenizer.get_vocab())
            text = MARKER + "y" * (64 * longest)
            status, reply = await asyncio.wait_for(_post(f"{handle.url}/v1/chat/completions", _chat(text)), 20)
            assert status == 400, reply
            assert "characters" in reply["error"]["message"]
            assert not tokenizer.entered.is_set()
        finally:
            tokenizer.release.set()
            await handle.stop()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        (_chat("hi", temperature=50), "temperature"),
        (_chat("hi", top_p=0), "top_p"),
        (_chat("hi", max_tokens=10**9), "max_tokens"),
        (_chat("hi", max_tokens=-3), "max_tokens"),
        (_chat("hi", seed=2**70), "seed"),
        (_chat("hi", stop=["s"] * 1000), "stop"),
        (_chat("hi", stream="yes"), "stream"),
        (_chat("hi", frequency_penalty=9), "frequency_penalty"),
    ],
)
def test_roles_and_sampling_parameters_outside_their_range_are_refused(body: dict, names: str):
    async def main() -> None:
        handle = await _serve(build_tokenizer())
        try:
            status, reply = await _post(f"{handle.url}/v1/chat/completions", body)
            assert status == 400, reply
            assert names in reply["error"]["message"]
        finally:
            await handle.stop()

    asyncio.run(main())
