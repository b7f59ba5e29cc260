"""The HTTP front answers SGLang payloads exactly as the in-process engine call does."""

from __future__ import annotations

import asyncio
import gc
import sys
import weakref
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from fake_engine import FakeEngine, next_token

from miles.engines.client import EngineClient, EngineHTTPError, EngineTimeoutError
from miles.engines.http_front import start_http_server
from miles.engines.sglang_protocol import parse_generate_body


@asynccontextmanager
async def serving(engine, receiver=None, **doors):
    handle = await start_http_server(engine, "127.0.0.1", 0, receiver=receiver, **doors)
    client = EngineClient(handle.url, timeout_s=30, max_retries=0)
    try:
        yield client
    finally:
        await client.close()
        await handle.stop()


def run(coro):
    return asyncio.run(coro)


def greedy(prompt_last: int, n: int) -> list[int]:
    out, t = [], prompt_last
    for _ in range(n):
        t = next_token(t)
        out.append(t)
    return out


def test_generate_matches_in_process_call():
    payload = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "no_stop_trim": True},
        "return_logprob": True,
        "logprob_start_len": 1,
        "rid": "r-1",
    }

    async def main():
        engine = FakeEngine()
        direct = await engine.generate(
            input_ids=[5, 6, 7],
            sampling_params=dict(payload["sampling_params"]),
            rid="r-1",
            return_logprob=True,
            logprob_start_len=1,
        )
        async with serving(engine) as client:
            over_http = await client.generate(payload)
        return direct, over_http

    direct, over_http = run(main())
    assert over_http == direct
    assert over_http["output_ids"] == greedy(7, 6)
    meta = over_http["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert [e[1] for e in meta["output_token_logprobs"]] == greedy(7, 6)
    # logprob_start_len=1 keeps input positions 1 and 2.
    assert [e[1] for e in meta["input_token_logprobs"]] == [6, 7]


def test_a_stopped_front_lets_its_engine_go():
    """aiohttp keeps every app's middleware-wrapped handlers in a process-wide cache after the app stopped:
    the handlers must not hold the engine (a real one holds its weights and KV cache) past `stop()`."""

    async def main():
        engine = FakeEngine()
        async with serving(engine) as client:
            await client.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
            await client.update_weight_version("1")  # through the weight receiver, which holds the engine too
        return weakref.ref(engine)

    gone = run(main())
    gc.collect()
    assert gone() is None


def test_batch_and_n_are_flattened_like_sglang():
    async def main():
        engine = FakeEngine()
        async with serving(engine) as client:
            batch = await client.generate(
                {"input_ids": [[1], [2]], "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
            )
            many = await client.generate(
                {"text": "ab", "sampling_params": {"temperature": 1.0, "max_new_tokens": 3, "n": 3}}
            )
            per_item = await client.generate(
                {
                    "input_ids": [[1], [2]],
                    "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 4}],
                    "rid": ["a", "b"],
                }
            )
        return batch, many, per_item

    batch, many, per_item = run(main())
    assert [b["output_ids"] for b in batch] == [greedy(1, 2), greedy(2, 2)]
    assert isinstance(many, list) and len(many) == 3
    assert [len(p["output_ids"]) for p in per_item] == [1, 4]
    assert [p["meta_info"]["id"] for p in per_item] == ["a", "b"]


def test_return_text_in_logprobs_fills_token_text():
    async def main():
        async with serving(FakeEngine()) as client:
            return await client.generate(
                {
                    "input_ids": [3],
                    "sampling_params": {"temperature": 0, "max_new_tokens": 2},
                    "return_logprob": True,
                    "return_text_in_logprobs": True,
                }
            )

    out = run(main())
    toks = greedy(3, 2)
    assert out["meta_info"]["output_token_logprobs"] == [[-0.5, t, chr(32 + t % 90)] for t in toks]


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"input_ids": [1], "stream": True}, "stream"),
        ({"input_ids": [1], "return_hidden_states": True}, "return_hidden_states"),
        ({"input_ids": [1], "token_ids_logprob": [[1], [2]]}, "2 lists for 1 prompt"),
        ({"sampling_params": {}}, "exactly one"),
        ({"input_ids": [1], "text": "x"}, "exactly one"),
        ({"input_ids": [[1], [2]], "rid": ["only-one"]}, "1 entries for 2 prompts"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "bogus"),
    ],
)
def test_bad_generate_payloads_are_400_with_reason(body, needle):
    async def main():
        async with serving(FakeEngine()) as client:
            with pytest.raises(EngineHTTPError) as info:
                await client.generate(body)
            return info.value

    err = run(main())
    assert err.status == 400
    assert needle in str(err)


