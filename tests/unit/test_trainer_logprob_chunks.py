"""Chunked log-probs and entropy (miles.trainer.forward) against a direct reference.

The reference takes log_softmax of the whole [tokens, vocab] fp32 logits at once and lets autograd
differentiate it. The chunked path must give the same values and gradients: bit-identical values
in fp32; gradients to 1e-6 (fp32 rounding of the recomputed chunks), and to one bf16 ulp for bf16
logits. It must also keep no fp32 tensor larger than one chunk alive for backward.
"""

from __future__ import annotations

import pytest
import torch

from miles.trainer.forward import log_probs_and_entropy

TOKENS, VOCAB = 37, 50
CHUNK_ROWS = 8  # 37 rows -> chunks of 8, 8, 8, 8, 5


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_p.gather(-1, targets[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)


def _case(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(TOKENS, VOCAB, generator=g) * 3).to(dtype)
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    return logits, targets, torch.randn(TOKENS, generator=g), torch.randn(TOKENS, generator=g)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy", ["grad", "detached", "none"])
@pytest.mark.parametrize("chunk_rows", [1, CHUNK_ROWS, TOKENS])
def test_chunked_matches_reference_fp32(entropy, temperature, chunk_rows):
    logits, targets, w_lp, w_ent = _case(torch.float32)
    x_ref = logits.clone().requires_grad_()
    lp_ref, ent_ref = _reference(x_ref, targets, temperature)
    ((lp_ref * w_lp).sum() + (ent_ref * w_ent).sum() * (entropy == "grad")).backward()

    x = logits.clone().requires_grad_()
    lp, ent = log_probs_and_entropy(x, targets, temperature, entropy=entropy, chunk_bytes=chunk_rows * 4 * VOCAB)
    loss = (lp * w_lp).sum()
    if entropy == "grad":
        assert ent.requires_grad
        loss = loss + (ent * w_ent).sum()
    loss.backward()

    assert torch.equal(lp.detach(), lp_ref.detach())
    if entropy == "none":
        assert ent is None
    else:
        torch.testing.assert_close(ent.detach(), ent_ref.detach(), atol=1e-6, rtol=0)
        assert entropy == "grad" or not ent.requires_grad
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-6, rtol=0)


def test_chunked_bf16_logits_grad_dtype_and_values():
    logits, targets, w_lp, w_ent = _case(torch.bfloat16, seed=1)
    x_ref = logits.clone().requires_grad_()
    lp_ref, ent_ref = _reference(x_ref, targets, 0.7)
    ((lp_ref * w_lp).sum() + (ent_ref * w_ent).sum()).backward()
    x = logits.clone().requires_grad_()
    lp, ent = log_probs_and_entropy(x, targets, 0.7, entropy="grad", chunk_bytes=CHUNK_ROWS * 4 * VOCAB)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    assert lp.dtype == ent.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert torch.equal(lp.detach(), lp_ref.detach())
    torch.testing.assert_close(ent.detach(), ent_ref.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), atol=0, rtol=2**-7)  # one bf16 ulp


def test_no_grad_path_matches_reference():
    logits, targets, _, _ = _case(torch.float32, seed=2)
    with torch.no_grad():
        lp, ent = log_probs_and_entropy(logits, targets, 0.7, chunk_bytes=CHUNK_ROWS * 4 * VOCAB)
    lp_ref, ent_ref = _reference(logits, targets, 0.7)
    assert torch.equal(lp, lp_ref)
    torch.testing.assert_close(ent, ent_ref, atol=1e-6, rtol=0)


def test_only_one_chunk_of_fp32_logits_is_kept_for_backward():
    logits, targets, w_lp, w_ent = _case(torch.bfloat16, seed=3)
    x = logits.clone().requires_grad_()
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        lp, ent = log_probs_and_entropy(x, targets, 0.7, entropy="grad", chunk_bytes=CHUNK_ROWS * 4 * VOCAB)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    fp32_numel = [t.numel() for t in saved if t.dtype == torch.float32]
    assert max(fp32_numel, default=0) <= CHUNK_ROWS * VOCAB, f"fp32 tensors saved for backward: {fp32_numel}"

    # the unchunked computation (one chunk holds every row) does keep [tokens, vocab] in fp32
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        log_probs_and_entropy(logits.clone().requires_grad_(), targets, 0.7, entropy="grad")
    assert max(t.numel() for t in saved if t.dtype == torch.float32) == TOKENS * VOCAB


def test_unknown_entropy_mode_is_rejected():
    logits, targets, _, _ = _case(torch.float32)
    with pytest.raises(ValueError, match="entropy='sometimes'"):
        log_probs_and_entropy(logits, targets, 1.0, entropy="sometimes")


@pytest.mark.parametrize("entropy", ["detached", "none"])
def test_one_log_softmax_gives_cross_entropys_log_probs_and_gradients_exactly(entropy):
    # the entropy shares the log-softmax the log-probs come from; neither values nor gradients may move
    logits, targets, w_lp, _ = _case(torch.float32, seed=3)
    x_ce = logits.clone().requires_grad_()
    lp_ce = -torch.nn.functional.cross_entropy(x_ce / 0.7, targets, reduction="none")
    (lp_ce * w_lp).sum().backward()
    x = logits.clone().requires_grad_()
    lp, ent = log_probs_and_entropy(x, targets, 0.7, entropy=entropy, chunk_bytes=TOKENS * 4 * VOCAB)
    (lp * w_lp).sum().backward()
    assert torch.equal(lp, lp_ce) and torch.equal(x.grad, x_ce.grad)
    assert (ent is None) == (entropy == "none")
