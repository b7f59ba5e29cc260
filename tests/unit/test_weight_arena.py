"""The engine's CPU weight buffer (miles/weights/arena.py) outlives its arena while any view of it lives."""

import subprocess
import sys
import textwrap

import pytest
import torch

from miles.weights.arena import SharedWeights


def test_views_stay_readable_after_the_arena_is_closed_and_collected():
    """Run apart: before, the collected segment object unmapped the memory and the read crashed the
    interpreter (SIGSEGV) instead of failing an assertion."""
    script = textwrap.dedent(
        """
        import gc, os, torch
        from miles.weights.arena import WeightArena
        arena = WeightArena({"w": torch.arange(1_000_000, dtype=torch.float32)}, "cpu", 1)
        view, name = arena.views["w"], arena._shm.name
        arena.close()
        del arena
        gc.collect()
        filler = [bytearray(10**6) for _ in range(8)]  # reuse what an unmapped range would have held
        assert not os.path.exists(os.path.join("/dev/shm", name)), "the segment's name is unlinked"
        print(float(view.double().sum()))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert float(out.stdout.strip()) == sum(range(1_000_000))


def test_a_repack_keeps_the_previous_generations_views_readable():
    shared = SharedWeights("cpu")
    first = shared.pack({"a": torch.full((4, 4), 3.0)})
    second = shared.pack({"a": torch.full((4, 4), 5.0)})  # a new generation: the first arena is closed
    try:
        assert first["a"].sum().item() == 48.0 and second["a"].sum().item() == 80.0
        second["a"].add_(1.0)
        assert first["a"].sum().item() == 48.0  # two buffers, not one
    finally:
        shared.drop()


def test_a_cuda_export_shares_the_buffer_once_for_each_mapping_and_drops_no_count(monkeypatch):
    """torch counts each CUDA IPC share once (an unsigned counter) and the mapping made from it gives that count back
    when it closes; a block freed while its count is positive stays in torch's IPC limbo. Sharing once per buffer
    and dropping the count at once took the counter below zero at a trainer's close: it wrapped, and every
    buffer released after one stayed in limbo (an offloading 0.5B run grew by one weight push a step on an H100).
    So: a fresh share for every export that will be mapped, none for an export of names alone or an "unchanged"
    answer, and no count dropped here (on CPU, a stand-in for the CUDA share)."""
    from miles.weights import arena as arena_module
    from miles.weights.arena import WeightArena
    from miles.weights.buffer_writer import MappedBuffer

    shares, dropped = [], []
    monkeypatch.setattr(arena_module, "share_cuda_buffer", lambda flat: shares.append(flat) or {"handle": "h"})
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda", lambda *a: dropped.append(a), raising=False)
    arena = WeightArena({"w": torch.ones(8)}, "cpu", 7)
    shm, arena._shm = arena._shm, None  # the buffer as a device allocation exports it
    try:
        params = {"w": arena.views["w"]}
        names_only = arena.export(params)
        assert names_only["buffer"] is None and names_only["tensors"]["w"]["shape"] == [8] and shares == []
        with pytest.raises(ValueError, match="for_mapping=true"):
            MappedBuffer(names_only)
        assert arena.export(params, for_mapping=True)["buffer"] == {"kind": "cuda_ipc", "handle": "h"}
        assert arena.export(params, known_generation=7, for_mapping=True) == {"generation": 7, "unchanged": True}
        arena.export(params, known_generation=6, for_mapping=True)  # a trainer that mapped an older generation
        assert len(shares) == 2 and all(flat is arena.flat for flat in shares)
        assert dropped == []
    finally:
        arena._shm = shm
        arena.close()