def test_parse_generate_body_assigns_rids_and_defaults():
    calls, is_batch = parse_generate_body({"text": "hi"})
    assert not is_batch and len(calls) == 1
    call = calls[0]
    assert call["text"] == "hi" and call["sampling_params"] == {} and call["logprob_start_len"] == -1
    assert isinstance(call["rid"], str) and call["rid"]


def test_abort_pause_continue_and_flush():
    async def main():
        engine = FakeEngine(delay_s=0.01)
        async with serving(engine) as client:
            task = asyncio.create_task(
                client.generate(
                    {
                        "input_ids": [1],
                        "rid": "long",
                        "sampling_params": {"temperature": 0, "max_new_tokens": 10_000, "ignore_eos": True},
                    }
                )
            )
            while engine.num_active_requests == 0:
                await asyncio.sleep(0.01)
            flushed_busy = await client.flush_cache()
            await client.pause_generation("retract")
            await client.continue_generation()
            await client.abort_request(rid="long")
            out = await task
            flushed_idle = await client.flush_cache()
            with pytest.raises(EngineHTTPError) as bad_mode:
                await client.pause_generation("sideways")
        return engine, out, flushed_busy, flushed_idle, bad_mode.value

    engine, out, flushed_busy, flushed_idle, bad_mode = run(main())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert flushed_busy is False and flushed_idle is True
    assert engine.pause_modes == ["retract"]
    assert bad_mode.status == 400 and "sideways" in str(bad_mode)


def test_abort_all_ends_every_request():
    async def main():
        engine = FakeEngine(delay_s=0.01)
        async with serving(engine) as client:
            body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 10_000, "ignore_eos": True}}
            tasks = [asyncio.create_task(client.generate(dict(body))) for _ in range(4)]
            while engine.num_active_requests < 4:
                await asyncio.sleep(0.01)
            await client.abort_request(abort_all=True)
            return await asyncio.gather(*tasks)

    outs = run(main())
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort"] * 4


def test_client_disconnect_aborts_the_engine_request():
    async def main():
        engine = FakeEngine(delay_s=0.01)
        async with serving(engine) as client:
            with pytest.raises(EngineTimeoutError):
                await client.generate(
                    {
                        "input_ids": [1],
                        "rid": "gone",
                        "sampling_params": {"max_new_tokens": 10_000, "ignore_eos": True},
                    },
                    timeout_s=0.3,
                )
            for _ in range(500):  # wait for the server to notice the closed connection
                if engine.num_active_requests == 0:
                    break
                await asyncio.sleep(0.01)
        return engine

    engine = run(main())
    assert "gone" in engine._aborted
    assert engine.num_active_requests == 0


def test_info_version_memory_and_health_endpoints():
    async def main():
        engine = FakeEngine()
        async with serving(engine) as client:
            await client.update_weight_version(7)
            version = await client.get_weight_version()
            legacy = await client._get("/get_weight_version")
            info = await client.model_info()
            server = await client.server_info()
            legacy_server = await client._get("/get_server_info")
            await client.release_memory_occupation(["weights", "kv_cache", "cuda_graph"])
            released = engine.released
            await client.resume_memory_occupation(["weights"])
            healthy = await client.health()
            healthy_plain = await client.health(generate=False)
        return engine, version, legacy, info, server, legacy_server, released, healthy, healthy_plain

    engine, version, legacy, info, server, legacy_server, released, healthy, healthy_plain = run(main())
    assert version == 7 and engine.weight_version == 7
    assert legacy == {"weight_version": "7"}
    assert info["weight_version"] == "7" and info["is_generation"] is True
    assert server["internal_states"][0]["num_active_requests"] == 0 and server["model_path"] == "fake-model"
    assert legacy_server == server
    assert released == ["weights", "kv_cache"]  # cuda_graph has no meaning here
    assert engine.released is None
    assert healthy and healthy_plain
    # the health probe is a real one-token generation on an idle engine
    assert engine.calls[-1]["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}


class RecordingReceiver:
    def __init__(self):
        self.calls = []

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "miles",
        backend: str = "gloo",
    ):
        self.calls.append(("init", master_address, master_port, rank_offset, world_size, group_name, backend))

    async def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name="miles", weight_version=None, flush_cache=False, **_
    ):
        if len(names) != len(shapes):
            raise ValueError(f"{len(names)} names but {len(shapes)} shapes")
        self.calls.append(("dist", names, dtypes, shapes, weight_version))

    async def weights_checker(self, action: str, **kw):
        return {"action": action, "mismatched": []}

    async def update_weight_version(self, new_version: str):
        self.calls.append(("version", new_version))


