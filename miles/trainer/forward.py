"""Forward passes over packed micro-batches: response-token log-probs, entropy and values.

Only the positions that predict a response token go through the LM head (`logits_to_keep`), so
the [tokens, vocab] logits tensor covers response tokens only. Log-probs and entropy are taken
in fp32 from logits divided by the sampling temperature, the same quantity the engine reports
for its sampled tokens, one chunk of tokens at a time (`LOGITS_CHUNK_BYTES` of fp32 logits on CPU;
on CUDA up to a quarter of the free device memory), so the fp32 copy of the full-vocabulary logits
never exists for the whole micro-batch when memory is short.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from miles.rollout.train_data import TrainBatch
from miles.trainer.packing import PackedInputs, layout_for, pack_sequences

ENTROPY_MODES = ("grad", "detached", "none")


def response_logits(model: nn.Module, packed: PackedInputs) -> torch.Tensor:
    """Logits [sum(response_lengths), vocab] predicting each response token, TrainBatch order."""
    out = model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        logits_to_keep=packed.logits_index,
        use_cache=False,
        **packed.attention_kwargs,
    )
    if packed.gather_is_identity:  # every kept position is a response token, in order: a view, no copy
        return out.logits.flatten(0, 1)
    return out.logits[packed.gather_rows, packed.gather_cols]


def model_layout(model: nn.Module) -> str:
    """The batch layout `model`'s attention runs best on (see miles.trainer.packing)."""
    return layout_for(getattr(getattr(model, "config", None), "_attn_implementation", None))


def response_values(critic: nn.Module, packed: PackedInputs) -> torch.Tensor:
    """Critic values [sum(response_lengths)] at the positions that predict each response token."""
    out = critic(input_ids=packed.input_ids, position_ids=packed.position_ids, **packed.attention_kwargs)
    scores = out.logits[:, packed.logits_index, 0]
    return scores[packed.gather_rows, packed.gather_cols].float()


# fp32 logits alive at a time in the log-prob/entropy path: about 880 tokens at Qwen2's 151,936-token
# vocabulary, instead of [tokens, vocab] fp32 for the whole micro-batch.
LOGITS_CHUNK_BYTES = 512 * 2**20


def _log_probs_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log p(target) and, when asked, the entropy, from one log_softmax over the vocabulary.

    cross_entropy is log_softmax + nll_loss under autograd (it keeps the [tokens, vocab] log-softmax for
    backward as well), so the entropy reads that same log-softmax rather than computing a second one:
    the log-probs and their gradients are bit-identical to cross_entropy's, at one full-vocabulary pass
    fewer per micro-batch."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    if entropy == "none":
        return -F.cross_entropy(x, targets, reduction="none"), None
    log_p = torch.log_softmax(x, dim=-1)
    log_probs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        ent = -(log_p.exp() * log_p).sum(-1)
    return log_probs, ent if entropy == "grad" else ent.detach()


@functools.cache
def _compiled(fn: Callable) -> Callable:
    # Fuses the fp32 upcast into the reductions: no fp32 copy of the chunk's logits.
    return torch.compile(fn, dynamic=True)


