"""EngineClient: concurrency, retries, timeouts; SGLangServer command line and process lifecycle."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest
from aiohttp import web
from fake_engine import FakeEngine, next_token

from miles.controller.router import Router
from miles.engines.client import (
    ROUTING_KEY_HEADER,
    EngineClient,
    EngineConnectionError,
    EngineHTTPError,
    EngineTimeoutError,
)
from miles.engines.http_front import start_http_server
from miles.engines.sglang_engine import SGLangServer, build_sglang_command
from miles.wire.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def run(coro):
    return asyncio.run(coro)


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_500_concurrent_generates_all_resolve():
    async def main():
        engine = FakeEngine(delay_s=0.005)
        handle = await start_http_server(engine, "127.0.0.1", 0)
        client = EngineClient(handle.url, timeout_s=60)
        try:
            outs = await asyncio.gather(
                *(
                    client.generate(
                        {
                            "input_ids": [i % 90 + 1],
                            "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
                            "rid": f"r{i}",
                        }
                    )
                    for i in range(500)
                )
            )
        finally:
            await client.close()
            await handle.stop()
        return outs

    outs = run(main())
    assert len(outs) == 500
    for i, out in enumerate(outs):
        t1 = next_token(i % 90 + 1)
        t2 = next_token(t1)
        assert out["output_ids"] == [t1, t2, next_token(t2)]
        assert out["meta_info"]["id"] == f"r{i}"


def test_connection_errors_are_retried_then_succeed():
    attempts = []

    async def flaky(request: web.Request) -> web.Response:
        attempts.append(1)
        if len(attempts) <= 2:
            request.transport.close()  # drop the connection mid-request
            await asyncio.sleep(0.05)
        return web.json_response({"ok": len(attempts)})

    async def main():
        app = web.Application()
        app.router.add_post("/generate", flaky)
        runner, url = await serve_app(app)
        client = EngineClient(url, max_retries=3, retry_backoff_s=0.01)
        try:
            return await client.generate({"input_ids": [1]})
        finally:
            await client.close()
            await runner.cleanup()

    assert run(main()) == {"ok": 3}
    assert len(attempts) == 3


def test_unreachable_engine_raises_after_all_retries():
    port = free_port()  # nothing listens there

    async def main():
        client = EngineClient(f"http://127.0.0.1:{port}", max_retries=2, retry_backoff_s=0.01)
        try:
            await client.generate({"input_ids": [1]})
        finally:
            await client.close()

    with pytest.raises(EngineConnectionError) as info:
        run(main())
    assert "after 3 attempts" in str(info.value)


def test_a_dead_engine_is_one_warning_and_one_error_naming_it(caplog):
    port = free_port()  # nothing listens there: the engine died

    async def main():
        client = EngineClient(f"http://127.0.0.1:{port}", max_retries=2, retry_backoff_s=0.01, name="rollout:0")
        try:
            results = await asyncio.gather(
                *(client.generate({"input_ids": [i]}) for i in range(30)), return_exceptions=True
            )
            await client.abort_request(abort_all=True)  # nothing left to abort on a dead engine: no error
        finally:
            await client.close()
        return results

    with caplog.at_level("WARNING", logger="miles.engines.client"):
        results = run(main())
    assert all(isinstance(r, EngineConnectionError) for r in results)
    assert f"engine rollout:0 at http://127.0.0.1:{port} is unreachable" in str(results[0])
    warnings = [r for r in caplog.records if r.name == "miles.engines.client"]
    assert len(warnings) == 1 and "rollout:0" in warnings[0].getMessage()


def test_an_outage_past_the_retry_budget_gets_one_attempt_per_request():
    attempts = []

    async def drop(request: web.Request) -> web.Response:
        attempts.append(1)
        request.transport.close()
        await asyncio.sleep(0.05)
        return web.Response()

    async def main():
        app = web.Application()
        app.router.add_post("/generate", drop)
        runner, url = await serve_app(app)
        client = EngineClient(url, max_retries=2, retry_backoff_s=0.01)
        try:
            for _ in range(2):
                with pytest.raises(EngineConnectionError):
                    await client.generate({"input_ids": [1]})
        finally:
            await client.close()
            await runner.cleanup()

    run(main())
    assert len(attempts) == 3 + 1  # the first request retried twice; the outage then outlasted the budget


def test_a_known_failure_is_raised_instead_of_retrying():
    port = free_port()
    died = RuntimeError("rollout:0 (pid 123) was killed by SIGKILL")

    async def main():
        client = EngineClient(
            f"http://127.0.0.1:{port}", max_retries=50, retry_backoff_s=10, known_failure=lambda: died
        )
        try:
            with pytest.raises(RuntimeError) as info:
                await client.generate({"input_ids": [1]})
            await client.abort_request(rid="r")  # the engine is known gone: nothing to abort, no error
        finally:
            await client.close()
        return info.value

    assert run(main()) is died


def test_the_api_key_travels_on_every_request():
    seen = []

    async def record(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"ok": True})

    async def main():
        app = web.Application()
        app.router.add_post("/generate", record)
        app.router.add_post("/abort_request", record)
        runner, url = await serve_app(app)
        client = EngineClient(url, api_key="k1")
        try:
            await client.generate({"input_ids": [1]}, routing_key="s")
            await client.abort_request(abort_all=True)
        finally:
            await client.close()
            await runner.cleanup()

    run(main())
    assert seen == ["Bearer k1", "Bearer k1"]


def test_sglang_command_carries_the_key_but_its_log_line_does_not():
    server = SGLangServer("/m", 30000, api_key="sekrit")
    assert server.command[server.command.index("--api-key") + 1] == "sekrit"
    assert "sekrit" not in server.command_text
    with pytest.raises(ValueError, match="--api-key"):
        build_sglang_command("/m", 1, sglang_args={"api_key": "x"})


@pytest.mark.parametrize("status", [400, 404, 422])
def test_4xx_is_not_retried_and_carries_the_message(status):
    attempts = []

    async def reject(request: web.Request) -> web.Response:
        attempts.append(1)
        return web.json_response({"error": {"message": "max_new_tokens must be >= 0"}}, status=status)

    async def main():
        app = web.Application()
        app.router.add_post("/generate", reject)
        runner, url = await serve_app(app)
        client = EngineClient(url, max_retries=3, retry_backoff_s=0.01)
        try:
            await client.generate({"input_ids": [1]})
        finally:
            await client.close()
            await runner.cleanup()

    with pytest.raises(EngineHTTPError) as info:
        run(main())
    assert len(attempts) == 1
    err = info.value
    assert err.status == status and err.endpoint == "/generate"
    assert "max_new_tokens must be >= 0" in str(err)


def test_timeout_raises_and_is_not_retried():
    attempts = []

    async def slow(request: web.Request) -> web.Response:
        attempts.append(1)
        await asyncio.sleep(5)
        return web.json_response({})

    async def main():
        app = web.Application()
        app.router.add_post("/generate", slow)
        runner, url = await serve_app(app)
        client = EngineClient(url, max_retries=3, timeout_s=60)
        try:
            await client.generate({"input_ids": [1]}, timeout_s=0.2)
        finally:
            await client.close()
            await runner.cleanup()

    with pytest.raises(EngineTimeoutError):
        run(main())
    assert len(attempts) == 1


def test_routing_key_travels_in_header_and_router_keeps_affinity():
    seen: list[tuple[int, str | None]] = []

    def make_app(index: int) -> web.Application:
        async def generate(request: web.Request) -> web.Response:
            seen.append((index, request.headers.get(ROUTING_KEY_HEADER)))
            return web.json_response(
                {"text": "", "output_ids": [], "meta_info": {"prompt_tokens": 4, "cached_tokens": 3}}
            )

        app = web.Application()
        app.router.add_post("/generate", generate)
        return app

    async def main():
        servers = [await serve_app(make_app(i)) for i in range(2)]
        router = Router([EngineClient(url) for _, url in servers], session_mode=True)
        try:
            for turn in range(3):
                await router.generate({"input_ids": [turn]}, routing_key="session-A")
            await router.generate({"input_ids": [9]}, routing_key="session-B")
            return router.stats()
        finally:
            await router.close()
            for runner, _ in servers:
                await runner.cleanup()

    stats = run(main())
    assert [key for _, key in seen] == ["session-A"] * 3 + ["session-B"]
    assert len({index for index, key in seen if key == "session-A"}) == 1
    assert stats["affinity_hits"] == 2
    assert stats["prefix_cache_hit_rate"] == pytest.approx(12 / 16)


# -- SGLang backend ------------------------------------------------------------------------------

FAKE_LAUNCH_SERVER = textwrap.dedent(
    """
    import argparse, asyncio, json, os, sys
    sys.path.insert(0, os.environ["FAKE_ENGINE_DIR"])
    from fake_engine import FakeEngine
    from miles.engines.http_front import start_http_server

    if os.environ.get("FAKE_SGLANG_FAIL"):
        print("fake sglang: refusing to start", flush=True)
        sys.exit(3)
    with open(os.environ["FAKE_SGLANG_ARGV_OUT"], "w") as f:
        json.dump(sys.argv[1:], f)
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args, _ = parser.parse_known_args()

    async def main():
        engine = FakeEngine(args.model_path)
        await engine.start()
        await start_http_server(engine, args.host, args.port)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


