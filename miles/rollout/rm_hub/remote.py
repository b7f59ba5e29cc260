"""Remote reward model over HTTP: POST {prompt, response, label} to `--rm-url`.

Concurrency is bounded by one semaphore per event loop (asyncio primitives belong to the loop
that created them, and the controller and tests may each run their own loop). A call is retried
on connection errors, timeouts, 429 and 5xx with exponential backoff; a 4xx other than 429 means
the request itself is wrong and fails at once. When the last attempt fails the caller gets
`RewardFailed`, never a silent 0.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

import aiohttp

from miles.rollout.sample import Sample

logger = logging.getLogger(__name__)

_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_BACKOFF_CAP_S = 8.0

# loop -> {concurrency: semaphore}; weak keys so a finished loop takes its semaphores with it.
_SEMAPHORES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary()
)


class RewardFailed(Exception):
    """A reward could not be computed after every retry; the caller marks the sample FAILED."""

    def __init__(self, message: str, *, sample_index: int | None = None, attempts: int = 0) -> None:
        super().__init__(message)
        self.sample_index = sample_index
        self.attempts = attempts


class _Retryable(Exception):
    pass


def _semaphore(concurrency: int) -> asyncio.Semaphore:
    per_loop = _SEMAPHORES.setdefault(asyncio.get_running_loop(), {})
    if concurrency not in per_loop:
        per_loop[concurrency] = asyncio.Semaphore(concurrency)
    return per_loop[concurrency]


def _payload(sample: Sample) -> dict[str, Any]:
    return {"prompt": sample.prompt, "response": sample.response, "label": sample.label}


def _parse_reward(body: Any, url: str) -> float | dict:
    """A number, or a dict (the caller selects a scalar with --reward-key)."""
    if isinstance(body, bool) or not isinstance(body, (int, float, dict)):
        raise RewardFailed(
            f"reward server {url} returned {type(body).__name__} {body!r:.200}; expected a number or an object"
        )
    return float(body) if isinstance(body, (int, float)) else body


async def _post_once(session: aiohttp.ClientSession, url: str, payload: dict, timeout_s: float) -> float | dict:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.post(url, json=payload, timeout=timeout) as resp:
            text = await resp.text()
            if resp.status in _RETRYABLE_STATUS:
                raise _Retryable(f"HTTP {resp.status}: {text[:200]}")
            if resp.status >= 400:
                raise RewardFailed(f"reward server {url} rejected the request: HTTP {resp.status}: {text[:200]}")
            try:
                body = await resp.json(content_type=None)
            except ValueError as e:
                raise RewardFailed(f"reward server {url} returned non-JSON body {text[:200]!r}") from e
            return _parse_reward(body, url)
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
        raise _Retryable(f"{type(e).__name__}: {e}") from e


async def remote_rm(args: Any, sample: Sample, *, session: aiohttp.ClientSession | None = None) -> float | dict:
    """Score one sample with the remote reward model named by `args.rm_url`."""
    url = getattr(args, "rm_url", None)
    if not url:
        raise ValueError("rm_type='remote_rm' needs --rm-url (e.g. http://host:8000/reward)")
    retries = int(getattr(args, "rm_max_retries", 3))
    timeout_s = float(getattr(args, "rm_timeout_s", 30.0))
    backoff_s = float(getattr(args, "rm_retry_backoff_s", 0.5))
    limit = _semaphore(int(getattr(args, "rm_concurrency", 64)))
    if session is not None:
        return await _with_retries(session, limit, url, sample, retries, timeout_s, backoff_s)
    async with aiohttp.ClientSession() as own_session:
        return await _with_retries(own_session, limit, url, sample, retries, timeout_s, backoff_s)


async def _with_retries(
    session: aiohttp.ClientSession,
    limit: asyncio.Semaphore,
    url: str,
    sample: Sample,
    retries: int,
    timeout_s: float,
    backoff_s: float,
) -> float | dict:
    payload = _payload(sample)
    last_error = ""
    for attempt in range(retries + 1):
        try:
            # The slot is held per attempt, not across backoff sleeps, so a flaky sample
            # does not starve the others.
            async with limit:
                return await _post_once(session, url, payload, timeout_s)
        except _Retryable as e:
            last_error = str(e)
            if attempt < retries:
                delay_s = min(backoff_s * 2**attempt, _BACKOFF_CAP_S)
                logger.warning(
                    "reward call for sample %s failed (attempt %d/%d): %s; retrying in %.2fs",
                    sample.index,
                    attempt + 1,
                    retries + 1,
                    last_error,
                    delay_s,
                )
                await asyncio.sleep(delay_s)
        except RewardFailed as e:
            e.sample_index, e.attempts = sample.index, attempt + 1
            raise
    raise RewardFailed(
        f"reward server {url} failed for sample {sample.index} after {retries + 1} attempts: {last_error}; "
        "check the server or raise --rm-max-retries / --rm-timeout-s",
        sample_index=sample.index,
        attempts=retries + 1,
    )
