"""A multi-turn trajectory recorded token by token, for generate functions that drive the engine themselves.

The prompt comes first; then each model turn's output ids (loss mask 1, the engine's log-probs
and weight versions) and each environment turn's ids (tool output, user turns: loss mask 0,
log-prob 0.0, the weight version of the model token before them). `fill` writes the result into
a `Sample`, whose response is everything after the prompt. Turn and length limits are checked by
the caller through `turns` and `room`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.rollout.sample import Sample, SampleStatus

_FINISH_TO_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


@dataclass(slots=True)
class Trajectory:
    prompt_ids: list[int]
    max_len: int | None = None  # prompt + response tokens at most
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    turns: int = 0
    finish: str = "stop"
    tool_time_s: float = 0.0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def room(self) -> int | None:
        """Tokens left before `max_len` (None: no limit)."""
        return None if self.max_len is None else self.max_len - len(self.prompt_ids) - len(self.response_ids)

    def add_model_turn(self, ids: list[int], log_probs: list[float], versions: list[int], finish: str) -> None:
        if not len(ids) == len(log_probs) == len(versions):
            raise ValueError(f"a model turn has {len(ids)} ids, {len(log_probs)} log-probs, {len(versions)} versions")
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.log_probs += log_probs
        self.weight_versions += versions
        self.turns += 1
        self.finish = finish

    def add_env_tokens(self, ids: list[int]) -> None:
        """Tokens the model did not generate; cut at `max_len` (the trajectory is then truncated)."""
        room = self.room()
        if room is not None and len(ids) > room:
            ids, self.finish = ids[: max(room, 0)], "length"
        version = self.weight_versions[-1] if self.weight_versions else 0
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        self.weight_versions += [version] * len(ids)

    def fill(self, sample: Sample, tokenizer: Any) -> Sample:
        sample.tokens = self.token_ids
        sample.response_length = len(self.response_ids)
        sample.response = tokenizer.decode(self.response_ids, skip_special_tokens=False)
        sample.loss_mask = list(self.loss_mask)
        sample.rollout_log_probs = list(self.log_probs)
        sample.weight_versions = list(self.weight_versions)
        sample.status = _FINISH_TO_STATUS.get(self.finish, SampleStatus.FAILED)
        sample.non_generation_time = self.tool_time_s
        sample.metadata["num_turns"] = self.turns
        return sample