@pytest.fixture
def fake_sglang(tmp_path: Path) -> dict[str, str]:
    pkg = tmp_path / "site" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    return {
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO_ROOT)]),
        "FAKE_ENGINE_DIR": str(Path(__file__).parent),
        "FAKE_SGLANG_ARGV_OUT": str(tmp_path / "argv.json"),
    }


def test_sglang_command_line():
    cmd = build_sglang_command(
        "/models/qwen",
        30001,
        host="0.0.0.0",
        tp_size=2,
        python="/usr/bin/python3",
        sglang_args={
            "sglang_mem_fraction_static": 0.7,
            "enable-memory-saver": True,
            "disable_radix_cache": False,
            "random_seed": 5,
            "cuda_graph_bs": [1, 2, 4],
            "skip_server_warmup": False,
        },
    )
    assert cmd == [
        "/usr/bin/python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/qwen",
        "--host",
        "0.0.0.0",
        "--port",
        "30001",
        "--tp-size",
        "2",
        "--mem-fraction-static",
        "0.7",
        "--enable-memory-saver",
        "--random-seed",
        "5",
        "--cuda-graph-bs",
        "1",
        "2",
        "4",
    ]
    assert "--skip-server-warmup" in build_sglang_command("/m", 1)
    with pytest.raises(ValueError, match="tp_size"):
        build_sglang_command("/m", 1, sglang_args={"sglang_tp_size": 4})


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sglang_server_lifecycle_with_stand_in_package(fake_sglang, tmp_path):
    port = free_port()
    server = SGLangServer(
        "/models/tiny",
        port,
        sglang_args={"mem_fraction_static": 0.5},
        tp_size=1,
        env=fake_sglang,
        log_path=tmp_path / "sglang.log",
    )
    server.start()
    try:
        server.wait_healthy(timeout=60)

        async def use():
            async with server.client() as client:
                out = await client.generate(
                    {"input_ids": [4], "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
                )
                return out, await client.model_info()

        out, info = run(use())
    finally:
        code = server.stop(timeout=10)
    argv = json.loads(Path(fake_sglang["FAKE_SGLANG_ARGV_OUT"]).read_text())
    assert argv == server.command[3:]
    assert "--mem-fraction-static" in argv and "0.5" in argv
    assert out["output_ids"] == [next_token(4), next_token(next_token(4))]
    assert info["model_path"] == "/models/tiny"
    assert code == -signal.SIGTERM
    assert not _group_alive(server.process.pid)


def test_sglang_server_that_dies_reports_its_exit_code(fake_sglang, tmp_path):
    env = dict(fake_sglang, FAKE_SGLANG_FAIL="1")
    server = SGLangServer("/m", free_port(), env=env, log_path=tmp_path / "log.txt")
    server.start()
    try:
        with pytest.raises(RuntimeError) as info:
            run(server.wait_healthy_async(timeout=60))
    finally:
        server.stop(timeout=5)
    assert "exited with code 3" in str(info.value)
    assert "refusing to start" in str(info.value)  # the log tail is in the message


def test_sglang_server_python_is_the_running_interpreter():
    assert SGLangServer("/m", 1).command[0] == sys.executable


def test_client_survives_being_used_from_two_event_loops():
    async def call(client):
        return await client.model_info()

    async def serve_and_use(client):
        handle = await start_http_server(FakeEngine(), "127.0.0.1", 0)
        client.base_url = handle.url
        try:
            return await call(client)
        finally:
            await handle.stop()

    client = EngineClient("http://127.0.0.1:1")
    first = run(serve_and_use(client))
    second = run(serve_and_use(client))  # a new loop: the old session must not be reused
    run(client.close())
    assert first["model_path"] == second["model_path"] == "fake-model"
