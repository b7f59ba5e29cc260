"""The embedded engine's HTTP front lets in only the run's clients, bounded requests and the run's paths.

Each test serves a real EmbeddedEngine (tiny random model) in-process and knocks on a door the way
the issue's attacker did: no key or a wrong one, a client-chosen directory or shared-memory name,
an oversized body, a huge prompt beside a small one, NaN sampling parameters.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import threading
from contextlib import asynccontextmanager

import aiohttp
import pytest
import torch

from miles.engines.client import EngineClient, EngineHTTPError
from miles.engines.embedded.engine import EmbeddedEngine
from miles.engines.embedded.request_intake import INLINE_TOKENIZE_CHARS
from miles.engines.http_front import start_http_server
from miles.weights.receiver import MATERIALISE_BASE

KEY = "test-key-0123456789"
GREEDY = {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: str) -> str:
    torch.set_num_threads(1)
    return tiny_model_dir


@asynccontextmanager
async def serving(model_dir: str, **doors):
    engine = EmbeddedEngine(model_dir, seed=0)
    await engine.start()
    handle = await start_http_server(engine, "127.0.0.1", 0, api_key=KEY, **doors)
    client = EngineClient(handle.url, api_key=KEY, timeout_s=60, max_retries=0)
    try:
        yield engine, handle.url, client
    finally:
        await client.close()
        await handle.stop()
        await engine.shutdown()


def run(coro):
    return asyncio.run(coro)


async def raw(method: str, url: str, headers: dict | None = None, **kw) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.request(method, url, headers=headers, **kw) as resp:
        return resp.status, await resp.text()


def test_every_endpoint_but_health_wants_the_key(model_dir):
    async def main():
        async with serving(model_dir) as (engine, url, client):
            body = {"input_ids": [3, 4], "sampling_params": GREEDY}
            refused = {
                "none": await raw("POST", f"{url}/generate", json=body),
                "wrong": await raw("POST", f"{url}/generate", {"Authorization": "Bearer not-the-key"}, json=body),
                "no bearer": await raw("POST", f"{url}/generate", {"Authorization": KEY}, json=body),
                "version": await raw("POST", f"{url}/update_weight_version", json={"new_version": "7"}),
                "health_generate": await raw("GET", f"{url}/health_generate"),
            }
            version_after_attack = engine.weight_version
            health = await raw("GET", f"{url}/health")
            answered = await client.generate(body)
            await client.update_weight_version("1")
            return refused, version_after_attack, health, answered, engine.weight_version

    refused, version_after_attack, health, answered, version = run(main())
    for what, (status, text) in refused.items():
        assert status == 401, what
        assert "\n" not in text.strip() and "Authorization: Bearer" in json.loads(text)["error"], what
    assert version_after_attack == 0  # the unauthenticated version bump changed nothing
    assert health[0] == 200
    assert len(answered["output_ids"]) == 2 and version == 1


def test_a_wrong_key_tells_the_client_what_to_do(model_dir):
    async def main():
        async with serving(model_dir) as (_, url, _client):
            async with EngineClient(url, api_key="stale-key", max_retries=0) as wrong:
                with pytest.raises(EngineHTTPError) as info:
                    await wrong.get_weight_version()
        return info.value

    err = run(main())
    assert err.status == 401 and "--api-key" in str(err) and "stale-key" not in str(err)


def test_weight_endpoints_take_only_the_runs_directories(model_dir, tmp_path):
    allowed, outside = tmp_path / "run", tmp_path / "elsewhere"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "link").symlink_to(outside)  # a link inside an allowed directory must not lead out

    async def main():
        async with serving(model_dir, weight_dirs=[str(allowed)]) as (_, _url, client):
            statuses = {}
            attempts = {
                "pull into elsewhere": dict(local_checkpoint_dir=str(outside / "host"), source_dir=str(allowed)),
                "pull from elsewhere": dict(local_checkpoint_dir=str(allowed / "host"), source_dir=str(outside)),
                "pull via ..": dict(local_checkpoint_dir=f"{allowed}/../elsewhere/host", source_dir=str(allowed)),
                "pull via link": dict(local_checkpoint_dir=str(allowed / "link" / "host"), source_dir=str(allowed)),
            }
            for what, dirs in attempts.items():
                with pytest.raises(EngineHTTPError) as info:
                    await client.pull_weights(target_version=MATERIALISE_BASE, **dirs)
                statuses[what] = info.value
            with pytest.raises(EngineHTTPError) as info:
                await client.update_weights_from_disk(model_path=str(outside), weight_version="3")
            statuses["reload from elsewhere"] = info.value
            # inside the run's directory and from the served model: accepted
            pulled = await client.pull_weights(
                local_checkpoint_dir=str(allowed / "host"), source_dir=str(allowed), target_version=MATERIALISE_BASE
            )
            await client.update_weights_from_disk(model_path=model_dir, weight_version="2")
            version = await client.get_weight_version()
        return statuses, pulled, version

    statuses, pulled, version = run(main())
    for what, err in statuses.items():
        assert err.status == 403 and "outside the directories" in str(err), what
    assert list(outside.iterdir()) == []  # nothing was written where the client pointed
    assert pulled["materialised"] and any((allowed / "host").iterdir())
    assert version == 2


class _SharedStorage:
    """Pickles as torch's file_system storage reduction naming `segment` (SGLang's payload format)."""

    def __init__(self, segment: str) -> None:
        self.segment = segment

    def __reduce__(self):
        from torch.multiprocessing import reductions

        return reductions.rebuild_storage_filename, (torch.UntypedStorage, b"/manager", self.segment.encode(), 64)


def _storage_payload(segment: str) -> str:
    return base64.b64encode(pickle.dumps([("w", _SharedStorage(segment))])).decode()


def test_a_shared_memory_segment_must_be_a_plain_name(model_dir, tmp_path):
    secret = tmp_path / "not-shm"
    secret.write_bytes(b"\0" * 64)
    escape = os.path.relpath(secret, "/dev/shm")  # ../../tmp/...: a file outside /dev/shm
    assert escape.startswith("..")

    async def main():
        async with serving(model_dir) as (_, _url, client):
            errors = []
            for segment in (escape, "/" + escape, "a/b", ".."):
                payload = _storage_payload(segment)
                with pytest.raises(EngineHTTPError) as info:
                    await client.update_weights_from_tensor(serialized_named_tensors=[payload])
                errors.append(info.value)
        return errors

    for err in run(main()):
        assert err.status == 400 and "plain segment name" in str(err)


def test_an_oversized_body_is_refused_before_it_is_read(model_dir):
    async def main():
        async with serving(model_dir, max_body_mb=1) as (_, url, client):
            host, port = url.removeprefix("http://").split(":")
            # headers announcing 300 MB and no body at all: the answer must come without waiting for it
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                f"POST /generate HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {300 * 2**20}\r\n\r\n".encode()
            )
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), timeout=30)
            writer.close()

            async def chunks():  # no Content-Length: cut off once past the limit
                for _ in range(8):
                    yield b" " * 2**20

            chunked = await raw("POST", f"{url}/generate", {"Authorization": f"Bearer {KEY}"}, data=chunks())
            small = await client.generate({"input_ids": [3, 4], "sampling_params": GREEDY})
        return status_line, chunked, small

    status_line, (chunked_status, chunked_text), small = run(main())
    assert status_line.split()[1] == b"413"
    assert chunked_status == 413 and "--http-max-body-mb" in json.loads(chunked_text)["error"]
    assert len(small["output_ids"]) == 2  # the server still serves


class GatedTokenizer:
    """The engine's tokenizer, except that a long text waits until the test opens the gate (a slow tokeniser)."""

    def __init__(self, inner, timeout_s: float = 15.0) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.long_texts = 0
        self.timeout_s = timeout_s

    def __call__(self, text: str, **kw):
        if len(text) > INLINE_TOKENIZE_CHARS:
            self.long_texts += 1
            self.gate.wait(self.timeout_s)
        return self.inner(text, **kw)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_huge_prompt_does_not_stall_a_small_one(model_dir):
    async def main():
        async with serving(model_dir) as (engine, _url, client):
            gated = engine.tokenizer = GatedTokenizer(engine.tokenizer)
            big_text = "x " * (INLINE_TOKENIZE_CHARS + 100)  # tokenised off the loop, fits no context
            big = asyncio.create_task(client.generate({"text": big_text, "sampling_params": GREEDY}))
            while gated.long_texts == 0:  # the big prompt is being tokenised (and blocked there)
                await asyncio.sleep(0.01)
            small = await client.generate({"text": "What is 3+4?", "sampling_params": GREEDY})
            big_done_before_small = big.done()
            gated.gate.set()
            with pytest.raises(EngineHTTPError) as info:
                await big
        return small, big_done_before_small, info.value

    small, big_done_before_small, big_err = run(main())
    assert len(small["output_ids"]) == 2 and not big_done_before_small
    assert big_err.status == 400 and "context" in str(big_err)  # 8k tokens: over the 4096-token context


