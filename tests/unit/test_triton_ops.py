"""Triton decode kernels and sampler against the torch paths they replace.

On a CUDA machine the checks run on the GPU (bf16 model numerics aside, they use fp32). Elsewhere the
kernels run under Triton's interpreter on CPU tensors: the interpreter must be switched on before
triton is imported, so `test_kernels_under_interpreter` re-runs this file in a child process with
TRITON_INTERPRET=1 and the checks skip in the parent.
"""

from __future__ import annotations

import pytest
import torch
from harness import extend_batch, run_under_triton_interpreter

triton = pytest.importorskip("triton")

from miles.engines.embedded import fp8, fp8_triton, fused_forward, triton_ops  # noqa: E402
from miles.engines.embedded.kv_cache import KVCache  # noqa: E402
from miles.engines.embedded.layer_ops import rms_norm  # noqa: E402
from miles.engines.embedded.model import CausalLM  # noqa: E402
from miles.engines.embedded.sampler import SamplingParams, sample  # noqa: E402
from miles.models.tiny import make_tiny_model  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RUNS_HERE = triton_ops.available(DEVICE)
needs_kernels = pytest.mark.skipif(not RUNS_HERE, reason="runs on CUDA, or in the interpreter child process")


@pytest.mark.skipif(RUNS_HERE or triton_ops.INTERPRET, reason="the checks run directly here")
def test_kernels_under_interpreter():
    run_under_triton_interpreter(__file__)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@needs_kernels
