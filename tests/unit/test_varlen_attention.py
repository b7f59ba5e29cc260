"""`miles_varlen` attention (miles.trainer.varlen_attention): packed rows with no padding give the padded
layout's log-probs, values and gradients; the trainer picks it only where its kernel runs.

On CPU the kernel is the per-sequence SDPA loop; the CUDA flash kernel is checked in
tests/gpu/test_varlen_attention_gpu.py.
"""

from __future__ import annotations

import importlib.util
import json
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import make_train_batch

from miles.trainer import varlen_attention as va
from miles.trainer.forward import forward_micro_batch, model_layout, response_values
from miles.trainer.hf_io import load_causal_lm, load_value_model, pick_attn_implementation
from miles.trainer.packing import pack_sequences, plan_micro_batches

SEQ_LENS, RESP_LENS = [9, 5, 12, 7, 12], [3, 1, 6, 2, 4]


def _padded_reference(q, k, v, lens, scale):
    """Each sequence right-padded to the longest, one batched causal SDPA, padding dropped."""
    width, out = max(lens), []
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    rows = []
    for t in (q, k, v):
        rows.append(
            torch.stack([F.pad(t[s : s + n], (0, 0, 0, 0, 0, width - n)) for s, n in zip(starts, lens, strict=True)])
        )
    qb, kb, vb = (r.transpose(1, 2) for r in rows)  # [n, heads, width, d]
    full = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)
    for i, n in enumerate(lens):
        out.append(full[i, :n])
    return torch.cat(out)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_reference_kernel_matches_padded_attention(kv_heads):
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 9, 3]
    total = sum(lens)
    q = torch.randn(total, 4, 8, generator=g)
    k, v = (torch.randn(total, kv_heads, 8, generator=g) for _ in range(2))
    cu, longest = va.boundaries(lens)
    assert cu.tolist() == [0, 5, 6, 15, 18] and cu.dtype == torch.int32 and longest == 9
    got = va.reference_varlen(q, k, v, cu, longest, 0.3)
    torch.testing.assert_close(got, _padded_reference(q, k, v, lens, 0.3), rtol=1e-5, atol=1e-6)
    # sequences never see each other: changing the first one leaves the others alone
    q2 = q.clone()
    q2[:5] += 1.0
    again = va.reference_varlen(q2, k, v, cu, longest, 0.3)
    assert not torch.allclose(again[:5], got[:5]) and torch.equal(again[5:], got[5:])


def test_attention_forward_reads_boundaries_from_kwargs_or_positions():
    g = torch.Generator().manual_seed(1)
    lens = [4, 7, 2]
    total = sum(lens)
    query = torch.randn(1, 4, total, 8, generator=g)
    key, value = (torch.randn(1, 2, total, 8, generator=g) for _ in range(2))
    cu, longest = va.boundaries(lens)
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    given, _ = va.attention_forward(
        None, query, key, value, None, scaling=0.25, cu_seq_lens_q=cu, max_length_q=longest
    )
    derived, _ = va.attention_forward(None, query, key, value, None, scaling=0.25, position_ids=positions)
    assert given.shape == (1, total, 4, 8)
    torch.testing.assert_close(given, derived, rtol=0, atol=0)
    want = va.reference_varlen(*(t[0].transpose(0, 1) for t in (query, key, value)), cu, longest, 0.25)
    torch.testing.assert_close(given[0], want, rtol=0, atol=0)


def test_attention_forward_several_rows_is_causal_sdpa():
    g = torch.Generator().manual_seed(2)
    query = torch.randn(3, 4, 6, 8, generator=g)
    key, value = (torch.randn(3, 2, 6, 8, generator=g) for _ in range(2))
    got, _ = va.attention_forward(None, query, key, value, None, scaling=0.5)
    want = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=0.5, enable_gqa=True)
    torch.testing.assert_close(got, want.transpose(1, 2))
    with pytest.raises(ValueError, match="one packed row"):
        va.attention_forward(None, query, key, value, None, cu_seq_lens_q=torch.tensor([0, 6]), max_length_q=6)
    with pytest.raises(ValueError, match="sliding windows"):
        va.attention_forward(None, query, key, value, None, sliding_window=4)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_packed_row_gives_padded_log_probs_and_gradients(tmp_path, arch):
    from miles.models.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path / arch), arch=arch, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=64)
    padded = load_causal_lm(path, attn_implementation="sdpa")
    packed = load_causal_lm(path, attn_implementation=va.NAME)
    assert (model_layout(padded), model_layout(packed)) == ("padded", "row")
    batch = make_train_batch(SEQ_LENS, RESP_LENS, padded.config.vocab_size)
    results = []
    for model in (padded, packed):
        lp, ent, tokens = forward_micro_batch(model, batch, torch.device("cpu"), 0.8, entropy="grad")
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((lp.detach(), ent.detach(), tokens, grads))
    (lp_a, ent_a, tok_a, g_a), (lp_b, ent_b, tok_b, g_b) = results
    assert (tok_a, tok_b) == (len(SEQ_LENS) * max(SEQ_LENS), sum(SEQ_LENS))  # the row holds no padding
    torch.testing.assert_close(lp_b, lp_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, rtol=1e-5, atol=1e-5)
    assert g_a.keys() == g_b.keys() and len(g_a) > 0
    for name in g_a:
        torch.testing.assert_close(g_b[name], g_a[name], rtol=1e-4, atol=1e-6, msg=name)


