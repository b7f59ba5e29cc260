"""The embedded engine on CUDA through what an RL run does to it between rollouts.

Requests arrive one at a time, as a rollout's HTTP calls do: a request prefilled alone once sent its
slot index to the prefill kernel as a stride-0 view, read past its storage (KV written to random
slots, then an illegal memory access), which killed disaggregated and long-answer runs.

Disaggregated runs load new weights in place while graphs, KV and a queued lookahead persist (and
weights arrive on another stream, as NCCL delivers them); colocated runs release and resume weights
and KV around every update, and long answers then capture new batch buckets. Each test drives many
such cycles with requests finishing at different lengths, so many batch buckets are replayed and
captured, and checks that every request finishes with in-range tokens and that the device is
still healthy (an illegal memory access would surface at the final synchronize, if not before).
"""

import asyncio
import random

import pytest
import torch

from miles.engines.embedded.engine import EmbeddedEngine
from miles.models.tiny import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # the demo's shape (tiny:qwen2:2x64): 2 layers, hidden 64, 4 heads of 16, 2 kv heads
    return make_tiny_model(
        str(tmp_path_factory.mktemp("tiny") / "qwen2"), layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128
    )


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


async def _rollout(engine: EmbeddedEngine, step: int, max_new: int, n_prompts: int = 16, n: int = 8) -> list[dict]:
    """n_prompts groups of n samples, sent one request at a time as the rollout's HTTP calls arrive (so
    steps mix one-request prefills with decodes), lengths spread so batch sizes shrink one bucket at a time."""
    rng = random.Random(step)

    async def one(prompt: list[int], params: dict) -> dict:
        await asyncio.sleep(rng.random() * 0.05)
        return await engine.generate(input_ids=prompt, sampling_params=params, return_logprob=True)

    calls = []
    for i, prompt in enumerate(_prompts(n_prompts, step)):
        params = {"temperature": 1.0, "max_new_tokens": rng.randrange(1, max_new + 1), "ignore_eos": i % 2 == 0}
        calls += [one(prompt, params) for _ in range(n)]
    return await asyncio.gather(*calls)


def _new_weights(engine: EmbeddedEngine, step: int) -> list[tuple[str, torch.Tensor]]:
    """Perturbed copies of the engine's weights, made on a side stream (NCCL receives on its own stream)."""
    stream = torch.cuda.Stream()
    g = torch.Generator(device="cuda").manual_seed(step)
    with torch.cuda.stream(stream):
        named = [
            (name, t.float() + 0.01 * torch.randn(t.shape, device="cuda", generator=g))
            for name, t in engine.named_weights()
        ]
    torch.cuda.current_stream().wait_stream(stream)
    return named


def _check(outs: list[dict], vocab: int) -> None:
    for out in outs:
        ids = out["output_ids"]
        assert ids and all(0 <= t < vocab for t in ids)
        assert len(out["meta_info"]["output_token_logprobs"]) == len(ids)


@pytest.mark.parametrize("pause_mode", ["retract", "in_place", "abort"])
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_in_place_weight_loads_between_and_during_rollouts(model_dir, pause_mode, cuda_graphs):
    """Disaggregated: 40 rollouts, each followed by a weight load from another thread; every fourth load
    lands while requests are in flight (the fully async loop's update)."""

    async def main():
        engine = EmbeddedEngine(
            model_dir,
            device="cuda",
            dtype="bfloat16",
            max_running_requests=128,
            max_total_tokens=128 * 1040,
            cuda_graphs=cuda_graphs,
        )
        await engine.start()
        vocab = engine.model.spec.vocab_size
        try:
            for step in range(40):
                rollout = asyncio.create_task(_rollout(engine, step, max_new=12))
                if step % 4 == 3:
                    await asyncio.sleep(0.005 * (step % 5))
                else:
                    _check(await rollout, vocab)
                await engine.pause_generation(pause_mode)
                named = await asyncio.to_thread(_new_weights, engine, step)
                engine.load_weights(named)
                engine.weight_version = step + 1
                await engine.continue_generation()
                outs = await rollout
                if pause_mode != "abort":
                    _check(outs, vocab)
            torch.cuda.synchronize()
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_release_resume_cycles_with_long_answers(model_dir, cuda_graphs, direct):
    """Colocated: 12 cycles of rollout (answers up to 512 tokens), release weights and KV, resume, load
    (copies into the live tensors, or writes into the exported shared buffer and an install). What the
    engine keeps on the device after each release must not grow from cycle to cycle: a colocated 0.5B run
    on an 80 GB GPU ran out of memory in the trainer at step 16 with the engine's process holding 22 GiB."""
    held_after_release: list[float] = []  # GiB of the device in use beyond what was in use before the engine

    async def main():
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        engine = EmbeddedEngine(
            model_dir,
            device="cuda",
            dtype="bfloat16",
            max_running_requests=256,
            max_total_tokens=256 * 640,
            cuda_graphs=cuda_graphs,
        )
        await engine.start()
        vocab = engine.model.spec.vocab_size
        try:
            for step in range(12):
                _check(await _rollout(engine, step, max_new=512, n_prompts=32), vocab)
                await engine.pause_generation("retract")
                engine.release_memory_occupation(["kv_cache", "weights"])
                held_after_release.append((free_before - torch.cuda.mem_get_info()[0]) / 2**30)
                engine.resume_memory_occupation(["weights"])
                named = await asyncio.to_thread(_new_weights, engine, step)
                if direct:  # what the colocated trainer does through the buffer's IPC mapping
                    generation = engine.export_weight_buffer()["generation"]
                    for (_, new), (_, live) in zip(named, engine.named_weights(), strict=True):
                        live.copy_(new)
                    engine.install_weight_buffer(generation, step + 1)
                else:
                    engine.load_weights(named)
                engine.resume_memory_occupation(["kv_cache"])
                engine.weight_version = step + 1
                await engine.continue_generation()
            torch.cuda.synchronize()
        finally:
            await engine.shutdown()

    asyncio.run(main())
    print("device memory held after each release (GiB):", [round(x, 3) for x in held_after_release])
    assert max(held_after_release[2:]) - held_after_release[1] < 0.5, held_after_release