def test_weight_endpoints_reach_the_receiver():
    receiver = RecordingReceiver()

    async def main():
        async with serving(FakeEngine(), receiver=receiver) as client:
            await client.init_weights_update_group(
                master_address="127.0.0.1",
                master_port=1234,
                rank_offset=1,
                world_size=2,
                group_name="miles",
                backend="gloo",
            )
            await client.update_weights_from_distributed(
                names=["w"],
                dtypes=["float32"],
                shapes=[[2, 3]],
                group_name="miles",
                flush_cache=False,
                weight_version="3",
                selector="all",
            )
            checked = await client.weights_checker(action="compare")
            await client.update_weight_version("4")
            with pytest.raises(EngineHTTPError) as mismatch:
                await client.update_weights_from_distributed(names=["a", "b"], dtypes=["float32"], shapes=[[1]])
            with pytest.raises(EngineHTTPError) as bad_fields:
                await client.init_weights_update_group(master_address="x")
        return checked, mismatch.value, bad_fields.value

    checked, mismatch, bad_fields = run(main())
    assert receiver.calls[0] == ("init", "127.0.0.1", 1234, 1, 2, "miles", "gloo")
    assert receiver.calls[1] == ("dist", ["w"], ["float32"], [[2, 3]], "3")
    assert receiver.calls[2] == ("version", "4")
    assert checked["success"] is True and checked["action"] == "compare"
    assert mismatch.status == 400 and "2 names but 1 shapes" in str(mismatch)
    assert bad_fields.status == 400 and "init_weights_update_group" in str(bad_fields)


def test_weight_endpoints_answer_501_without_receiver_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "miles.weights.receiver", None)  # import now raises ImportError

    async def main():
        engine = FakeEngine()
        async with serving(engine) as client:
            with pytest.raises(EngineHTTPError) as info:
                await client.pull_weights(local_checkpoint_dir="/a", source_dir="/b", target_version=1)
            await client.update_weight_version("2")  # needs no transport: still served
        return engine, info.value

    engine, err = run(main())
    assert err.status == 501 and "miles.weights.receiver" in str(err)
    assert engine.weight_version == 2


def _real_engine_available() -> bool:
    try:
        import miles.engines.embedded.engine  # noqa: F401
        import miles.models.tiny  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _real_engine_available(), reason="embedded engine / tiny model not available yet")
def test_real_embedded_engine_behind_front_matches_in_process(tiny_model_dir):
    import torch

    from miles.engines.embedded.engine import EmbeddedEngine

    torch.set_num_threads(1)
    model_dir = tiny_model_dir
    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}

    async def main():
        engine = EmbeddedEngine(str(model_dir), seed=0, deterministic=True)
        await engine.start()
        try:
            direct = await engine.generate(
                input_ids=[3, 4, 5], sampling_params=dict(params), rid="x", return_logprob=True
            )
            async with serving(engine) as client:
                over_http = await client.generate(
                    {"input_ids": [3, 4, 5], "sampling_params": params, "rid": "x", "return_logprob": True}
                )
                scored = await client.generate(
                    {
                        "input_ids": [3, 4, 5, 6],
                        "sampling_params": {"max_new_tokens": 0},
                        "return_logprob": True,
                        "logprob_start_len": 0,
                    }
                )
                healthy = await client.health()
        finally:
            await engine.shutdown()
        return direct, over_http, scored, healthy

    direct, over_http, scored, healthy = run(main())
    assert over_http["output_ids"] == direct["output_ids"]
    assert set(over_http["meta_info"]) == set(direct["meta_info"])
    assert [e[1] for e in over_http["meta_info"]["output_token_logprobs"]] == over_http["output_ids"]
    assert len(over_http["output_ids"]) == 8 and over_http["meta_info"]["finish_reason"]["type"] == "length"
    assert scored["output_ids"] == [] and [e[1] for e in scored["meta_info"]["input_token_logprobs"]] == [3, 4, 5, 6]
    assert healthy


def test_serve_main_flags_and_defaults():
    from miles.engines.http_front import parse_engine_args as _parse_args

    args = _parse_args(["--model-path", "/m", "--port", "0", "--deterministic", "--max-running-requests", "8"])
    assert (args.model_path, args.host, args.port, args.device, args.dtype) == ("/m", "127.0.0.1", 0, "cpu", "auto")
    assert (args.max_running_requests, args.seed, args.deterministic) == (8, 0, True)
    with pytest.raises(SystemExit):
        _parse_args(["--port", "1"])  # --model-path is required


