"""The supervised data path of `--loss-type sft_loss`: rows of --prompt-data become training samples.

Two row shapes, read with the usual keys (`--input-key`, `--label-key`, `--tool-key`):
- prompt/response: the prompt in `--input-key` (text, or chat messages) and the response text in
  `--label-key`. A text prompt is tokenised as an engine would (with the tokenizer's special
  tokens), the response after it, then the EOS token, so the model learns where to stop; the loss
  covers the response and that EOS. A chat prompt (or a text prompt with --apply-chat-template)
  gets the response as its final assistant message (next shape).
- chat messages, without `--label-key`: the whole conversation in `--input-key`, rendered with the
  tokenizer's chat template; the loss covers every assistant message (its content and the
  template's end-of-turn tokens), not the system, user or tool turns in between.

A sample's tokens run from the prompt up to the end of its last trained turn; its "response"
starts at the first trained token, and `loss_mask` zeroes the untrained turns inside it. Rows are
tokenised once, at start-up, so a malformed row stops the run before any worker starts (or is
skipped and counted with --skip-bad-rows), as are rows longer than the run's length limit.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.config import DataConfig
from miles.rollout.data_source import JsonlDataSource
from miles.rollout.prompt_rows import (
    PromptLimit,
    PromptRow,
    PromptTooLong,
    decode_line,
    parse_row,
    row_from_dict,
)
from miles.rollout.sample import Sample, SampleStatus


@dataclass(slots=True)
class SupervisedRow(PromptRow):
    """A row tokenised for training: `tokens` = prompt + response, the mask over the response."""

    loss_mask: list[int] = field(default_factory=list)
    response_length: int = 0


def _render(tokenizer: Any, messages: list[dict], tools: Any, *, generation_prompt: bool) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as e:  # noqa: BLE001 - templates raise jinja errors for bad roles/content
        raise ValueError(f"the chat template rejected the messages: {type(e).__name__}: {e}") from e
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_tokens(messages: list[dict], tokenizer: Any, tools: Any = None) -> tuple[list[int], list[int], int]:
    """(tokens, loss mask over the response, response length) of a conversation; loss on assistant turns.

    Each assistant turn spans from the end of the conversation before it with the generation prompt
    to the end of the conversation through it; the template must render every such prefix as a
    token prefix of the whole (true of ChatML-style templates), else the row is refused.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat messages need the tokenizer's chat template, and this tokenizer has none")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ValueError("the conversation has no assistant message to train on")
    if turns[0] == 0:
        raise ValueError("the conversation starts with an assistant message; it needs a prompt before it")
    full = _render(tokenizer, messages[: turns[-1] + 1], tools, generation_prompt=False)
    spans = []
    for i in turns:
        start = _render(tokenizer, messages[:i], tools, generation_prompt=True)
        end = _render(tokenizer, messages[: i + 1], tools, generation_prompt=False)
        if full[: len(start)] != start or full[: len(end)] != end:
            raise ValueError(
                f"the chat template does not render the conversation up to message {i} as a prefix of the whole "
                "(it rewrites earlier turns); give such rows as prompt/response pairs with --label-key"
            )
        if len(end) <= len(start):
            raise ValueError(f"assistant message {i} renders to no tokens")
        spans.append((len(start), len(end)))
    first, last = spans[0][0], spans[-1][1]
    mask = [0] * (last - first)
    for s, e in spans:
        mask[s - first : e - first] = [1] * (e - s)
    return full[:last], mask, last - first


def text_tokens(prompt: str, response: str, tokenizer: Any) -> tuple[list[int], list[int], int]:
    """(tokens, loss mask, response length) of a text prompt and its response, EOS appended."""
    prompt_ids = list(tokenizer(prompt)["input_ids"])
    response_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        response_ids.append(tokenizer.eos_token_id)
    if not prompt_ids or not response_ids:
        raise ValueError("the prompt or the response tokenises to nothing")
    return prompt_ids + response_ids, [1] * len(response_ids), len(response_ids)


def supervised_tokens(row: PromptRow, data: DataConfig, tokenizer: Any) -> tuple[list[int], list[int], int]:
    """(tokens, loss mask over the response, response length) of one row."""
    if isinstance(row.prompt, str) and not data.apply_chat_template:
        if row.label is None:
            raise ValueError("a text prompt needs its response: set --label-key to the response column")
        return text_tokens(row.prompt, row.label, tokenizer)
    messages = [{"role": "user", "content": row.prompt}] if isinstance(row.prompt, str) else list(row.prompt)
    if row.label is not None:
        messages.append({"role": "assistant", "content": row.label})
    return chat_tokens(messages, tokenizer, row.metadata.get("tools"))


class SupervisedDataSource(JsonlDataSource):
    """Training samples of an SFT run: one per row, tokenised at start-up, drawn in epochs like prompts.

    The length limit (`prompt_limit`: --rollout-max-prompt-len or the model's positions) applies to
    prompt + response.
    """

    def __init__(
        self, data: DataConfig, *, tokenizer: Any, prompt_limit: PromptLimit | None = None, path: str | None = None
    ) -> None:
        if tokenizer is None:
            raise ValueError("SFT tokenises its data at start-up and needs the model's tokenizer")
        super().__init__(data, n_samples_per_prompt=1, tokenizer=tokenizer, path=path, prompt_limit=prompt_limit)

    def _read_row(self, raw: bytes | dict[str, Any], tokenizer: Any) -> SupervisedRow:
        row = parse_row(decode_line(raw), self.data) if isinstance(raw, bytes) else row_from_dict(raw, self.data)
        tokens, mask, response_length = supervised_tokens(row, self.data, tokenizer)
        if self.prompt_limit is not None and len(tokens) > self.prompt_limit.max_tokens:
            raise PromptTooLong(len(tokens), "tokens")
        return SupervisedRow(row.prompt, row.label, row.metadata, tokens, mask, response_length)

    def _tokenize(self, path: Path, pending: list[tuple[int, PromptRow]], tokenizer: Any) -> list[PromptRow]:
        """Each row was tokenised with its response, and held to the limit, as it was read."""
        return [row for _, row in pending]

    def _make_group(self, row: PromptRow) -> list[Sample]:
        assert isinstance(row, SupervisedRow)
        sample = Sample(
            prompt=copy.deepcopy(row.prompt),
            tokens=list(row.tokens),
            response_length=row.response_length,
            loss_mask=list(row.loss_mask),
            label=row.label,
            reward=0.0,
            status=SampleStatus.COMPLETED,
            metadata=copy.deepcopy(row.metadata),
            group_index=self.next_group_index,
            index=self.next_sample_index,
        )
        self.next_group_index += 1
        self.next_sample_index += 1
        return [sample]
