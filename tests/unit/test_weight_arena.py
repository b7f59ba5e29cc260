"""The engine's CPU weight buffer (miles/weights/arena.py) outlives its arena while any view of it lives."""

import subprocess
import sys
import textwrap

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
