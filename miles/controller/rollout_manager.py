"""The sync rollout step: submit groups until `rollout_batch_size` accepted groups exist.

Groups are the unit of scheduling, filtering and dropping. A group is accepted when every
sample finished (completed or truncated), every reward is known, and the dynamic filter keeps
it. Aborted groups and groups whose reward failed (after its retries, or a value that is not a
finite number) are dropped and counted; their prompts go back to the data source so nothing is
lost. Retries are bounded: when every group keeps dropping, `DropGuard` ends the run with one
error naming the cause. A stop signal abandons the step at once and hands its prompts back.

Once the step has its groups, the ones still generating are aborted. Without `--partial-rollout`
their prompts go back to be generated afresh; with it they go back as they stand (Miles' partial
rollout): finished samples keep their output and reward, aborted ones their tokens, log-probs
and weight versions, and the next rollout resumes them from prompt + partial response. A group is
trained at most once: only groups that were not accepted go back.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from miles.config import MilesConfig
from miles.controller.drop_guard import DropGuard, max_consecutive_drops
from miles.controller.group_runner import GroupRunner, sampling_from_config
from miles.controller.router import Router
from miles.controller.signals import StopRequested
from miles.errors import RolloutStalled
from miles.rollout.data_source import DataSource
from miles.rollout.filters import DynamicFilterOutput, apply_filter
from miles.rollout.opd_teacher import TeacherScorer
from miles.rollout.sample import Sample, SampleStatus
from miles.rollout.train_data import reward_value
from miles.utils.misc import load_function

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

MAX_REWARD_ATTEMPTS = 3  # a prompt whose reward failed this many times is skipped, not retried forever


@dataclass
class RolloutResult:
    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)


def _submission_order(group: list[Sample]) -> int:
    """Groups are drawn (and sample indices given) in order; carried groups keep their earlier indices."""
    return min(s.index for s in group)


def prompt_group(group: list[Sample]) -> list[Sample]:
    """One sample per prompt copy (a generate function may have turned one into several trajectories)."""
    seen: set[int | None] = set()
    out = []
    for s in group:
        if s.index is None or s.index not in seen:
            seen.add(s.index)
            out.append(s)
    return out


def group_drop_reason(group: list[Sample], *, scored: bool = True) -> str | None:
    """Why a finished group cannot be trained on (None: it can). `scored=False` before rewards exist."""
    if any(s.status == SampleStatus.ABORTED for s in group):
        return "aborted"
    if any(s.status == SampleStatus.FAILED for s in group):
        return "reward_failed"
    if scored and any(s.reward is None for s in group):
        return "no_reward"
    return None


def retry_after_reward_failure(group: list[Sample]) -> bool:
    """Count a reward failure of the group's prompt; False once it reached MAX_REWARD_ATTEMPTS (skip it).

    Retrying covers a flaky reward server; a reward that always fails on one prompt (a bad label, a
    plug-in bug) would otherwise come back first in every refill and crowd out fresh prompts.
    """
    attempts = int(group[0].metadata.get("reward_attempts", 0)) + 1
    for s in group:
        s.metadata["reward_attempts"] = attempts
    if attempts < MAX_REWARD_ATTEMPTS:
        return True
    logger.warning(
        "the reward of group %s failed %d times; its prompt is skipped (last error: %s)",
        group[0].group_index,
        attempts,
        group[0].metadata.get("reward_error"),
    )
    return False


@dataclass
class _Step:
    """One sync step's groups as `SyncRolloutManager.generate` moves them along."""

    rollout_id: int
    target: int
    guard: DropGuard
    accepted: list[list[Sample]] = field(default_factory=list)
    drops: Counter[str] = field(default_factory=Counter)
    pending: set[asyncio.Task] = field(default_factory=set)
    submitted: int = 0
    generated: list[list[Sample]] = field(default_factory=list)  # separate reward phase: generated, not yet scored
    surplus: list[list[Sample]] = field(default_factory=list)  # --partial-rollout: finished after the target

    def wanted(self) -> int:
        """Groups still to submit: the target less those accepted, generating or waiting for rewards."""
        return self.target - len(self.accepted) - len(self.pending) - len(self.generated)


