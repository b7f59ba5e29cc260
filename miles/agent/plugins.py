"""The three plug-in layers of a rollout, with the original Miles signatures, and their start-up checks.

Innermost to outermost (docs/agentic.md):

  agent function     `async def agent(base_url, prompt, request_kwargs, metadata, **kw) -> dict | None`
                     runs an episode against an OpenAI-compatible endpoint (`{base_url}/v1`); the
                     session server records its tokens. `--custom-agent-function-path`.
  generate function  `async def generate(args, sample, sampling_params[, evaluation=False])
                     -> Sample | list[Sample]`, or `async def generate(input: GenerateFnInput)
                     -> GenerateFnOutput`, or a class called like the latter: takes over generation
                     and token recording for one sample. `--custom-generate-function-path`.
  rollout function   a class built once with `RolloutFnConstructorInput(args, data_source)` and
                     called with `RolloutFnTrainInput(rollout_id, weight_version)` -> `RolloutFnTrainOutput`
                     (or a coroutine of it), or a function `fn(args, rollout_id, data_source,
                     evaluation=False)` -> output or `list[list[Sample]]`: replaces the whole
                     rollout (tasks, grouping, rewards). `--rollout-function-path`.

Plug-ins reach the engines through the rollout gateway at `gateway_url(args)` (the router's
`/generate` and the session server), with the run's key (`auth_headers(args)`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from miles.engines.doors import auth_headers as _key_headers
from miles.rollout.sample import Sample
from miles.utils.misc import load_function

GENERATE_SIGNATURE = (
    "async def generate(args, sample, sampling_params[, evaluation=False]) -> Sample | list[Sample], "
    "async def generate(input: GenerateFnInput) -> GenerateFnOutput, or a class whose instances are "
    "called like the latter"
)
AGENT_SIGNATURE = "async def agent(base_url, prompt, request_kwargs, metadata, **kw) -> dict | None"
ROLLOUT_SIGNATURE = (
    "a class built with RolloutFnConstructorInput(args, data_source) whose instances take "
    "RolloutFnTrainInput(rollout_id, weight_version), or fn(args, rollout_id, data_source, "
    "evaluation=False)"
)


class PluginShapeError(TypeError):
    """A plug-in loaded but does not have the shape its layer calls."""


# ---------------------------------------------------------------- contracts


@dataclass(frozen=True, slots=True)
class GenerateState:
    args: Any
    tokenizer: Any
    sampling_params: dict[str, Any]  # the run's base sampling parameters


@dataclass(frozen=True, slots=True)
class GenerateFnInput:
    state: GenerateState
    sample: Sample
    sampling_params: dict[str, Any]  # this sample's copy
    evaluation: bool = False

    @property
    def args(self) -> Any:
        return self.state.args


@dataclass(frozen=True, slots=True)
class GenerateFnOutput:
    samples: Sample | list[Sample]


@dataclass(frozen=True, slots=True)
class RolloutFnConstructorInput:
    args: Any
    data_source: Any


@dataclass(frozen=True, slots=True)
class RolloutFnTrainInput:
    rollout_id: int
    weight_version: int | None


@dataclass(slots=True)
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, float] | None = None


GenerateFn = Callable[[Any, Sample, dict[str, Any], bool, Any], Awaitable[list[Sample]]]
RolloutFn = Callable[[int, int | None], Awaitable[RolloutFnTrainOutput]]


# ---------------------------------------------------------------- shapes


def _params(fn: Callable) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())


def _positional(params: list[inspect.Parameter]) -> list[inspect.Parameter]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p for p in params if p.kind in kinds]


def _accepts(fn: Callable, *args: Any, **kwargs: Any) -> bool:
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _instance_call(cls: type) -> Callable | None:
    """The `__call__` a class defines for its instances (not the metaclass's)."""
    return next((k.__dict__["__call__"] for k in cls.__mro__ if k is not object and "__call__" in k.__dict__), None)


def generate_form(obj: Any) -> str:
    """ "input", "legacy" or "class"; PluginShapeError when `obj` is none of the three."""
    if inspect.isclass(obj):
        if not _accepts(obj) or not inspect.iscoroutinefunction(_instance_call(obj)):
            raise PluginShapeError(
                f"a generate class must build with no arguments and have an async __call__(input); "
                f"expected {GENERATE_SIGNATURE}"
            )
        return "class"
    if not inspect.iscoroutinefunction(obj):
        raise PluginShapeError(f"it is not an async function; expected {GENERATE_SIGNATURE}")
    positional = _positional(_params(obj))
    if positional and positional[0].name == "input" and _accepts(obj, None):
        return "input"
    if len(positional) >= 3 and _accepts(obj, None, None, None):
        return "legacy"
    raise PluginShapeError(f"its signature is {inspect.signature(obj)}; expected {GENERATE_SIGNATURE}")


def check_agent(obj: Any) -> None:
    if not inspect.iscoroutinefunction(obj):
        raise PluginShapeError(f"it is not an async function; expected {AGENT_SIGNATURE}")
    if not _accepts(obj, "http://x/sessions/s", [], {}, {}):
        raise PluginShapeError(f"its signature is {inspect.signature(obj)}; expected {AGENT_SIGNATURE}")


def rollout_form(obj: Any) -> str:
    """ "class" or "function"; PluginShapeError otherwise."""
    if inspect.isclass(obj):
        if not _accepts(obj, None) or _instance_call(obj) is None:
            raise PluginShapeError(
                f"the class must build from one RolloutFnConstructorInput and be callable; "
                f"expected {ROLLOUT_SIGNATURE}"
            )
        return "class"
    if callable(obj) and _accepts(obj, None, 0, None) and _accepts(obj, None, 0, None, evaluation=False):
        return "function"
    shape = inspect.signature(obj) if callable(obj) else type(obj).__name__
    raise PluginShapeError(f"it is {shape}; expected {ROLLOUT_SIGNATURE}")


PLUGIN_CHECKS: dict[str, Callable[[Any], Any]] = {
    "custom_generate_function_path": generate_form,
    "custom_agent_function_path": check_agent,
    "rollout_function_path": rollout_form,
}


# ---------------------------------------------------------------- adapters


def load_generate(path: str) -> GenerateFn:
    """`fn(args, sample, sampling_params, evaluation, tokenizer) -> list[Sample]` calling the plug-in in its form."""
    obj = load_function(path)
    form = generate_form(obj)
    if form == "class":
        obj = obj()

    async def call(args: Any, sample: Sample, sampling_params: dict, evaluation: bool, tokenizer: Any) -> list[Sample]:
        if form == "legacy":
            extra = {"evaluation": evaluation} if _accepts(obj, None, None, None, evaluation=False) else {}
            out = await obj(args, sample, sampling_params, **extra)
        else:
            state = GenerateState(args, tokenizer, dict(sampling_params))
            out = await obj(GenerateFnInput(state, sample, dict(sampling_params), evaluation))
            out = out.samples if isinstance(out, GenerateFnOutput) else out
        return _as_samples(out, path)

    return call


def _as_samples(out: Any, path: str) -> list[Sample]:
    samples = [out] if isinstance(out, Sample) else list(out) if isinstance(out, (list, tuple)) else None
    if not samples or not all(isinstance(s, Sample) for s in samples):
        raise TypeError(
            f"--custom-generate-function-path {path!r} returned {type(out).__name__}; it must return a "
            "Sample or a non-empty list of Samples"
        )
    return samples


def load_rollout(path: str, args: Any, data_source: Any) -> RolloutFn:
    """`await fn(rollout_id, weight_version) -> RolloutFnTrainOutput` over the plug-in in its form."""
    obj = load_function(path)
    form = rollout_form(obj)
    instance = obj(RolloutFnConstructorInput(args, data_source)) if form == "class" else None

    async def call(rollout_id: int, weight_version: int | None) -> RolloutFnTrainOutput:
        if instance is not None:
            out = instance(RolloutFnTrainInput(rollout_id, weight_version))
        else:
            out = obj(args, rollout_id, data_source, evaluation=False)
        if inspect.isawaitable(out):
            out = await out
        if isinstance(out, RolloutFnTrainOutput):
            return out
        if isinstance(out, list):
            return RolloutFnTrainOutput(out)
        raise TypeError(
            f"--rollout-function-path {path!r} returned {type(out).__name__}; expected "
            "RolloutFnTrainOutput or list[list[Sample]]"
        )

    return call


def agent_abort_hook(path: str | None) -> Callable[[], Any] | None:
    """The `abort` callable beside an agent function, called when a rollout aborts its requests."""
    if not path:
        return None
    module_path = path.partition(":")[0] if ":" in path else path.rpartition(".")[0]
    hook = getattr(importlib.import_module(module_path), "abort", None)
    return hook if callable(hook) else None


def gateway_url(args: Any) -> str:
    """The rollout gateway of the run (router /generate + session server), where Miles' plug-ins find the router."""
    ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
    if not ip or not port:
        raise RuntimeError(
            "no rollout gateway on args (sglang_router_ip / sglang_router_port): the run starts it "
            "when a plug-in layer or --use-session-server is set"
        )
    return f"http://{ip}:{port}"


def auth_headers(args: Any) -> dict[str, str]:
    return _key_headers(getattr(args, "api_key", None))
