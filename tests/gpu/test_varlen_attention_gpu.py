"""`miles_varlen` on CUDA: torch's flash kernel over packed rows against SDPA over padded rows, in bf16,
eager and with the decoder blocks compiled as `--compile` compiles them."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from harness import make_train_batch  # noqa: E402

from miles.trainer import varlen_attention as va  # noqa: E402
from miles.trainer.forward import forward_micro_batch  # noqa: E402
from miles.trainer.hf_io import load_causal_lm, pick_attn_implementation  # noqa: E402

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (16, 8, 128), (4, 4, 64)])
def test_kernel_check_passes_on_this_gpu(heads, kv_heads, head_dim):
    assert va.flash_ops_present()
    assert va.kernel_check(0, torch.bfloat16, heads, kv_heads, head_dim) is None


def test_flash_kernel_matches_per_sequence_sdpa():
    g = torch.Generator(device=CUDA).manual_seed(0)
    lens = [1, 130, 7, 512, 64]
    cu, longest = va.boundaries(lens)
    cu = cu.to(CUDA)
    total = sum(lens)
    q = torch.randn(total, 14, 64, device=CUDA, dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(total, 2, 64, device=CUDA, dtype=torch.bfloat16, generator=g).requires_grad_() for _ in "kv")
    grad = torch.randn(total, 14, 64, device=CUDA, dtype=torch.bfloat16, generator=g)
    out = va.flash_varlen(q, k, v, cu, longest, 0.125)
    got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_out = va.reference_varlen(*ref, cu, longest, 0.125)
    want = [ref_out, *torch.autograd.grad(ref_out, ref, grad)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("compiled", [False, True])
def test_trainer_forward_packed_row_matches_padded_bf16(tmp_path, compiled):
    from miles.models.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path / "m"), arch="qwen2", layers=2, hidden=256, heads=4, kv_heads=2,
                           intermediate=512)  # fmt: skip
    assert pick_attn_implementation(CUDA, torch.bfloat16, path) == va.NAME
    out = []
    for attn in ("sdpa", va.NAME):
        model = load_causal_lm(path, attn_implementation=attn).to(CUDA, torch.bfloat16)
        if compiled:
            for block in model.model.layers:
                block.compile(dynamic=True)
        batch = make_train_batch([97, 40, 233, 12, 150, 233], [60, 11, 120, 5, 90, 30], model.config.vocab_size)
        lp, _, _ = forward_micro_batch(model, batch, CUDA, 1.0, entropy="none", compiled=compiled)
        lp.sum().backward()
        out.append((lp.detach().float(), model.model.layers[0].self_attn.q_proj.weight.grad.float()))
    (lp_pad, g_pad), (lp_row, g_row) = out
    assert (lp_pad - lp_row).abs().mean().item() < 0.02
    assert (lp_pad - lp_row).abs().max().item() < 0.25
    assert torch.nn.functional.cosine_similarity(g_pad.flatten(), g_row.flatten(), dim=0).item() > 0.99
