"""The KV cache's storage dtype (SGLang's --kv-cache-dtype): FP8 writes saturate and read back as torch's own
cast of the clamped values (the reference is written out here); sizes follow the storage dtype."""

from __future__ import annotations

import pytest
import torch

from miles.engines.embedded import engine_setup
from miles.engines.embedded.checkpoint import ModelSpec
from miles.engines.embedded.kv_cache import FP8_STORAGE, KVCache, storage_dtype

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # the formats' largest finite values


def _cache(dtype: torch.dtype = torch.float32, storage: torch.dtype | None = None, slots: int = 3) -> KVCache:
    return KVCache(
        num_layers=2, num_slots=slots, max_seq_len=20, num_kv_heads=2, head_dim=8, dtype=dtype, device="cpu",
        storage_dtype=storage,
    )  # fmt: skip


def _spec() -> ModelSpec:
    return ModelSpec(
        model_type="qwen2", vocab_size=64, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=4096,
        tie_word_embeddings=True, qk_norm=False,
    )  # fmt: skip


def _write_rows(kv: KVCache, layer: int, slot: int, positions: list[int], scale: float, seed: int):
    """Random k, v at `positions` of `slot` (written through `write`); returns them, [T, kv_heads, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    shape = (len(positions), kv.k.shape[2], kv.k.shape[-1])
    k, v = torch.randn(shape, generator=g) * scale, torch.randn(shape, generator=g) * scale
    rows = kv.cache_rows(slot, torch.tensor([positions]))
    kv.write(layer, rows, k.to(kv.dtype), v.to(kv.dtype))
    return k.to(kv.dtype), v.to(kv.dtype)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_writes_read_back_as_the_clamped_cast(model_dtype, fp8):
    """Values across the format's range and past it (scale 300 puts some beyond e4m3's 448): every entry reads
    back as clamp-then-cast of what was written, in the model dtype, at its own slot and position."""
    kv = _cache(model_dtype, fp8)
    positions = [0, 3, 7, 19]
    k, v = _write_rows(kv, layer=1, slot=2, positions=positions, scale=300.0, seed=0)
    keys, values = kv.read(1, 2, 1, 20)
    assert keys.dtype == values.dtype == model_dtype and keys.shape == (1, 2, 20, 8)
    limit = FP8_MAX[fp8]
    for got, wrote in ((keys, k), (values, v)):
        want = wrote.float().clamp(-limit, limit).to(fp8).to(model_dtype)  # [T, kvh, hd]
        assert torch.equal(got[0, :, positions].transpose(0, 1), want)
        others = [p for p in range(20) if p not in positions]
        assert not got[0, :, others].any()
    assert kv.k.dtype == kv.v.dtype == fp8
    assert not kv.k[0].view(torch.uint8).any() and not kv.k[1, :2].view(torch.uint8).any()  # other layer, slots


def test_values_past_the_fp8_range_saturate_instead_of_becoming_nan_or_inf():
    """The bare cast overflows e5m2 to inf (e4m3fn to NaN in torch builds whose cast does not saturate)."""
    assert torch.tensor([1e6]).to(torch.float8_e5m2).float().isinf().all()
    for fp8, limit in FP8_MAX.items():
        kv = _cache(torch.float32, fp8)
        big = torch.tensor([1e6, -1e6, 2 * limit, -limit, 0.5, 300.0, -1e9, 7.0]).repeat(2, 1).reshape(1, 2, 8)
        kv.write(0, kv.cache_rows(0, torch.tensor([[4]])), big, -big)
        keys, values = kv.read(0, 0, 1, 5)
        assert torch.isfinite(keys).all() and torch.isfinite(values).all()
        assert keys[0, :, 4, :4].tolist() == [[limit, -limit, limit, -limit]] * 2
        assert torch.equal(keys[0, :, 4], big.clamp(-limit, limit).to(fp8).float()[0])
        assert torch.equal(values[0, :, 4], (-big).clamp(-limit, limit).to(fp8).float()[0])


def test_reads_of_a_model_dtype_cache_are_views_and_fp8_reads_convert_only_the_slice():
    plain = _cache()
    keys, values = plain.read(0, 1, 2, 6)
    assert keys.data_ptr() == plain.k[0, 1].data_ptr() and values.data_ptr() == plain.v[0, 1].data_ptr()
    fp8 = _cache(torch.float32, torch.float8_e4m3fn)
    keys, _ = fp8.read(0, 1, 2, 6)
    assert keys.shape == (2, 2, 6, 8) and keys.dtype == torch.float32


def test_nbytes_and_sizing_follow_the_storage_dtype():
    bf16 = _cache(torch.bfloat16)
    fp8 = _cache(torch.bfloat16, torch.float8_e4m3fn)
    assert fp8.nbytes * 2 == bf16.nbytes == bf16.k.numel() * 2 * 2
    spec = _spec()
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim  # K and V, every layer: values
    assert engine_setup.kv_bytes_per_token(spec, torch.bfloat16) == 2 * per_token
    assert engine_setup.kv_bytes_per_token(spec, torch.float8_e5m2) == per_token
    with pytest.raises(ValueError, match=rf"\({per_token} bytes a token\)"):
        engine_setup.check_kv_fits(spec, torch.float8_e4m3fn, torch.device("cpu"), 4, 2**50)


def test_move_slot_copies_fp8_codes():
    kv = _cache(torch.float32, torch.float8_e4m3fn)
    _write_rows(kv, layer=0, slot=2, positions=[0, 1, 2, 5], scale=100.0, seed=1)
    kv.move_slot(2, 0, 6)
    assert torch.equal(kv.k[:, 0, :, :6].view(torch.uint8), kv.k[:, 2, :, :6].view(torch.uint8))
    assert torch.equal(kv.v[:, 0, :, :6].view(torch.uint8), kv.v[:, 2, :, :6].view(torch.uint8))


def test_kv_cache_dtype_names_and_what_is_refused():
    assert storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert storage_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert storage_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8'.* auto \(the model's dtype\), fp8_e4m3 or fp8_e5m2"):
        storage_dtype("fp8", torch.bfloat16)
    assert engine_setup.resolve_kv_dtype("auto", torch.float32, true_on_policy=True) == torch.float32
    with pytest.raises(ValueError, match=r"--true-on-policy-mode .* kv_cache_dtype='fp8_e4m3'"):
        engine_setup.resolve_kv_dtype("fp8_e4m3", torch.float32, true_on_policy=True)


def test_the_configs_accepted_names_are_the_engines():
    from miles.config import EMBEDDED_KV_CACHE_DTYPES

    assert set(EMBEDDED_KV_CACHE_DTYPES) == {"auto", *FP8_STORAGE}
