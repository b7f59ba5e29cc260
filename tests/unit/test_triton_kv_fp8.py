"""The Triton decode kernels over an FP8 KV cache (kv_cache.py), against torch.

Reads: the attention kernels widen FP8 keys and values before any math, so they must agree with SDPA over the
cache converted by torch. Writes: the RoPE + KV-write kernels store the codes torch's clamp-then-cast gives
for the values they store into a cache of the model's dtype (the same kernel, so the same fp32 values).

On a CUDA machine the checks run on the GPU; elsewhere in a child process under Triton's interpreter (as in
test_triton_ops.py). The interpreter's fp32 -> FP8 conversion (triton 3.6) is not the GPU's: it truncates or
rounds half away from zero and loses the carry of a round-up into the next power of two (31.5 -> 16), so
there the `gpu_rounding` fixture makes it round to nearest even as the GPU's cvt.rn does, by torch's cast;
the kernels' own code (clamp, conversions, addresses) is what runs.
"""

from __future__ import annotations

import pytest
import torch
from harness import extend_batch, run_under_triton_interpreter

triton = pytest.importorskip("triton")

from miles.engines.embedded import fused_forward, triton_ops  # noqa: E402
from miles.engines.embedded.kv_cache import KVCache  # noqa: E402
from miles.engines.embedded.model import CausalLM  # noqa: E402
from miles.models.tiny import make_tiny_model  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RUNS_HERE = triton_ops.available(DEVICE)
needs_kernels = pytest.mark.skipif(not RUNS_HERE, reason="runs on CUDA, or in the interpreter child process")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
H, KVH, HD, CAP = 6, 2, 16, 600