class SyncRolloutManager:
    """Produces one step's accepted groups from the data source through the router."""

    def __init__(
        self,
        cfg: MilesConfig,
        router: Router,
        data_source: DataSource,
        tokenizer: PreTrainedTokenizerBase,
        *,
        plugin_args: argparse.Namespace | None = None,
        seed: int | None = None,
        stop: asyncio.Event | None = None,
        teacher: TeacherScorer | None = None,
    ) -> None:
        """`plugin_args`: the flat namespace the filters, rewards and generate plug-ins receive."""
        self.rollout = cfg.rollout
        self.reward_key = cfg.reward.reward_key
        self.router = router
        self.data_source = data_source
        self.runner = GroupRunner(
            cfg,
            router,
            tokenizer,
            sampling_from_config(cfg.rollout),
            plugin_args=plugin_args,
            reward_inline=cfg.rollout.reward_phase == "inline",
            deterministic_seed=seed,
            recompute_logprobs=cfg.rollout.recompute_logprobs_via_prefill,
            teacher=teacher,
        )
        self.plugin_args = self.runner.plugin_args
        self.filter_fn = load_function(cfg.rollout.dynamic_sampling_filter_path)
        self.sample_filter_fn = load_function(cfg.rollout.rollout_sample_filter_path)
        self.max_drops = max_consecutive_drops(cfg.rollout)
        self.stop = stop  # set by a stop signal: the step is abandoned and its prompts handed back

    async def generate(self, rollout_id: int) -> RolloutResult:
        """`rollout_batch_size` accepted groups; raises RolloutStalled when every group keeps dropping and
        StopRequested (prompts handed back) when a stop signal arrives meanwhile."""
        target = self.rollout.rollout_batch_size
        guard = DropGuard(self.max_drops, target=target, args=self.plugin_args, where=f"rollout {rollout_id}")
        step = _Step(rollout_id, target, guard)
        try:
            while len(step.accepted) < target:
                self._submit(step)
                for group in await self._next_round(step):
                    self._admit(group, step)
        except StopRequested:
            logger.warning(
                "rollout %d abandoned by the stop signal (%d of %d groups accepted); its prompts go back "
                "to the data source",
                rollout_id,
                len(step.accepted),
                target,
            )
            self._hand_back(step.accepted + step.generated)
            raise
        finally:
            carried = await self._abort_leftovers(step.pending, rollout_id, step.surplus)
        return self._result(step, carried)

    def _submit(self, step: _Step) -> None:
        """Draw --over-sampling-batch-size groups (default the target) when fewer than the target are on the way."""
        if step.wanted() <= 0:
            return
        for group in self.data_source.get_samples(self.rollout.over_sampling_batch_size or step.target):
            step.pending.add(asyncio.create_task(self.runner.run(group)))
            step.submitted += 1

    async def _next_round(self, step: _Step) -> list[list[Sample]]:
        """The next scored groups to judge (none while a separate reward phase waits for more generation)."""
        if not step.pending and not step.generated:
            raise RolloutStalled(
                f"rollout {step.rollout_id}: the data source gave no prompts; "
                f"{len(step.accepted)} of {step.target} groups accepted"
            )
        finished, step.pending = await self._next_finished(step.pending)
        if self.runner.reward_inline:
            return finished
        step.generated += [g for g in finished if not self._drop(g, step.drops, step.guard, scored=False)]
        if step.pending and len(step.accepted) + len(step.generated) < step.target:
            return []  # keep generating; score once this round's generation is complete
        finished, step.generated = step.generated, []
        whole_group = self.runner.scores_whole_groups
        await asyncio.gather(*(self.runner.score(g, whole_group=whole_group) for g in finished))
        return finished

    def _admit(self, group: list[Sample], step: _Step) -> None:
        """Accept a scored group up to the target; past it, --partial-rollout carries it to the next step."""
        if self._drop(group, step.drops, step.guard):
            return
        if len(step.accepted) < step.target:
            step.accepted.append(group)
            step.guard.accept()
        elif self.rollout.partial_rollout:
            step.surplus.append(group)

    def _result(self, step: _Step, carried: int) -> RolloutResult:
        accepted = sorted(step.accepted, key=_submission_order)
        if self.sample_filter_fn is not None:
            self.sample_filter_fn(self.plugin_args, accepted)
        metrics = {
            **rollout_metrics(accepted, step.drops, step.submitted, self.reward_key),
            **self.runner.pop_metrics(),
        }
        if self.rollout.partial_rollout:
            metrics["rollout/partial_groups_carried"] = float(carried)
        return RolloutResult(accepted, metrics)

    async def _next_finished(self, pending: set[asyncio.Task]) -> tuple[list[list[Sample]], set[asyncio.Task]]:
        """Wait for some groups to finish, or for a stop signal (then every task stays pending, to be aborted)."""
        if self.stop is not None and self.stop.is_set():
            raise StopRequested
        if not pending:
            return [], pending
        stop_wait = asyncio.ensure_future(self.stop.wait()) if self.stop is not None else None
        try:
            done, _ = await asyncio.wait(
                pending | ({stop_wait} if stop_wait else set()), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if stop_wait is not None:
                stop_wait.cancel()
        if self.stop is not None and self.stop.is_set():
            raise StopRequested
        # groups that finished together are taken in submission order (asyncio.wait's set has none):
        # which of them fill the batch must not depend on hashing
        return sorted((t.result() for t in done), key=_submission_order), pending - done

    def _drop(self, group: list[Sample], drops: Counter[str], guard: DropGuard, *, scored: bool = True) -> bool:
        """True when the group cannot be trained on; a failed or aborted group's prompt is retried."""
        reason = group_drop_reason(group, scored=scored)
        if reason is not None:
            drops[f"{reason}_groups"] += 1
            if reason != "reward_failed" or retry_after_reward_failure(group):
                self._hand_back([group])
            else:
                drops["reward_failed_skipped_prompts"] += 1
            guard.drop(group, reason)
            return True
        if not scored:
            return False
        verdict = self._filter(group)
        if verdict.keep:
            return False
        key = f"dynamic_filter/drop_{verdict.reason or 'filtered'}"
        drops[key] += 1
        guard.drop(group, key)
        return True

    def _hand_back(self, groups: list[list[Sample]]) -> None:
        """Return groups' prompts to the data source, outputs cleared: they are generated again."""
        groups = [prompt_group(g) for g in groups]
        for group in groups:
            for s in group:
                s.reset_for_retry()
        if groups:
            self.data_source.add_samples(groups)

    def _filter(self, group: list[Sample]) -> DynamicFilterOutput:
        if self.filter_fn is None:
            return DynamicFilterOutput(keep=True)
        return apply_filter(self.filter_fn, self.plugin_args, group)

    async def _abort_leftovers(self, pending: set[asyncio.Task], rollout_id: int, surplus: list[list[Sample]]) -> int:
        """Abort the groups still generating and hand them back; returns how many were carried as they stand."""
        groups = list(surplus)
        if pending:
            await self.router.abort_all()
            await self.runner.on_abort()
            results = await asyncio.gather(*pending, return_exceptions=True)
            groups += [g for g in results if isinstance(g, list)]  # over-sampled, not needed: back in order
        if not self.rollout.partial_rollout:
            self._hand_back(groups)
            return 0
        groups.sort(key=lambda g: min(s.index or 0 for s in g))  # served next in prompt order
        for group in groups:
            for s in group:
                s.metadata.setdefault("start_rollout_id", rollout_id)
                if s.status not in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED, SampleStatus.ABORTED):
                    s.reset_for_retry()  # a failed reward is generated again, not resumed
        if groups:
            self.data_source.add_samples(groups)
        return len(groups)


