"""Nothing silent, nothing unbounded: reward values are checked, retries of dropped groups are
bounded, a stop signal ends a rollout that cannot finish, and bad numeric flags are refused.

The rollout runs against an in-test router (SGLang-shaped replies) and a list-backed data source.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from miles.config import ConfigError, MilesConfig, load_config
from miles.controller.drop_guard import DropGuard, max_consecutive_drops
from miles.controller.rollout_manager import MAX_REWARD_ATTEMPTS, SyncRolloutManager
from miles.controller.signals import StopRequested
from miles.errors import NonFiniteTraining, RolloutStalled, as_run_failure
from miles.rollout.rm_hub import RewardFailed, async_rm, batched_async_rm, check_reward
from miles.rollout.sample import Sample, SampleStatus

from harness import minimal_train_args  # isort: skip

# ---- plug-ins, loaded by path ------------------------------------------------------------


async def none_rm(args, sample):
    return None


def by_index_rm(args, sample):
    """NaN for samples 0 mod 8, the string "1.0" for 1 mod 8, inf for 2 mod 8, else index parity."""
    return {0: float("nan"), 1: "1.0", 2: float("inf")}.get(sample.index % 8, float(sample.index % 2))


def parity_rm(args, sample):
    return float(sample.index % 2)


def half_string_group_rm(args, samples):
    return ["0.5" if i % 2 else 1.0 for i in range(len(samples))]


def reject_all(args, group):
    return False


# ---- check_reward --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", [0, 1, 0.25, -3.5, True, np.float32(0.5), np.int64(2), np.bool_(True), {"acc": 1.0, "fmt": "x"}]
)
def test_finite_numbers_and_keyed_dicts_are_rewards(value) -> None:
    assert check_reward(value, Sample(index=1), source="rm", reward_key="acc") is value


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (None, "None (NoneType)"),
        ("0.5", "'0.5' (str)"),
        (float("nan"), "nan (float)"),
        (float("-inf"), "-inf (float)"),
        (np.float64("inf"), "(float64)"),
        ([1.0], "[1.0] (list)"),
        ({"acc": float("nan")}, "nan (float)"),
    ],
)
def test_anything_else_is_a_reward_failure_naming_what_was_returned(value, shown) -> None:
    with pytest.raises(RewardFailed, match="a reward must be a finite number") as info:
        check_reward(value, Sample(index=7), source="--custom-rm-path x:y", reward_key="acc")
    assert shown in str(info.value) and "--custom-rm-path x:y returned" in str(info.value)
    assert info.value.sample_index == 7


def test_dict_without_the_reward_key_fails_and_without_a_key_passes_through() -> None:
    with pytest.raises(RewardFailed, match="without --reward-key 'acc'"):
        check_reward({"fmt": 1.0}, Sample(), source="rm", reward_key="acc")
    assert check_reward({"fmt": 1.0}, Sample(), source="rm") == {"fmt": 1.0}  # conversion asks for the key


def _args(**kw) -> SimpleNamespace:
    base = dict(
        rm_type=None,
        custom_rm_path=None,
        group_rm=False,
        group_reward_path=None,
        reward_key=None,
        rm_url=None,
        dynamic_sampling_filter_path=None,
    )
    return SimpleNamespace(**{**base, **kw})


def test_plugin_values_are_checked_in_async_rm_and_in_group_paths() -> None:
    with pytest.raises(RewardFailed, match="none_rm returned None"):
        asyncio.run(async_rm(_args(custom_rm_path=f"{__name__}:none_rm"), Sample(index=3)))
    samples = [Sample(index=i, group_index=0) for i in range(4)]
    with pytest.raises(RewardFailed, match="2 of 4 rewards failed") as info:
        asyncio.run(batched_async_rm(_args(group_reward_path=f"{__name__}:half_string_group_rm"), samples))
    results = info.value.results
    assert results[0] == 1.0 and results[2] == 1.0  # siblings keep their rewards
    assert isinstance(results[1], RewardFailed) and "'0.5' (str)" in str(results[1])


# ---- the sync rollout against an in-test router -------------------------------------------------


class EchoRouter:
    """Answers every request with 3 tokens; counts requests; abort is a no-op."""

    def __init__(self) -> None:
        self.requests = 0

    async def generate(self, payload):
        self.requests += 1
        await asyncio.sleep(0)
        return {
            "text": "7 7",
            "output_ids": [5, 6, 7],
            "meta_info": {
                "output_token_logprobs": [[-0.1, t] for t in (5, 6, 7)],
                "weight_version": 0,
                "finish_reason": {"type": "stop"},
            },
        }

    async def abort_all(self):
        pass


class ListSource:
    """Fresh groups of `n` samples with unique indices; handed-back groups are served first."""

    def __init__(self, n: int) -> None:
        self.n, self.next_group, self.buffer = n, 0, []

    def get_samples(self, k: int) -> list[list[Sample]]:
        out = [self.buffer.pop(0) for _ in range(min(k, len(self.buffer)))]
        while len(out) < k:
            g = self.next_group
            out.append(
                [Sample(tokens=[1, 2, 3], label="7", group_index=g, index=g * self.n + i) for i in range(self.n)]
            )
            self.next_group += 1
        return out

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.buffer.extend(groups)


def _manager(rm: str, *, filter_path: str | None = None, limit: int | None = 12, stop: asyncio.Event | None = None):
    cfg = MilesConfig()
    r = cfg.rollout
    r.rollout_batch_size, r.n_samples_per_prompt, r.over_sampling_batch_size = 4, 4, 4
    r.rollout_max_consecutive_drops, r.dynamic_sampling_filter_path = limit, filter_path
    cfg.reward.custom_rm_path = f"{__name__}:{rm}"
    source, router = ListSource(4), EchoRouter()
    return SyncRolloutManager(cfg, router, source, tokenizer=None, stop=stop), source, router


def test_a_reward_that_is_always_none_stops_after_the_limit_with_the_cause() -> None:
    manager, source, router = _manager("none_rm", limit=12)
    with pytest.raises(RolloutStalled) as info:
        asyncio.run(manager.generate(3))
    text = str(info.value)
    assert text.startswith("rollout 3: the last 12 groups (48 samples) were all dropped (reward_failed 12)")
    assert "0 of 4 groups accepted" in text and f"--custom-rm-path {__name__}:none_rm" in text
    assert "returned None (NoneType)" in text and "--rollout-max-consecutive-drops (now 12)" in text
    assert router.requests <= 4 * (12 + 4)  # bounded: the limit plus one refill in flight
    assert all(s.status == SampleStatus.ABORTED for g in source.buffer for s in g)  # prompts kept for a retry


def test_a_filter_that_rejects_everything_stops_naming_the_filter() -> None:
    manager, _, _ = _manager("parity_rm", filter_path=f"{__name__}:reject_all", limit=8)
    with pytest.raises(RolloutStalled) as info:
        asyncio.run(manager.generate(0))
    assert (
        "were all dropped (dynamic_filter/drop_filtered 8); 0 of 4 groups accepted. The dynamic sampling "
        f"filter --dynamic-sampling-filter-path {__name__}:reject_all rejected groups." in str(info.value)
    )


def test_mixed_causes_are_all_named() -> None:
    manager, _, _ = _manager("by_index_rm", filter_path=f"{__name__}:reject_all", limit=8)
    with pytest.raises(RolloutStalled) as info:
        asyncio.run(manager.generate(0))
    text = str(info.value)
    # the last 8 drops, by cause (how they split depends on which groups finish first)
    failed = re.search(r"[(,] ?reward_failed (\d+)[,)]", text)
    filtered = re.search(r"[(,] ?dynamic_filter/drop_filtered (\d+)[,)]", text)
    assert failed and filtered, text
    assert int(failed[1]) + int(filtered[1]) == 8 and int(failed[1]) > 0 and int(filtered[1]) > 0, text
    assert f"the reward (--custom-rm-path {__name__}:by_index_rm) failed; first error: " in text.lower()
    assert (
        f"the dynamic sampling filter --dynamic-sampling-filter-path {__name__}:reject_all rejected groups"
        in text.lower()
    )


def test_bad_reward_values_are_counted_named_and_the_rollout_completes(caplog) -> None:
    """Samples 0, 1, 2 mod 8 fail (NaN, "1.0", inf), so every even group of 4 is dropped; its prompt is
    retried until it failed MAX_REWARD_ATTEMPTS times, then skipped. The odd groups are accepted."""
    manager, source, _ = _manager("by_index_rm", limit=None)
    with caplog.at_level(logging.WARNING, logger="miles.controller.rollout_manager"):
        result = asyncio.run(manager.generate(0))
    assert [g[0].group_index for g in result.groups] == [1, 3, 5, 7]
    assert all(isinstance(s.reward, float) and math.isfinite(s.reward) for g in result.groups for s in g)
    m = result.metrics
    assert m["rollout/reward_failed_groups"] >= MAX_REWARD_ATTEMPTS  # group 0 at least, every attempt
    # 3 bad samples a failing group; groups still scoring when the step's last group arrives are aborted and
    # handed back (their failed samples count, the group is not a drop), so samples can exceed 3 x drops
    assert m["rollout/reward_failed_samples"] % 3 == 0
    assert m["rollout/reward_failed_samples"] >= 3 * m["rollout/reward_failed_groups"]
    assert m["rollout/reward_failed_skipped_prompts"] >= 1
    assert all(
        g[0].group_index % 2 == 0 and g[0].metadata.get("reward_attempts", 0) < MAX_REWARD_ATTEMPTS
        for g in source.buffer
    )  # still to retry: failing prompts only, none past the limit (one aborted before its first score has none)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "reward failed for sample 0 (group 0)" in warned and "returned nan (float)" in warned
    assert "reward failed for sample 1 (group 0)" in warned and "returned '1.0' (str)" in warned
    assert f"the reward of group 0 failed {MAX_REWARD_ATTEMPTS} times; its prompt is skipped" in warned


def test_a_stop_signal_ends_the_retry_loop_and_hands_every_prompt_back() -> None:
    async def body(manager, stop):
        task = asyncio.create_task(manager.generate(0))
        while manager.runner.reward_failures < 40:  # well inside the retry loop
            await asyncio.sleep(0)
        stop.set()
        with pytest.raises(StopRequested):
            await task

    stop = asyncio.Event()
    manager, source, _ = _manager("none_rm", limit=10**9, stop=stop)
    asyncio.run(body(manager, stop))
    assert source.buffer and all(s.status == SampleStatus.ABORTED for g in source.buffer for s in g)


# ---- the guard and its default ------------------------------------------------------------------


def test_guard_counts_only_drops_in_a_row() -> None:
    guard = DropGuard(3, target=2, args=_args(rm_type="math"), where="rollout 0")
    group = [Sample(index=0)]
    guard.drop(group, "reward_failed")
    guard.drop(group, "aborted")
    guard.accept()  # an accepted group resets the run of drops
    guard.drop(group, "aborted")
    guard.drop(group, "aborted")
    with pytest.raises(
        RolloutStalled, match="the last 3 groups .* 1 of 2 groups accepted. The engines aborted requests"
    ):
        guard.drop(group, "aborted")


def test_default_limit_is_sixteen_refills() -> None:
    r = MilesConfig().rollout
    r.rollout_batch_size = 8
    assert max_consecutive_drops(r) == 128
    r.over_sampling_batch_size = 12
    assert max_consecutive_drops(r) == 192
    r.rollout_max_consecutive_drops = 5
    assert max_consecutive_drops(r) == 5


# ---- errors that end a run with one line ------------------------------------------------------------


def test_a_worker_raised_run_failure_comes_back_as_its_kind() -> None:
    remote = RuntimeError("trainer:0.train() raised NonFiniteTraining: step 2 ...\n--- remote traceback ---")
    remote.exc_type, remote.remote_message = "NonFiniteTraining", "step 2: the actor has loss=nan"
    failure = as_run_failure(remote)
    assert isinstance(failure, NonFiniteTraining) and str(failure) == "step 2: the actor has loss=nan"
    assert as_run_failure(ValueError("a bug")) is None


# ---- numeric flags -------------------------------------------------------------------------------

BASE = minimal_train_args(num_rollout=2)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lr", "inf"], "config error: --lr=inf is not a finite number; give a real value (default 1e-06)"),
        (["--lr", "nan"], "config error: --lr=nan is not a finite number"),
        (["--lr=-1e-6"], "config error: --lr=-1e-06 is outside [0, inf)"),
        (["--kl-loss-coef=-inf"], "config error: --kl-loss-coef=-inf is not a finite number"),
        (["--adam-beta2", "1"], "config error: --adam-beta2=1.0 is outside [0, 1)"),
        (["--rollout-top-p", "0"], "config error: --rollout-top-p=0.0 is outside (0, 1]"),
        (
            ["--rollout-max-consecutive-drops", "0"],
            "config error: --rollout-max-consecutive-drops=0 is outside [1, inf)",
        ),
        # a batch knob below 1 is the batch rule's one line, not that and its range as well
        (["--rollout-batch-size", "0"], "config error: --rollout-batch-size=0 must be a positive integer"),
    ],
)
def test_bad_numbers_are_refused_with_one_line(flags, message) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(BASE + flags)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_edge_values_are_accepted() -> None:
    cfg = load_config(
        BASE
        + [
            "--lr",
            "0",
            "--rollout-temperature",
            "0",
            "--rollout-top-p",
            "1",
            "--clip-grad",
            "0",
            "--gamma",
            "1",
            "--rollout-max-consecutive-drops",
            "1",
        ]
    )
    assert cfg.train.lr == 0.0 and cfg.rollout.rollout_max_consecutive_drops == 1
