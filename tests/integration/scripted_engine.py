"""An engine double speaking SGLang's /generate that answers from a script and records every request.

Each reply is a list of token ids (the "model's" output, the end-of-turn token appended unless the
entry says otherwise), so a test knows exactly what the engine consumed and produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from miles.engines.client import ROUTING_KEY_HEADER
from miles.utils.routing import encode_sglang

# R3: the routed experts the script returns, 2 MoE layers x top-2 of 8 experts; token at position p -> scripted_route(p)
ROUTING = (2, 2, 8)


def scripted_route(position: int, token: int) -> list[list[int]]:
    return [[(position + token) % 8, (position + token + 1) % 8], [token % 8, (token + 3) % 8]]


@dataclass
class Reply:
    ids: list[int]
    finish: str = "stop"  # stop | length | abort
    version: int = 3


@dataclass
class ScriptedEngine:
    replies: list[Reply] = field(default_factory=list)
    default: Reply | None = None  # answered once the script is used up
    requests: list[dict[str, Any]] = field(default_factory=list)  # input_ids, sampling_params, routing key
    outputs: list[list[int]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        return app

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        reply = self.replies.pop(0) if self.replies else self.default
        assert reply is not None, "the script ran out of replies"
        self.requests.append(
            {
                "input_ids": list(body["input_ids"]),
                "sampling_params": body["sampling_params"],
                "routing_key": request.headers.get(ROUTING_KEY_HEADER),
            }
        )
        ids = list(reply.ids)[: body["sampling_params"].get("max_new_tokens", len(reply.ids))]
        finish = reply.finish if len(ids) == len(reply.ids) else "length"
        self.outputs.append(ids)
        logprobs = [[-0.01 * (i + 1), t, None] for i, t in enumerate(ids)]
        meta = {
            "finish_reason": {"type": finish},
            "output_token_logprobs": logprobs,
            "weight_version": str(reply.version),
            "output_token_weight_versions": [reply.version] * len(ids),
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
        }
        if body.get("return_routed_experts"):  # SGLang's base64 int32 rows of every token fed (all but the last)
            seq = list(body["input_ids"]) + ids
            meta["routed_experts"] = encode_sglang(np.array([scripted_route(p, t) for p, t in enumerate(seq[:-1])]))
        return web.json_response({"text": "", "output_ids": ids, "meta_info": meta})


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
