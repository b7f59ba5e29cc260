"""Direct colocated writes into the embedded engine's shared weight buffer (CPU: shared memory).

The engine's q/k/v (and gate/up) are stored fused, so each HF name is a row slice of one tensor;
the trainer must land every name in its own rows. A tied lm_head goes to the embedding."""

import asyncio
import os
import threading

import pytest
import torch

from miles.engines.embedded.engine import EmbeddedEngine
from miles.engines.embedded.runner import DecodeGraphs
from miles.models.tiny import make_tiny_model
from miles.weights.arena import StaleWeightBufferError
from miles.weights.buffer_writer import MappedBuffer, open_export, write_into


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "qwen2"), hidden=32, layers=2, intermediate=64)


def _new_weights(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in engine.named_weights()}


def test_every_name_lands_in_its_fused_rows(model_dir):
    engine = EmbeddedEngine(model_dir)
    try:
        export = engine.export_weight_buffer()
        assert len({e["offset"] for e in export["tensors"].values()}) == len(export["tensors"])
        new = _new_weights(engine)
        epoch = engine.runner.kv_epoch
        with open_export(export) as flat:
            count, _ = write_into(flat, export, new.items())
        engine.install_weight_buffer(export["generation"], 3)
        assert count == len(new)
        assert engine.weight_version == 3
        assert engine.runner.kv_epoch > epoch  # KV computed with the old weights is not reused
        served = dict(engine.named_weights())
        for name, t in new.items():
            assert torch.equal(served[name].view(torch.uint8), t.view(torch.uint8)), name
        # Independent of the views: the fused storage is the concatenation of its parts.
        p = "model.layers.1."
        qkv = torch.cat([new[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        gate_up = torch.cat([new[p + "mlp.gate_proj.weight"], new[p + "mlp.up_proj.weight"]])
        fused = [t for t in engine.model.storage.values() if t.shape in (qkv.shape, gate_up.shape)]
        assert any(torch.equal(t, qkv) for t in fused)
        assert any(torch.equal(t, gate_up) for t in fused)
    finally:
        asyncio.run(engine.shutdown())


def test_export_answers_unchanged_for_the_current_generation_only(model_dir):
    engine = EmbeddedEngine(model_dir)
    try:
        export = engine.export_weight_buffer()
        current = export["generation"]
        assert engine.export_weight_buffer(generation=current) == {"generation": current, "unchanged": True}
        assert "tensors" in engine.export_weight_buffer(generation=current - 1)
        mapped = MappedBuffer(export)
        try:
            assert mapped.still_current()  # the engine's generation word holds this buffer's generation
            engine._shared.drop()  # what a weight release does: the word reads 0 before the buffer goes
            assert not mapped.still_current()
        finally:
            mapped.close()
    finally:
        asyncio.run(engine.shutdown())
    assert not os.path.exists(f"/dev/shm/{export['generation_word']}")  # unlinked at shutdown


def test_tied_lm_head_goes_to_the_embedding_and_stale_generation_is_refused(model_dir):
    engine = EmbeddedEngine(model_dir)
    try:
        assert engine.model.spec.tie_word_embeddings
        export = engine.export_weight_buffer()
        embed = engine.model.params["model.embed_tokens.weight"]
        head = torch.full(embed.shape, 0.25, dtype=embed.dtype)
        with open_export(export) as flat:
            write_into(flat, export, [("lm_head.weight", head)])
        assert torch.equal(engine.model.params["model.embed_tokens.weight"], head)
        with pytest.raises(StaleWeightBufferError, match="generation"):
            engine.install_weight_buffer(export["generation"] + 1, 1)
        assert engine.weight_version == 0
    finally:
        asyncio.run(engine.shutdown())


def test_export_is_refused_while_generating(model_dir):
    engine = EmbeddedEngine(model_dir)

    async def main() -> None:
        await engine.start()
        try:
            with pytest.raises(RuntimeError, match="pause_generation first"):
                engine.export_weight_buffer()
            await engine.pause_generation("retract")
            export = engine.export_weight_buffer()
            engine.install_weight_buffer(export["generation"], 1)
            await engine.continue_generation()
            out = await engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})
            assert out["meta_info"]["weight_version"] == "1"
        finally:
            await engine.shutdown()

    asyncio.run(main())


class _Graph:
    """Stands in for a captured torch.cuda.CUDAGraph (CPU has none): records that its pool was given back."""

    def __init__(self):
        self.was_reset = False

    def reset(self):
        self.was_reset = True


def _fake_graphs(engine: EmbeddedEngine) -> tuple[DecodeGraphs, dict[int, _Graph]]:
    graphs = DecodeGraphs(engine.model, engine.runner.kv, 4, None, warmup_stream=None)
    captured = {b: _Graph() for b in graphs.buckets}
    graphs.graphs.update(captured)
    graphs.outputs.update({b: torch.zeros(b, 8) for b in graphs.buckets})
    engine.runner.graphs = graphs
    return graphs, captured


def test_repacking_and_shutdown_free_the_captured_decode_graphs_at_once(model_dir):
    """Graphs hold the weights' old addresses; dropping them must give their pools back now, not whenever the
    last reference goes."""
    engine = EmbeddedEngine(model_dir)
    try:
        graphs, captured = _fake_graphs(engine)
        logits = graphs.outputs[4][:2]  # held by the caller, as a step's logits are
        engine.export_weight_buffer()  # repacks the weights into the shared buffer
        assert engine.runner.graphs is None
        assert all(g.was_reset for g in captured.values())
        assert not graphs.graphs and not graphs.outputs
        assert logits.shape == (2, 8)  # the caller's view stays valid
        graphs, captured = _fake_graphs(engine)
    finally:
        asyncio.run(engine.shutdown())
    assert engine.runner.graphs is None and all(g.was_reset for g in captured.values())


def test_every_step_and_scoring_runs_on_the_one_device_thread(model_dir):
    """cuBLAS keeps a workspace per thread and stream it has seen (never freed): the engine's device work
    off the event loop must use one thread for its whole life, not whichever pool thread is free."""
    engine = EmbeddedEngine(model_dir, inline_step_s=0)  # every step off the loop
    seen: set[str] = set()
    for method in ("prefill", "decode"):
        original = getattr(engine.runner, method)

        def recorded(*args, _original=original, **kwargs):
            seen.add(threading.current_thread().name)
            return _original(*args, **kwargs)

        setattr(engine.runner, method, recorded)

    async def main():
        await engine.start()
        try:
            for wave in range(3):  # requests arriving apart, so steps land on many pool threads if allowed
                calls = [
                    engine.generate(input_ids=[5 + i, 6, 7], sampling_params={"max_new_tokens": 4 + i + wave})
                    for i in range(6)
                ]
                outs = await asyncio.gather(*calls)
                assert all(len(o["output_ids"]) > 0 for o in outs)
            worker = engine.runner._worker
        finally:
            await engine.shutdown()
        return worker

    worker = asyncio.run(main())
    assert len(seen) == 1 and next(iter(seen)).startswith("engine-device"), seen
    assert engine.runner._worker is None and worker._shutdown  # shutdown ends the thread
