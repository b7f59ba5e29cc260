"""Rule-based reward types: `math`, `gsm8k`, `deepscaler`, `f1`, `exact`, and the `boxed_` prefix.

Every rule is a pure function `(response, label) -> float` so that evaluation scripts and the
rollout path score identically; `grade()` in the package front dispatches on the type name.

A response keeps the token its turn ended with (the engines decode with special tokens and no stop
trim, token-in token-out), so "The answer is 23." arrives as "The answer is 23.<|im_end|>". Every rule
grades the text without that trailing end-of-turn markup (`strip_end_markers`): a correct answer scores
the same whether the model closed its turn or ran out of tokens.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable

from miles.rollout.rm_hub.math_utils import (
    extract_answer_phrase,
    extract_boxed,
    extract_hash_answer,
    extract_last_number,
    extract_math_answer,
    is_equiv,
    strip_reasoning,
)

RuleFn = Callable[[str, str], float]
BOXED_PREFIX = "boxed_"

# The markup chat templates close a turn with: ChatML, Qwen and SmolLM `<|im_end|>` and `<|endoftext|>`,
# Llama 3 `<|eot_id|>`, Phi `<|end|>`, DeepSeek `<｜end▁of▁sentence｜>`, Llama 2 and Mistral `</s>`,
# Gemma `<end_of_turn>` and `<eos>`. Matched only at the very end of a response.
_END_MARKER_RE = re.compile(r"(?:<\|[^<>|\s]{1,40}\|>|<｜[^<>｜\s]{1,40}｜>|</s>|<eos>|<end_of_turn>)\Z")
_END_MARKER_MAX_CHARS = 44


def strip_end_markers(response: str) -> str:
    """`response` without the end-of-turn tokens (and the whitespace around them) it ends with, if any."""
    text = response
    while True:
        trimmed = text.rstrip()
        found = _END_MARKER_RE.search(trimmed, max(0, len(trimmed) - _END_MARKER_MAX_CHARS))
        if found is None:
            return text if text is response else trimmed
        text = trimmed[: found.start()]


def _reference(label: str) -> str:
    """The answer inside a label that carries a worked solution ("... #### 72", "\\boxed{72}")."""
    for extract in (extract_boxed, extract_hash_answer):
        found = extract(label)
        if found is not None:
            return found
    return label


def grade_math(response: str, label: str) -> float:
    """1.0 when the response's final answer is equivalent to the label's, else 0.0."""
    return float(is_equiv(extract_math_answer(response), _reference(label)))


def grade_gsm8k(response: str, label: str) -> float:
    """GSM8K: the answer after "####"; else a boxed / "answer is" answer; else the last number."""
    answer = extract_hash_answer(response)
    if answer is None:
        answer = extract_boxed(response) or extract_answer_phrase(response) or extract_last_number(response)
    return float(answer is not None and is_equiv(answer, _reference(label)))


def grade_deepscaler(response: str, label: str) -> float:
    """Reasoning-model format: only the text after `</think>` counts; no closed block scores 0."""
    tail = strip_reasoning(response)
    return 0.0 if tail is None else grade_math(tail, label)


_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT_TABLE = str.maketrans("", "", string.punctuation)


def _f1_tokens(text: str) -> list[str]:
    """SQuAD-style normalisation: lower case, no punctuation, no articles, single spaces."""
    return _ARTICLES_RE.sub(" ", text.lower().translate(_PUNCT_TABLE)).split()


def grade_f1(response: str, label: str) -> float:
    """Token-level F1 between response and label (bag of words)."""
    pred, gold = _f1_tokens(response), _f1_tokens(label)
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def grade_exact(response: str, label: str) -> float:
    """Exact match after trimming and collapsing whitespace (case-sensitive)."""
    return float(" ".join(response.split()) == " ".join(label.split()))


RULES: dict[str, RuleFn] = {
    "math": grade_math,
    "gsm8k": grade_gsm8k,
    "deepscaler": grade_deepscaler,
    "f1": grade_f1,
    "exact": grade_exact,
}


def resolve_rule(rm_type: str) -> Callable[[str, str], float]:
    """The grading function for `rm_type`, honouring the `boxed_` prefix (score the boxed content), applied
    to the response without its trailing end-of-turn markup."""
    if rm_type.startswith(BOXED_PREFIX):
        inner = _rule_or_raise(rm_type[len(BOXED_PREFIX) :], rm_type)

        def boxed_rule(response: str, label: str) -> float:
            boxed = extract_boxed(strip_end_markers(response))
            return 0.0 if boxed is None else inner(boxed, label)

        return boxed_rule
    rule = _rule_or_raise(rm_type, rm_type)

    def graded(response: str, label: str) -> float:
        return rule(strip_end_markers(response), label)

    return graded


def _rule_or_raise(name: str, full: str) -> RuleFn:
    rule = RULES.get(name)
    if rule is None:
        known = ", ".join(sorted(RULES)) + ", remote_rm, boxed_<rule>"
        raise ValueError(f"unknown rm_type {full!r}; use one of: {known} (or set --custom-rm-path)")
    return rule
