"""Reward hub: one entry point that scores a sample with a rule, a remote model or a plug-in.

Resolution per sample: `--custom-rm-path` wins; otherwise `metadata["rm_type"]` overrides
`--rm-type`. Rule types (`math`, `gsm8k`, `deepscaler`, `f1`, `exact`, `boxed_<rule>`) go
through `grade()`, the same function evaluation uses. `remote_rm` posts to `--rm-url` and raises
`RewardFailed` after its last retry; the caller marks that sample FAILED and counts it.

Every reward a plug-in or a remote model returns passes `check_reward`: a finite real number
(int, float, bool, numpy scalar), or a dict whose `--reward-key` entry is one. Anything else
(None, a string, NaN, inf) is a `RewardFailed` saying what was returned, counted like a failed
call; a string "0.5" is not silently converted.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections import defaultdict
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np

from miles.rollout.rm_hub.remote import RewardFailed, remote_rm
from miles.rollout.rm_hub.rules import resolve_rule
from miles.rollout.sample import Sample, SampleStatus
from miles.utils.misc import load_function

__all__ = ["RewardFailed", "assign_rewards", "async_rm", "batched_async_rm", "check_reward", "grade"]

logger = logging.getLogger(__name__)

# Grading long responses is regex work; past this size it runs in a thread, off the event loop.
_INLINE_GRADE_MAX_CHARS = 20_000


def check_reward(value: Any, sample: Sample, *, source: str, reward_key: str | None = None) -> float | dict:
    """`value` when it is a usable reward of `sample`; otherwise RewardFailed saying what `source` returned.

    A dict is checked at its `--reward-key` entry; without one it passes, and the conversion to
    training data asks for `--reward-key`.
    """
    scalar = value
    if isinstance(value, dict):
        if reward_key is None:
            return value
        if reward_key not in value:
            raise RewardFailed(
                f"{source} returned a dict without --reward-key {reward_key!r} (keys {sorted(value)})",
                sample_index=sample.index,
            )
        scalar = value[reward_key]
    if isinstance(scalar, (numbers.Real, np.bool_)) and math.isfinite(float(scalar)):
        return value
    shown = repr(scalar)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise RewardFailed(
        f"{source} returned {shown} ({type(scalar).__name__}); a reward must be a finite number "
        "(int, float, bool or numpy scalar)",
        sample_index=sample.index,
    )


def reward_source(args: Any, sample: Sample | None = None) -> str:
    """Where a sample's reward comes from, as the user configured it (for error messages)."""
    if getattr(args, "group_reward_path", None):
        return f"--group-reward-path {args.group_reward_path}"
    if getattr(args, "custom_rm_path", None):
        return f"--custom-rm-path {args.custom_rm_path}"
    rm_type = (sample.metadata.get("rm_type") if sample is not None else None) or getattr(args, "rm_type", None)
    if rm_type == "remote_rm":
        return f"the remote reward model at --rm-url {getattr(args, 'rm_url', None)}"
    return f"--rm-type {rm_type}"


def _checked(value: Any, args: Any, sample: Sample, source: str) -> float | dict:
    return check_reward(value, sample, source=source, reward_key=getattr(args, "reward_key", None))


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
        return _checked(await _call_plugin(custom_path, args, sample), args, sample, f"--custom-rm-path {custom_path}")
    rm_type = _rm_type_of(args, sample)
    if rm_type == "remote_rm":
        reward = await remote_rm(args, sample, session=session)
        return _checked(reward, args, sample, f"the remote reward model at --rm-url {args.rm_url}")
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
        values = _checked_list(await _call_plugin(path, args, samples), len(samples), path)
        return _raise_on_failures(_each_checked(values, args, samples, f"--custom-rm-path {path}"))
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
        values = _each_checked(
            _checked_list(out, len(idx), path), args, [samples[i] for i in idx], f"--group-reward-path {path}"
        )
        for i, value in zip(idx, values, strict=True):
            results[i] = value
    return _raise_on_failures(results)


def _checked_list(values: Any, expected: int, path: str) -> list[float | dict]:
    if not isinstance(values, (list, tuple)) or len(values) != expected:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise TypeError(f"group reward plug-in {path!r} must return a list of {expected} rewards, got {got}")
    return list(values)


def _each_checked(values: list[Any], args: Any, samples: list[Sample], source: str) -> list[Any]:
    """Each value checked; an unusable one is replaced by its RewardFailed, so its siblings still count."""
    out: list[Any] = []
    for value, sample in zip(values, samples, strict=True):
        try:
            out.append(_checked(value, args, sample, source))
        except RewardFailed as e:
            out.append(e)
    return out


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
