"""Async HTTP client of one engine speaking SGLang's server protocol.

The same client drives the embedded engine's HTTP front (`miles.engines.http_front`) and a real
`sglang.launch_server`. One pooled `aiohttp` session carries thousands of concurrent `/generate`
calls; every request carries the engine's API key (`Authorization: Bearer`) when one is given.

Connection failures (refused, reset, server gone mid-request) are retried with exponential
backoff; HTTP errors are not retried, and a timeout is not retried either: the engine may still be
working on a timed-out request, so sending it again would double the load. An outage is logged
once per engine, not once per request, and is bounded: once it has lasted the whole retry budget,
new requests get one attempt. When the owner knows why an engine is gone (`known_failure`, e.g.
the runtime's WorkerDied for the engine's process), that error is raised instead of retrying.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from miles.engines.doors import auth_headers

logger = logging.getLogger(__name__)

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


class EngineHTTPError(RuntimeError):
    """A non-2xx answer from an engine endpoint."""

    def __init__(self, status: int, url: str, endpoint: str, body: str) -> None:
        self.status = status
        self.url = url
        self.endpoint = endpoint
        self.body = body
        detail = _error_detail(body)
        if status == 401:
            hint = " (give the client the key the engine was started with: --api-key)"
        elif 400 <= status < 500:
            hint = " (the request was rejected; fix the payload, it is not retried)"
        else:
            hint = ""
        super().__init__(f"engine {url} answered HTTP {status} on {endpoint}: {detail}{hint}")


class EngineConnectionError(ConnectionError):
    """The engine could not be reached after every retry."""


class EngineTimeoutError(TimeoutError):
    """A call ran past its deadline (not retried: the engine may still be working on it)."""


def _error_detail(body: str) -> str:
    """The human message inside an error body: SGLang's {"error": {"message"}}, ours {"error": msg}, or text."""
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, TypeError):
        return body.strip()[:500] or "<empty body>"
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed.get("message"))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)[:500]
    return body.strip()[:500]


