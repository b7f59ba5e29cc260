"""The session server (TITO) driven by the official `openai` client, over scripted engines.

The engines answer from a script and record what they were sent, so every test compares the
session's stored token ids with the ids the engine actually consumed and produced.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import aiohttp
import pytest

from miles.agent.families import FAMILIES
from miles.agent.gateway import Gateway
from miles.agent.matchers import MATCHERS
from miles.agent.openai_protocol import ChatDefaults
from miles.agent.server import start_gateway
from miles.agent.tito import TitoTokenizer, normalize_message
from miles.controller.router import Router
from miles.engines.client import EngineClient
from miles.models.tiny import build_tokenizer
from miles.rollout.sample import Sample
from miles.utils.routing import RoutingShape

from scripted_engine import ROUTING, Reply, ScriptedEngine, scripted_route, serve  # isort: skip  (same folder)

openai = pytest.importorskip("openai")

TOKENIZER = build_tokenizer()
TITO = TitoTokenizer(FAMILIES["chatml"], TOKENIZER)
EOT = TITO.end_of_turn_id
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
USER = {"role": "user", "content": "What is 12 * 7?"}


def char_ids(text: str) -> list[int]:
    """The text as one token per character: valid ids, but not how the tokenizer would split it."""
    return [i for ch in text for i in TITO.encode(ch)]


def canonical(text: str) -> list[int]:
    return TITO.encode(text)


@asynccontextmanager
async def gateway(
    engines: list[ScriptedEngine],
    *,
    rule: str = "linear",
    matcher: str = "strict",
    routing: RoutingShape | None = None,
):
    servers = [await serve(e.app()) for e in engines]
    router = Router([EngineClient(url) for _, url in servers], session_mode=True)
    defaults = ChatDefaults(max_tokens=256, routing=routing)
    gw = Gateway(router, TITO, rule=rule, matcher=MATCHERS[matcher], defaults=defaults)
    handle = await start_gateway(gw)
    try:
        yield gw, handle.url
    finally:
        await handle.stop()
        await router.close()
        for runner, _ in servers:
            await runner.cleanup()


async def new_session(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.post(f"{url}/sessions", json={}) as resp:
        return (await resp.json())["session_id"]


async def get_json(url: str, method: str = "GET", body: dict | None = None) -> dict:
    async with aiohttp.ClientSession() as http, http.request(method, url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def client(base_url: str):
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


async def tool_episode(url: str, sid: str) -> tuple[list[dict], object, object]:
    """user -> tool call -> tool result -> answer, as an agent written against the OpenAI API does it."""
    chat = client(f"{url}/sessions/{sid}/v1")
    first = await chat.chat.completions.create(model="m", messages=[USER], tools=[CALC])
    call = first.choices[0].message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": "84"}
    history = [USER, first.choices[0].message.model_dump(exclude_none=True), result]
    second = await chat.chat.completions.create(model="m", messages=history, tools=[CALC])
    await chat.close()
    return history, first, second


def test_tool_chat_stores_the_engines_own_tokens_turn_by_turn():
    engine = ScriptedEngine([Reply(char_ids(CALL_TEXT) + [EOT]), Reply(canonical("Answer: 84") + [EOT])])

    async def main():
        async with gateway([engine]) as (gw, url):
            sid = await new_session(url)
            history, first, second = await tool_episode(url, sid)
            state = await get_json(f"{url}/sessions/{sid}")
            samples = (await get_json(f"{url}/sessions/{sid}/samples", "POST", {}))["samples"]
            return history, first, second, state, samples

    history, first, second, state, samples = asyncio.run(main())
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "12 * 7"}
    assert second.choices[0].message.content == "Answer: 84" and second.choices[0].finish_reason == "stop"

    (in1, in2), (out1, out2) = [r["input_ids"] for r in engine.requests], engine.outputs
    c1, c2 = state["checkpoints"]
    assert in1 == TITO.prompt_ids([USER], [CALC])  # the first turn: the template over the messages
    assert c1["token_ids"] == in1 + out1 and c2["token_ids"] == in2 + out2
    assert in2[: len(c1["token_ids"])] == c1["token_ids"]  # the stored ids are reused, not re-tokenised
    assert out1 != canonical(CALL_TEXT) + [EOT]  # (so re-tokenising would have changed them)
    suffix = TOKENIZER.decode(in2[len(c1["token_ids"]) :])
    assert suffix == "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert c2["parent"] == c1["index"] and state["leaves"] == [c2["index"]]
    generated = {i for i in range(len(in1), len(in1) + len(out1))} | {i for i in range(len(in2), len(c2["token_ids"]))}
    assert [i for i, m in enumerate(c2["loss_mask"]) if m] == sorted(generated)

    (sample,) = samples
    assert sample["tokens"] == c2["token_ids"] and sample["response_length"] == len(c2["token_ids"]) - len(in1)
    assert sample["status"] == "completed"
    mask, lps = sample["loss_mask"], sample["rollout_log_probs"]
    assert sum(mask) == len(out1) + len(out2)
    model_lps = [lp for lp, m in zip(lps, mask, strict=True) if m]
    assert model_lps == pytest.approx(
        [-0.01 * (i + 1) for i in range(len(out1))] + [-0.01 * (i + 1) for i in range(len(out2))]
    )
    assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if not m)
    assert all(r["routing_key"] == engine.requests[0]["routing_key"] for r in engine.requests)


def test_r3_sessions_keep_the_engines_routing_of_every_token_but_the_last():
    """Each turn's request returns the routing of its whole sequence; the sample takes the last turn's rows."""
    engine = ScriptedEngine([Reply(char_ids(CALL_TEXT) + [EOT]), Reply(canonical("Answer: 84") + [EOT])])

    async def main():
        async with gateway([engine], routing=RoutingShape(*ROUTING)) as (gw, url):
            sid = await new_session(url)
            await tool_episode(url, sid)
            return (await get_json(f"{url}/sessions/{sid}/samples", "POST", {}))["samples"]

    (raw,) = asyncio.run(main())
    sample = Sample.from_dict(raw)
    sample.validate()
    tokens = sample.tokens
    want = [scripted_route(p, t) for p, t in enumerate(tokens[:-1])]
    assert sample.rollout_routed_experts.dtype.name == "uint8"
    assert sample.rollout_routed_experts.tolist() == want


def _reserialised(history: list[dict], second) -> list[dict]:
    """The history as a harness that writes tool-call arguments compactly replays it, plus a new user turn."""
    replay = [dict(m) for m in history]
    call = dict(replay[1]["tool_calls"][0])
    call["function"] = {
        **call["function"],
        "arguments": json.dumps(json.loads(call["function"]["arguments"]), separators=(",", ":")),
    }
    replay[1] = {**replay[1], "tool_calls": [call]}
    return replay + [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Thanks."}]


@pytest.mark.parametrize(("matcher", "attached_to_last"), [("loose_tool_call", True), ("strict", False)])
def test_reserialised_history_matches_lenient_and_branches_exact(matcher: str, attached_to_last: bool):
    engine = ScriptedEngine(
        [Reply(canonical(CALL_TEXT) + [EOT]), Reply(canonical("Answer: 84") + [EOT])],
        default=Reply(canonical("Bye.") + [EOT]),
    )

    async def main():
        async with gateway([engine], rule="branching", matcher=matcher) as (gw, url):
            sid = await new_session(url)
            history, _, second = await tool_episode(url, sid)
            chat = client(f"{url}/sessions/{sid}/v1")
            replay = _reserialised(history, second)
            await chat.chat.completions.create(model="m", messages=replay, tools=[CALC])
            await chat.close()
            return await get_json(f"{url}/sessions/{sid}"), replay

    state, replay = asyncio.run(main())
    c1, c2, c3 = state["checkpoints"]
    if attached_to_last:  # the stored prefix stays authoritative; only the user turn is tokenised
        assert c3["parent"] == c2["index"]
        assert engine.requests[2]["input_ids"][: len(c2["token_ids"])] == c2["token_ids"]
        assert state["leaves"] == [c3["index"]]
    else:  # exact comparison: the re-serialised call diverges at the first assistant turn, a new branch
        assert c3["parent"] is None
        assert engine.requests[2]["input_ids"] == TITO.prompt_ids([normalize_message(m) for m in replay], [CALC])
        assert sorted(state["leaves"]) == [c2["index"], c3["index"]]


def test_linear_session_refuses_a_history_that_diverges_before_its_last_turn():
    engine = ScriptedEngine(
        [Reply(canonical(CALL_TEXT) + [EOT]), Reply(canonical("Answer: 84") + [EOT])],
        default=Reply(canonical("Again.") + [EOT]),
    )

    async def main():
        async with gateway([engine], rule="linear", matcher="strict") as (gw, url):
            sid = await new_session(url)
            history, _, second = await tool_episode(url, sid)
            chat = client(f"{url}/sessions/{sid}/v1")
            with pytest.raises(openai.ConflictError, match="diverges"):
                await chat.chat.completions.create(model="m", messages=_reserialised(history, second), tools=[CALC])
            retry = await chat.chat.completions.create(model="m", messages=history, tools=[CALC])  # the last turn
            await chat.close()
            return retry, await get_json(f"{url}/sessions/{sid}")

    retry, state = asyncio.run(main())
    assert retry.choices[0].message.content == "Again."
    c1, c3 = state["checkpoints"]  # the retried turn replaced the second one: one trajectory
    assert c3["parent"] == c1["index"] and state["leaves"] == [c3["index"]]


def test_root_endpoint_is_one_session_per_request_and_streams():
    engine = ScriptedEngine(default=Reply(canonical("Hello.") + [EOT]))

    async def main():
        async with gateway([engine]) as (gw, url):
            chat = client(f"{url}/v1")
            plain = await chat.chat.completions.create(model="m", messages=[USER])
            stream = await chat.chat.completions.create(model="m", messages=[USER], stream=True)
            chunks = [c async for c in stream]
            await chat.close()
            return plain, chunks, len(gw.sessions)

    plain, chunks, open_sessions = asyncio.run(main())
    assert plain.choices[0].message.content == "Hello."
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello."
    assert open_sessions == 0
    keys = [r["routing_key"] for r in engine.requests]
    assert len(set(keys)) == 2 and None not in keys


def test_under_the_router_a_session_stays_on_one_engine_and_new_sessions_go_to_the_idler():
    engines = [ScriptedEngine(default=Reply(canonical("ok") + [EOT])) for _ in range(2)]

    async def main():
        async with gateway(engines) as (gw, url):
            a, b = await new_session(url), await new_session(url)
            chat_a, chat_b = client(f"{url}/sessions/{a}/v1"), client(f"{url}/sessions/{b}/v1")
            history = [USER]
            for _ in range(3):
                reply = await chat_a.chat.completions.create(model="m", messages=history)
                history = history + [
                    reply.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "More."},
                ]
                await chat_b.chat.completions.create(model="m", messages=[USER])
            await chat_a.close()
            await chat_b.close()
            async with aiohttp.ClientSession() as http, http.post(f"{url}/generate", json={"input_ids": [1]}) as r:
                keyless = (r.status, await r.text())
            return a, b, keyless

    a, b, keyless = asyncio.run(main())
    seen = {i: {r["routing_key"] for r in e.requests} for i, e in enumerate(engines)}
    assert seen == {0: {a}, 1: {b}} or seen == {0: {b}, 1: {a}}  # each session on one engine, one each
    assert sum(len(e.requests) for e in engines) == 6
    assert keyless[0] == 400 and "routing key" in keyless[1]


def test_miles_session_serve_answers_any_openai_client(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from miles.models.tiny import make_tiny_model

    model = make_tiny_model(str(tmp_path / "tiny"), seed=1)
    env = {**os.environ, "MILES_TORCH_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "miles.cli",
        "session",
        "serve",
        "--model-path",
        model,
        "--port",
        "0",
        "--tito-model",
        "chatml",
        "--max-tokens",
        "6",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "OpenAI base_url" in line, line
        url = line.rsplit("base_url ", 1)[1].strip(" )\n")
        chat = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        once = chat.chat.completions.create(model="m", messages=[USER], tools=[CALC])
        assert once.usage.completion_tokens == 6 and once.choices[0].finish_reason == "length"
        root = url.removesuffix("/v1")
        sid = asyncio.run(new_session(root))
        session = openai.OpenAI(base_url=f"{root}/sessions/{sid}/v1", api_key="unused", max_retries=0)
        every_token = {"stop_token_ids": list(range(3, 576))}  # a one-token turn that stops (not at the length limit)
        first = session.chat.completions.create(model="m", messages=[USER], extra_body=every_token)
        history = [USER, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And?"}]
        session.chat.completions.create(model="m", messages=history, extra_body=every_token)
        state = asyncio.run(get_json(f"{root}/sessions/{sid}"))
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    c1, c2 = state["checkpoints"]
    assert c2["parent"] == c1["index"] and c2["token_ids"][: len(c1["token_ids"])] == c1["token_ids"]


def test_an_aborted_turn_ends_the_episode_and_its_sample_is_aborted():
    engine = ScriptedEngine([Reply(canonical("Let me"), finish="abort")])

    async def main():
        async with gateway([engine]) as (gw, url):
            sid = await new_session(url)
            chat = client(f"{url}/sessions/{sid}/v1")
            with pytest.raises(openai.InternalServerError, match="aborted"):
                await chat.chat.completions.create(model="m", messages=[USER])
            await chat.close()
            return (await get_json(f"{url}/sessions/{sid}/samples", "POST", {}))["samples"]

    (sample,) = asyncio.run(main())
    assert sample["status"] == "aborted" and sample["response_length"] == len(canonical("Let me"))


def test_with_a_key_only_a_sessions_own_routes_are_open_without_it():
    engine = ScriptedEngine(default=Reply(canonical("ok") + [EOT]))

    async def main():
        servers = [await serve(engine.app())]
        router = Router([EngineClient(servers[0][1])], session_mode=True)
        handle = await start_gateway(Gateway(router, TITO), api_key="secret")
        url, statuses = handle.url, {}
        try:
            async with aiohttp.ClientSession() as http:
                for name, method, path, headers in (
                    ("create_without_key", "POST", "/sessions", {}),
                    ("generate_without_key", "POST", "/generate", {}),
                    ("health", "GET", "/health", {}),
                    ("create_with_key", "POST", "/sessions", {"Authorization": "Bearer secret"}),
                ):
                    async with http.request(method, url + path, json={}, headers=headers) as r:
                        statuses[name] = r.status
                        body = await r.json()
                sid = body["session_id"]
                chat = client(f"{url}/sessions/{sid}/v1")  # the session id in the path is the credential
                reply = await chat.chat.completions.create(model="m", messages=[USER])
                await chat.close()
                async with http.get(f"{url}/sessions/not-a-session") as r:
                    statuses["unknown_session"] = r.status
            return statuses, reply
        finally:
            await handle.stop()
            await router.close()
            await servers[0][0].cleanup()

    statuses, reply = asyncio.run(main())
    assert statuses == {
        "create_without_key": 401,
        "generate_without_key": 401,
        "health": 200,
        "create_with_key": 200,
        "unknown_session": 401,
    }
    assert reply.choices[0].message.content == "ok"