class _ChunkedLogProbs(torch.autograd.Function):
    """`fn` over row chunks of the logits, recomputed chunk by chunk in backward.

    Autograd keeps only the logits (in their compute dtype); the fp32 intermediates (upcast,
    log_softmax, their gradients) exist for one chunk at a time, in forward and in backward.
    Backward differentiates the very ops of the forward, so gradients match the unchunked path's
    up to fp32 rounding (bit-identical when the entropy carries no gradient, on CPU).
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, entropy, chunk_rows, fn):
        ctx.save_for_backward(logits, targets)
        ctx.set_materialize_grads(False)
        ctx.args = (temperature, entropy, chunk_rows, fn)
        chunks = zip(logits.split(chunk_rows), targets.split(chunk_rows), strict=True)
        outs = [fn(lg, tg, temperature, entropy) for lg, tg in chunks]
        log_probs = torch.cat([lp for lp, _ in outs])
        ent = torch.cat([e for _, e in outs]) if entropy != "none" else log_probs.new_empty(0)
        if entropy != "grad":
            ctx.mark_non_differentiable(ent)
        return log_probs, ent

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, targets = ctx.saved_tensors
        temperature, entropy, chunk_rows, fn = ctx.args
        if entropy != "grad":
            grad_entropy = None
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None, None
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            with torch.enable_grad():
                x = logits[rows].detach().requires_grad_()
                log_probs, ent = fn(x, targets[rows], temperature, "none" if grad_entropy is None else entropy)
                pairs = [(log_probs, grad_log_probs), (ent, grad_entropy)]
                outs, grads = zip(*[(o, g[rows]) for o, g in pairs if g is not None], strict=True)
                (grad_logits[rows],) = torch.autograd.grad(outs, x, grads)
        return grad_logits, None, None, None, None, None


def default_chunk_bytes(device: torch.device) -> int:
    """LOGITS_CHUNK_BYTES; on CUDA, up to a quarter of the device's free memory. Chunking trades a
    backward recompute of the log-softmax for memory, worth paying only when memory is short."""
    if device.type != "cuda":
        return LOGITS_CHUNK_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return max(LOGITS_CHUNK_BYTES, free // 4)


def log_probs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    entropy: str = "detached",
    compiled: bool = False,
    chunk_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log p(target) and entropy per row of `logits`, `chunk_bytes` of fp32 logits at a time
    (default: `default_chunk_bytes`).

    entropy: "grad" (part of the loss), "detached" (a metric only) or "none" (skipped).
    When every row fits in one chunk there is nothing to bound, so autograd records the ops
    directly and backward recomputes nothing.
    """
    if entropy not in ENTROPY_MODES:
        raise ValueError(f"entropy={entropy!r} is not one of {ENTROPY_MODES}")
    fn = _compiled(_log_probs_entropy) if compiled else _log_probs_entropy
    if chunk_bytes is None:
        chunk_bytes = default_chunk_bytes(logits.device)
    chunk_rows = max(1, chunk_bytes // (4 * logits.shape[-1]))
    if logits.shape[0] <= chunk_rows:
        return fn(logits, targets, temperature, entropy)
    log_probs, ent = _ChunkedLogProbs.apply(logits, targets, temperature, entropy, chunk_rows, fn)
    return log_probs, None if entropy == "none" else ent


def dummy_batch() -> TrainBatch:
    """A 2-token sample: run by ranks with fewer micro-batches so FSDP collectives stay matched."""
    z = np.zeros
    return TrainBatch(
        tokens=z(2, np.int64),
        seq_lens=np.array([2]),
        response_lengths=np.array([1]),
        loss_masks=z(1, np.float32),
        rewards=z(1, np.float32),
        raw_rewards=z(1, np.float32),
        group_index=z(1, np.int64),
        sample_index=z(1, np.int64),
        truncated=z(1, np.int8),
    )


def token_index(response_lengths: np.ndarray, sample_idx: list[int]) -> slice | np.ndarray:
    """Where, in the per-token columns of a batch, the response tokens of `sample_idx` sit.

    A slice when the samples are consecutive (fixed micro-batches, optimizer-step chunks), so
    selecting them is a view rather than a gather.
    """
    offsets = np.concatenate([[0], np.cumsum(response_lengths)])
    if not sample_idx:
        return np.zeros(0, np.int64)
    first, last = sample_idx[0], sample_idx[-1]
    if last - first + 1 == len(sample_idx) and list(sample_idx) == list(range(first, last + 1)):
        return slice(int(offsets[first]), int(offsets[last + 1]))
    return np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in sample_idx])


def forward_micro_batch(
    model: nn.Module,
    sub: TrainBatch,
    device: torch.device,
    temperature: float,
    *,
    entropy: str = "detached",
    compiled: bool = False,
    true_on_policy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(log_probs[T], entropy[T], tokens in the micro-batch) for one micro-batch; `true_on_policy`: one
    sequence per reference forward, the engine's scoring path (miles/trainer/true_on_policy.py)."""
    if true_on_policy:
        from miles.trainer.true_on_policy import forward_sequences

        return forward_sequences(model, sub, device, temperature, entropy=entropy)
    packed = pack_sequences(sub, model_layout(model)).to(device)
    logits = response_logits(model, packed)
    log_probs, entropy = log_probs_and_entropy(logits, packed.targets, temperature, entropy=entropy, compiled=compiled)
    return log_probs, entropy, packed.num_tokens