@pytest.mark.skipif(not _real_engine_available(), reason="embedded engine / tiny model not available yet")
def test_serve_main_process_serves_and_exits_on_sigterm(tiny_model_dir):
    import os
    import re
    import signal
    import subprocess

    model_dir = tiny_model_dir
    code = "import sys; from miles.engines.http_front import serve_main; sys.exit(serve_main(sys.argv[1:]))"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--model-path", model_dir, "--port", "0", "--seed", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"on (http://\S+)", line)
        assert match, f"no serving line, got {line!r}"

        async def use(url):
            async with EngineClient(url, max_retries=0) as client:
                out = await client.generate(
                    {
                        "text": "What is 3+4?",
                        "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
                    }
                )
                return out, await client.health()

        out, healthy = run(use(match.group(1)))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(out["output_ids"]) == 3 and healthy


def test_real_weight_receiver_behind_front_loads_from_disk(tmp_path):
    pytest.importorskip("miles.weights.receiver")
    import torch
    from safetensors.torch import save_file

    save_file({"lm_head.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(tmp_path / "m.safetensors"))

    async def main():
        engine = FakeEngine()
        # no receiver passed: the front creates WeightReceiver(engine); tmp_path is a directory it may read
        async with serving(engine, weight_dirs=[str(tmp_path)]) as client:
            await client.update_weights_from_disk(model_path=str(tmp_path), weight_version="5")
            version = await client.get_weight_version()
        return engine, version

    engine, version = run(main())
    assert [name for name, _ in engine.loaded] == ["lm_head.weight"]
    assert engine.loaded[0][1].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert version == 5


def test_memory_tags_only_cuda_graph_is_a_no_op():
    async def main():
        engine = FakeEngine()
        engine.released = ["sentinel"]
        async with serving(engine) as client:
            await client.release_memory_occupation(["cuda_graph"])
            untouched = engine.released
            await client.release_memory_occupation(None)
            everything = engine.released
            with pytest.raises(EngineHTTPError) as bad:
                await client._post("/release_memory_occupation", {"tags": "weights"})
        return untouched, everything, bad.value

    untouched, everything, bad = run(main())
    assert untouched == ["sentinel"]
    assert everything is None  # null reaches the engine as None: every tag
    assert bad.status == 400


@pytest.mark.skipif(not _real_engine_available(), reason="embedded engine / tiny model not available yet")
def test_real_engine_control_and_weight_reload_over_http(tiny_model_dir):
    import torch

    from miles.engines.embedded.engine import EmbeddedEngine

    torch.set_num_threads(1)
    model_dir = tiny_model_dir
    greedy_body = {
        "text": "What is 3+4?",
        "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
    }
    long_body = {"input_ids": [5, 6], "sampling_params": {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}}

    async def main():
        engine = EmbeddedEngine(model_dir, seed=0)
        await engine.start()
        try:
            async with serving(engine) as client:
                before = await client.generate(greedy_body)
                # pause (retract) while a request runs, then continue: it still finishes by length
                running = asyncio.create_task(client.generate(dict(long_body, rid="long")))
                while engine.num_active_requests == 0:
                    await asyncio.sleep(0.01)
                await client.pause_generation("retract")
                await client.continue_generation()
                finished = await running
                # abort one request by rid
                doomed = asyncio.create_task(
                    client.generate(
                        dict(
                            long_body,
                            rid="doomed",
                            sampling_params={**long_body["sampling_params"], "max_new_tokens": 100_000},
                        )
                    )
                )
                while engine.num_active_requests == 0:
                    await asyncio.sleep(0.01)
                await client.abort_request(rid="doomed")
                aborted = await doomed
                # reload the same weights from disk as version 1, checked against a snapshot
                await client.weights_checker(action="snapshot")
                await client.update_weights_from_disk(model_path=model_dir, weight_version="1")
                compared = await client.weights_checker(action="compare")
                after = await client.generate(greedy_body)
                version = await client.get_weight_version()
        finally:
            await engine.shutdown()
        return before, finished, aborted, compared, after, version

    before, finished, aborted, compared, after, version = run(main())
    assert finished["meta_info"]["finish_reason"]["type"] == "length" and len(finished["output_ids"]) == 200
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert compared["mismatched"] == [] and compared["missing"] == []
    assert after["output_ids"] == before["output_ids"]  # same weights reloaded: same greedy tokens
    assert before["meta_info"]["weight_version"] == "0" and after["meta_info"]["weight_version"] == "1"
    assert version == 1


def test_failing_prompt_in_a_batch_aborts_its_siblings():
    async def main():
        engine = FakeEngine(delay_s=0.01)
        async with serving(engine) as client:
            with pytest.raises(EngineHTTPError) as info:
                await client.generate(
                    {
                        "input_ids": [[1], [2]],
                        "rid": ["ok", "bad"],
                        "sampling_params": [{"max_new_tokens": 10_000, "ignore_eos": True}, {"bogus": 1}],
                    }
                )
            for _ in range(500):
                if engine.num_active_requests == 0:
                    break
                await asyncio.sleep(0.01)
        return engine, info.value

    engine, err = run(main())
    assert err.status == 400 and "bogus" in str(err)
    assert "ok" in engine._aborted and engine.num_active_requests == 0
