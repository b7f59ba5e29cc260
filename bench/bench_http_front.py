"""Cost of the HTTP hop: N concurrent /generate calls through EngineClient + http_front vs direct calls.

The engine is an instant stub (it returns a fixed 32-token reply with logprobs), so the figure is
pure protocol overhead: JSON encode/decode, aiohttp server and client, connection pooling. Both
paths run side by side in the same process, several repetitions, medians.

    python bench/bench_http_front.py [--requests 2000] [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from miles.engines.client import EngineClient
from miles.engines.http_front import start_http_server

REPLY_TOKENS = 32


class InstantEngine:
    weight_version = 0
    num_active_requests = 0

    async def generate(
        self, *, input_ids=None, text=None, sampling_params=None, rid=None, return_logprob=False, logprob_start_len=-1
    ):
        await asyncio.sleep(0)
        out = list(range(REPLY_TOKENS))
        meta = {
            "id": rid,
            "finish_reason": {"type": "length", "length": REPLY_TOKENS},
            "prompt_tokens": len(input_ids),
            "completion_tokens": REPLY_TOKENS,
            "cached_tokens": 0,
            "weight_version": "0",
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[-0.25, t, None] for t in out]
        return {"text": "x" * REPLY_TOKENS, "output_ids": out, "meta_info": meta}

    def abort(self, rid=None, abort_all=False):
        pass


def payload(i: int) -> dict:
    return {
        "input_ids": list(range(64)),
        "sampling_params": {"temperature": 1.0, "max_new_tokens": REPLY_TOKENS},
        "return_logprob": True,
        "rid": f"r{i}",
    }


async def direct(engine: InstantEngine, n: int) -> float:
    start = time.perf_counter()
    await asyncio.gather(
        *(
            engine.generate(
                input_ids=p["input_ids"], sampling_params=p["sampling_params"], rid=p["rid"], return_logprob=True
            )
            for p in map(payload, range(n))
        )
    )
    return time.perf_counter() - start


async def over_http(client: EngineClient, n: int) -> float:
    start = time.perf_counter()
    await asyncio.gather(*(client.generate(payload(i)) for i in range(n)))
    return time.perf_counter() - start


async def main(n: int, reps: int) -> dict:
    engine = InstantEngine()
    handle = await start_http_server(engine, "127.0.0.1", 0)
    client = EngineClient(handle.url, timeout_s=120)
    try:
        await over_http(client, 50)  # warm the connection pool
        base, http = [], []
        for _ in range(reps):
            base.append(await direct(engine, n))
            http.append(await over_http(client, n))
    finally:
        await client.close()
        await handle.stop()
    base_s, http_s = statistics.median(base), statistics.median(http)
    return {
        "bench": "http_front",
        "requests": n,
        "reps": reps,
        "direct_s": round(base_s, 4),
        "http_s": round(http_s, 4),
        "http_req_per_s": round(n / http_s, 1),
        "http_overhead_ms_per_req": round((http_s - base_s) / n * 1e3, 4),
        "ratio_http_vs_direct": round(http_s / base_s, 1),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    result = asyncio.run(main(args.requests, args.reps))
    print(
        f"{args.requests} concurrent requests: direct {result['direct_s']}s, over HTTP {result['http_s']}s "
        f"({result['http_req_per_s']} req/s, {result['http_overhead_ms_per_req']} ms overhead per request)"
    )
    print(json.dumps(result))