def test_a_prompt_too_long_to_fit_is_refused_before_tokenising(model_dir):
    async def main():
        async with serving(model_dir) as (engine, _url, client):
            gated = engine.tokenizer = GatedTokenizer(engine.tokenizer, timeout_s=0)
            with pytest.raises(EngineHTTPError) as info:
                await client.generate({"text": "y" * (engine.max_prompt_chars + 1), "sampling_params": GREEDY})
        return info.value, gated.long_texts

    err, tokenised = run(main())
    assert err.status == 400 and "before tokenising" in str(err) and tokenised == 0


@pytest.mark.parametrize(
    "sampling_params",
    [{"temperature": float("nan")}, {"top_p": float("inf")}, {"temperature": 1e400}, {"max_new_tokens": 1e400}],
)
def test_non_finite_sampling_params_are_refused(model_dir, sampling_params):
    async def main():
        async with serving(model_dir) as (_, _url, client):
            with pytest.raises(EngineHTTPError) as info:
                await client.generate({"input_ids": [3, 4], "sampling_params": sampling_params})
            after = await client.generate({"input_ids": [3, 4], "sampling_params": GREEDY})
        return info.value, after

    err, after = run(main())
    assert err.status == 400 and len(after["output_ids"]) == 2


def test_serve_main_takes_the_doors_flags():
    from miles.engines.http_front import parse_engine_args as _parse_args

    args = _parse_args(["--model-path", "/m", "--api-key", "k", "--weight-dir", "/a", "--weight-dir", "/b"])
    assert (args.api_key, args.weight_dir, args.host, args.max_body_mb) == ("k", ["/a", "/b"], "127.0.0.1", 64)