@pytest.mark.skipif(RUNS_HERE or triton_ops.INTERPRET, reason="the checks run directly here")
def test_kernels_under_interpreter():
    run_under_triton_interpreter(__file__)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fp8_of(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """The reference store: clamp to the format's largest finite value, then torch's cast."""
    limit = torch.finfo(fp8).max
    return x.float().clamp(-limit, limit).to(fp8)


def _codes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@needs_kernels
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("splits_sms", [1, 64])  # one split; several splits + reduction
def test_decode_attention_reads_an_fp8_cache_as_its_values(fp8, splits_sms):
    g = _gen(2)
    batch = 3
    q = torch.randn(batch, H, HD, generator=g).to(DEVICE)
    k = _fp8_of(torch.randn(batch, KVH, CAP, HD, generator=g) * 2, fp8).to(DEVICE)
    v = _fp8_of(torch.randn(batch, KVH, CAP, HD, generator=g) * 2, fp8).to(DEVICE)
    lens = torch.tensor([577, 1, 300], device=DEVICE)
    out = triton_ops.DecodeAttention(H, KVH, HD, CAP, num_sms=splits_sms)(q, k, v, lens)
    assert out.dtype == q.dtype
    for b in range(batch):
        n = int(lens[b])
        kk = k[b, :, :n].float().repeat_interleave(H // KVH, dim=0)
        vv = v[b, :, :n].float().repeat_interleave(H // KVH, dim=0)
        ref = torch.nn.functional.scaled_dot_product_attention(q[b][:, None], kk, vv)[:, 0]
        torch.testing.assert_close(out[b], ref, rtol=1e-4, atol=1e-5)


def _rope_inputs(seed: int, scale: float):
    """qkv of 4 rows (the last one padding, at the scratch position) and a RoPE table."""
    g = _gen(seed)
    positions = torch.tensor([576, 0, 299, CAP - 1], device=DEVICE)
    lens = torch.tensor([577, 1, 300, 1], device=DEVICE)
    qkv = (torch.randn(4, (H + 2 * KVH) * HD, generator=g) * scale).to(DEVICE)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, HD, 2).float() / HD)
    emb = torch.arange(CAP).float()[:, None] * inv_freq
    emb = torch.cat((emb, emb), dim=-1)
    sign = torch.cat((-torch.ones(HD // 2), torch.ones(HD // 2)))
    table = torch.cat((emb.cos(), emb.sin() * sign), dim=-1).to(DEVICE)
    return qkv, positions, lens, table


def _caches(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random cache contents, stored as `dtype` (FP8: clamped then cast)."""
    g = _gen(seed)
    k, v = (torch.randn(4, KVH, CAP, HD, generator=g) for _ in range(2))
    if dtype in FP8:
        return _fp8_of(k, dtype).to(DEVICE), _fp8_of(v, dtype).to(DEVICE)
    return k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)


@needs_kernels
@pytest.mark.parametrize("fp8", FP8)
def test_rope_kv_write_stores_the_clamped_cast_of_what_it_stores_in_full_precision(fp8, gpu_rounding):
    qkv, positions, _, table = _rope_inputs(seed=3, scale=300.0)
    qkv[:, ::7] *= 300.0  # and some past e5m2's 57344
    slots = torch.arange(4, device=DEVICE)
    k32, v32 = _caches(torch.float32, seed=4)
    k8, v8 = _fp8_of(k32, fp8), _fp8_of(v32, fp8)
    q32 = triton_ops.rope_kv_write(qkv, positions, slots, table, k32, v32, H, KVH)
    q8 = triton_ops.rope_kv_write(qkv, positions, slots, table, k8, v8, H, KVH)
    assert torch.equal(q8, q32)  # the queries stay in the model's dtype
    assert _codes_equal(k8, _fp8_of(k32, fp8)) and _codes_equal(v8, _fp8_of(v32, fp8))
    for written in (k32[torch.arange(4), :, positions], v32[torch.arange(4), :, positions]):  # [4, KVH, HD]
        assert written.abs().max() > torch.finfo(fp8).max  # some values saturated; none became NaN or inf
    assert torch.isfinite(k8.float()).all() and torch.isfinite(v8.float()).all()


@needs_kernels
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("splits_sms", [1, 64])
def test_rope_attend_on_an_fp8_cache_equals_rope_write_then_attention(fp8, splits_sms, gpu_rounding):
    """The one-launch kernel's new token enters the softmax as stored (FP8-rounded), as the two kernels it
    replaces read it back; both leave the same codes everywhere."""
    qkv, positions, lens, table = _rope_inputs(seed=5, scale=3.0)
    k, v = _caches(fp8, seed=6)
    k_ref, v_ref = k.clone(), v.clone()
    attn = triton_ops.DecodeAttention(H, KVH, HD, CAP, num_sms=splits_sms)
    q = triton_ops.rope_kv_write(qkv, positions, torch.arange(4, device=DEVICE), table, k_ref, v_ref, H, KVH)
    ref = attn(q, k_ref, v_ref, lens)
    out = attn.rope_attend(qkv, positions, lens, table, k, v)
    torch.testing.assert_close(out[:3], ref[:3], rtol=1e-4, atol=1e-5)
    assert torch.isfinite(out[3]).all()
    assert _codes_equal(k, k_ref) and _codes_equal(v, v_ref)


LENS = [5, 9, 3]  # the prompt lengths of the fused-versus-torch forward tests


def _model_and_two_caches(tmp_path, arch: str, seed: int, fp8: torch.dtype) -> tuple[CausalLM, list[KVCache]]:
    """A tiny fp32 model and two FP8 caches with a slot per row of LENS (and one spare), one for each path."""
    model = CausalLM.from_pretrained(
        make_tiny_model(str(tmp_path / arch), arch=arch, init_std=0.2, seed=seed), DEVICE, torch.float32
    )
    s = model.spec
    kw = dict(num_layers=s.num_layers, num_slots=len(LENS) + 1, max_seq_len=40, num_kv_heads=s.num_kv_heads)
    return model, [
        KVCache(**kw, head_dim=s.head_dim, dtype=torch.float32, device=DEVICE, storage_dtype=fp8) for _ in "ab"
    ]


@needs_kernels
@pytest.mark.parametrize("fp8", FP8)
def test_fused_decode_step_on_an_fp8_cache_equals_the_torch_step(tmp_path, fp8, gpu_rounding):
    """A batch prefilled by the torch forward into two FP8 caches, then one decode step through each path
    (fp32 model): the same hidden states, and the new entries written as the same codes."""
    model, caches = _model_and_two_caches(tmp_path, "qwen3", 3, fp8)
    s, B, width = model.spec, len(LENS), max(LENS)
    lens = LENS
    g = _gen(6)
    tokens = torch.randint(3, s.vocab_size, (B, width), generator=g).to(DEVICE)
    pos = torch.arange(width, device=DEVICE)[None].expand(B, width)
    for kv in caches:
        write = torch.where(pos < torch.tensor(lens, device=DEVICE)[:, None], pos, kv.scratch_pos)
        model.forward(tokens, pos, kv, 0, write, kv_len=None)
    step = torch.randint(3, s.vocab_size, (B,), generator=g).to(DEVICE)
    positions = torch.tensor(lens, device=DEVICE)
    ref = model.forward(step[:, None], positions[:, None], caches[0], 0, positions[:, None], width + 1)
    attention = triton_ops.DecodeAttention(s.num_heads, s.num_kv_heads, s.head_dim, caches[1].capacity, 4)
    fused = fused_forward.decode_fused(model, step, positions, positions + 1, caches[1], attention)
    torch.testing.assert_close(fused, ref[:, 0], rtol=1e-3, atol=1e-3)
    assert caches[1].k.dtype == fp8
    for name in ("k", "v"):
        new = [getattr(c, name)[:, torch.arange(B), :, positions] for c in caches]  # [layers, B, kvh, hd]
        same = (new[0].view(torch.uint8) == new[1].view(torch.uint8)).float().mean().item()
        assert same > 0.98, (name, same)  # fp32 sums in another order may round a tie the other way


@needs_kernels
def test_fused_prefill_on_an_fp8_cache_equals_the_torch_prefill(tmp_path, gpu_rounding):
    """The last layer of a prefill attends over the keys just written to the cache: through FP8 in both paths."""
    model, caches = _model_and_two_caches(tmp_path, "qwen2", 4, FP8[0])
    s, B, width = model.spec, len(LENS), max(LENS)
    lens = LENS
    tokens = torch.randint(3, s.vocab_size, (B, width), generator=_gen(8)).to(DEVICE)
    pos = torch.arange(width, device=DEVICE)[None].expand(B, width)
    last = torch.tensor(lens, device=DEVICE) - 1
    write = torch.where(pos <= last[:, None], pos, caches[0].scratch_pos)
    ref = model.forward(tokens, pos, caches[0], 1, write, kv_len=None, out_index=last)
    attention = triton_ops.DecodeAttention(s.num_heads, s.num_kv_heads, s.head_dim, caches[1].capacity, 4)
    fused = fused_forward.prefill_fused(model, tokens, pos, write, last, caches[1], 1, attention)
    torch.testing.assert_close(fused, ref, rtol=1e-3, atol=1e-3)
    for name in ("k", "v"):
        got, want = (getattr(c, name)[:, 1 : 1 + B, :, :width].view(torch.uint8) for c in caches)
        assert (got == want).float().mean().item() > 0.98, name


@needs_kernels
def test_fused_extend_on_an_fp8_cache_equals_the_torch_extend(tmp_path, gpu_rounding):
    """After cached prefixes (prefix cache hits) every layer attends over the cache read back through FP8, the
    fresh keys included, in both paths: the same hidden states and codes."""
    model, caches = _model_and_two_caches(tmp_path, "qwen3", 5, FP8[0])
    s, g = model.spec, _gen(9)
    starts, lens = [4, 2, 0], [3, 5, 2]
    tokens, positions, write, last, kv_len = extend_batch(model, caches, starts, lens, 0, g)
    ref = model.forward(tokens, positions, caches[0], 0, write, kv_len=None, out_index=last, extend_len=kv_len)
    attention = triton_ops.DecodeAttention(s.num_heads, s.num_kv_heads, s.head_dim, caches[1].capacity, 4)
    fused = fused_forward.prefill_fused(model, tokens, positions, write, last, caches[1], 0, attention, kv_len)
    torch.testing.assert_close(fused, ref, rtol=1e-3, atol=1e-3)
    for name in ("k", "v"):
        for b, (a, n) in enumerate(zip(starts, lens, strict=True)):
            got, want = (getattr(c, name)[:, b, :, : a + n].view(torch.uint8) for c in caches)
            assert (got == want).float().mean().item() > 0.98, name