def rollout_metrics(
    groups: list[list[Sample]], drops: Counter[str] | dict[str, int], submitted: int, reward_key: str | None = None
) -> dict[str, float]:
    """A step's rollout figures: rewards and lengths of the groups trained on, groups submitted and dropped."""
    samples = [s for g in groups for s in g]
    raw = np.array([reward_value(s, reward_key) for s in samples], dtype=np.float64)
    lengths = np.array([s.response_length for s in samples], dtype=np.float64)
    m = {
        "rollout/reward_mean": float(raw.mean()) if len(raw) else float("nan"),
        "rollout/reward_std": float(raw.std()) if len(raw) else float("nan"),
        "rollout/response_len_mean": float(lengths.mean()) if len(lengths) else 0.0,
        "rollout/response_len_max": float(lengths.max()) if len(lengths) else 0.0,
        "rollout/truncated_frac": float(np.mean([s.status == SampleStatus.TRUNCATED for s in samples]))
        if samples
        else 0.0,
        "rollout/groups_submitted": float(submitted),
    }
    for k, v in drops.items():
        m[f"rollout/{k}"] = float(v)
    m.update(multi_turn_metrics(samples))
    return m


def multi_turn_metrics(samples: list[Sample]) -> dict[str, float]:
    """Turns per trajectory and the share of response tokens the model generated (loss mask 1)."""
    turns = [s.metadata["num_turns"] for s in samples if "num_turns" in s.metadata]
    if not turns:
        return {}
    masked = [sum(s.loss_mask) for s in samples if s.loss_mask is not None]
    lengths = sum(s.response_length for s in samples if s.loss_mask is not None)
    return {
        "rollout/turns_mean": float(np.mean(turns)),
        "rollout/turns_max": float(max(turns)),
        "rollout/model_token_frac": float(sum(masked)) / lengths if lengths else 0.0,
    }
