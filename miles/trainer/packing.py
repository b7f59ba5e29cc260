"""Micro-batching: split one optimizer step's samples into micro-batches and pack them.

Two schedules:
- fixed: `micro_batch_size` samples per micro-batch, in order;
- dynamic (`--use-dynamic-batch-size`): samples packed into micro-batches of at most
  `max_tokens_per_gpu` tokens (first-fit over lengths in decreasing order), so a step needs few
  forward passes and no token is padding.

A packed micro-batch is one row of concatenated sequences whose position ids restart at 0 for
every sequence; the model's attention sees the restarts and keeps sequences apart (block-diagonal
causal mask with SDPA, varlen kernels with flash attention). When every sequence of a micro-batch
has the same length the row is reshaped to [n, L] instead, which needs no mask at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from miles.rollout.train_data import TrainBatch

logger = logging.getLogger(__name__)


def fixed_micro_batches(num_samples: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of `micro_batch_size` sample indices (the last may be shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    return [list(range(i, min(i + micro_batch_size, num_samples))) for i in range(0, num_samples, micro_batch_size)]


def token_budget_micro_batches(seq_lens: list[int] | np.ndarray, max_tokens: int) -> list[list[int]]:
    """Pack sample indices into bins of at most `max_tokens` tokens (first-fit decreasing).

    Every index appears in exactly one bin. A sequence longer than the budget cannot be split
    and gets a bin of its own (logged once per call). Inside a bin indices keep their original
    order so results are easy to read back; bins are ordered by their first index.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_gpu={max_tokens} must be >= 1")
    lens = [int(x) for x in seq_lens]
    too_long = [n for n in lens if n > max_tokens]
    if too_long:
        logger.warning(
            "%d sequence(s) longer than max_tokens_per_gpu=%d (longest %d) each get a micro-batch of their own; "
            "raise --max-tokens-per-gpu to at least %d to pack them",
            len(too_long),
            max_tokens,
            max(too_long),
            max(too_long),
        )
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lens)), key=lambda j: (-lens[j], j)):
        for b, load in enumerate(loads):
            if load + lens[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lens[i]
                break
        else:
            bins.append([i])
            loads.append(lens[i])
    for b in bins:
        b.sort()
    bins.sort(key=lambda b: b[0])
    return bins


def plan_micro_batches(
    seq_lens: list[int] | np.ndarray,
    *,
    micro_batch_size: int,
    use_dynamic_batch_size: bool,
    max_tokens_per_gpu: int | None,
) -> list[list[int]]:
    """The micro-batch schedule for one step's samples, per the PERF flags."""
    if use_dynamic_batch_size:
        if max_tokens_per_gpu is None:
            raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu (token budget of one micro-batch)")
        return token_budget_micro_batches(seq_lens, max_tokens_per_gpu)
    return fixed_micro_batches(len(seq_lens), micro_batch_size)


@dataclass(slots=True)
class PackedInputs:
    """Model inputs for one micro-batch plus where its response tokens sit.

    `input_ids`/`position_ids` are [rows, cols]. `logits_index` selects, along the column axis,
    the positions whose logits predict a response token; `gather_rows`/`gather_cols` pick, from
    the [rows, len(logits_index)] selection, each response token in TrainBatch order; `targets`
    are those response tokens.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logits_index: torch.Tensor
    gather_rows: torch.Tensor
    gather_cols: torch.Tensor
    targets: torch.Tensor
    response_lengths: list[int]
    num_tokens: int
    gather_is_identity: bool = False  # the [rows, kept] logits flattened are already in TrainBatch order

    def to(self, device: torch.device | str) -> PackedInputs:
        move = {
            k: getattr(self, k).to(device, non_blocking=True)
            for k in ("input_ids", "position_ids", "logits_index", "gather_rows", "gather_cols", "targets")
        }
        return PackedInputs(
            **move,
            response_lengths=self.response_lengths,
            num_tokens=self.num_tokens,
            gather_is_identity=self.gather_is_identity,
        )


def pack_sequences(batch: TrainBatch) -> PackedInputs:
    """Pack every sample of `batch` into model inputs without padding.

    The response token at absolute position p of a sequence is predicted by the logits at p - 1,
    so a response of length r in a sequence of length s uses logits at s-r-1 .. s-2.
    """
    seqs = batch.sequences()
    seq_lens = [int(x) for x in batch.seq_lens]
    resp_lens = [int(x) for x in batch.response_lengths]
    for i, (s, r) in enumerate(zip(seq_lens, resp_lens, strict=True)):
        if not 0 < r < s:
            raise ValueError(
                f"sample {i}: response_length={r} must be in [1, seq_len-1={s - 1}]; the trainer needs at least one "
                "prompt token before the response and one response token"
            )
    if len(set(seq_lens)) == 1:
        return _pack_rectangular(seqs, seq_lens[0], resp_lens)
    return _pack_row(seqs, seq_lens, resp_lens)


def _pack_rectangular(seqs: list[np.ndarray], seq_len: int, resp_lens: list[int]) -> PackedInputs:
    # Equal lengths: [n, L] with plain causal attention; keep logits for the longest response window.
    n, max_resp = len(seqs), max(resp_lens)
    input_ids = torch.from_numpy(np.stack(seqs).astype(np.int64))
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(n, -1).contiguous()
    first = seq_len - max_resp - 1
    logits_index = torch.arange(first, seq_len - 1)
    rows, cols = [], []
    for i, r in enumerate(resp_lens):
        rows.append(torch.full((r,), i))
        cols.append(torch.arange(max_resp - r, max_resp))
    targets = torch.cat([input_ids[i, seq_len - r :] for i, r in enumerate(resp_lens)])
    return PackedInputs(
        input_ids,
        position_ids,
        logits_index,
        torch.cat(rows),
        torch.cat(cols),
        targets,
        resp_lens,
        n * seq_len,
        gather_is_identity=len(set(resp_lens)) == 1,
    )


def _pack_row(seqs: list[np.ndarray], seq_lens: list[int], resp_lens: list[int]) -> PackedInputs:
    input_ids = torch.from_numpy(np.concatenate(seqs).astype(np.int64)).unsqueeze(0)
    position_ids = torch.cat([torch.arange(s) for s in seq_lens]).unsqueeze(0)
    starts = np.concatenate([[0], np.cumsum(seq_lens)[:-1]])
    logits_index = torch.cat(
        [torch.arange(st + s - r - 1, st + s - 1) for st, s, r in zip(starts, seq_lens, resp_lens, strict=True)]
    )
    total_resp = int(sum(resp_lens))
    targets = input_ids[0, logits_index + 1]
    return PackedInputs(
        input_ids,
        position_ids,
        logits_index,
        torch.zeros(total_resp, dtype=torch.long),
        torch.arange(total_resp),
        targets,
        resp_lens,
        int(sum(seq_lens)),
        gather_is_identity=True,
    )
