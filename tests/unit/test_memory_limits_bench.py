"""bench/memory_limits.py, its CPU side: the meta-built random model is a working Qwen2, the batch is consistent."""

from __future__ import annotations

import torch

from bench_modules import load_bench  # isort: skip  (same folder, rootdir on sys.path)

bench = load_bench("memory_limits")
TINY = dict(bench.QWEN25, vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip


def test_random_model_is_materialised_with_real_rotary_tables(monkeypatch):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    monkeypatch.setitem(bench.SHAPES, "tiny", TINY)
    model = bench.random_model("tiny", torch.device("cpu"))
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in model.parameters())
    reference = Qwen2ForCausalLM(Qwen2Config(**TINY))
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    logits = model(input_ids=torch.arange(10).view(1, 10)).logits
    assert logits.shape == (1, 10, 97) and torch.isfinite(logits).all()


def test_grpo_batch_lengths_add_up():
    b = bench.grpo_batch(16, 64, 16, 97)
    assert len(b.tokens) == 16 * 64 and len(b.loss_masks) == 16 * 48 and b.group_index.max() == 1


def test_every_shape_is_a_qwen25_config():
    from transformers import Qwen2Config

    for shape in ("1.5b", "7b", "14b"):
        cfg = Qwen2Config(**bench.SHAPES[shape])
        assert cfg.hidden_size % cfg.num_attention_heads == 0
