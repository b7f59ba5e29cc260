"""In-loop evaluation on the shared engines: scores recorded against the weight version they measured."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Protocol

import numpy as np

from miles.config import MilesConfig
from miles.controller.group_runner import GroupRunner, sampling_from_config
from miles.controller.preflight import parse_eval_datasets
from miles.controller.router import Router
from miles.controller.run import MilesRun
from miles.rollout.data_source import JsonlDataSource
from miles.rollout.debug_data import save_debug_rollout
from miles.rollout.sample import Sample, SampleStatus
from miles.rollout.train_data import reward_value

logger = logging.getLogger(__name__)


class Pausable(Protocol):
    """What stops new generation while an eval runs on the same engines (the async producer)."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...


class Evaluator:
    def __init__(self, cfg: MilesConfig, run: MilesRun) -> None:
        self.cfg = cfg
        self.run = run
        self.datasets = parse_eval_datasets(cfg.eval.eval_prompt_data)
        e = cfg.eval
        self.sampling = sampling_from_config(
            cfg.rollout,
            {
                "temperature": e.eval_temperature,
                "top_p": e.eval_top_p,
                "top_k": e.eval_top_k,
                "max_new_tokens": e.eval_max_response_len,
            },
        )

    def due(self, step: int, *, before_train: bool = False) -> bool:
        if not self.datasets or not self.cfg.eval.eval_interval:
            return False
        if before_train:
            return not self.cfg.eval.skip_eval_before_train
        return step % self.cfg.eval.eval_interval == 0 or step == self.cfg.rollout.num_rollout

    async def maybe_eval(
        self, step: int, *, before_train: bool = False, pause: Pausable | None = None
    ) -> dict[str, float]:
        """Evaluate when due. `pause` (the async producer) stops new generation while eval runs."""
        if not self.due(step, before_train=before_train):
            return {}
        if pause is not None:
            pause.pause()
        try:
            return await self._eval_all(step, before_train)
        finally:
            if pause is not None:
                pause.resume()

    async def _eval_all(self, step: int, before_train: bool) -> dict[str, float]:
        out: dict[str, float] = {}
        kept: list[list[Sample]] | None = [] if self.cfg.runtime.save_debug_rollout_data else None
        for name, path in self.datasets:
            try:
                out.update(await self.run.timed("eval_time", self.evaluate(name, path, keep=kept)))
            except Exception as e:  # noqa: BLE001 - a failed eval is reported and training goes on
                logger.warning("eval %s at step %d failed, skipped: %s", name, step, e)
                out[f"eval/{name}/skipped"] = 1.0
        if kept:
            await self._save(kept, out)
        if before_train and out:
            self.run.sink.log(step - 1 if step > 0 else -1, out)
            return {}
        return out

    async def _save(self, groups: list[list[Sample]], metrics: dict[str, float]) -> None:
        """--save-debug-rollout-data: the evaluation's samples (each with its set's name in `eval_dataset`) beside
        the rollouts, as `eval_<weight version>` in place of the step (Miles' `eval_` prefix)."""
        rollout_id = f"eval_{self.run.weight_version}"
        path = await asyncio.to_thread(
            save_debug_rollout, self.cfg.runtime.save_debug_rollout_data, rollout_id, groups, metrics
        )
        logger.info("saved the evaluation of weight version %d to %s", self.run.weight_version, path)

    async def evaluate(
        self,
        name: str,
        path: str,
        *,
        router: Router | None = None,
        version: int | None = None,
        keep: list[list[Sample]] | None = None,
    ) -> dict[str, float]:
        """Scores of one dataset on `router`'s engines (default: the rollout fleet at the run's version); `keep`
        receives its groups."""
        source = self.run.eval_sets.get(name)  # read and checked at start-up
        if source is None or source.path != path:
            data_cfg = replace(self.cfg.data, prompt_data=path, rollout_shuffle=False)
            source = JsonlDataSource(
                data_cfg, n_samples_per_prompt=self.cfg.eval.n_samples_per_eval_prompt, tokenizer=self.run.tokenizer
            )
        source.rewind()  # every eval draws the whole set with the same ids
        groups = source.get_samples(len(source))
        runner = GroupRunner(
            self.cfg,
            router or self.run.router,
            self.run.tokenizer,
            self.sampling,
            plugin_args=self.run.plugin_args,
            evaluation=True,
        )
        version = self.run.weight_version if version is None else version
        done = await asyncio.gather(*(runner.run(g) for g in groups))
        samples = [s for g in done for s in g]
        if keep is not None:
            for s in samples:
                s.metadata["eval_dataset"] = name
            keep.extend(done)
        scored = [s for s in samples if s.status != SampleStatus.FAILED and s.reward is not None]
        rewards = np.array([reward_value(s, self.cfg.reward.reward_key) for s in scored], dtype=np.float64)
        versions = [v for s in samples for v in s.weight_versions]
        return {
            f"eval/{name}/reward_mean": float(rewards.mean()) if rewards.size else float("nan"),
            f"eval/{name}/num_samples": float(len(samples)),
            f"eval/{name}/reward_failed": float(len(samples) - len(scored)),
            f"eval/{name}/weight_version": float(version),
            f"eval/{name}/mixed_version_frac": float(np.mean([v != version for v in versions])) if versions else 0.0,
            f"eval/{name}/truncated_frac": float(np.mean([s.status == SampleStatus.TRUNCATED for s in samples])),
        }
