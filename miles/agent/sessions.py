"""Session state of the token-in-token-out server: checkpoints, the linear and branching rules, samples.

After every completed turn a session stores a checkpoint: the messages of the request plus the
assistant's reply, and the token ids the engine consumed and produced, with a loss mask (1 on
tokens the model generated), the engine's log-probs and weight versions. A new request attaches
to the deepest checkpoint whose messages match the start of its own (the matcher decides what
"match" means) and the server tokenises only what follows.

  linear (v1)     the request must extend the last checkpoint, or retry the last turn (attach one
                  checkpoint back, which drops the last one); anything else is refused. One
                  trajectory per session.
  branching (v2)  the checkpoints form a tree that is never pruned: the request attaches to the
                  deepest matching checkpoint and a new child starts there. Every leaf is one
                  trajectory.
A checkpoint whose turn stopped at the length limit (or was aborted) cannot be extended.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from miles.agent.matchers import Matcher
from miles.rollout.sample import Sample, SampleStatus

RULES = {"v1": "linear", "v2": "branching"}
_FINISH_TO_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


class SessionConflict(ValueError):
    """A request the session's rule cannot attach (answered with HTTP 409)."""


@dataclass(eq=False, slots=True)
class Checkpoint:
    """The state after one completed turn. Token lists cover the whole sequence, prompt included."""

    index: int
    parent: Checkpoint | None
    messages: list[dict[str, Any]]  # the request's messages + the assistant's reply
    token_ids: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    weight_versions: list[int]
    finish_reason: str  # stop | length | abort
    closed_turn: bool  # the output ended with the end-of-turn token
    input_len: int  # tokens the engine was given for this turn
    turns: int  # model turns from the root to here
    tools: list[dict] | None = None  # the request's tools (they are part of the rendered prompt)
    routed: np.ndarray | None = None  # R3: the engine's experts of token_ids[:-1] (this turn's request covers all)

    @property
    def extendable(self) -> bool:
        return self.finish_reason == "stop"

    @property
    def prompt_len(self) -> int:
        """Tokens of the trajectory's first prompt (the root turn's input)."""
        node = self
        while node.parent is not None:
            node = node.parent
        return node.input_len

    def summary(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "parent": self.parent.index if self.parent else None,
            "num_messages": len(self.messages),
            "turns": self.turns,
            "input_len": self.input_len,
            "token_ids": self.token_ids,
            "loss_mask": self.loss_mask,
            "log_probs": self.log_probs,
            "weight_versions": self.weight_versions,
            "finish_reason": self.finish_reason,
        }


