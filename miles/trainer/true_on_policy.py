"""The trainer's side of `--true-on-policy-mode`: log-probs from the reference forward, one sequence at a time.

Each sample of a micro-batch goes through `miles/true_on_policy/scoring.py` alone, exactly as the
engine re-scored it after sampling (same model class with eager attention, same positions, same
logits slice, same fp32 log-softmax at the rollout temperature), so the old log-probs equal the
rollout's bit for bit, and the first optimizer step's new log-probs equal both. Micro-batches keep
their meaning for gradient accumulation; only the packing of several sequences into one forward is
given up (the throughput this costs is measured by bench/true_on_policy.py). With several ranks every
rank must run the same number of forwards (FSDP gathers per forward), which fixed-size micro-batches
guarantee; `--use-dynamic-batch-size` is refused there at start-up.
"""

from __future__ import annotations

import torch
from torch import nn

from miles.rollout.train_data import TrainBatch
from miles.true_on_policy.scoring import entropy as entropy_of
from miles.true_on_policy.scoring import scaled_log_softmax, sequence_logits, token_log_probs


def forward_sequences(
    model: nn.Module, sub: TrainBatch, device: torch.device, temperature: float, *, entropy: str
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(log_probs[T], entropy[T] or None, tokens) of a micro-batch, TrainBatch order, as `forward_micro_batch`."""
    log_probs, entropies = [], []
    for seq, n_response in zip(sub.sequences(), sub.response_lengths.tolist(), strict=True):
        if n_response == 0:
            continue
        ids = torch.from_numpy(seq).to(device)
        start = len(seq) - n_response
        rows = scaled_log_softmax(sequence_logits(model, ids, start), temperature)
        log_probs.append(token_log_probs(rows, ids[start:]))
        if entropy != "none":
            with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
                entropies.append(entropy_of(rows))
    empty = torch.zeros(0, device=device)
    lp = torch.cat(log_probs) if log_probs else empty
    ent = None if entropy == "none" else (torch.cat(entropies) if entropies else empty)
    if ent is not None and entropy != "grad":
        ent = ent.detach()
    return lp, ent, sub.num_tokens
