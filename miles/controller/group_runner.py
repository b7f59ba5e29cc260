"""One group of samples generated and scored: the unit the sync rollout, eval and the fully async
producer share.

`GroupRunner` reads the run's typed sections (rollout, reward, model, train); the flat `args`
namespace it holds is passed only to the plug-ins that expect Miles' signature (a generate or agent
function, a reward function, a group reward function).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from miles.agent.plugins import agent_abort_hook, load_generate
from miles.config import MilesConfig, RolloutConfig
from miles.controller.router import Router
from miles.rollout.generate import SamplingDefaults, generate_group, generate_sample, is_fresh
from miles.rollout.opd_teacher import TeacherRoutingError, TeacherScorer
from miles.rollout.rm_hub import RewardFailed, async_rm, batched_async_rm, check_reward
from miles.rollout.sample import Sample, SampleStatus
from miles.utils.misc import load_function
from miles.utils.routing import routing_shape

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_REWARD_WARNINGS_PER_STEP = 5


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


class GroupRunner:
    """Generates and scores one group; shared by the sync rollout, eval and the fully async producer."""

    def __init__(
        self,
        cfg: MilesConfig,
        router: Router,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingDefaults,
        *,
        plugin_args: argparse.Namespace | None = None,
        reward_inline: bool = True,
        deterministic_seed: int | None = None,
        recompute_logprobs: bool = False,
        evaluation: bool = False,
        teacher: TeacherScorer | None = None,
    ) -> None:
        """`plugin_args`: the flat namespace the plug-ins receive (the run's, which points them at its
        gateway); a fresh `cfg.flat()` when None."""
        self.rollout = cfg.rollout
        self.reward = cfg.reward
        self.plugin_args = plugin_args if plugin_args is not None else cfg.flat()
        self.router = router
        self.tokenizer = tokenizer
        self.teacher = teacher  # on-policy distillation: scores every finished sample
        if teacher is not None and teacher.student_top_k:
            sampling = dataclasses.replace(sampling, top_logprobs_num=teacher.student_top_k)
        if cfg.train.use_rollout_routing_replay and not evaluation:  # R3: every token's experts
            sampling = dataclasses.replace(sampling, routing=routing_shape(cfg.model.hf_checkpoint))
        self.sampling = sampling
        self.reward_inline = reward_inline
        self.deterministic_seed = deterministic_seed
        self.group_reward_fn = load_function(cfg.reward.group_reward_path)
        self.recompute_logprobs = recompute_logprobs
        self.evaluation = evaluation
        self.plugin_generate = plugin_generate_fn(cfg.rollout)  # None: the built-in single-turn generate
        self.abort_hook = agent_abort_hook(cfg.rollout.custom_agent_function_path)
        # one routing key per trajectory: every turn on one engine (and none missing in session mode)
        self.keyed = bool(cfg.rollout.use_session_server) or self.plugin_generate is not None
        self.tool_time_s = 0.0
        # Miles' --sglang-server-concurrency: at most this many samples in flight per engine
        engines = len(getattr(router, "engines", ())) or 1
        self.concurrency = cfg.rollout.sglang_server_concurrency * engines
        self.in_flight = asyncio.Semaphore(self.concurrency)
        self._claiming = asyncio.Lock()  # a group takes its permits all at once: no two groups hold part each
        self.reward_failures = 0
        self.reward_time_s = 0.0
        self.recompute_time_s = 0.0
        self._prefix_seen = (0, 0)  # the router's (prompt, cached) token totals at the last pop_metrics

    @property
    def scores_whole_groups(self) -> bool:
        """Rewards come per group (--group-rm or --group-reward-path), once every sample finished."""
        return bool(self.reward.group_rm or self.group_reward_fn is not None)

    def _seed(self, sample: Sample) -> int | None:
        if self.deterministic_seed is None or sample.index is None:
            return None
        return self.deterministic_seed + sample.index

    async def trajectory(self, sample: Sample) -> list[Sample]:
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
        if self.reward_inline and not self.reward.group_rm and unscored:
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
        return await self.plugin_generate(self.plugin_args, sample, params, self.evaluation, self.tokenizer)

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
            group = [
                s for trajectory in await asyncio.gather(*(self.trajectory(s) for s in group)) for s in trajectory
            ]
        if self.reward_inline and self.scores_whole_groups:
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
            result = self.group_reward_fn(self.plugin_args, samples)
            rewards = await result if asyncio.iscoroutine(result) else result
            source = f"--group-reward-path {self.reward.group_reward_path}"
            return [self._checked(r, s, source) for s, r in zip(samples, rewards, strict=True)]
        if whole_group or self.reward.group_rm or len(samples) > 1:
            return await batched_async_rm(self.plugin_args, samples)
        return [await async_rm(self.plugin_args, samples[0])]

    def _checked(self, reward: Any, sample: Sample, source: str) -> Any:
        try:
            return check_reward(reward, sample, source=source, reward_key=self.reward.reward_key)
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


def plugin_generate_fn(rollout: RolloutConfig):
    """The generate plug-in of the run (the agent driver when only an agent function is given), or None."""
    path = rollout.custom_generate_function_path
    if not path and rollout.custom_agent_function_path:
        path = "miles.agent.agentic:generate"
    return load_generate(path) if path else None
