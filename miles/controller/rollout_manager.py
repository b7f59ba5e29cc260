"""The sync rollout step: submit groups until `rollout_batch_size` accepted groups exist.

Groups are the unit of scheduling, filtering and dropping. A group is accepted when every
sample finished (completed or truncated), every reward is known, and the dynamic filter keeps
it. Aborted groups and groups whose reward call failed after its retries are dropped and
counted; their prompts go back to the data source so nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from miles.rollout.filters import DynamicFilterOutput, apply_filter
from miles.rollout.generate import SamplingDefaults, generate_sample
from miles.rollout.rm_hub import RewardFailed, async_rm, batched_async_rm
from miles.rollout.sample import Sample, SampleStatus
from miles.rollout.train_data import reward_value
from miles.utils.misc import load_function

logger = logging.getLogger(__name__)


@dataclass
class RolloutResult:
    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)


def sampling_from_config(rollout, eval_overrides: dict[str, Any] | None = None) -> SamplingDefaults:
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

    def __init__(self, args, router, tokenizer, sampling: SamplingDefaults, *, reward_inline: bool = True,
                 deterministic_seed: int | None = None, recompute_logprobs: bool = False):
        self.args = args
        self.router = router
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.reward_inline = reward_inline
        self.deterministic_seed = deterministic_seed
        self.group_reward_fn = load_function(getattr(args, "group_reward_path", None))
        self.recompute_logprobs = recompute_logprobs
        self.reward_failures = 0
        self.reward_time_s = 0.0
        self.recompute_time_s = 0.0

    def _seed(self, sample: Sample) -> int | None:
        if self.deterministic_seed is None or sample.index is None:
            return None
        return self.deterministic_seed + sample.index

    async def _one(self, sample: Sample) -> Sample:
        sample = await generate_sample(self.router, sample, self.tokenizer, self.sampling, seed=self._seed(sample))
        if self.recompute_logprobs and sample.status != SampleStatus.ABORTED and sample.response_length:
            await self.recompute(sample)
        if self.reward_inline and not self.args.group_rm and sample.status != SampleStatus.ABORTED:
            await self.score([sample])
        return sample

    async def run(self, group: list[Sample]) -> list[Sample]:
        group = list(await asyncio.gather(*(self._one(s) for s in group)))
        if self.reward_inline and (self.args.group_rm or self.group_reward_fn):
            if not any(s.status == SampleStatus.ABORTED for s in group):
                await self.score(group, whole_group=True)
        return group

    async def recompute(self, sample: Sample) -> None:
        """Re-score the sampled tokens with one prefill pass (the shape of computation the trainer uses)."""
        start = time.perf_counter()
        payload = {"input_ids": list(sample.tokens), "return_logprob": True, "logprob_start_len": sample.prompt_length,
                   "sampling_params": {"max_new_tokens": 0, "temperature": self.sampling.temperature}}
        out = await self.router.generate(payload)
        logprobs = [float(t[0]) for t in out["meta_info"]["input_token_logprobs"]]
        if len(logprobs) != sample.response_length:
            raise RuntimeError(f"prefill re-scoring returned {len(logprobs)} log-probs for "
                               f"{sample.response_length} response tokens (sample {sample.index})")
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
            if whole_group and self.group_reward_fn is not None:
                result = self.group_reward_fn(self.args, samples)
                rewards = await result if asyncio.iscoroutine(result) else result
            elif whole_group or self.args.group_rm:
                rewards = await batched_async_rm(self.args, samples)
            else:
                rewards = [await async_rm(self.args, samples[0])] if len(samples) == 1 else await asyncio.gather(
                    *(async_rm(self.args, s) for s in samples))
        except RewardFailed as e:
            self.reward_failures += len(samples)
            logger.warning("reward failed for %d sample(s): %s", len(samples), e)
            for s in samples:
                s.status = SampleStatus.FAILED
                s.metadata["reward_error"] = str(e)
            return
        for s, r in zip(samples, rewards, strict=True):
            s.reward = r


def group_drop_reason(group: list[Sample], *, scored: bool = True) -> str | None:
    """Why a finished group cannot be trained on (None: it can). `scored=False` before rewards exist."""
    if any(s.status == SampleStatus.ABORTED for s in group):
        return "aborted"
    if any(s.status == SampleStatus.FAILED for s in group):
        return "reward_failed"
    if scored and any(s.reward is None for s in group):
        return "no_reward"
    return None


class SyncRolloutManager:
    """Produces one step's accepted groups from the data source through the router."""

    def __init__(self, args, rollout_cfg, router, data_source, tokenizer, *, seed: int | None = None):
        self.args = args
        self.cfg = rollout_cfg
        self.router = router
        self.data_source = data_source
        self.runner = GroupRunner(args, router, tokenizer, sampling_from_config(rollout_cfg),
                                  reward_inline=rollout_cfg.reward_phase == "inline", deterministic_seed=seed,
                                  recompute_logprobs=rollout_cfg.recompute_logprobs_via_prefill)
        self.filter_fn = load_function(rollout_cfg.dynamic_sampling_filter_path)
        self.sample_filter_fn = load_function(rollout_cfg.rollout_sample_filter_path)

    async def generate(self, rollout_id: int) -> RolloutResult:
        target = self.cfg.rollout_batch_size
        refill = self.cfg.over_sampling_batch_size or target
        accepted: list[list[Sample]] = []
        drops: Counter[str] = Counter()
        pending: set[asyncio.Task] = set()
        submitted = 0
        generated: list[list[Sample]] = []  # separate reward phase: generated, not yet scored
        try:
            while len(accepted) < target:
                if len(accepted) + len(pending) + len(generated) < target:
                    for group in self.data_source.get_samples(refill):
                        pending.add(asyncio.create_task(self.runner.run(group)))
                        submitted += 1
                if pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    finished = [t.result() for t in done]
                else:
                    finished = []
                if not self.runner.reward_inline:
                    generated += [g for g in finished if not self._drop(g, drops, scored=False)]
                    if pending and len(accepted) + len(generated) < target:
                        continue  # keep generating; score once this round's generation is complete
                    finished, generated = generated, []
                    await asyncio.gather(*(self.runner.score(g, whole_group=self.args.group_rm
                                                             or self.runner.group_reward_fn is not None)
                                           for g in finished))
                for group in finished:
                    if self._drop(group, drops):
                        continue
                    verdict = self._filter(group)
                    if not verdict.keep:
                        drops[f"dynamic_filter/drop_{verdict.reason or 'filtered'}"] += 1
                        continue
                    if len(accepted) < target:
                        accepted.append(group)
        finally:
            await self._abort_leftovers(pending)
        accepted.sort(key=lambda g: min(s.index for s in g))
        if self.sample_filter_fn is not None:
            self.sample_filter_fn(self.args, accepted)
        metrics = self._metrics(accepted, drops, submitted, self.args.reward_key)
        metrics["rollout/reward_failed_samples"] = float(self.runner.reward_failures)
        # summed over samples: rewards and re-scoring run concurrently with generation
        metrics["perf/rollout/reward_time_sum"] = self.runner.reward_time_s
        metrics["perf/rollout/log_prob_recompute_time_sum"] = self.runner.recompute_time_s
        self.runner.reward_failures = 0
        self.runner.reward_time_s = self.runner.recompute_time_s = 0.0
        return RolloutResult(accepted, metrics)

    def _drop(self, group: list[Sample], drops: Counter[str], *, scored: bool = True) -> bool:
        reason = group_drop_reason(group, scored=scored)
        if reason is None:
            return False
        drops[f"{reason}_groups"] += 1
        for s in group:
            s.reset_for_retry()
        self.data_source.add_samples([group])  # the prompt is retried, never lost
        return True

    def _filter(self, group: list[Sample]) -> DynamicFilterOutput:
        if self.filter_fn is None:
            return DynamicFilterOutput(keep=True)
        return apply_filter(self.filter_fn, self.args, group)

    async def _abort_leftovers(self, pending: set[asyncio.Task]) -> None:
        if not pending:
            return
        await self.router.broadcast("abort_request", abort_all=True)
        results = await asyncio.gather(*pending, return_exceptions=True)
        leftovers = [g for g in results if isinstance(g, list)]
        for g in leftovers:
            for s in g:
                s.reset_for_retry()
        if leftovers:  # over-sampled prompts that were not needed go back to the source in order
            self.data_source.add_samples(leftovers)

    @staticmethod
    def _metrics(groups: list[list[Sample]], drops: Counter[str], submitted: int,
                 reward_key: str | None = None) -> dict[str, float]:
        samples = [s for g in groups for s in g]
        raw = np.array([reward_value(s, reward_key) for s in samples], dtype=np.float64)
        lengths = np.array([s.response_length for s in samples], dtype=np.float64)
        m = {
            "rollout/reward_mean": float(raw.mean()) if len(raw) else float("nan"),
            "rollout/reward_std": float(raw.std()) if len(raw) else float("nan"),
            "rollout/response_len_mean": float(lengths.mean()) if len(lengths) else 0.0,
            "rollout/response_len_max": float(lengths.max()) if len(lengths) else 0.0,
            "rollout/truncated_frac": float(np.mean([s.status == SampleStatus.TRUNCATED for s in samples])) if samples else 0.0,
            "rollout/groups_submitted": float(submitted),
        }
        for k, v in drops.items():
            m[f"rollout/{k}"] = float(v)
        return m
