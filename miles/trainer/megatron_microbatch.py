"""THD-packed micro-batches of the megatron backend: every sequence of a micro-batch in one row.

`pack_thd` lays the samples `idx` of a TrainBatch end to end in one row (position ids restarting at 0
for every sequence) and says where each starts (`PackedSeqParams`), so megatron-core's attention keeps
them apart; with sequence parallelism a padding sequence makes the row's length divide by the
tensor-parallel size. It also gathers the positions that predict a response token (`logits_index`, in
TrainBatch order) and those tokens (`targets`): only they reach the output layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from miles.rollout.train_data import TrainBatch
from miles.trainer.mcore_model import packed_seq_params


@dataclass(slots=True)
class MicroBatch:
    """One THD-packed micro-batch: every sequence of `idx` in one row (+ a padding sequence when
    sequence parallelism needs the row length to divide by the tensor-parallel size)."""

    idx: list[int]
    input_ids: torch.Tensor  # [1, t]
    position_ids: torch.Tensor  # [1, t]
    seq_params: object  # PackedSeqParams
    logits_index: torch.Tensor  # positions predicting a response token, TrainBatch order
    targets: torch.Tensor  # those response tokens
    sub: TrainBatch | None = None  # the samples themselves (routing replay reads their routed experts)


def pack_thd(batch: TrainBatch, idx: list[int], device: torch.device, multiple_of: int = 1) -> MicroBatch:
    sub = batch.select(idx)
    seq_lens = [int(x) for x in sub.seq_lens]
    resp_lens = [int(x) for x in sub.response_lengths]
    tokens = np.concatenate(sub.sequences()).astype(np.int64)
    pad = -len(tokens) % multiple_of
    starts = np.concatenate([[0], np.cumsum(seq_lens)[:-1]])
    logits_index = np.concatenate(
        [np.arange(st + s - r - 1, st + s - 1) for st, s, r in zip(starts, seq_lens, resp_lens, strict=True)]
    )
    ids = torch.from_numpy(np.concatenate([tokens, np.zeros(pad, np.int64)]))
    positions = torch.cat([torch.arange(s) for s in [*seq_lens, pad] if s])
    lens = [*seq_lens, pad] if pad else seq_lens
    return MicroBatch(
        idx=idx,
        input_ids=ids.unsqueeze(0).to(device),
        position_ids=positions.unsqueeze(0).to(device),
        seq_params=packed_seq_params(lens, device),
        logits_index=torch.from_numpy(logits_index).to(device),
        targets=torch.from_numpy(tokens[logits_index + 1]).to(device),
        sub=sub,
    )
