"""Forward passes over packed micro-batches: response-token log-probs, entropy and values.

Only the positions that predict a response token go through the LM head (`logits_to_keep`), so
the [tokens, vocab] logits tensor covers response tokens only. Log-probs and entropy are taken
in fp32 from logits divided by the sampling temperature, the same quantity the engine reports
for its sampled tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from miles.rollout.train_data import TrainBatch
from miles.trainer.packing import PackedInputs, pack_sequences

ENTROPY_MODES = ("grad", "detached", "none")


def response_logits(model: nn.Module, packed: PackedInputs) -> torch.Tensor:
    """Logits [sum(response_lengths), vocab] predicting each response token, TrainBatch order."""
    out = model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        logits_to_keep=packed.logits_index,
        use_cache=False,
    )
    if packed.gather_is_identity:  # every kept position is a response token, in order: a view, no copy
        return out.logits.flatten(0, 1)
    return out.logits[packed.gather_rows, packed.gather_cols]


def response_values(critic: nn.Module, packed: PackedInputs) -> torch.Tensor:
    """Critic values [sum(response_lengths)] at the positions that predict each response token."""
    out = critic(input_ids=packed.input_ids, position_ids=packed.position_ids)
    scores = out.logits[:, packed.logits_index, 0]
    return scores[packed.gather_rows, packed.gather_cols].float()


def _token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    # cross_entropy is one fused kernel with a cheap backward (softmax - one_hot)
    return -F.cross_entropy(x, targets, reduction="none")


def _token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    # Fuses the fp32 upcast into the reduction: no [tokens, vocab] fp32 copy of the logits.
    return torch.compile(fn, dynamic=True)


def log_probs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    entropy: str = "detached",
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log p(target) and entropy per row of `logits`.

    entropy: "grad" (part of the loss), "detached" (a metric only) or "none" (skipped: it costs
    another pass over the [tokens, vocab] logits).
    """
    if entropy not in ENTROPY_MODES:
        raise ValueError(f"entropy={entropy!r} is not one of {ENTROPY_MODES}")
    log_probs_fn = _compiled(_token_log_probs) if compiled else _token_log_probs
    log_probs = log_probs_fn(logits, targets, temperature)
    if entropy == "none":
        return log_probs, None
    entropy_fn = _compiled(_token_entropy) if compiled else _token_entropy
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        ent = entropy_fn(logits, temperature)
    return log_probs, ent if entropy == "grad" else ent.detach()


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
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(log_probs[T], entropy[T], tokens in the micro-batch) for one micro-batch."""
    packed = pack_sequences(sub).to(device)
    logits = response_logits(model, packed)
    log_probs, entropy = log_probs_and_entropy(logits, packed.targets, temperature, entropy=entropy, compiled=compiled)
    return log_probs, entropy, packed.num_tokens
