"""Column-oriented training data: what crosses from rollout to the trainer.

Every per-sample column has B entries; every per-token column is the concatenation, over the
samples in order, of their *response* tokens (sum(response_lengths) entries). `tokens` is the
concatenation of full sequences (prompt + response; sum(seq_lens) entries). Arrays are numpy so
the RPC codec ships them as out-of-band frames, never as per-sample Python objects.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

_PER_SAMPLE = ("seq_lens", "response_lengths", "rewards", "raw_rewards", "group_index", "sample_index", "truncated")
_PER_TOKEN = ("loss_masks", "rollout_log_probs", "weight_versions", "teacher_log_probs")


@dataclass(slots=True)
class TrainBatch:
    tokens: np.ndarray  # int64 [sum(seq_lens)]
    seq_lens: np.ndarray  # int64 [B]
    response_lengths: np.ndarray  # int64 [B]
    loss_masks: np.ndarray  # float32 [sum(response_lengths)]
    rewards: np.ndarray  # float32 [B], normalised per group (what the estimator uses)
    raw_rewards: np.ndarray  # float32 [B], as the reward function returned them
    group_index: np.ndarray  # int64 [B]
    sample_index: np.ndarray  # int64 [B]
    truncated: np.ndarray  # int8 [B]
    rollout_log_probs: np.ndarray | None = None  # float32 [sum(response_lengths)]
    weight_versions: np.ndarray | None = None  # int64 [sum(response_lengths)]
    teacher_log_probs: np.ndarray | None = None  # float32 [sum(response_lengths)]

    def __len__(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.seq_lens.sum())

    def to_dict(self) -> dict[str, np.ndarray | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, np.ndarray | None]) -> TrainBatch:
        return cls(**{f.name: d.get(f.name) for f in fields(cls)})

    def sequences(self) -> list[np.ndarray]:
        """Full token sequences, one array per sample."""
        return np.split(self.tokens, np.cumsum(self.seq_lens)[:-1]) if len(self) else []

    def per_token(self, name: str) -> list[np.ndarray]:
        """Split a per-token column into one array per sample."""
        col = getattr(self, name)
        return np.split(col, np.cumsum(self.response_lengths)[:-1]) if len(self) else []

    def select(self, idx: list[int] | np.ndarray) -> TrainBatch:
        """A new batch with samples `idx`, in that order."""
        idx = np.asarray(idx, dtype=np.int64)
        seq_off = np.concatenate([[0], np.cumsum(self.seq_lens)])
        resp_off = np.concatenate([[0], np.cumsum(self.response_lengths)])
        tok_sel = np.concatenate([np.arange(seq_off[i], seq_off[i + 1]) for i in idx]) if len(idx) else np.zeros(0, np.int64)
        rsp_sel = (
            np.concatenate([np.arange(resp_off[i], resp_off[i + 1]) for i in idx]) if len(idx) else np.zeros(0, np.int64)
        )
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                out[f.name] = None
            elif f.name == "tokens":
                out[f.name] = v[tok_sel]
            elif f.name in _PER_TOKEN:
                out[f.name] = v[rsp_sel]
            else:
                out[f.name] = v[idx]
        return TrainBatch(**out)