def test_a_multi_node_engine_refuses_to_listen_everywhere_without_a_key(monkeypatch):
    import logging

    from miles.workers.base import WorkerContext
    from miles.workers.rollout_worker import RolloutWorker

    monkeypatch.setenv("MILES_NUM_NODES", "2")
    ctx = WorkerContext("rollout", 0, "/tmp", 0, {}, logging.getLogger("test"))
    with pytest.raises(ValueError, match="without an API key"):
        RolloutWorker(ctx, engine="embedded", model_path="/m")
    assert RolloutWorker(ctx, engine="embedded", model_path="/m", api_key=KEY).host == "0.0.0.0"


def test_the_key_reaches_every_engine_but_never_the_saved_config(tmp_path):
    from miles.config import load_config, save_config
    from miles.controller.placement import plan_placement

    cfg = load_config(
        [
            "--hf-checkpoint",
            "/m",
            "--prompt-data",
            "/p.jsonl",
            "--rm-type",
            "math",
            "--rollout-batch-size",
            "2",
            "--global-batch-size",
            "2",
            "--num-rollout",
            "1",
            "--output-dir",
            str(tmp_path),
            "--api-key",
            KEY,
            "--update-weight-disk-dir",
            str(tmp_path / "delta"),
        ],
        for_train=False,
    )
    placement = plan_placement(cfg, device="cpu")
    spec = placement.rollout_specs[0].init_kwargs
    assert spec["api_key"] == KEY and spec["weight_dirs"] == [str(tmp_path), str(tmp_path / "delta")]
    assert placement.trainer_specs[0].init_kwargs["sections"]["engine"]["api_key"] == KEY
    save_config(cfg, tmp_path / "config.yaml")
    assert KEY not in (tmp_path / "config.yaml").read_text()
    assert KEY not in json.dumps(cfg.to_dict())
