"""One trajectory and its bookkeeping.

A `Sample` is one attempt at one prompt. Samples of the same prompt share `group_index`;
`index` is unique over the run. Per-token lists (`loss_mask`, `rollout_log_probs`,
`weight_versions`, `teacher_log_probs`, `opd_reverse_kl`) have exactly `response_length` entries:
they describe the response tail of `tokens`.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class SampleStatus(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


_FINISH_TO_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


@dataclass
class Sample:
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, float] | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    weight_versions: list[int] = field(default_factory=list)
    status: SampleStatus = SampleStatus.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    group_index: int | None = None
    index: int | None = None
    teacher_log_probs: list[float] | None = None  # OPD: the teacher's log-prob of each response token
    opd_reverse_kl: list[float] | None = None  # top-K OPD: the reverse-KL estimate at each response token
    remove_sample: bool = False
    routing_key: str | None = None  # sent as X-SMG-Routing-Key: every turn of a trajectory on one engine
    non_generation_time: float = 0.0  # tool / environment seconds, reported apart from generation

    Status = SampleStatus

    # ---- invariants -------------------------------------------------------------------
    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def validate(self) -> None:
        """Raise ValueError when a per-token list disagrees with `response_length`."""
        n = self.response_length
        if n > len(self.tokens):
            raise ValueError(f"sample {self.index}: response_length={n} > len(tokens)={len(self.tokens)}")
        for name in ("loss_mask", "rollout_log_probs", "teacher_log_probs", "opd_reverse_kl"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"sample {self.index}: len({name})={len(value)} != response_length={n}")
        if self.weight_versions and len(self.weight_versions) != n:
            raise ValueError(
                f"sample {self.index}: len(weight_versions)={len(self.weight_versions)} != response_length={n}"
            )

    @property
    def oldest_weight_version(self) -> int | None:
        return min(self.weight_versions) if self.weight_versions else None

    def status_from_finish_reason(self, finish_type: str) -> None:
        self.status = _FINISH_TO_STATUS.get(finish_type, SampleStatus.FAILED)

    def reset_for_retry(self) -> None:
        """Keep the prompt identity, drop every output; the sample goes back as ABORTED."""
        self.tokens = self.tokens[: self.prompt_length] if self.response_length else self.tokens
        self.response = ""
        self.response_length = 0
        self.reward = None
        self.loss_mask = None
        self.rollout_log_probs = None
        self.teacher_log_probs = None
        self.opd_reverse_kl = None
        self.weight_versions = []
        self.non_generation_time = 0.0
        self.status = SampleStatus.ABORTED

    # ---- (de)serialisation ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        d = dict(d)
        d["status"] = SampleStatus(d.get("status", "pending"))
        known = {f for f in cls.__dataclass_fields__}
        extra = {k: d.pop(k) for k in list(d) if k not in known}
        s = cls(**d)
        s.metadata.update({k: v for k, v in extra.items()})
        return s
