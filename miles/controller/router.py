"""Request placement over the engine fleet, and the fleet's typed fleet-wide calls.

Single-turn work goes to the engine with the fewest requests in flight. A routing key (a session
or trajectory id) binds to one engine for its lifetime, so every later turn lands where its
prefix is already in the KV cache; a new key goes to the least-loaded engine. In session mode a
request without a key is an error: silently routing it by load would cost cache hits and leave
nothing in the logs to explain why. `EngineFleet` sends one call to every engine at once (pause,
continue, abort, memory release and resume, weight versions).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from miles.engines.client import EngineClient

logger = logging.getLogger(__name__)


async def engine_clients(
    runtime: Any, role: str, *, api_key: str | None, external: Iterable[str] = ()
) -> list[EngineClient]:
    """Clients of the engines a run started as `role` workers, then of the `external` URLs, all with the run's key.

    A started engine's client is named after its worker (`rollout:0`) and, once the runtime knows the
    worker is gone, raises the runtime's WorkerDied instead of retrying a dead address.
    """
    clients = [
        EngineClient(
            (await w.call("info"))["url"],
            api_key=api_key,
            name=f"{w.role}:{w.rank}",
            known_failure=lambda: runtime.failure,
        )
        for w in runtime.workers(role)
    ]
    return clients + [EngineClient(url, api_key=api_key) for url in external]


class EngineFleet:
    """Every engine of a fleet, called concurrently; each method is one EngineClient call per engine.

    An empty fleet (a run without engines) answers every call with nothing done."""

    def __init__(self, engines: list[EngineClient]) -> None:
        self.engines = list(engines)

    def __len__(self) -> int:
        return len(self.engines)

    async def _each(self, call: Callable[[EngineClient], Awaitable[Any]]) -> list:
        return list(await asyncio.gather(*(call(engine) for engine in self.engines)))

    async def pause_generation(self, mode: str) -> None:
        """`mode`: abort | in_place | retract (`--pause-generation-mode`)."""
        await self._each(lambda e: e.pause_generation(mode=mode))

    async def continue_generation(self) -> None:
        await self._each(lambda e: e.continue_generation())

    async def abort_all(self) -> None:
        """Abort every request in flight; their samples come back as aborted."""
        await self._each(lambda e: e.abort_request(abort_all=True))

    async def release_memory_occupation(self, tags: list[str]) -> None:
        await self._each(lambda e: e.release_memory_occupation(tags=tags))

    async def resume_memory_occupation(self, tags: list[str]) -> None:
        await self._each(lambda e: e.resume_memory_occupation(tags=tags))

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        await self._each(
            lambda e: e.update_weights_from_disk(model_path=model_path, weight_version=str(weight_version))
        )

    async def weight_versions(self) -> list[int]:
        """The weight version each engine serves, in fleet order."""
        return [int(v) for v in await self._each(lambda e: e.get_weight_version())]

    async def close(self) -> None:
        await self._each(lambda e: e.close())


class RoutingKeyMissing(ValueError):
    """Session mode got a request with no routing key."""


@dataclass(slots=True)
class EngineLoad:
    active: int = 0  # requests in flight through this router
    total: int = 0  # requests ever dispatched
    affinity_hits: int = 0  # requests that followed an existing key binding (prefix likely cached)
    new_keys: int = 0  # keys first bound to this engine
    prompt_tokens: int = 0  # from meta_info of finished requests
    cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache


class Router:
    """Least-active placement with key affinity over a list of engine clients."""

    def __init__(self, engines: list[EngineClient], *, session_mode: bool = False, max_bound_keys: int = 1_000_000):
        if not engines:
            raise ValueError("Router needs at least one engine; got an empty list")
        self.engines = list(engines)
        self.session_mode = session_mode
        self.batched_generate = True  # engines take SGLang's list form of /generate (one call, many prompts)
        self.max_bound_keys = max_bound_keys
        self._loads = [EngineLoad() for _ in self.engines]
        # Insertion/use order doubles as LRU order, so a leaked key is eventually evicted.
        self._bindings: OrderedDict[str, int] = OrderedDict()

    def _least_active(self) -> int:
        # Ties go to the engine that has served fewer requests, then to the lower index.
        return min(range(len(self.engines)), key=lambda i: (self._loads[i].active, self._loads[i].total, i))

    def pick(self, routing_key: str | None = None) -> int:
        """Index of the engine for this request; binds a new key (does not count the request)."""
        if routing_key is None:
            if self.session_mode:
                raise RoutingKeyMissing(
                    "session mode requires a routing key on every request (X-SMG-Routing-Key / routing_key=); "
                    "got none. Pass the session id as routing_key."
                )
            return self._least_active()
        index = self._bindings.get(routing_key)
        if index is not None:
            self._bindings.move_to_end(routing_key)
            return index
        index = self._least_active()
        self._bindings[routing_key] = index
        self._loads[index].new_keys += 1
        if len(self._bindings) > self.max_bound_keys:
            evicted, _ = self._bindings.popitem(last=False)
            logger.warning(
                "router holds %d keys; evicted the least recent %r (release_key when a session ends)",
                self.max_bound_keys,
                evicted,
            )
        return index

    def release_key(self, routing_key: str) -> None:
        """Forget a key's binding (its session ended); unknown keys are ignored."""
        self._bindings.pop(routing_key, None)

    @property
    def loads(self) -> list[EngineLoad]:
        """Each engine's counters (read-only use)."""
        return self._loads

    def engine_for_key(self, routing_key: str) -> int | None:
        return self._bindings.get(routing_key)

    async def generate(self, payload: dict, *, routing_key: str | None = None) -> dict | list:
        """Place one /generate call, track it as active while it runs, and record cache statistics."""
        had_binding = routing_key is not None and routing_key in self._bindings
        index = self.pick(routing_key)
        load = self._loads[index]
        load.active += 1
        load.total += 1
        if had_binding:
            load.affinity_hits += 1
        try:
            result = await self.engines[index].generate(payload, routing_key=routing_key)
        finally:
            load.active -= 1
        for out in result if isinstance(result, list) else [result]:
            meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
            load.prompt_tokens += int(meta.get("prompt_tokens", 0) or 0)
            load.cached_tokens += int(meta.get("cached_tokens", 0) or 0)
        return result

    def stats(self) -> dict:
        """Per-engine counters plus fleet totals (prefix-cache hit rate = cached / prompt tokens)."""
        per_engine = [
            dict(asdict(load), url=engine.base_url) for load, engine in zip(self._loads, self.engines, strict=True)
        ]
        prompt = sum(load.prompt_tokens for load in self._loads)
        cached = sum(load.cached_tokens for load in self._loads)
        return {
            "engines": per_engine,
            "bound_keys": len(self._bindings),
            "affinity_hits": sum(load.affinity_hits for load in self._loads),
            "total": sum(load.total for load in self._loads),
            "prefix_cache_hit_rate": cached / prompt if prompt else 0.0,
        }

    async def abort_all(self) -> None:
        """Abort every request in flight on the engines this router places work on."""
        await EngineFleet(self.engines).abort_all()

    async def close(self) -> None:
        await EngineFleet(self.engines).close()
