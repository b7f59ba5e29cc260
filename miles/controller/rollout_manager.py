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
import dataclasses
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from miles.agent.plugins import agent_abort_hook, load_generate
from miles.config import RolloutConfig
from miles.controller.drop_guard import DropGuard, max_consecutive_drops
from miles.controller.router import Router
from miles.controller.signals import StopRequested
from miles.errors import RolloutStalled
from miles.rollout.data_source import DataSource
from miles.rollout.filters import DynamicFilterOutput, apply_filter
from miles.rollout.generate import SamplingDefaults, generate_group, generate_sample, is_fresh
from miles.rollout.opd_teacher import TeacherRoutingError, TeacherScorer
from miles.rollout.rm_hub import RewardFailed, async_rm, batched_async_rm, check_reward
from miles.rollout.sample import Sample, SampleStatus
from miles.rollout.train_data import reward_value
from miles.utils.misc import load_function
from miles.utils.routing import routing_shape

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_REWARD_WARNINGS_PER_STEP = 5
MAX_REWARD_ATTEMPTS = 3  # a prompt whose reward failed this many times is skipped, not retried forever


@dataclass
class RolloutResult:
    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)


def sampling_from_config(rollout: RolloutConfig, eval_overrides: dict[str, Any] | None = None) -> SamplingDefaults:
    s = SamplingDefaults(
        temperature=rollout.rollout_temperature,
        top_p=rollout.rollout_top_p,
        top_k=rollout.rollout_top_k,
        min_p=rollout.rollout_min_p,
        max_new_tokens=rollout.rollout_max_response_len,
        max_context_len=rollout.rollout_max_context_len,
        stop=tuple(rollout.rollout_stop or ()),
        stop_token_ids=tuple(rollout.rollout_stop_token_ids or ()),
        skip_special_tokens=rollout.rollout_skip_special_tokens,
    )
    for k, v in (eval_overrides or {}).items():
        if v is not None:
            setattr(s, k, v)
    return s


def _submission_order(group: list[Sample]) -> int:
    """Groups are drawn (and sample indices given) in order; carried groups keep their earlier indices."""
    return min(s.index for s in group)