class EngineClient:
    """One engine's endpoints as async methods (payloads as SGLang's http_server expects them)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600,
        max_retries: int = 3,
        session: aiohttp.ClientSession | None = None,
        max_connections: int = 4096,
        retry_backoff_s: float = 0.2,
        api_key: str | None = None,
        name: str | None = None,
        known_failure: Callable[[], BaseException | None] | None = None,
    ) -> None:
        """`api_key`: sent as `Authorization: Bearer` on every request. `name`: the engine's worker name, for
        errors. `known_failure`: returns why the engine is known to be gone (or None); raised instead of retrying."""
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"engine base_url={base_url!r} has no scheme; pass e.g. 'http://127.0.0.1:30000'")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.name = name
        self._headers = auth_headers(api_key)
        self._known_failure = known_failure
        self._outage_since: float | None = None  # monotonic time of the first failure of the current outage
        self._max_connections = max_connections
        self._session = session
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._owns_session = session is None

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    @property
    def label(self) -> str:
        """How errors name this engine: its worker name and URL when the name is known."""
        return f"{self.name} at {self.base_url}" if self.name else self.base_url

    def _get_session(self) -> aiohttp.ClientSession:
        # Created lazily so the session binds to the loop that uses it; a session left on another
        # (finished) loop cannot be reused, so an owned one is replaced.
        loop = asyncio.get_running_loop()
        stale = self._owns_session and self._session is not None and self._session_loop is not loop
        if self._session is None or self._session.closed or stale:
            connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=self._max_connections)
            self._session = aiohttp.ClientSession(connector=connector)
            self._session_loop = loop
            self._owns_session = True
        return self._session

    async def close(self) -> None:
        session, self._session = self._session, None
        if self._owns_session and session is not None and not session.closed:
            if self._session_loop is asyncio.get_running_loop():
                await session.close()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request(
        self,
        method: str,
        endpoint: str,
        payload: dict | None = None,
        *,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
        ok_statuses: tuple[int, ...] = (),
        max_retries: int | None = None,
    ) -> tuple[int, Any]:
        """Send one request, retrying connection failures; returns (status, parsed JSON or text or None)."""
        url = self.base_url + endpoint
        retries = self.max_retries if max_retries is None else max_retries
        if self._outage_since is not None and time.monotonic() - self._outage_since > self._retry_budget_s():
            retries = 0  # the engine has been unreachable for a whole retry budget already: one attempt
        timeout = aiohttp.ClientTimeout(total=timeout_s if timeout_s is not None else self.timeout_s)
        headers = {**self._headers, **headers} if headers else self._headers
        for attempt in range(retries + 1):
            try:
                async with self._get_session().request(
                    method, url, json=payload, headers=headers, timeout=timeout
                ) as resp:
                    body = await resp.text()
                self._reachable()
                if resp.status >= 300 and resp.status not in ok_statuses:
                    raise EngineHTTPError(resp.status, self.base_url, endpoint, body)
                return resp.status, _parse_body(body, resp.content_type)
            except aiohttp.ClientConnectionError as exc:
                # ServerTimeoutError is a connection error subclass in aiohttp but means a read timeout.
                if isinstance(exc, aiohttp.ServerTimeoutError):
                    raise EngineTimeoutError(f"{method} {url} timed out: {exc}") from exc
                failure = self._known_failure() if self._known_failure is not None else None
                if failure is not None:  # shared by every request that hits it: keep only this raise's frames
                    raise failure.with_traceback(None) from None
                if attempt >= retries:
                    down_s = time.monotonic() - (self._outage_since or time.monotonic())
                    raise EngineConnectionError(
                        f"engine {self.label} is unreachable: {method} {endpoint} failed after {attempt + 1} "
                        f"attempts, {down_s:.1f}s into the outage ({type(exc).__name__}: {exc}); its process "
                        "died or stopped listening on that address"
                    ) from exc
                self._unreachable(exc, retries)
                await asyncio.sleep(self.retry_backoff_s * (2**attempt))
            except asyncio.TimeoutError as exc:
                raise EngineTimeoutError(
                    f"{method} {url} did not answer within {timeout.total}s; raise timeout_s if the engine is slow"
                ) from exc
        raise AssertionError("unreachable")

    def _retry_budget_s(self) -> float:
        return self.retry_backoff_s * (2**self.max_retries - 1)

    def _unreachable(self, exc: Exception, retries: int) -> None:
        if self._outage_since is None:  # one warning per outage, however many requests hit it
            self._outage_since = time.monotonic()
            logger.warning(
                "engine %s is unreachable (%s: %s); retrying each request up to %d times over %.1fs",
                self.label,
                type(exc).__name__,
                exc,
                retries,
                self._retry_budget_s(),
            )

    def _reachable(self) -> None:
        if self._outage_since is not None:
            logger.warning("engine %s answers again after %.1fs", self.label, time.monotonic() - self._outage_since)
            self._outage_since = None

    async def _post(self, endpoint: str, payload: dict | None = None, **kw: Any) -> Any:
        return (await self.request("POST", endpoint, payload if payload is not None else {}, **kw))[1]

    async def _get(self, endpoint: str, **kw: Any) -> Any:
        return (await self.request("GET", endpoint, **kw))[1]

    # -- generation -------------------------------------------------------------------------------

    async def generate(
        self, payload: dict, *, routing_key: str | None = None, timeout_s: float | None = None
    ) -> dict | list:
        """POST /generate with an SGLang GenerateReqInput body; the routing key travels as a header."""
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key is not None else None
        return await self._post("/generate", payload, headers=headers, timeout_s=timeout_s)

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort one request or all; an engine that cannot be reached has nothing left to abort (not an error)."""
        if rid is None and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        try:
            await self._post("/abort_request", {"rid": rid or "", "abort_all": abort_all})
        except EngineConnectionError as exc:
            logger.debug("abort on %s skipped: %s", self.label, exc)
        except Exception as exc:
            if self._known_failure is None or exc is not self._known_failure():
                raise
            logger.debug("abort on %s skipped: the engine is gone (%s)", self.label, exc)

    async def pause_generation(self, mode: str = "retract") -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._post("/continue_generation", {})

    async def flush_cache(self) -> bool:
        """GET /flush_cache; False when the engine refused (400: requests still running), as SGLang does."""
        status, _ = await self.request("GET", "/flush_cache", ok_statuses=(400,))
        return status == 200

    # -- weights ----------------------------------------------------------------------------------

    async def init_weights_update_group(self, **kw: Any) -> None:
        await self._post("/init_weights_update_group", kw)

    async def destroy_weights_update_group(self, group_name: str = "miles") -> None:
        await self._post("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(self, **kw: Any) -> None:
        await self._post("/update_weights_from_distributed", kw)

    async def update_weights_from_tensor(self, **kw: Any) -> None:
        await self._post("/update_weights_from_tensor", kw)

    async def update_weights_from_disk(self, **kw: Any) -> None:
        await self._post("/update_weights_from_disk", kw)

    async def pull_weights(self, **kw: Any) -> dict:
        """Disk-delta patch on the engine host (an endpoint of the Miles SGLang fork and of our front)."""
        return await self._post("/pull_weights", kw)

    async def load_lora_adapter_from_distributed(self, **kw: Any) -> None:
        await self._post("/load_lora_adapter_from_distributed", kw)

    async def load_lora_adapter_from_tensors(self, **kw: Any) -> None:
        await self._post("/load_lora_adapter_from_tensors", kw)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self._post("/unload_lora_adapter", {"lora_name": lora_name})

    async def update_weight_version(self, new_version: str | int, abort_all_requests: bool = False) -> None:
        await self._post(
            "/update_weight_version", {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        )

    async def weights_checker(self, **kw: Any) -> dict:
        return await self._post("/weights_checker", kw)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._post("/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._post("/resume_memory_occupation", {"tags": tags})

    # -- info -------------------------------------------------------------------------------------

    async def model_info(self) -> dict:
        """GET /model_info, falling back to the older /get_model_info name."""
        try:
            return await self._get("/model_info")
        except EngineHTTPError as exc:
            if exc.status != 404:
                raise
            return await self._get("/get_model_info")

    async def get_weight_version(self) -> int:
        """The engine's weight version as an int (SGLang stores it as a string; newer SGLang only in /model_info)."""
        info = await self.model_info()
        version = info.get("weight_version")
        if version is None:
            version = (await self._get("/get_weight_version"))["weight_version"]
        try:
            return int(version)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"engine {self.base_url} reports weight_version={version!r}, not an integer; "
                "was it started without a miles weight update (SGLang's default is 'default')?"
            ) from exc

    async def server_info(self) -> dict:
        try:
            return await self._get("/server_info")
        except EngineHTTPError as exc:
            if exc.status != 404:
                raise
            return await self._get("/get_server_info")

    async def health(self, *, generate: bool = True, timeout_s: float = 30.0) -> bool:
        """True when /health_generate (or /health) answers 200; never raises."""
        endpoint = "/health_generate" if generate else "/health"
        try:
            status, _ = await self.request("GET", endpoint, timeout_s=timeout_s, max_retries=0)
        except (EngineHTTPError, EngineConnectionError, EngineTimeoutError):
            return False
        return status == 200


def _parse_body(body: str, content_type: str) -> Any:
    if not body:
        return None
    if content_type == "application/json" or body[:1] in "{[":
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return body
    return body