def test_critic_values_on_a_packed_row(tmp_path):
    from miles.models.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path / "m"), arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2)
    padded, packed = (load_value_model(path, attn_implementation=a) for a in ("sdpa", va.NAME))
    packed.load_state_dict(padded.state_dict())  # the score head is freshly initialised by each load
    batch = make_train_batch(SEQ_LENS, RESP_LENS, padded.config.vocab_size, seed=3)
    with torch.no_grad():
        a, b = (response_values(m, pack_sequences(batch, model_layout(m))) for m in (padded, packed))
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_row_layout_budget_counts_real_tokens_only():
    lens = [300, 120, 500, 80, 290, 410]
    padded = plan_micro_batches(lens, micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=1000,
                                layout="padded")  # fmt: skip
    row = plan_micro_batches(lens, micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=1000)
    assert all(sum(lens[i] for i in b) <= 1000 for b in row)
    assert len(row) < len(padded)  # no padding in the budget: fewer, fuller micro-batches


QWEN2 = {"model_type": "qwen2", "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896,
         "use_sliding_window": False, "sliding_window": 32768}  # fmt: skip


def test_unsupported_configs():
    assert va.unsupported(QWEN2) is None
    assert "sliding-window" in va.unsupported({**QWEN2, "use_sliding_window": True})
    assert "sliding-window" in va.unsupported({**QWEN2, "layer_types": ["full_attention", "sliding_attention"]})
    assert "sliding-window" in va.unsupported({"model_type": "mistral", "sliding_window": 4096})
    assert va.unsupported({"model_type": "mistral", "sliding_window": None}) is None
    assert "gemma2" in va.unsupported({"model_type": "gemma2"})


