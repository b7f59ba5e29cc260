"""The colocated hand-over: `MilesRun.generation_phase` and the push move the trainer and the engines
in the order the GPUs need, as `OffloadPlan` decides, and nothing moves on a run that is not colocated."""

from __future__ import annotations

import asyncio

import pytest

from miles.config import MilesConfig
from miles.controller.offload import OffloadPlan
from miles.controller.run import MilesRun
from miles.controller.signals import StopRequested
from miles.utils.timer import StepTimers


class Recorder:
    """Trainers and a fleet in one: every call appends its name."""

    def __init__(self, calls: list[str], version: list[int]) -> None:
        self.calls, self.version = calls, version

    def __bool__(self) -> bool:
        return True

    def __getattr__(self, name: str):
        async def call(*args, **kwargs):
            self.calls.append(name)
            if name == "push_weights":
                self.version[0] = args[0]
                return {}
            if name == "weight_versions":
                return [self.version[0]]
            return None

        return call


def _run(plan: OffloadPlan) -> tuple[MilesRun, list[str]]:
    calls: list[str] = []
    version = [0]
    run = MilesRun.__new__(MilesRun)  # only what the hand-over and the push read
    run.cfg = MilesConfig()
    run.offload, run.trainers, run.fleet = plan, Recorder(calls, version), Recorder(calls, version)
    run.timers, run._worker_wait_s, run._engines_released = StepTimers(), 0.0, False
    run._cache_release_logged = False
    run.weight_version, run.engine_versions, run._last_push_metrics = 0, [0], None
    return run, calls


def _generate_twice(run: MilesRun, calls: list[str]) -> None:
    """Two generations with no push between (--update-weights-interval > 1)."""

    async def two_steps() -> None:
        for _ in range(2):
            async with run.generation_phase():
                calls.append("generate")

    asyncio.run(two_steps())


def test_plan_offloads_only_on_a_colocated_run_and_only_what_exists() -> None:
    cfg = MilesConfig()
    cfg.train.offload_train, cfg.train.offload_rollout = True, True
    cfg.train.offload_rollout_level = ["kv_cache", "weight"]
    assert OffloadPlan.of(cfg, colocated=False, has_trainer=True, has_engines=True) == OffloadPlan()
    full = OffloadPlan.of(cfg, colocated=True, has_trainer=True, has_engines=True)
    assert full.trainer and set(full.engine_tags) == {"kv_cache", "weights"}
    assert OffloadPlan.of(cfg, colocated=True, has_trainer=False, has_engines=False) == OffloadPlan()
    cfg.train.offload_train = False
    assert not OffloadPlan.of(cfg, colocated=True, has_trainer=True, has_engines=True).trainer


def test_generation_hands_the_gpus_over_and_the_push_takes_them_back() -> None:
    run, calls = _run(OffloadPlan(trainer=True, engine_tags=("kv_cache",)))

    async def step() -> None:
        async with run.generation_phase():
            calls.append("generate")
        calls.append("train")
        await run.push_weights(1)
        async with run.generation_phase():  # engines already resumed by the push: not twice
            calls.append("generate")

    asyncio.run(step())
    assert calls == [
        "offload",
        "generate",
        "release_memory_occupation",
        "onload",
        "train",
        "release_cached_memory",  # the trainer's cached activations go before the engines take memory back
        "resume_memory_occupation",
        "pause_generation",
        "push_weights",
        "weight_versions",
        "continue_generation",
        "offload",
        "generate",
        "release_memory_occupation",
        "onload",
    ]
    timed = run.timers.pop_all()
    assert run.weight_version == 1 and {"perf/offload_time", "perf/update_weights_time"} <= set(timed)


def test_without_a_push_the_next_generation_resumes_the_engines() -> None:
    run, calls = _run(OffloadPlan(engine_tags=("kv_cache",)))
    _generate_twice(run, calls)
    assert calls == [
        "generate",
        "release_memory_occupation",
        "release_cached_memory",
        "resume_memory_occupation",
        "generate",
        "release_memory_occupation",
    ]


def test_without_a_push_the_trainer_leaves_before_the_engines_come_back() -> None:
    """Two generations with no push between (--update-weights-interval > 1): the trainer's state is offloaded
    before the engines resume, so the two need not fit on the GPU together."""
    run, calls = _run(OffloadPlan(trainer=True, engine_tags=("kv_cache", "weights")))
    _generate_twice(run, calls)
    assert calls == [
        "offload",
        "generate",
        "release_memory_occupation",
        "onload",
        "offload",
        "release_cached_memory",
        "resume_memory_occupation",
        "generate",
        "release_memory_occupation",
        "onload",
    ]


def test_a_stop_hands_the_gpus_back_and_a_failure_leaves_them() -> None:
    run, calls = _run(OffloadPlan(trainer=True, engine_tags=("kv_cache",)))

    async def body(error: BaseException) -> None:
        async with run.generation_phase():
            raise error

    with pytest.raises(StopRequested):
        asyncio.run(body(StopRequested()))
    assert calls == ["offload", "release_memory_occupation", "onload"]  # the trainer can save the last step
    calls.clear()
    with pytest.raises(RuntimeError):
        asyncio.run(body(RuntimeError("engine died")))
    assert calls == [
        "offload",  # the trainer's state leaves before the engines take their memory back
        "release_cached_memory",
        "resume_memory_occupation",
    ]  # no call to workers that may be gone


def test_not_colocated_nothing_moves() -> None:
    run, calls = _run(OffloadPlan())

    async def step() -> None:
        async with run.generation_phase():
            calls.append("generate")

    asyncio.run(step())
    assert calls == ["generate"] and run.timers.pop_all() == {}
