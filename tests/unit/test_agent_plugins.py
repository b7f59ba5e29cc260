"""The three plug-in layers: accepted shapes, start-up refusals, adapters, the rollout function's checks."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from miles.agent.plugins import (
    GenerateFnInput,
    GenerateFnOutput,
    PluginShapeError,
    RolloutFnTrainOutput,
    check_agent,
    generate_form,
    load_generate,
    rollout_form,
)
from miles.config import ConfigError, load_config
from miles.controller.plugin_rollout import PluginRolloutManager
from miles.controller.preflight import PreflightError, check_plugin_paths
from miles.controller.rollout_manager import prompt_group
from miles.rollout.sample import Sample, SampleStatus

BASE = {"hf_checkpoint": "m", "prompt_data": "p.jsonl", "rm_type": "math", "rollout_batch_size": 2, "num_rollout": 1}


# ---------------------------------------------------------------- shapes


async def legacy_generate(args, sample, sampling_params, evaluation=False):
    return [sample, Sample(prompt="second", index=sample.index)]


async def input_generate(input: GenerateFnInput) -> GenerateFnOutput:
    input.sample.response = f"{input.sampling_params['temperature']}:{input.evaluation}"
    return GenerateFnOutput(input.sample)


class ClassGenerate:
    async def __call__(self, input: GenerateFnInput) -> GenerateFnOutput:
        return GenerateFnOutput([input.sample])


async def agent(base_url, prompt, request_kwargs, metadata, **kw):
    return None


class Rollout:
    def __init__(self, input):
        self.input = input

    def __call__(self, input):
        return RolloutFnTrainOutput([[Sample(reward=1.0, status=SampleStatus.COMPLETED)]])


def rollout_fn(args, rollout_id, data_source, evaluation=False):
    return [[Sample(reward=0.5, status=SampleStatus.COMPLETED), Sample(reward=1.5, status=SampleStatus.TRUNCATED)]]


def test_each_layer_accepts_its_shapes():
    assert [generate_form(f) for f in (legacy_generate, input_generate, ClassGenerate)] == ["legacy", "input", "class"]
    check_agent(agent)
    assert [rollout_form(f) for f in (Rollout, rollout_fn)] == ["class", "function"]


def sync_generate(args, sample, sampling_params):
    return sample


async def two_args(args, sample):
    return sample


async def agent_missing_metadata(base_url, prompt, request_kwargs):
    return None


@pytest.mark.parametrize(
    ("check", "obj", "words"),
    [
        (generate_form, sync_generate, "not an async function"),
        (generate_form, two_args, "(args, sample)"),
        (generate_form, Rollout, "no arguments"),
        (check_agent, sync_generate, "not an async function"),
        (check_agent, agent_missing_metadata, "(base_url, prompt, request_kwargs)"),
        (rollout_form, two_args, "fn(args, rollout_id, data_source"),
        (rollout_form, ClassGenerate, "RolloutFnConstructorInput"),
    ],
)
def test_a_wrong_shape_is_refused_with_what_was_expected(check, obj, words):
    with pytest.raises(PluginShapeError, match="expected") as info:
        check(obj)
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("flag", "path", "words"),
    [
        ("custom_generate_function_path", "miles.agent.envs.calculator.reward", "async def generate(args, sample"),
        ("custom_agent_function_path", "miles.agent.envs.calculator.calculate", "not an async function"),
        ("rollout_function_path", "miles.agent.envs.calculator.score", "RolloutFnConstructorInput"),
        ("custom_agent_function_path", "miles.agent.envs.no_such_env.agent", "does not load"),
    ],
)
def test_preflight_refuses_a_bad_plugin_naming_the_path(flag, path, words):
    cfg = load_config([], base={**BASE, flag: path, "use_session_server": True})
    with pytest.raises(PreflightError) as info:
        check_plugin_paths(cfg)
    text = str(info.value)
    assert path in text and words in text and "--" + flag.replace("_", "-") in text


def test_the_calculator_plugins_pass_preflight():
    cfg = load_config(
        [],
        base={
            **BASE,
            "use_session_server": True,
            "custom_agent_function_path": "miles.agent.envs.calculator.agent",
            "custom_generate_function_path": "miles.agent.envs.calculator.generate",
            "rollout_function_path": "miles.agent.envs.calculator.CalculatorRollout",
        },
    )
    check_plugin_paths(cfg)


# ---------------------------------------------------------------- config refusals


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"custom_agent_function_path": "a.b"}, "needs --use-session-server"),
        ({"rollout_function_path": "a.B", "fully_async": True}, "--fully-async"),
        ({"rollout_function_path": "a.B", "dynamic_sampling_filter_path": "a.f"}, "--dynamic-sampling-filter-path"),
        ({"tito_model": "chatml"}, "--tito-model='chatml' applies to the session server only"),
        ({"session_message_matcher": "loose_tool_call"}, "--session-message-matcher"),
        ({"custom_generate_function_path": "a.g", "partial_rollout": True}, "--partial-rollout"),
        (
            {"custom_agent_function_path": "a.b", "use_session_server": "v2", "apply_chat_template": True},
            "--apply-chat-template",
        ),
        ({"use_session_server": "v3"}, "not one of v1, v2"),
        ({"session_server_port": 9000}, "--session-server-port=9000"),
        ({"use_session_server": True, "pause_generation_mode": "abort"}, "--pause-generation-mode=abort"),
    ],
)
def test_combinations_where_a_flag_would_do_nothing_are_refused(values, words):
    with pytest.raises(ConfigError) as info:
        load_config([], base={**BASE, **values})
    assert words in str(info.value)


def test_session_server_flag_takes_miles_values():
    assert load_config(["--use-session-server"], base=BASE).rollout.use_session_server == "v1"
    assert load_config(["--use-session-server", "v2"], base=BASE).rollout.use_session_server == "v2"
    assert load_config([], base={**BASE, "use_session_server": True}).rollout.use_session_server == "v1"
    assert load_config([], base=BASE).rollout.use_session_server is None


# ---------------------------------------------------------------- adapters


def test_generate_adapters_call_each_form_and_return_lists():
    args = SimpleNamespace()
    params = {"temperature": 0.7}

    async def main():
        outs = []
        for path in (f"{__name__}:legacy_generate", f"{__name__}:input_generate", f"{__name__}:ClassGenerate"):
            outs.append(await load_generate(path)(args, Sample(index=3), params, True, None))
        return outs

    legacy, new, cls = asyncio.run(main())
    assert [s.prompt for s in legacy] == ["", "second"]
    assert new[0].response == "0.7:True" and len(cls) == 1


def test_a_trajectory_split_into_samples_hands_back_one_prompt():
    group = [Sample(index=0), Sample(index=0), Sample(index=1)]
    assert [s.index for s in prompt_group(group)] == [0, 1]


# ---------------------------------------------------------------- the rollout function's output


class _Args(SimpleNamespace):
    reward_key = None


def _manager(path: str) -> PluginRolloutManager:
    return PluginRolloutManager(_Args(), SimpleNamespace(rollout_function_path=path), None, lambda: 4)


def test_rollout_function_output_gets_ids_and_metrics():
    result = asyncio.run(_manager(f"{__name__}:rollout_fn").generate(0))
    (group,) = result.groups
    assert len({s.group_index for s in group}) == 1 and len({s.index for s in group}) == 2
    assert result.metrics["rollout/reward_mean"] == pytest.approx(1.0)


def unrewarded(args, rollout_id, data_source, evaluation=False):
    return [[Sample(status=SampleStatus.COMPLETED, index=7)]]


def aborted(args, rollout_id, data_source, evaluation=False):
    return [[Sample(status=SampleStatus.ABORTED, reward=0.0)]]


@pytest.mark.parametrize(("fn", "words"), [("unrewarded", "has no reward"), ("aborted", "status aborted")])
def test_rollout_function_output_that_cannot_be_trained_is_refused_by_name(fn, words):
    with pytest.raises(ValueError) as info:
        asyncio.run(_manager(f"{__name__}:{fn}").generate(3))
    assert f"{__name__}:{fn}" in str(info.value) and words in str(info.value) and "rollout 3" in str(info.value)
