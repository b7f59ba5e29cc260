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

import numpy as np

from miles.utils.routing import pack_routing, unpack_routing


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
    # R3: the engine's experts for every token but the last, [len(tokens) - 1, moe_layers, k] (uint8 for <= 256
    # experts; miles/utils/routing.py)
    rollout_routed_experts: np.ndarray | None = None

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
        routed = self.rollout_routed_experts
        if routed is not None and len(routed) != len(self.tokens) - 1:
            raise ValueError(
                f"sample {self.index}: rollout_routed_experts has {len(routed)} rows, len(tokens) - 1 = "
                f"{len(self.tokens) - 1}"
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
        self.rollout_routed_experts = None
        self.non_generation_time = 0.0
        self.status = SampleStatus.ABORTED

    # ---- (de)serialisation ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        routed, self.rollout_routed_experts = self.rollout_routed_experts, None
        try:
            d = asdict(self)
        finally:
            self.rollout_routed_experts = routed
        d["status"] = self.status.value
        d["rollout_routed_experts"] = None if routed is None else pack_routing(routed)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        d = dict(d)
        d["status"] = SampleStatus(d.get("status", "pending"))
        d["rollout_routed_experts"] = unpack_routing(d.get("rollout_routed_experts"))
        known = {f for f in cls.__dataclass_fields__}
        extra = {k: d.pop(k) for k in list(d) if k not in known}
        s = cls(**d)
        s.metadata.update({k: v for k, v in extra.items()})
        return s
