"""Micro-batching: split one optimizer step's samples into micro-batches and pack them.

Two schedules:
- fixed: `micro_batch_size` samples per micro-batch, in order;
- dynamic (`--use-dynamic-batch-size`): samples packed into micro-batches of at most
  `max_tokens_per_gpu` tokens (first-fit over lengths in decreasing order), so a step needs few
  forward passes and no token is padding.

Two layouts of a micro-batch's sequences (`pack_sequences(batch, layout)`):
- "row": one row of concatenated sequences whose position ids restart at 0 for every sequence;
  varlen attention kernels (flash-attn's, or torch's through `miles_varlen`,
  miles/trainer/varlen_attention.py) keep the sequences apart at no extra cost, told where each
  starts by `PackedInputs.attention_kwargs`;
- "padded": [n, L] rows, each sequence right-padded to the longest. Causal attention never lets a
  real token see the padding after it, so no mask is needed and SDPA runs its fused causal kernel.
  This is the layout for SDPA: a packed row there costs a dense [T, T] block-diagonal mask and
  attention over all T tokens of the row, quadratic in the micro-batch's size. The dynamic
  schedule then groups sequences of similar length and counts the padding in the token budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from miles.rollout.train_data import TrainBatch
from miles.trainer.varlen_attention import NAME as MILES_VARLEN
from miles.trainer.varlen_attention import boundaries

logger = logging.getLogger(__name__)


def fixed_micro_batches(num_samples: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of `micro_batch_size` sample indices (the last may be shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    return [list(range(i, min(i + micro_batch_size, num_samples))) for i in range(0, num_samples, micro_batch_size)]


LAYOUTS = ("row", "padded")
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", MILES_VARLEN)


def layout_for(attn_implementation: str | None) -> str:
    """ "row" for varlen attention kernels, "padded" for the rest (SDPA, eager)."""
    return "row" if attn_implementation in VARLEN_ATTENTION else "padded"


def token_budget_micro_batches(
    seq_lens: list[int] | np.ndarray, max_tokens: int, *, padded: bool = False
) -> list[list[int]]:
    """Pack sample indices into bins of at most `max_tokens` tokens (first-fit decreasing).

    padded: a bin costs (its size) x (its longest sequence), as in the padded layout; samples are
    taken longest first into consecutive bins, so each bin holds sequences of similar length.
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
    order = sorted(range(len(lens)), key=lambda j: (-lens[j], j))
    if padded:
        bins = _padded_bins(order, lens, max_tokens)
    else:
        bins = _first_fit_bins(order, lens, max_tokens)
    for b in bins:
        b.sort()
    bins.sort(key=lambda b: b[0])
    return bins


def _padded_bins(order: list[int], lens: list[int], max_tokens: int) -> list[list[int]]:
    bins: list[list[int]] = []
    for i in order:  # longest first: a bin's first sample sets its padded length
        if bins and (len(bins[-1]) + 1) * lens[bins[-1][0]] <= max_tokens:
            bins[-1].append(i)
        else:
            bins.append([i])
    return bins


def _first_fit_bins(order: list[int], lens: list[int], max_tokens: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lens[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lens[i]
                break
        else:
            bins.append([i])
            loads.append(lens[i])
    return bins


def plan_micro_batches(
    seq_lens: list[int] | np.ndarray,
    *,
    micro_batch_size: int,
    use_dynamic_batch_size: bool,
    max_tokens_per_gpu: int | None,
    layout: str = "row",
) -> list[list[int]]:
    """The micro-batch schedule for one step's samples, per the PERF flags and the batch layout."""
    if use_dynamic_batch_size:
        if max_tokens_per_gpu is None:
            raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu (token budget of one micro-batch)")
        return token_budget_micro_batches(seq_lens, max_tokens_per_gpu, padded=layout == "padded")
    return fixed_micro_batches(len(seq_lens), micro_batch_size)


@dataclass(slots=True)
class PackedInputs:
    """Model inputs for one micro-batch plus where its response tokens sit.

    `input_ids`/`position_ids` are [rows, cols]. `logits_index` selects, along the column axis,
    the positions whose logits predict a response token; `gather_rows`/`gather_cols` pick, from
    the [rows, len(logits_index)] selection, each response token in TrainBatch order; `targets`
    are those response tokens. In the row layout `cu_seq_lens` (int32 [n + 1]) and `max_seq_len` mark
    where each sequence starts, for varlen attention (`attention_kwargs`).
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
    cu_seq_lens: torch.Tensor | None = None
    max_seq_len: int = 0

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
            cu_seq_lens=None if self.cu_seq_lens is None else self.cu_seq_lens.to(device, non_blocking=True),
            max_seq_len=self.max_seq_len,
        )

    @property
    def attention_kwargs(self) -> dict:
        """The sequence boundaries of a packed row under the names transformers passes to varlen attention
        (its flash-attention path and `miles_varlen` read them); nothing for the padded layout."""
        if self.cu_seq_lens is None:
            return {}
        cu, longest = self.cu_seq_lens, self.max_seq_len
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def pack_sequences(batch: TrainBatch, layout: str = "row") -> PackedInputs:
    """Every sample of `batch` as model inputs in `layout` ("row": no padding; "padded": [n, L]).

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
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if layout == "padded" or len(set(seq_lens)) == 1:
        return _pack_padded(seqs, seq_lens, resp_lens)
    return _pack_row(seqs, seq_lens, resp_lens)


def _pack_padded(seqs: list[np.ndarray], seq_lens: list[int], resp_lens: list[int]) -> PackedInputs:
    # [n, L] right-padded, plain causal attention; logits for the columns that cover every response.
    n, width = len(seqs), max(seq_lens)
    ids = np.zeros((n, width), np.int64)  # the padding's id is never attended to nor predicted
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = seq
    input_ids = torch.from_numpy(ids)
    position_ids = torch.arange(width).unsqueeze(0).expand(n, -1).contiguous()
    first = min(s - r - 1 for s, r in zip(seq_lens, resp_lens, strict=True))
    last = max(seq_lens) - 1  # exclusive: the logits at s - 1 predict nothing
    logits_index = torch.arange(first, last)
    rows = torch.cat([torch.full((r,), i) for i, r in enumerate(resp_lens)])
    cols = torch.cat([torch.arange(s - r - 1, s - 1) - first for s, r in zip(seq_lens, resp_lens, strict=True)])
    targets = torch.cat([input_ids[i, s - r : s] for i, (s, r) in enumerate(zip(seq_lens, resp_lens, strict=True))])
    aligned = len(set(seq_lens)) == 1 and len(set(resp_lens)) == 1
    return PackedInputs(
        input_ids, position_ids, logits_index, rows, cols, targets, resp_lens, n * width, gather_is_identity=aligned
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
    cu, longest = boundaries(seq_lens)
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
        cu_seq_lens=cu,
        max_seq_len=longest,
    )


def flat_token_positions(batch: TrainBatch, layout: str = "row") -> tuple[int, list[np.ndarray]]:
    """(tokens in the model input of `pack_sequences(batch, layout)`, flattened, and for every sample the flat
    index of each of its tokens): what lines per-token data up with the model's [rows x cols] token order."""
    seq_lens = [int(x) for x in batch.seq_lens]
    if layout == "padded" or len(set(seq_lens)) == 1:
        width = max(seq_lens)
        return len(seq_lens) * width, [i * width + np.arange(s) for i, s in enumerate(seq_lens)]
    starts = np.concatenate([[0], np.cumsum(seq_lens)[:-1]])
    return int(sum(seq_lens)), [st + np.arange(s) for st, s in zip(starts, seq_lens, strict=True)]