@dataclass(eq=False)
class Session:
    """One episode's history under one rule; `lock` orders the requests of a linear session."""

    rule: str  # linear | branching
    matcher: Matcher
    max_turns: int
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    metadata: dict[str, Any] = field(default_factory=dict)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    created_s: float = field(default_factory=time.time)

    # ---- attach -------------------------------------------------------------------------------
    def attach(self, messages: list[dict], tools: list[dict] | None) -> Checkpoint | None:
        """The checkpoint a request extends (None: a fresh first turn); SessionConflict when refused.

        A checkpoint matches when its tools are the request's and each of its messages matches the
        request's message at the same position.
        """
        if self.rule == "linear":
            parent = self._attach_linear(messages, tools)
        else:
            parent = self._attach_branching(messages, tools)
        turns = parent.turns if parent is not None else 0
        if turns >= self.max_turns:
            raise SessionConflict(
                f"the trajectory already has {turns} model turns, the limit (--generate-max-turns); end the episode"
            )
        return parent

    def _matches(self, node: Checkpoint, messages: list[dict], tools: list[dict] | None, start: int = 0) -> bool:
        stored = node.messages
        return (
            node.tools == tools
            and len(messages) >= len(stored)
            and all(self.matcher(a, b) for a, b in zip(stored[start:], messages[start : len(stored)], strict=True))
        )

    def _attach_linear(self, messages: list[dict], tools: list[dict] | None) -> Checkpoint | None:
        path = self.checkpoints
        if not path:
            return None
        tip = path[-1]
        if self._matches(tip, messages, tools):
            if not tip.extendable:
                raise SessionConflict(
                    f"the last turn ended with finish_reason={tip.finish_reason!r}; a trajectory "
                    "whose turn stopped at the length limit or was aborted cannot be extended"
                )
            return tip
        back = tip.parent
        if back is None or self._matches(back, messages, tools):
            return back  # a retry of the last turn: `add` drops the rolled-back turn
        what = "its tools differ from the session's" if back.tools != tools else "it diverges from the session"
        raise SessionConflict(
            f"the request cannot extend this linear session: {what} before the last turn (the request has "
            f"{len(messages)} messages, the session {len(tip.messages)}); a linear session only extends or retries "
            "its last turn: check the history the agent replays, loosen --session-message-matcher, or use "
            "--use-session-server v2"
        )

    def _attach_branching(self, messages: list[dict], tools: list[dict] | None) -> Checkpoint | None:
        node: Checkpoint | None = None
        while True:
            start = len(node.messages) if node is not None else 0
            child = next(
                (
                    c
                    for c in reversed(self.checkpoints)
                    if c.parent is node and c.extendable and self._matches(c, messages, tools, start)
                ),
                None,
            )
            if child is None:
                return node
            node = child

    def add(self, checkpoint: Checkpoint) -> None:
        """Store a completed turn; in a linear session every checkpoint after its parent leaves the path."""
        if self.rule == "linear":
            while self.checkpoints and self.checkpoints[-1] is not checkpoint.parent:
                self.checkpoints.pop()
        self.checkpoints.append(checkpoint)

    def next_index(self) -> int:
        return max((c.index for c in self.checkpoints), default=-1) + 1

    # ---- trajectories -------------------------------------------------------------------------
    def leaves(self) -> list[Checkpoint]:
        """The trajectories: the last checkpoint (linear) or every checkpoint without children (branching)."""
        if self.rule == "linear":
            return self.checkpoints[-1:]
        parents = {id(c.parent) for c in self.checkpoints if c.parent is not None}
        return [c for c in self.checkpoints if id(c) not in parents]

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.id,
            "rule": self.rule,
            "metadata": self.metadata,
            "checkpoints": [c.summary() for c in self.checkpoints],
            "leaves": [c.index for c in self.leaves()],
        }


def checkpoint_to_sample(leaf: Checkpoint, tokenizer: Any, *, max_seq_len: int | None = None) -> Sample:
    """One training sample: the first prompt, then every turn; loss mask 1 only where the model generated.

    Tokens past `max_seq_len` are cut and the sample is TRUNCATED. Tokens the model did not
    generate get log-prob 0.0 and the weight version of the model token before them.
    """
    prompt_len = leaf.prompt_len
    end = len(leaf.token_ids) if max_seq_len is None else min(len(leaf.token_ids), max_seq_len)
    end = max(end, prompt_len)
    status = _FINISH_TO_STATUS.get(leaf.finish_reason, SampleStatus.FAILED)
    if end < len(leaf.token_ids):
        status = SampleStatus.TRUNCATED
    tokens = leaf.token_ids[:end]
    return Sample(
        prompt=_first_prompt(leaf),
        tokens=list(tokens),
        response=tokenizer.decode(tokens[prompt_len:], skip_special_tokens=False),
        response_length=end - prompt_len,
        loss_mask=list(leaf.loss_mask[prompt_len:end]),
        rollout_log_probs=list(leaf.log_probs[prompt_len:end]),
        weight_versions=list(leaf.weight_versions[prompt_len:end]),
        rollout_routed_experts=None if leaf.routed is None else leaf.routed[: end - 1],
        status=status,
        metadata={"messages": leaf.messages, "num_turns": leaf.turns},
    )


def _first_prompt(leaf: Checkpoint) -> list[dict[str, Any]]:
    node = leaf
    while node.parent is not None:
        node = node.parent
    return node.messages[:-1]
