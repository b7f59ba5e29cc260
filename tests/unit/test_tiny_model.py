"""make_tiny_model's `device`: the weights drawn where asked, written to the same files."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from miles.models import tiny


def test_the_default_device_draws_the_same_weights_as_the_cpu_and_the_cli_passes_it(tmp_path, monkeypatch):
    a = load_file(f"{tiny.make_tiny_model(str(tmp_path / 'a'), dtype='bfloat16')}/model.safetensors")
    b = load_file(f"{tiny.make_tiny_model(str(tmp_path / 'b'), dtype='bfloat16', device='cpu')}/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.bfloat16 for name, t in a.items() if not name.endswith("inv_freq"))
    seen = {}
    real = tiny.make_tiny_model
    monkeypatch.setattr(tiny, "make_tiny_model", lambda out, **kw: seen.update(kw) or real(out, **kw))
    assert tiny.main([str(tmp_path / "c"), "--device", "cpu"]) == 0
    assert seen["device"] == "cpu"
