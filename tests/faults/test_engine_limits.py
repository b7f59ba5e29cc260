"""The embedded engine's HTTP front under requests whose parameters would allocate without bound."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from miles.engines.embedded.engine import EmbeddedEngine
from miles.engines.http_front import start_http_server
from miles.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), arch="qwen2", seed=0)


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


def _answers(model_dir: str, bodies: list[dict], **front: object) -> list[tuple[int, dict]]:
    async def main() -> list[tuple[int, dict]]:
        engine = EmbeddedEngine(model_dir, max_running_requests=4, max_total_tokens=256)
        await engine.start()
        handle = await start_http_server(engine, "127.0.0.1", 0, **front)
        try:
            return [await _post(f"{handle.url}/generate", body) for body in bodies]
        finally:
            await handle.stop()
            await engine.shutdown()

    return asyncio.run(main())


def test_request_parameters_beyond_the_engine_are_refused_with_their_limit(model_dir):
    def body(**kw: object) -> dict:
        sampling = {"max_new_tokens": 2, **kw.pop("sampling", {})}
        return {"input_ids": [1, 2, 3], "sampling_params": sampling, **kw}

    cases = {
        "n": body(sampling={"n": 100_000}),
        "top_logprobs_num": body(return_logprob=True, top_logprobs_num=10**9),
        "stop": body(sampling={"stop": ["x" * 100_000]}),
        "sampling_seed": body(sampling={"sampling_seed": 2**80}),
    }
    answers = _answers(model_dir, list(cases.values()) + [body()])
    for (name, _), (status, reply) in zip(cases.items(), answers[:-1], strict=True):
        assert status == 400, (name, reply)
        assert name in reply["error"], (name, reply)
    assert answers[-1][0] == 200, answers[-1]  # the engine still serves a sane request after them


def test_the_413_names_the_flag_of_the_command_in_use(model_dir):
    big = {"input_ids": [1] * 50_000}
    ((status, reply),) = _answers(model_dir, [big], max_body_mb=0.01, max_body_flag="--max-body-mb")
    assert status == 413
    assert "--max-body-mb" in reply["error"] and "--http-max-body-mb" not in reply["error"]


def test_a_kv_cache_larger_than_the_machine_is_refused_naming_the_limit(model_dir):
    with pytest.raises(ValueError, match=r"max_total_tokens=\d+ needs a .* GiB KV cache .* at most \d+ tokens fit"):
        EmbeddedEngine(model_dir, max_running_requests=4, max_total_tokens=2**50)


@pytest.mark.parametrize("flag", ["--max-body-mb=0", "--max-running-requests=0", "--port=70000", "--seed=-1"])
def test_the_serving_commands_refuse_numbers_outside_their_range(flag, capsys):
    from miles.controller.session_serve import parse_serve_args
    from miles.engines.http_front import parse_engine_args as _parse_args

    for parse in (_parse_args, parse_serve_args):
        with pytest.raises(SystemExit):
            parse(["--model-path", "m", flag])
        assert "is outside" in capsys.readouterr().err
