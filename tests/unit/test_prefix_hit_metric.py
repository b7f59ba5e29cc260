"""perf/rollout/prefix_hit_rate: the share of the step's prompt tokens the engines took from their prefix
caches, summed by the router from SGLang's `cached_tokens` / `prompt_tokens` of every response."""

import asyncio

from miles.config import MilesConfig
from miles.controller.group_runner import GroupRunner
from miles.controller.router import Router
from miles.rollout.generate import SamplingDefaults


class _Engine:
    base_url = "http://engine"

    def __init__(self, cached: list[int]):
        self.cached = cached

    async def generate(self, payload: dict, routing_key: str | None = None) -> dict:
        return {"meta_info": {"prompt_tokens": 100, "cached_tokens": self.cached.pop(0)}}


def test_prefix_hit_rate_is_the_steps_cached_share_of_prompt_tokens():
    router = Router([_Engine([0, 90, 90, 90, 50])])
    cfg = MilesConfig()
    cfg.rollout.sglang_server_concurrency = 2
    runner = GroupRunner(cfg, router, None, SamplingDefaults())

    async def calls(n: int) -> None:
        for _ in range(n):
            await router.generate({})

    asyncio.run(calls(4))
    assert runner.pop_metrics()["perf/rollout/prefix_hit_rate"] == (0 + 90 + 90 + 90) / 400
    asyncio.run(calls(1))
    assert runner.pop_metrics()["perf/rollout/prefix_hit_rate"] == 0.5  # the last call alone
    assert "perf/rollout/prefix_hit_rate" not in runner.pop_metrics()  # no prompt since: no figure
    assert router.stats()["prefix_cache_hit_rate"] == 320 / 500


def test_disable_radix_cache_turns_the_embedded_engines_prefix_sharing_off():
    from miles.workers.rollout_worker import embedded_options

    assert embedded_options({"disable_radix_cache": True}) == {"prefix_cache": False}
    assert embedded_options({"disable_radix_cache": True, "disable_cuda_graph": True}) == {
        "prefix_cache": False,
        "cuda_graphs": False,
    }