def test_pick_only_where_the_kernel_runs(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert va.pick(torch.device("cpu"), torch.bfloat16, QWEN2) == (False, "not on CUDA")
    assert not va.pick(cuda, torch.float32, QWEN2)[0]
    assert "gemma2" in va.pick(cuda, torch.bfloat16, {"model_type": "gemma2"})[1]
    monkeypatch.setattr(va, "flash_ops_present", lambda: False)
    assert "lacks the variable-length flash ops" in va.pick(cuda, torch.bfloat16, QWEN2)[1]
    monkeypatch.setattr(va, "flash_ops_present", lambda: True)
    va.kernel_check.cache_clear()
    use, why = va.pick(cuda, torch.bfloat16, QWEN2)  # no GPU here: the kernel check fails, SDPA stays
    assert not use and why.startswith("the flash kernel failed on this device")
    va.kernel_check.cache_clear()


def test_flash_ops_present_in_this_torch():
    """The aten ops the CUDA kernel calls exist with the arguments it passes (the schema is device-independent)."""
    assert va.flash_ops_present()


def test_pick_attn_implementation_logs_and_falls_back(tmp_path, monkeypatch, caplog):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    assert pick_attn_implementation(torch.device("cpu"), torch.float32, str(tmp_path)) == "sdpa"
    monkeypatch.setattr(va, "pick", lambda device, dtype, config, **kw: (True, "checked"))
    assert pick_attn_implementation(torch.device("cpu"), torch.float32, str(tmp_path)) == va.NAME
    assert (
        pick_attn_implementation(torch.device("cpu"), torch.float32, str(tmp_path), trust_remote_code=True) == "sdpa"
    )
    monkeypatch.setattr(
        va, "pick", lambda device, dtype, config, **kw: (False, "the flash kernel failed on this device")
    )
    with caplog.at_level(logging.INFO, logger="miles.trainer.hf_io"):
        assert pick_attn_implementation(torch.device("cuda", 0), torch.bfloat16, str(tmp_path)) == "sdpa"
    assert "sdpa, padded rows (the flash kernel failed on this device)" in caplog.text


def test_start_up_refusals(tmp_path):
    from miles.config import load_config
    from miles.controller.placement import Placement
    from miles.controller.preflight import PreflightError, check_attention_model, check_train_backend

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    base = {"hf_checkpoint": str(tmp_path), "prompt_data": "p.jsonl", "rm_type": "math", "num_rollout": 1,
            "rollout_batch_size": 2}  # fmt: skip
    cfg = load_config(["--attn-implementation", va.NAME], base=base)
    with pytest.raises(PreflightError, match=r"--attn-implementation miles_varlen cannot serve .*gemma2"):
        check_attention_model(cfg)
    check_attention_model(load_config([], base=base))  # auto: SDPA serves it
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    check_attention_model(cfg)
    fa2 = load_config(["--attn-implementation", "flash_attention_2"], base=base)
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(PreflightError, match="needs the flash-attn package"):
            check_train_backend(fa2, Placement.__new__(Placement))


def test_forced_miles_varlen_is_refused_where_it_cannot_run(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    with pytest.raises(ValueError, match="miles_varlen cannot run here: model_type 'gemma2'"):
        pick_attn_implementation(torch.device("cpu"), torch.float32, str(tmp_path), requested=va.NAME)
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    assert pick_attn_implementation(torch.device("cpu"), torch.float32, str(tmp_path), requested=va.NAME) == va.NAME
    assert pick_attn_implementation(torch.device("cpu"), torch.float32, str(tmp_path), requested="eager") == "eager"


def test_flash_calls_fit_the_ops_meta_kernels():
    """The custom ops' bodies and their fakes, traced with fake CUDA tensors (no GPU needed): the aten ops take
    the arguments the bodies pass, and the fakes promise the shapes and dtypes the aten ops give."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(101, 14, 64, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.empty(101, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in "kv")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        real_fwd = va.flash_forward(q, k, v, cu, 64, 0.125)  # the body, through the aten op's meta
        fake_fwd = va._varlen_flash_fwd(q, k, v, cu, 64, 0.125)  # the registered fake
        out, lse, rng = real_fwd
        real_bwd = va.flash_backward(out, q, k, v, out, lse, rng, cu, 64, 0.125)
        fake_bwd = va._varlen_flash_bwd(out, q, k, v, out, lse, rng, cu, 64, 0.125)
    for real, fake in zip((*real_fwd, *real_bwd), (*fake_fwd, *fake_bwd), strict=True):
        assert (real.shape, real.dtype) == (fake.shape, fake.dtype)
    assert out.shape == real_bwd[0].shape == (101, 14, 64)
    assert real_bwd[1].shape == real_bwd[2].shape == (101, 2, 64)


def test_flash_kernel_autograd_and_compile_on_meta_tensors():
    """The CUDA path's autograd wiring and its tracing by torch.compile (dynamic shapes, as `--compile` compiles
    the blocks), run on meta tensors: the gradients come back in the inputs' shapes and two row lengths
    share one graph."""
    from torch._dynamo.utils import counters

    def loss(q, k, v, cu, longest):
        return va.flash_varlen(q, k, v, cu, longest, 0.125).float().sum()

    compiled = torch.compile(loss, backend="aot_eager", dynamic=True)
    counters.clear()
    for total in (101, 77):
        q = torch.empty(total, 14, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
        k, v = (torch.empty(total, 2, 64, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in "kv")
        cu = torch.empty(3, dtype=torch.int32, device="meta")
        grads = torch.autograd.grad(compiled(q, k, v, cu, total - 10), (q, k, v))
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert counters["stats"]["unique_graphs"] == 1


def test_rollout_routing_replay_on_a_packed_row(tmp_path):
    """R3 in the row layout: the engine's experts replayed at the same tokens as in the padded layout."""
    from miles.models.tiny import make_tiny_model
    from miles.trainer.routing_replay import RoutingReplay
    from miles.utils.routing import routing_dtype

    path = make_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe", layers=2, hidden=64, heads=4, kv_heads=2)
    models = [load_causal_lm(path, attn_implementation=a) for a in ("sdpa", va.NAME)]
    cfg = models[0].config
    batch = make_train_batch(SEQ_LENS, RESP_LENS, cfg.vocab_size, seed=5)
    rows = sum(n - 1 for n in SEQ_LENS)
    rng = np.random.default_rng(0)
    chosen = np.argsort(rng.random((rows, cfg.num_hidden_layers, cfg.num_experts)), -1)[..., : cfg.num_experts_per_tok]
    batch.routed_experts = chosen.astype(routing_dtype(cfg.num_experts))
    out = []
    for model in models:
        replay = RoutingReplay(model, mode="rollout")
        replay.begin_step()
        with torch.no_grad(), replay.scope(batch, model_layout(model), first_pass=True):
            lp, _, _ = forward_micro_batch(model, batch, torch.device("cpu"), 1.0, entropy="none")
        out.append((lp, replay.counts.copy()))
    (lp_a, counts_a), (lp_b, counts_b) = out
    torch.testing.assert_close(lp_b, lp_a, rtol=1e-5, atol=1e-5)
    assert counts_a[0] == counts_b[0] == rows and counts_a[1] == counts_b[1] == 0  # every token replayed
    assert counts_a[2] == counts_b[2] > 0  # the routers' own choice differs from the random experts