def test_add_rms_norm_matches_reference_and_updates_residual():
    g = _gen(0)
    x = torch.randn(5, 96, generator=g).to(DEVICE)
    res = torch.randn(5, 96, generator=g).to(DEVICE)
    w = torch.randn(96, generator=g).to(DEVICE)
    expected_res = x + res
    out = triton_ops.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(res, expected_res, rtol=0, atol=0)
    torch.testing.assert_close(out, rms_norm(expected_res, w, 1e-6), rtol=1e-5, atol=1e-5)
    plain = triton_ops.add_rms_norm(x, None, w, 1e-6)
    torch.testing.assert_close(plain, rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_silu_mul():
    gate_up = torch.randn(3, 2 * 200, generator=_gen(1)).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(triton_ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


@needs_kernels
@pytest.mark.parametrize("batch,splits_sms", [(3, 1), (2, 64)])  # one split; several splits + reduction
def test_decode_attention_matches_sdpa_over_each_rows_length(batch, splits_sms):
    g = _gen(2)
    H, KVH, HD, CAP = 6, 2, 16, 600
    q = torch.randn(batch, H, HD, generator=g).to(DEVICE)
    k = torch.randn(batch + 1, KVH, CAP, HD, generator=g).to(DEVICE)
    v = torch.randn(batch + 1, KVH, CAP, HD, generator=g).to(DEVICE)
    lens = torch.tensor([577, 1, 300][:batch], device=DEVICE)
    attn = triton_ops.DecodeAttention(H, KVH, HD, CAP, num_sms=splits_sms)
    assert (attn.splits(batch) > 1) == (splits_sms > 1)
    out = attn(q, k, v, lens)
    for b in range(batch):
        n = int(lens[b])
        kk = k[b, :, :n].repeat_interleave(H // KVH, dim=0)
        vv = v[b, :, :n].repeat_interleave(H // KVH, dim=0)
        ref = torch.nn.functional.scaled_dot_product_attention(q[b][:, None], kk, vv)[:, 0]
        torch.testing.assert_close(out[b], ref, rtol=1e-4, atol=1e-5)


def _rope_table(positions: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """[P, 2 x head_dim]: cos | sin with rotate_half's sign folded in (CausalLM's table layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(positions).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    sign = torch.cat((-torch.ones(head_dim // 2), torch.ones(head_dim // 2)))
    return torch.cat((emb.cos(), emb.sin() * sign), dim=-1)


@needs_kernels
@pytest.mark.parametrize("splits_sms", [1, 64])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_attend_equals_rope_write_then_attention(splits_sms, qk_norm):
    """The one-launch RoPE + KV write + attention against the two kernels it replaces: same outputs for
    real rows, same cache contents everywhere (the padded row writes its scratch position)."""
    g = _gen(7)
    H, KVH, HD, CAP = 6, 2, 16, 600
    positions = torch.tensor([576, 0, 299, CAP - 1], device=DEVICE)  # the last row is padding
    lens = torch.tensor([577, 1, 300, 1], device=DEVICE)
    B = len(positions)
    qkv = torch.randn(B, (H + 2 * KVH) * HD, generator=g).to(DEVICE)
    k = torch.randn(B, KVH, CAP, HD, generator=g).to(DEVICE)
    v = torch.randn(B, KVH, CAP, HD, generator=g).to(DEVICE)
    norms = (
        (torch.randn(HD, generator=g).to(DEVICE), torch.randn(HD, generator=g).to(DEVICE)) if qk_norm else (None, None)
    )
    table = _rope_table(CAP, HD).to(DEVICE)
    attn = triton_ops.DecodeAttention(H, KVH, HD, CAP, num_sms=splits_sms)
    assert (attn.splits(B) > 1) == (splits_sms > 1)
    k_ref, v_ref = k.clone(), v.clone()
    slots = torch.arange(B, device=DEVICE)
    q = triton_ops.rope_kv_write(qkv, positions, slots, table, k_ref, v_ref, H, KVH, *norms, 1e-6)
    ref = attn(q, k_ref, v_ref, lens)
    out = attn.rope_attend(qkv, positions, lens, table, k, v, *norms, 1e-6)
    torch.testing.assert_close(out[:3], ref[:3], rtol=1e-4, atol=1e-5)
    assert torch.isfinite(out[3]).all()
    torch.testing.assert_close(k, k_ref)  # q/k-norm: a row sum in another order, so not bit-equal
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("splits_sms", [1, 64])
def test_rope_attend_adds_the_bias_as_the_unfused_add(splits_sms):
    """bias=: the same outputs and cache writes as attending over `qkv + bias` (bf16 on CUDA, so the add's
    rounding counts; the interpreter's bf16 dots are wrong, so fp32 there), with one key split and several."""
    g = _gen(11)
    H, KVH, HD, CAP = 4, 2, 32, 600
    dt = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    positions = torch.tensor([576, 0, 299], device=DEVICE)
    lens = positions + 1
    B = len(positions)
    qkv = torch.randn(B, (H + 2 * KVH) * HD, generator=g).to(DEVICE, dt)
    bias = torch.randn((H + 2 * KVH) * HD, generator=g).to(DEVICE, dt)
    k = torch.randn(B, KVH, CAP, HD, generator=g).to(DEVICE, dt)
    v = torch.randn(B, KVH, CAP, HD, generator=g).to(DEVICE, dt)
    table = _rope_table(CAP, HD).to(DEVICE)
    attn = triton_ops.DecodeAttention(H, KVH, HD, CAP, num_sms=splits_sms)
    assert (attn.splits(B) > 1) == (splits_sms > 1)
    caches = [(k.clone(), v.clone()) for _ in range(2)]
    ref = attn.rope_attend(qkv + bias, positions, lens, table, *caches[0])
    out = attn.rope_attend(qkv, positions, lens, table, *caches[1], bias=bias)
    assert torch.equal(out, ref)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])
    with pytest.raises(ValueError, match="bias"):
        attn.rope_attend(qkv, positions, lens, table, *caches[1], bias=bias[:-1])


@needs_kernels
def test_fused_sampler_follows_the_inverse_cdf_rule():
    g = _gen(3)
    temps = (1.0, 0.7, 0.0, 1.3, 1.0, 0.5, 0.8)
    logits = (torch.randn(len(temps), 1000, generator=g) * 3).to(DEVICE)
    params = [SamplingParams(temperature=t) for t in temps]
    tokens, lps = sample(logits, params, [None] * 7, torch.Generator(DEVICE).manual_seed(5), fused=True)
    u = torch.rand(7, generator=torch.Generator(DEVICE).manual_seed(5), device=DEVICE, dtype=torch.float32)
    for i, p in enumerate(params):
        t = p.temperature if p.temperature > 0 else 1.0
        log_p = torch.log_softmax(logits[i].double() / t, -1)
        if p.temperature == 0:
            expected = int(logits[i].argmax())
        else:
            cdf = log_p.exp().cumsum(-1)
            expected = int(torch.searchsorted(cdf, u[i].double() * cdf[-1], right=True))
        assert int(tokens[i]) == expected, (i, int(tokens[i]), expected)
        assert abs(float(lps[i]) - float(log_p[expected])) < 1e-5


@needs_kernels
def test_greedy_rows_take_the_first_argmax_across_chunks():
    v = 3000  # several chunks, in the interpreter and on a GPU
    logits = torch.zeros(3, v)
    logits[0, [2500, 2900]] = 5.0  # tie in two late chunks
    logits[1, [7, 8, 2999]] = 4.0  # tie inside the first chunk
    logits[2, v - 1] = 1.0  # the max is the last token
    ones = torch.ones(3, device=DEVICE)
    tokens, lps = triton_ops.sample_rows(logits.to(DEVICE), ones, torch.rand(3).to(DEVICE), ones)
    assert tokens.tolist() == [2500, 7, v - 1]
    torch.testing.assert_close(lps.cpu(), torch.log_softmax(logits, -1)[torch.arange(3), [2500, 7, v - 1]])


@needs_kernels
def test_sampled_token_frequencies_match_the_distribution():
    """Uniforms spread evenly over [0, 1) (in shuffled row order): each token's share of the rows is its
    probability to within one row, 1/n. 1500 random uniforms bound it only to 5 sigma (0.028 to 0.065) and
    cost the interpreter six times as many row programs."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 256
    logits = probs.log()[None].expand(n, -1).contiguous().to(DEVICE)
    u = ((torch.arange(n, dtype=torch.float32) + 0.5) / n)[torch.randperm(n, generator=_gen(4))].to(DEVICE)
    tokens, lps = triton_ops.sample_rows(logits, torch.ones(n, device=DEVICE), u, torch.zeros(n, device=DEVICE))
    counts = torch.bincount(tokens.cpu(), minlength=4).double() / n
    assert torch.all((counts - probs.double()).abs() <= 1 / n + 1e-9), counts
    torch.testing.assert_close(lps.cpu(), probs.log()[tokens.cpu()], rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_fused_decode_step_equals_the_torch_decode_step(tmp_path, arch):
    """Prefill a batch of different lengths, then one decode step through both paths (fp32)."""
    path = make_tiny_model(str(tmp_path / arch), arch=arch, init_std=0.2, seed=3)
    model = CausalLM.from_pretrained(path, DEVICE, torch.float32)
    s = model.spec
    lens = [5, 9, 3]
    B = len(lens)

    def fresh_cache() -> KVCache:
        kw = dict(num_layers=s.num_layers, num_slots=B + 1, max_seq_len=40, num_kv_heads=s.num_kv_heads)
        return KVCache(**kw, head_dim=s.head_dim, dtype=torch.float32, device=DEVICE)

    g = _gen(6)
    seqs = [torch.randint(3, s.vocab_size, (n,), generator=g).tolist() for n in lens]
    caches = [fresh_cache(), fresh_cache()]
    for kv in caches:
        width = max(lens)
        tokens = torch.tensor([q + [0] * (width - len(q)) for q in seqs], device=DEVICE)
        pos = torch.arange(width, device=DEVICE)[None].expand(B, width)
        write = torch.where(pos < torch.tensor(lens, device=DEVICE)[:, None], pos, kv.scratch_pos)
        model.forward(tokens, pos, kv, 0, write, kv_len=None)
    step_tokens = torch.randint(3, s.vocab_size, (B,), generator=g).to(DEVICE)
    positions = torch.tensor(lens, device=DEVICE)
    ref = model.forward(step_tokens[:, None], positions[:, None], caches[0], 0, positions[:, None], max(lens) + 1)
    attention = triton_ops.DecodeAttention(s.num_heads, s.num_kv_heads, s.head_dim, caches[1].capacity, 4)
    fused = fused_forward.decode_fused(model, step_tokens, positions, positions + 1, caches[1], attention)
    torch.testing.assert_close(fused, ref[:, 0], rtol=1e-4, atol=1e-5)
    for layer in range(s.num_layers):
        for b, n in enumerate(lens):
            torch.testing.assert_close(caches[1].k[layer, b, :, : n + 1], caches[0].k[layer, b, :, : n + 1])
            torch.testing.assert_close(caches[1].v[layer, b, :, : n + 1], caches[0].v[layer, b, :, : n + 1])


def _prefill_batch(model: CausalLM, lens: list[int], g: torch.Generator, num_slots: int):
    """Random prompts of `lens` padded into one batch: (tokens, positions, last index, write positions) and two
    empty KV caches in the model's dtype (one per path compared); padding writes to the scratch position."""
    s = model.spec
    B, width = len(lens), max(lens)
    seqs = [torch.randint(3, s.vocab_size, (n,), generator=g).tolist() for n in lens]
    tokens = torch.tensor([q + [0] * (width - len(q)) for q in seqs], device=DEVICE)
    pos = torch.arange(width, device=DEVICE)[None].expand(B, width)
    last = torch.tensor(lens, device=DEVICE) - 1
    kw = dict(num_layers=s.num_layers, num_slots=num_slots, max_seq_len=40, num_kv_heads=s.num_kv_heads)
    caches = [KVCache(**kw, head_dim=s.head_dim, dtype=model.dtype, device=DEVICE) for _ in range(2)]
    write = torch.where(pos <= last[:, None], pos, caches[0].scratch_pos)
    return tokens, pos, last, write, caches


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("lens", [[5, 9, 3], [9]], ids=["three_rows", "one_row"])
def test_fused_prefill_equals_the_torch_prefill(tmp_path, arch, lens):
    """Rows of different lengths into slots from 1: the last tokens' hidden states and every cache entry
    the prompts wrote match the torch prefill (fp32), and no other slot is touched. One row is the
    prefill of a request that arrives alone (its slot index once reached the kernel as a stride-0 view,
    read past its one-element storage: KV written into random slots, or an illegal address on CUDA)."""
    path = make_tiny_model(str(tmp_path / arch), arch=arch, init_std=0.2, seed=4)
    model = CausalLM.from_pretrained(path, DEVICE, torch.float32)
    s = model.spec
    B, start = len(lens), 1
    tokens, pos, last, write, caches = _prefill_batch(model, lens, _gen(8), num_slots=B + 2)
    ref = model.forward(tokens, pos, caches[0], start, write, kv_len=None, out_index=last)
    attention = triton_ops.DecodeAttention(s.num_heads, s.num_kv_heads, s.head_dim, caches[1].capacity, 4)
    fused = fused_forward.prefill_fused(model, tokens, pos, write, last, caches[1], start, attention)
    torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-5)
    for layer in range(s.num_layers):
        for b, n in enumerate(lens):
            for cache in ("k", "v"):
                got = getattr(caches[1], cache)[layer, start + b, :, :n]
                torch.testing.assert_close(got, getattr(caches[0], cache)[layer, start + b, :, :n])
    for cache in ("k", "v"):  # every other slot stays empty (the scratch position takes the padding)
        t = getattr(caches[1], cache)
        others = [i for i in range(t.shape[1]) if not start <= i < start + B]
        assert not t[:, others].any()
        for b, n in enumerate(lens):
            assert not t[:, start + b, :, n : caches[1].scratch_pos].any()


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_fused_extend_equals_the_torch_extend(tmp_path, arch):
    """A prefill after cached prefixes (prefix cache hits: 3 and 6 cached tokens, and a row from position 0,
    as a batch of hits and misses has): the last tokens' hidden states and every cache entry match the eager
    extend, and the padding writes only the scratch position."""
    path = make_tiny_model(str(tmp_path / arch), arch=arch, init_std=0.2, seed=6)
    model = CausalLM.from_pretrained(path, DEVICE, torch.float32)
    s, g = model.spec, _gen(9)
    starts, lens, slot0 = [3, 0, 6], [4, 5, 1], 1
    kw = dict(num_layers=s.num_layers, num_slots=len(lens) + 2, max_seq_len=40, num_kv_heads=s.num_kv_heads)
    caches = [KVCache(**kw, head_dim=s.head_dim, dtype=model.dtype, device=DEVICE) for _ in range(2)]
    tokens, positions, write, last, kv_len = extend_batch(model, caches, starts, lens, slot0, g)
    ref = model.forward(tokens, positions, caches[0], slot0, write, kv_len=None, out_index=last, extend_len=kv_len)
    attention = triton_ops.DecodeAttention(s.num_heads, s.num_kv_heads, s.head_dim, caches[1].capacity, 4)
    fused = fused_forward.prefill_fused(model, tokens, positions, write, last, caches[1], slot0, attention, kv_len)
    torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-5)
    scratch = caches[0].scratch_pos
    for cache in ("k", "v"):
        got, want = getattr(caches[1], cache), getattr(caches[0], cache)
        for b, (a, n) in enumerate(zip(starts, lens, strict=True)):
            torch.testing.assert_close(got[:, slot0 + b, :, : a + n], want[:, slot0 + b, :, : a + n])
            assert not got[:, slot0 + b, :, a + n : scratch].any()


@needs_kernels
def test_an_engine_on_the_kernels_shares_a_groups_prompt_with_equal_greedy_tokens(tmp_path, monkeypatch):
    """The engine with its Triton kernels (no CUDA graphs here): a group of 3 prefills its prompt once, the other
    samples extend it through the fused extend, and their greedy first tokens (read from the extend's logits)
    equal those with prefix sharing off."""
    import asyncio

    from miles.engines.embedded.engine import EmbeddedEngine
    from miles.engines.embedded.prefix_cache import DEFAULT_PAGE_SIZE

    path = make_tiny_model(str(tmp_path / "qwen2"), arch="qwen2", init_std=0.2, seed=7)
    prompt = torch.randint(3, 200, (2 * DEFAULT_PAGE_SIZE + 1,), generator=_gen(10)).tolist()  # whole pages shared
    extends = []
    prefill_fused = fused_forward.prefill_fused

    def counted(*args, **kwargs):
        extends.append(kwargs.get("extend_len") is not None)
        return prefill_fused(*args, **kwargs)

    async def group(**kwargs):
        engine = EmbeddedEngine(path, device=str(DEVICE), dtype="float32", cuda_graphs=False, **kwargs)
        await engine.start()
        try:
            assert engine.runner.fused_kernels
            params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 1, "n": 3}
            outs = await engine.generate(input_ids=prompt, sampling_params=params)
            return [o["output_ids"] for o in outs], engine.prefix_cache_stats()
        finally:
            await engine.shutdown()

    monkeypatch.setattr(fused_forward, "prefill_fused", counted)
    shared, stats = asyncio.run(group())
    plain, _ = asyncio.run(group(prefix_cache=False))
    assert shared == plain
    assert stats["prefill_tokens_computed"] == len(prompt) + 2
    assert any(extends), "no prefix hit went through the fused extend"


@needs_kernels
def test_a_half_precision_model_keeps_an_fp32_residual_stream_in_the_fused_paths(tmp_path, monkeypatch):
    """fp16 (the interpreter has no bf16): the fused prefill and decode carry the residual stream in fp32, as
    the eager forward does, and agree with it; the norms hand the GEMMs fp16."""
    path = make_tiny_model(str(tmp_path / "qwen2"), arch="qwen2", init_std=0.2, seed=5)
    model = CausalLM.from_pretrained(path, DEVICE, torch.float16)
    assert model.fp32_residual
    s = model.spec
    streams = []
    add_rms_norm = triton_ops.add_rms_norm

    def recorded(x, residual, weight, eps, out=None, quantize=False):
        streams.append((residual if residual is not None else x).dtype)
        result = add_rms_norm(x, residual, weight, eps, out, quantize)
        assert result.dtype == torch.float16
        return result

    monkeypatch.setattr(triton_ops, "add_rms_norm", recorded)
    lens = [5, 9]
    B, width = len(lens), max(lens)
    g = _gen(9)
    tokens, pos, last, write, caches = _prefill_batch(model, lens, g, num_slots=B + 1)
    ref = model.forward(tokens, pos, caches[0], 0, write, kv_len=None, out_index=last)
    attention = triton_ops.DecodeAttention(s.num_heads, s.num_kv_heads, s.head_dim, caches[1].capacity, 4)
    fused = fused_forward.prefill_fused(model, tokens, pos, write, last, caches[1], 0, attention)
    torch.testing.assert_close(fused, ref, rtol=2e-2, atol=2e-2)
    step = torch.randint(3, s.vocab_size, (B,), generator=g).to(DEVICE)
    positions = torch.tensor(lens, device=DEVICE)
    ref_step = model.forward(step[:, None], positions[:, None], caches[0], 0, positions[:, None], width + 1)
    fused_step = fused_forward.decode_fused(model, step, positions, positions + 1, caches[1], attention)
    torch.testing.assert_close(fused_step, ref_step[:, 0], rtol=2e-2, atol=2e-2)
    assert streams and set(streams) == {torch.float32}, streams


# ---- FP8 (fp8_triton.py). The interpreter's fp32 -> e4m3 conversion (triton 3.6) is not the GPU's: ties go
# away from zero (17 -> 18) and a round-up into the next power of two loses its carry (31.5 -> 16), so the
# codes themselves are compared on CUDA only; scales, layout and padding everywhere.


def _fp8_mma_tolerance(want: torch.Tensor) -> dict[str, float]:
    """The FP8 GEMM kernel's tolerance against the exact product of the same codes. Exact but for fp32 rounding
    under the interpreter and on tensor cores that accumulate in full fp32; Hopper's FP8 warpgroup MMA (tiles of
    64+ rows) sums each 128-wide slice in a narrower accumulator (Triton's default there, as cuBLAS's fast
    accumulation), about 2^-10 of the slice's sum, before the kernel scales it into its fp32 total. A wrong
    scale, slice or tile is off by the output's own size, far outside either."""
    if DEVICE.type == "cuda" and torch.cuda.get_device_capability() >= (9, 0):
        return {"rtol": 0.0, "atol": 2e-3 * float(want.abs().max())}
    return {"rtol": 1e-5, "atol": 1e-5}


def _fp8_agree(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of e4m3 codes that are equal (the kernel's fp32 division may round a tie the other way)."""
    return (a.view(torch.uint8) == b.view(torch.uint8)).float().mean().item()


@needs_kernels
def test_fp8_weight_quant_kernel_matches_the_torch_form():
    w = (torch.randn(200, 300, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16).to(DEVICE)
    q, s = fp8_triton.quantize_weight(w)
    q_ref, s_ref = fp8.quantize_weight(w.cpu())  # the torch form (on CPU it never calls the kernel)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-6, atol=0)
    assert q.shape == (200, 300) and s.shape == (2, 3)
    if DEVICE.type == "cuda":
        assert _fp8_agree(q.cpu(), q_ref) > 0.999
        dq = fp8.dequantize_weight(q.cpu(), s.cpu())
        assert ((dq - w.cpu().float()).abs() <= fp8.error_bound(dq, s.cpu()) * 1.001).all()


@needs_kernels
def test_fp8_weight_quant_kernel_writes_into_a_weights_own_rows():
    """`out=`: the rows of a larger weight and their block scales are written in place (a push, no temporary)."""
    w = (torch.randn(200, 300, generator=torch.Generator().manual_seed(1)) * 0.05).to(torch.bfloat16).to(DEVICE)
    q_all = torch.zeros((384, 300), dtype=torch.float8_e4m3fn, device=DEVICE)
    s_all = torch.full((3, 3), -1.0, device=DEVICE)
    q_want, s_want = fp8_triton.quantize_weight(w)
    got = fp8_triton.quantize_weight(w, out=(q_all[128:328], s_all[1:3]))
    assert got[0].data_ptr() == q_all[128:].data_ptr()
    assert torch.equal(q_all[128:328].view(torch.uint8), q_want.view(torch.uint8)) and torch.equal(s_all[1:], s_want)
    assert not q_all[:128].view(torch.uint8).any() and (s_all[0] == -1).all()  # the other rows untouched


@needs_kernels
@pytest.mark.parametrize("m", [5, 37])  # within one tile of rows; across three, the last one partial
def test_fp8_activation_quant_kernel_pads_rows_and_lays_scales_out_outer_dim_major(m):
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEVICE)
    q, s = fp8_triton.quantize_activation(x, pad_to=4)
    m_pad = -(-m // 4) * 4
    assert q.shape == (m_pad, 256) and s.shape == (m_pad, 2) and s.stride() == (1, m_pad)
    q_ref, s_ref = fp8.quantize_activation(x.cpu())
    torch.testing.assert_close(s[:m].cpu(), s_ref, rtol=1e-6, atol=0)
    if DEVICE.type == "cuda":
        assert _fp8_agree(q[:m].cpu(), q_ref) > 0.999
    assert (q[m:].float() == 0).all()  # padded rows carry zeros, not stale memory


@needs_kernels
@pytest.mark.parametrize(
    ("m", "n", "k", "settings"),
    [(5, 200, 300, None), (37, 256, 512, None), (130, 384, 256, None), (37, 200, 640, (16, 64, 4, 2))],
)  # rows within a tile and across tiles; N and K not whole blocks; tiles of 64 columns (half a scale block)
def test_fp8_block_scaled_gemm_kernel_matches_the_emulation(m, n, k, settings):
    g = torch.Generator().manual_seed(m + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05
    xq, xs = fp8.quantize_activation(x)  # the torch forms: the same codes for both sides
    wq, ws = fp8.quantize_weight(w)
    want = fp8._emulated(x, fp8.Fp8Weight(wq, ws), torch.float32)
    on = [t.to(DEVICE) for t in (xq, xs, wq, ws)]
    got = fp8_triton.block_scaled_mm(*on, torch.float32, settings=settings)
    torch.testing.assert_close(got.cpu(), want, **_fp8_mma_tolerance(want))


@needs_kernels
@pytest.mark.parametrize(("splits", "quant_x"), [(2, False), (3, False), (4, False), (2, True)])
def test_fp8_gemm_kernel_split_over_k_equals_the_emulation(splits, quant_x):
    """K = 600 (five 128-slices, the last not whole; 2 splits make two chunks of 3 slices, 3 and 4 make three
    of 2: the last chunk's sixth slice lies past K, masked): the partial tiles summed equal the product of the same codes; with
    the activation quantized inside, the unsplit kernel's product (the interpreter's e4m3 rounding is not
    torch's, see below, but the same for both)."""
    g = torch.Generator().manual_seed(splits)
    x, w = torch.randn(37, 600, generator=g), torch.randn(200, 600, generator=g) * 0.05
    xq, xs = fp8.quantize_activation(x)
    wq, ws = fp8.quantize_weight(w)
    if quant_x:
        on = [t.to(DEVICE) for t in (x, wq, ws)]
        got = fp8_triton.quantized_linear(*on, torch.float32, splits=splits)
        want = fp8_triton.quantized_linear(*on, torch.float32).cpu()
    else:
        got = fp8_triton.block_scaled_mm(*(t.to(DEVICE) for t in (xq, xs, wq, ws)), torch.float32, splits=splits)
        want = fp8._emulated(x, fp8.Fp8Weight(wq, ws), torch.float32)
    assert got.shape == (37, 200) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, **_fp8_mma_tolerance(want))


@needs_kernels
def test_fp8_block_scaled_gemm_kernel_reads_the_activation_kernels_padded_outer_dim_major_scales():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 384, generator=g).to(torch.bfloat16).to(DEVICE)
    wq, ws = fp8.quantize_weight(torch.randn(256, 384, generator=g) * 0.05)
    xq, xs = fp8_triton.quantize_activation(x, pad_to=4)  # [40, 384] and scales of stride (1, 40)
    got = fp8_triton.block_scaled_mm(xq[:37], xs, wq.to(DEVICE), ws.to(DEVICE), torch.float32)
    dx = xq[:37].float().cpu() * xs[:37].cpu().repeat_interleave(128, 1)
    want = torch.nn.functional.linear(dx, fp8.dequantize_weight(wq, ws))
    torch.testing.assert_close(got.cpu(), want, **_fp8_mma_tolerance(want))
    with pytest.raises(ValueError, match="do not make one 128-block-scaled product"):
        fp8_triton.block_scaled_mm(xq, xs[:, :2], wq.to(DEVICE), ws.to(DEVICE), torch.float32)


@needs_kernels
@pytest.mark.parametrize(("m", "k"), [(37, 384), (5, 300)])  # K whole slices, and a last slice of 44
def test_fp8_gemm_quantizing_its_activation_inside_equals_the_two_kernels(m, k):
    """`quantized_linear` quantizes each slice as the activation kernel does: the same codes, so the same
    product as `block_scaled_mm` of `quantize_activation`'s output (under the interpreter its e4m3 rounding is
    not the GPU's, but it is the same on both sides). K not whole slices: against the torch form's codes."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    wq, ws = (t.to(DEVICE) for t in fp8.quantize_weight(torch.randn(200, k, generator=g) * 0.05))
    got = fp8_triton.quantized_linear(x, wq, ws)
    if k % 128 == 0:
        want = fp8_triton.block_scaled_mm(*fp8_triton.quantize_activation(x), wq, ws, torch.float32)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        want = fp8._emulated(x.cpu(), fp8.Fp8Weight(wq.cpu(), ws.cpu()), torch.float32)
        bound = 1e-4 if DEVICE.type == "cuda" else 0.05  # the interpreter's e4m3 rounding (see above): 0.039
        assert ((got.cpu() - want).norm() / want.norm()).item() < bound


@needs_kernels
@pytest.mark.parametrize(("m", "k"), [(37, 384), (5, 300)])  # K whole slices, and a last slice of 44
def test_fp8_triton_path_quantizes_its_input_once_with_the_same_codes(m, k):
    """MILES_FP8_GEMM=triton's GEMM (`fp8._triton_mm`) on the activation kernel's codes, or on a norm kernel's
    quantized output, gives the product the GEMM quantizing inside gives (the same codes); a K that is not whole
    slices is quantized inside."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    weight = fp8.Fp8Weight(*(t.to(DEVICE) for t in fp8.quantize_weight(torch.randn(200, k, generator=g) * 0.05)))
    want = fp8_triton.quantized_linear(x, weight.q, weight.scale_inv)
    got = fp8._triton_mm(x, weight)
    assert got.shape == (m, 200) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if k % 128:
        return
    norm = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    normed = triton_ops.add_rms_norm(x, None, norm, 1e-6)
    quantized = triton_ops.add_rms_norm(x, None, norm, 1e-6, quantize=True)
    assert isinstance(quantized, fp8.QuantizedInput) and quantized.q.shape[0] > m  # rows padded to 4
    got = fp8._triton_mm(quantized, weight)
    assert got.shape == (m, 200)
    torch.testing.assert_close(got, fp8_triton.quantized_linear(normed, weight.q, weight.scale_inv), rtol=0, atol=0)