class GroupRunner:
    """Generates and scores one group; shared by the sync rollout, eval and the fully async producer."""

    def __init__(
        self,
        args: argparse.Namespace,
        router: Router,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingDefaults,
        *,
        reward_inline: bool = True,
        deterministic_seed: int | None = None,
        recompute_logprobs: bool = False,
        evaluation: bool = False,
        teacher: TeacherScorer | None = None,
    ) -> None:
        self.args = args
        self.router = router
        self.tokenizer = tokenizer
        self.teacher = teacher  # on-policy distillation: scores every finished sample
        if teacher is not None and teacher.student_top_k:
            sampling = dataclasses.replace(sampling, top_logprobs_num=teacher.student_top_k)
        if getattr(args, "use_rollout_routing_replay", False) and not evaluation:  # R3: every token's experts
            sampling = dataclasses.replace(sampling, routing=routing_shape(args.hf_checkpoint))
        self.sampling = sampling
        self.reward_inline = reward_inline
        self.deterministic_seed = deterministic_seed
        self.group_reward_fn = load_function(getattr(args, "group_reward_path", None))
        self.recompute_logprobs = recompute_logprobs
        self.evaluation = evaluation
        self.plugin_generate = plugin_generate_fn(args)  # None: the built-in single-turn generate
        self.abort_hook = agent_abort_hook(getattr(args, "custom_agent_function_path", None))
        # one routing key per trajectory: every turn on one engine (and none missing in session mode)
        self.keyed = bool(getattr(args, "use_session_server", None)) or self.plugin_generate is not None
        self.tool_time_s = 0.0
        # Miles' --sglang-server-concurrency: at most this many samples in flight per engine
        engines = len(getattr(router, "engines", ())) or 1
        self.concurrency = args.sglang_server_concurrency * engines
        self.in_flight = asyncio.Semaphore(self.concurrency)
        self._claiming = asyncio.Lock()  # a group takes its permits all at once: no two groups hold part each
        self.reward_failures = 0
        self.reward_time_s = 0.0
        self.recompute_time_s = 0.0
        self._prefix_seen = (0, 0)  # the router's (prompt, cached) token totals at the last pop_metrics

    def _seed(self, sample: Sample) -> int | None:
        if self.deterministic_seed is None or sample.index is None:
            return None
        return self.deterministic_seed + sample.index

    async def _one(self, sample: Sample) -> list[Sample]:
        """One trajectory: a sample, or several from a generate function that returns a list."""
        key = sample.routing_key = sample.routing_key or (uuid.uuid4().hex if self.keyed else None)
        try:
            async with self.in_flight:
                samples = await self._generate(sample)
                for s in samples:
                    if self.recompute_logprobs and s.status != SampleStatus.ABORTED and s.response_length:
                        await self.recompute(s)
                await self._teacher_scores(samples)
        finally:
            if key is not None and hasattr(self.router, "release_key"):
                self.router.release_key(key)
        self.tool_time_s += sum(s.non_generation_time for s in samples)
        await self._score_unscored(samples)
        return samples

    async def _score_unscored(self, samples: list[Sample]) -> None:
        # a sample finished before a partial-rollout abort keeps its reward; a failed teacher leaves it FAILED
        unscored = [
            s for s in samples if s.status not in (SampleStatus.ABORTED, SampleStatus.FAILED) and s.reward is None
        ]
        if self.reward_inline and not self.args.group_rm and unscored:
            await self.score(unscored)

    async def _teacher_scores(self, samples: list[Sample]) -> None:
        """On-policy distillation: the teacher's log-probs of every finished sample, concurrently."""
        if self.teacher is not None:
            await asyncio.gather(
                *(self._teacher_score(s) for s in samples if s.status != SampleStatus.ABORTED and s.response_length)
            )

    async def _teacher_score(self, sample: Sample) -> None:
        """A teacher that fails marks the sample FAILED, as a reward would."""
        if sample.teacher_log_probs is not None and len(sample.teacher_log_probs) == sample.response_length:
            return  # scored before a partial-rollout abort and carried whole
        try:
            await self.teacher.score(sample)
        except TeacherRoutingError:
            raise  # the data names a teacher the flags do not: the run stops with that line
        except Exception as e:  # noqa: BLE001 - a teacher down or a bad reply: this sample cannot be trained on
            self._reward_failed(sample, RewardFailed(f"teacher scoring failed: {type(e).__name__}: {e}"))

    async def _generate(self, sample: Sample) -> list[Sample]:
        if self.plugin_generate is None:
            return [await generate_sample(self.router, sample, self.tokenizer, self.sampling, seed=self._seed(sample))]
        if sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
            return [sample]
        params = {
            **self.sampling.to_payload(0, seed=self._seed(sample)),
            **(sample.metadata.get("sampling_params") or {}),
        }  # per-prompt overrides
        return await self.plugin_generate(self.args, sample, params, self.evaluation, self.tokenizer)

    async def on_abort(self) -> None:
        """The agent function's sibling `abort` hook, once the engines aborted the rollout's requests."""
        if self.abort_hook is not None:
            result = self.abort_hook()
            if asyncio.iscoroutine(result):
                await result

    def _batchable(self, group: list[Sample]) -> bool:
        """One batched call for the group: all fresh, one round trip each, no session routing."""
        return (
            1 < len(group) <= self.concurrency
            and not self.recompute_logprobs
            and not self.keyed
            and getattr(self.router, "batched_generate", False)
            and not getattr(self.router, "session_mode", False)
            and all(is_fresh(s) for s in group)
        )

    async def _batch(self, group: list[Sample]) -> list[Sample]:
        async with self._claiming:
            for _ in group:
                await self.in_flight.acquire()
        try:
            group = await generate_group(
                self.router, group, self.tokenizer, self.sampling, seeds=[self._seed(s) for s in group]
            )
            await self._teacher_scores(group)
        finally:
            for _ in group:
                self.in_flight.release()
        await self._score_unscored(group)
        return group

    async def run(self, group: list[Sample]) -> list[Sample]:
        if self._batchable(group):
            group = await self._batch(group)
        else:
            group = [s for trajectory in await asyncio.gather(*(self._one(s) for s in group)) for s in trajectory]
        if self.reward_inline and (self.args.group_rm or self.group_reward_fn):
            if not any(s.status == SampleStatus.ABORTED for s in group):
                await self.score(group, whole_group=True)
        return group

    async def recompute(self, sample: Sample) -> None:
        """Re-score the sampled tokens with one prefill pass (the shape of computation the trainer uses)."""
        start = time.perf_counter()
        payload = {
            "input_ids": list(sample.tokens),
            "return_logprob": True,
            "logprob_start_len": sample.prompt_length,
            "sampling_params": {"max_new_tokens": 0, "temperature": self.sampling.temperature},
        }
        keyed = {"routing_key": sample.routing_key} if sample.routing_key else {}  # the engine that has its prefix
        out = await self.router.generate(payload, **keyed)
        logprobs = [float(t[0]) for t in out["meta_info"]["input_token_logprobs"]]
        if len(logprobs) != sample.response_length:
            raise RuntimeError(
                f"prefill re-scoring returned {len(logprobs)} log-probs for "
                f"{sample.response_length} response tokens (sample {sample.index})"
            )
        sample.metadata["decode_log_probs"] = sample.rollout_log_probs
        sample.rollout_log_probs = logprobs
        self.recompute_time_s += time.perf_counter() - start

    async def score(self, samples: list[Sample], *, whole_group: bool = False) -> None:
        """Reward the samples; a reward that fails after its retries marks the sample FAILED."""
        start = time.perf_counter()
        try:
            await self._score(samples, whole_group=whole_group)
        finally:
            self.reward_time_s += time.perf_counter() - start

    async def _score(self, samples: list[Sample], *, whole_group: bool = False) -> None:
        try:
            results = await self._rewards(samples, whole_group)
        except RewardFailed as e:  # `.results` holds the siblings that did score
            results = getattr(e, "results", None) or [e] * len(samples)
        for s, r in zip(samples, results, strict=True):
            if isinstance(r, RewardFailed):
                self._reward_failed(s, r)
            else:
                s.reward = r

    async def _rewards(self, samples: list[Sample], whole_group: bool) -> list[Any]:
        if whole_group and self.group_reward_fn is not None:
            result = self.group_reward_fn(self.args, samples)
            rewards = await result if asyncio.iscoroutine(result) else result
            source = f"--group-reward-path {self.args.group_reward_path}"
            return [self._checked(r, s, source) for s, r in zip(samples, rewards, strict=True)]
        if whole_group or self.args.group_rm or len(samples) > 1:
            return await batched_async_rm(self.args, samples)
        return [await async_rm(self.args, samples[0])]

    def _checked(self, reward: Any, sample: Sample, source: str) -> Any:
        try:
            return check_reward(reward, sample, source=source, reward_key=self.args.reward_key)
        except RewardFailed as e:
            return e

    def _reward_failed(self, sample: Sample, error: RewardFailed) -> None:
        """Mark the sample FAILED and count it; the first few of each step are named in a warning."""
        self.reward_failures += 1
        sample.status = SampleStatus.FAILED
        sample.metadata["reward_error"] = str(error)
        if self.reward_failures <= _REWARD_WARNINGS_PER_STEP:
            more = (
                "; further failures this step are only counted (rollout/reward_failed_samples)"
                if self.reward_failures == _REWARD_WARNINGS_PER_STEP
                else ""
            )
            logger.warning(
                "reward failed for sample %s (group %s): %s%s", sample.index, sample.group_index, error, more
            )

    def pop_metrics(self) -> dict[str, float]:
        """Reward failures and time summed over samples since the last call (rewards and re-scoring
        run concurrently with generation, so these are sums, not wall time); the teacher's, with OPD."""
        m = {
            "rollout/reward_failed_samples": float(self.reward_failures),
            "perf/rollout/reward_time_sum": self.reward_time_s,
            "perf/rollout/log_prob_recompute_time_sum": self.recompute_time_s,
        }
        if self.plugin_generate is not None:  # tool / environment seconds, apart from generation
            m["perf/rollout/tool_time_sum"] = self.tool_time_s
        if self.teacher is not None:
            m.update(self.teacher.pop_metrics())
        m.update(self._prefix_metrics())
        self.reward_failures = 0
        self.reward_time_s = self.recompute_time_s = self.tool_time_s = 0.0
        return m

    def _prefix_metrics(self) -> dict[str, float]:
        """Share of the prompt tokens since the last call that the engines served from their prefix caches
        (the router sums SGLang's `cached_tokens` / `prompt_tokens` of every response it places)."""
        loads = getattr(self.router, "loads", None)
        if loads is None:
            return {}
        prompt = sum(load.prompt_tokens for load in loads)
        cached = sum(load.cached_tokens for load in loads)
        seen_prompt, seen_cached = self._prefix_seen
        self._prefix_seen = (prompt, cached)
        if prompt == seen_prompt:
            return {}
        return {"perf/rollout/prefix_hit_rate": (cached - seen_cached) / (prompt - seen_prompt)}


