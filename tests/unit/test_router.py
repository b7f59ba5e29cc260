"""Router placement: least-active for single-turn work, key affinity for sessions, no silent fallback."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from miles.controller.router import EngineFleet, Router, RoutingKeyMissing
from miles.engines.client import EngineClient


class StubEngine:
    """An EngineClient stand-in whose generate() blocks until the test releases it."""

    def __init__(self, name: str, prompt_tokens: int = 10, cached_tokens: int = 0):
        self.base_url = f"http://{name}"
        self.gates: list[asyncio.Event] = []
        self.keys: list[str | None] = []
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.fail = False

    async def generate(self, payload, *, routing_key=None, timeout_s=None):
        self.keys.append(routing_key)
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        if self.fail:
            raise ConnectionError("engine went away")
        return {
            "text": "",
            "output_ids": [],
            "meta_info": {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens},
        }

    async def close(self):
        pass


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_least_active_placement_for_single_turn():
    async def main():
        engines = [StubEngine(f"e{i}") for i in range(3)]
        router = Router(engines)
        tasks = [asyncio.create_task(router.generate({})) for _ in range(4)]
        await settle()
        counts_after_4 = [len(e.keys) for e in engines]  # e0, e1, e2, then e0 again (all at 1 active, e0 lowest)
        engines[1].gates[0].set()  # e1 finishes its request
        await settle()
        tasks.append(asyncio.create_task(router.generate({})))
        await settle()
        counts_after_5 = [len(e.keys) for e in engines]
        active = [s["active"] for s in router.stats()["engines"]]
        for e in engines:
            for g in e.gates:
                g.set()
        await asyncio.gather(*tasks)
        return counts_after_4, counts_after_5, active, router.stats()

    after_4, after_5, active, stats = asyncio.run(main())
    assert after_4 == [2, 1, 1]
    assert after_5 == [2, 2, 1]  # the freed engine e1 (0 active) takes the next request
    assert active == [2, 1, 1]
    assert [s["active"] for s in stats["engines"]] == [0, 0, 0]
    assert [s["total"] for s in stats["engines"]] == [2, 2, 1]
    assert stats["affinity_hits"] == 0


def test_key_affinity_binds_for_the_session_lifetime():
    async def main():
        engines = [StubEngine("e0"), StubEngine("e1")]
        router = Router(engines, session_mode=True)
        first = asyncio.create_task(router.generate({}, routing_key="s1"))  # -> e0
        await settle()
        second = asyncio.create_task(router.generate({}, routing_key="s2"))  # new key -> least active e1
        await settle()
        # e0 now has 1 active, e1 has 1; s1's next turns still go to e0 even as e0 gets busier.
        turns = [asyncio.create_task(router.generate({}, routing_key="s1")) for _ in range(3)]
        await settle()
        placed = (router.engine_for_key("s1"), router.engine_for_key("s2"))
        keys = ([k for k in engines[0].keys], [k for k in engines[1].keys])
        for e in engines:
            for g in e.gates:
                g.set()
        await asyncio.gather(first, second, *turns)
        return placed, keys, router.stats()

    placed, keys, stats = asyncio.run(main())
    assert placed == (0, 1)
    assert keys == (["s1", "s1", "s1", "s1"], ["s2"])
    assert stats["affinity_hits"] == 3
    assert [s["affinity_hits"] for s in stats["engines"]] == [3, 0]
    assert [s["new_keys"] for s in stats["engines"]] == [1, 1]
    assert stats["bound_keys"] == 2


def test_new_key_goes_to_engine_with_fewest_active_requests():
    async def main():
        engines = [StubEngine(f"e{i}") for i in range(3)]
        router = Router(engines, session_mode=True)
        busy = [asyncio.create_task(router.generate({}, routing_key=f"k{i}")) for i in range(3)]
        await settle()
        engines[2].gates[0].set()  # e2 becomes idle
        await settle()
        chosen = router.pick("fresh")
        for e in engines:
            for g in e.gates:
                g.set()
        await asyncio.gather(*busy)
        return chosen

    assert asyncio.run(main()) == 2


def test_session_mode_without_key_is_an_error_not_a_fallback():
    async def main():
        engines = [StubEngine("e0")]
        router = Router(engines, session_mode=True)
        with pytest.raises(RoutingKeyMissing, match="routing key"):
            await router.generate({})
        return engines[0].keys, router.stats()["total"]

    keys, total = asyncio.run(main())
    assert keys == [] and total == 0
    assert issubclass(RoutingKeyMissing, ValueError)


def test_release_key_lets_the_key_rebind():
    router = Router([StubEngine("e0"), StubEngine("e1")])
    assert router.pick("a") == 0
    router._loads[0].active = 5  # e0 got busy meanwhile
    assert router.pick("a") == 0  # still bound
    router.release_key("a")
    assert router.pick("a") == 1
    router.release_key("never-seen")  # ignored


def test_bound_keys_are_capped_least_recent_first():
    router = Router([StubEngine("e0")], max_bound_keys=2)
    router.pick("a")
    router.pick("b")
    router.pick("a")  # refresh a
    router.pick("c")  # evicts b, the least recently used
    assert router.engine_for_key("a") == 0 and router.engine_for_key("c") == 0
    assert router.engine_for_key("b") is None


def test_active_count_is_released_when_the_engine_fails():
    async def main():
        engine = StubEngine("e0")
        engine.fail = True
        router = Router([engine])
        task = asyncio.create_task(router.generate({}))
        await settle()
        engine.gates[0].set()
        with pytest.raises(ConnectionError):
            await task
        return router.stats()["engines"][0]

    load = asyncio.run(main())
    assert load["active"] == 0 and load["total"] == 1


def test_prefix_cache_hit_rate_from_meta_info():
    async def main():
        engines = [StubEngine("e0", prompt_tokens=10, cached_tokens=8), StubEngine("e1", prompt_tokens=30)]
        router = Router(engines)
        tasks = [asyncio.create_task(router.generate({})) for _ in range(2)]
        await settle()
        for e in engines:
            e.gates[0].set()
        await asyncio.gather(*tasks)
        return router.stats()

    stats = asyncio.run(main())
    assert stats["prefix_cache_hit_rate"] == pytest.approx(8 / 40)
    assert [s["cached_tokens"] for s in stats["engines"]] == [8, 0]


class RecordingEngine:
    """Records each EngineClient call, after checking EngineClient has that method and takes those arguments."""

    def __init__(self, version: int = 0) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.version = version

    def __getattr__(self, name: str):
        async def call(**kw):
            inspect.signature(getattr(EngineClient, name)).bind(None, **kw)
            self.calls.append((name, kw))
            return self.version if name == "get_weight_version" else None

        return call


def test_fleet_calls_reach_every_engine_as_engine_client_methods():
    async def main(engines):
        fleet = EngineFleet(engines)
        await fleet.pause_generation("in_place")
        await fleet.continue_generation()
        await fleet.abort_all()
        await fleet.release_memory_occupation(["kv_cache"])
        await fleet.resume_memory_occupation(["kv_cache"])
        await fleet.update_weights_from_disk("/snap", 7)
        return await fleet.weight_versions()

    engines = [RecordingEngine(3), RecordingEngine(4)]
    assert asyncio.run(main(engines)) == [3, 4]
    expected = [
        ("pause_generation", {"mode": "in_place"}),
        ("continue_generation", {}),
        ("abort_request", {"abort_all": True}),
        ("release_memory_occupation", {"tags": ["kv_cache"]}),
        ("resume_memory_occupation", {"tags": ["kv_cache"]}),
        ("update_weights_from_disk", {"model_path": "/snap", "weight_version": "7"}),
        ("get_weight_version", {}),
    ]
    assert [e.calls for e in engines] == [expected, expected]
    assert not EngineFleet([]) and asyncio.run(EngineFleet([]).weight_versions()) == []


def test_router_abort_reaches_every_engine():
    engines = [RecordingEngine(), RecordingEngine()]
    asyncio.run(Router(engines).abort_all())
    assert [e.calls for e in engines] == [[("abort_request", {"abort_all": True})]] * 2


def test_router_needs_engines():
    with pytest.raises(ValueError, match="at least one engine"):
        Router([])
