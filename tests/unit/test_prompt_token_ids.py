"""A sample's prompt ids when the data source left them to the rollout: text or chat messages."""

from __future__ import annotations

from transformers import AutoTokenizer

from miles.models.resolve import resolve_spec
from miles.rollout.generate import prompt_token_ids
from miles.rollout.sample import Sample


def test_chat_messages_become_the_templates_token_ids():
    tok = AutoTokenizer.from_pretrained(resolve_spec("tiny:"))
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    want = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    ids = prompt_token_ids(Sample(prompt=messages), tok)
    assert ids == want["input_ids"] and all(isinstance(i, int) for i in ids)
    assert (
        prompt_token_ids(Sample(prompt="plain text"), tok) == tok("plain text", add_special_tokens=False)["input_ids"]
    )
    assert prompt_token_ids(Sample(prompt=messages, tokens=[5, 6, 7], response_length=1), tok) == [5, 6]