def prompt_group(group: list[Sample]) -> list[Sample]:
    """One sample per prompt copy (a generate function may have turned one into several trajectories)."""
    seen: set[int | None] = set()
    out = []
    for s in group:
        if s.index is None or s.index not in seen:
            seen.add(s.index)
            out.append(s)
    return out


def plugin_generate_fn(args):
    """The generate plug-in of the run (the agent driver when only an agent function is given), or None."""
    path = getattr(args, "custom_generate_function_path", None)
    if not path and getattr(args, "custom_agent_function_path", None):
        path = "miles.agent.agentic:generate"
    return load_generate(path) if path else None


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


class SyncRolloutManager:
    """Produces one step's accepted groups from the data source through the router."""

    def __init__(
        self,
        args: argparse.Namespace,
        rollout_cfg: RolloutConfig,
        router: Router,
        data_source: DataSource,
        tokenizer: PreTrainedTokenizerBase,
        *,
        seed: int | None = None,
        stop: asyncio.Event | None = None,
        teacher: TeacherScorer | None = None,
    ) -> None:
        self.args = args
        self.cfg = rollout_cfg
        self.router = router
        self.data_source = data_source
        self.runner = GroupRunner(
            args,
            router,
            tokenizer,
            sampling_from_config(rollout_cfg),
            reward_inline=rollout_cfg.reward_phase == "inline",
            deterministic_seed=seed,
            recompute_logprobs=rollout_cfg.recompute_logprobs_via_prefill,
            teacher=teacher,
        )
        self.filter_fn = load_function(rollout_cfg.dynamic_sampling_filter_path)
        self.sample_filter_fn = load_function(rollout_cfg.rollout_sample_filter_path)
        self.max_drops = max_consecutive_drops(rollout_cfg)
        self.stop = stop  # set by a stop signal: the step is abandoned and its prompts handed back

    async def generate(self, rollout_id: int) -> RolloutResult:
        """`rollout_batch_size` accepted groups; raises RolloutStalled when every group keeps dropping and
        StopRequested (prompts handed back) when a stop signal arrives meanwhile."""
        target = self.cfg.rollout_batch_size
        refill = self.cfg.over_sampling_batch_size or target
        guard = DropGuard(self.max_drops, target=target, args=self.args, where=f"rollout {rollout_id}")
        accepted: list[list[Sample]] = []
        drops: Counter[str] = Counter()
        pending: set[asyncio.Task] = set()
        submitted = 0
        generated: list[list[Sample]] = []  # separate reward phase: generated, not yet scored
        surplus: list[list[Sample]] = []  # --partial-rollout: finished after the target, carried whole
        try:
            while len(accepted) < target:
                if len(accepted) + len(pending) + len(generated) < target:
                    for group in self.data_source.get_samples(refill):
                        pending.add(asyncio.create_task(self.runner.run(group)))
                        submitted += 1
                if not pending and not generated:
                    raise RolloutStalled(
                        f"rollout {rollout_id}: the data source gave no prompts; "
                        f"{len(accepted)} of {target} groups accepted"
                    )
                finished, pending = await self._next_finished(pending)
                if not self.runner.reward_inline:
                    generated += [g for g in finished if not self._drop(g, drops, guard, scored=False)]
                    if pending and len(accepted) + len(generated) < target:
                        continue  # keep generating; score once this round's generation is complete
                    finished, generated = generated, []
                    await asyncio.gather(
                        *(
                            self.runner.score(
                                g, whole_group=self.args.group_rm or self.runner.group_reward_fn is not None
                            )
                            for g in finished
                        )
                    )
                for group in finished:
                    if self._drop(group, drops, guard):
                        continue
                    if len(accepted) < target:
                        accepted.append(group)
                        guard.accept()
                    elif self.cfg.partial_rollout:
                        surplus.append(group)
        except StopRequested:
            logger.warning(
                "rollout %d abandoned by the stop signal (%d of %d groups accepted); its prompts go back "
                "to the data source",
                rollout_id,
                len(accepted),
                target,
            )
            self._hand_back(accepted + generated)
            raise
        finally:
            carried = await self._abort_leftovers(pending, rollout_id, surplus)
        accepted.sort(key=_submission_order)
        if self.sample_filter_fn is not None:
            self.sample_filter_fn(self.args, accepted)
        metrics = {**self._metrics(accepted, drops, submitted, self.args.reward_key), **self.runner.pop_metrics()}
        if self.cfg.partial_rollout:
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
        return apply_filter(self.filter_fn, self.args, group)

    async def _abort_leftovers(self, pending: set[asyncio.Task], rollout_id: int, surplus: list[list[Sample]]) -> int:
        """Abort the groups still generating and hand them back; returns how many were carried as they stand."""
        groups = list(surplus)
        if pending:
            await self.router.abort_all()
            await self.runner.on_abort()
            results = await asyncio.gather(*pending, return_exceptions=True)
            groups += [g for g in results if isinstance(g, list)]  # over-sampled, not needed: back in order
        if not self.cfg.partial_rollout:
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

    @staticmethod
    def _metrics(
        groups: list[list[Sample]], drops: Counter[str], submitted: int, reward_key: str | None = None
    ) -> dict[str, float]:
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
