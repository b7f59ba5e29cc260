"""Reward hub: one entry point that scores a sample with a rule, a remote model or a plug-in.

Resolution per sample: `--custom-rm-path` wins; otherwise `metadata["rm_type"]` overrides
`--rm-type`. Rule types (`math`, `gsm8k`, `deepscaler`, `f1`, `exact`, `boxed_<rule>`) go
through `grade()`, the same function evaluation uses. `remote_rm` posts to `--rm-url` and raises
`RewardFailed` after its last retry; the caller marks that sample FAILED and counts it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import defaultdict
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from miles.rollout.rm_hub.remote import RewardFailed, remote_rm
from miles.rollout.rm_hub.rules import resolve_rule
from miles.rollout.sample import Sample, SampleStatus
from miles.utils.misc import load_function

__all__ = ["RewardFailed", "assign_rewards", "async_rm", "batched_async_rm", "grade"]

logger = logging.getLogger(__name__)

# Grading long responses is regex work; past this size it runs in a thread, off the event loop.
_INLINE_GRADE_MAX_CHARS = 20_000


def grade(rm_type: str, response: str, label: str) -> float:
    """Score `response` against `label` with the rule `rm_type` (e.g. "math", "boxed_exact")."""
    return resolve_rule(rm_type)(response, label)


@lru_cache(maxsize=32)
def _plugin(path: str) -> Callable[..., Any]:
    fn = load_function(path)
    if not callable(fn):
        raise TypeError(f"reward plug-in {path!r} resolved to {type(fn).__name__}, which is not callable")
    return fn


async def _call_plugin(path: str, *call_args: Any) -> Any:
    """Call a sync or async plug-in; a sync one runs in a thread so it cannot stall the loop."""
    fn = _plugin(path)
    if inspect.iscoroutinefunction(fn):
        return await fn(*call_args)
    result = await asyncio.to_thread(fn, *call_args)
    return await result if inspect.isawaitable(result) else result


def _rm_type_of(args: Any, sample: Sample) -> str:
    rm_type = sample.metadata.get("rm_type") or getattr(args, "rm_type", None)
    if not rm_type:
        raise ValueError(
            f"sample {sample.index}: no reward type; set --rm-type (math, gsm8k, deepscaler, f1, exact, remote_rm, "
            "boxed_<rule>), metadata['rm_type'] in the data, or --custom-rm-path"
        )
    return rm_type


async def async_rm(args: Any, sample: Sample, *, session: Any = None) -> float | dict:
    """Reward of one sample (a float, or a dict that `--reward-key` reduces later)."""
    custom_path = getattr(args, "custom_rm_path", None)
    if custom_path:
        return await _call_plugin(custom_path, args, sample)
    rm_type = _rm_type_of(args, sample)
    if rm_type == "remote_rm":
        return await remote_rm(args, sample, session=session)
    rule = resolve_rule(rm_type)
    if sample.label is None:
        raise ValueError(
            f"sample {sample.index}: rm_type={rm_type!r} needs a label; set --label-key to the answer column"
        )
    if len(sample.response) > _INLINE_GRADE_MAX_CHARS:
        return await asyncio.to_thread(rule, sample.response, sample.label)
    return rule(sample.response, sample.label)


async def batched_async_rm(args: Any, samples: list[Sample]) -> list[float | dict]:
    """Rewards of many samples, in order.

    `--group-reward-path` is called once per group (by `group_index`) with the whole group, for
    rewards that rank siblings; `--group-rm` calls `--custom-rm-path` once with the list;
    otherwise every sample is scored concurrently with `async_rm`. When some samples fail after
    their retries the others still finish, then `RewardFailed` is raised with `.results` holding
    the rewards and the exceptions in place.
    """
    group_path = getattr(args, "group_reward_path", None)
    if group_path:
        return await _group_rewards(group_path, args, samples)
    if getattr(args, "group_rm", False):
        path = getattr(args, "custom_rm_path", None)
        if not path:
            raise ValueError("--group-rm scores groups with --custom-rm-path, which is not set")
        return _checked_list(await _call_plugin(path, args, samples), len(samples), path)
    results = await asyncio.gather(*(async_rm(args, s) for s in samples), return_exceptions=True)
    return _raise_on_failures(list(results))


async def _group_rewards(path: str, args: Any, samples: list[Sample]) -> list[float | dict]:
    by_group: dict[Any, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        by_group[sample.group_index].append(i)
    outputs = await asyncio.gather(
        *(_call_plugin(path, args, [samples[i] for i in idx]) for idx in by_group.values()), return_exceptions=True
    )
    results: list[Any] = [None] * len(samples)
    for idx, out in zip(by_group.values(), outputs, strict=True):
        if isinstance(out, BaseException):
            if not isinstance(out, Exception):
                raise out
            failure = (
                out if isinstance(out, RewardFailed) else RewardFailed(f"{path} raised {type(out).__name__}: {out}")
            )
            for i in idx:
                results[i] = failure
            continue
        for i, value in zip(idx, _checked_list(out, len(idx), path), strict=True):
            results[i] = value
    return _raise_on_failures(results)


def _checked_list(values: Any, expected: int, path: str) -> list[float | dict]:
    if not isinstance(values, (list, tuple)) or len(values) != expected:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise TypeError(f"group reward plug-in {path!r} must return a list of {expected} rewards, got {got}")
    return list(values)


def _raise_on_failures(results: list[Any]) -> list[float | dict]:
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, RewardFailed):
            raise r  # a bug (bad label, bad plug-in), not a flaky reward server
    failures = [r for r in results if isinstance(r, RewardFailed)]
    if failures:
        error = RewardFailed(f"{len(failures)} of {len(results)} rewards failed; first: {failures[0]}")
        error.results = results  # type: ignore[attr-defined]
        raise error
    return results


async def assign_rewards(args: Any, samples: list[Sample]) -> int:
    """Score `samples` in place; failed ones get status FAILED and `metadata['reward_error']`.

    Returns how many failed, for the caller's `rollout/reward_failed` counter.
    """
    try:
        results: list[Any] = await batched_async_rm(args, samples)
    except RewardFailed as e:
        results = getattr(e, "results", None) or [e] * len(samples)
    failed = 0
    for sample, result in zip(samples, results, strict=True):
        if isinstance(result, RewardFailed):
            sample.status = SampleStatus.FAILED
            sample.metadata["reward_error"] = str(result)
            failed += 1
        else:
            sample.reward = result
    if failed:
        logger.warning("%d of %d samples failed reward scoring and are marked FAILED", failed, len(samples))
    return failed
