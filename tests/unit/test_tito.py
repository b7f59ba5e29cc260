"""Token-in-token-out pieces on their own: the family check, tool-call parsing, matchers, session rules."""

from __future__ import annotations

import json

import pytest

from miles.agent.families import CHATML_TOOLS_TEMPLATE, FAMILIES, ModelFamily, parse_hermes_tool_calls, resolve_family
from miles.agent.matchers import loose_tool_call, resolve_matcher, role_content_only, strict
from miles.agent.sessions import Checkpoint, Session, SessionConflict, checkpoint_to_sample
from miles.agent.tito import NotAppendOnly, TitoTokenizer, check_append_only, normalize_message
from miles.models.tiny import build_tokenizer
from miles.rollout.sample import SampleStatus

TOKENIZER = build_tokenizer()
CHATML = TitoTokenizer(FAMILIES["chatml"], TOKENIZER)


def call(call_id: str, arguments: str, name: str = "calculator") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------- families and the append-only check


def test_chatml_is_append_only_on_the_tiny_tokenizer():
    assert check_append_only(CHATML) == []


def test_a_template_that_drops_earlier_tool_calls_fails_the_check():
    # renders the tool calls of the last message only, as templates that prune history do
    pruning = CHATML_TOOLS_TEMPLATE.replace(
        "{%- for call in message['tool_calls'] or [] %}",
        "{%- for call in (message['tool_calls'] or []) if loop.last %}",
    )
    problems = check_append_only(TitoTokenizer(ModelFamily("pruning", pruning, "<|im_end|>"), TOKENIZER))
    assert len(problems) == 2 and all("differently once more follow" in p for p in problems)


def test_the_checkpoints_own_template_without_tools_fails_where_tools_are_needed():
    problems = check_append_only(TitoTokenizer(FAMILIES["default"], TOKENIZER))
    assert [p.split(":")[0] for p in problems] == ["conversation 0", "conversation 1"]  # the third has no tools


def test_suffix_is_what_follows_the_stored_turn_and_closes_an_unclosed_one():
    messages = [
        normalize_message(m)
        for m in (
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
        )
    ]
    closed = TOKENIZER.decode(CHATML.suffix_ids(messages, 2, None, closed_turn=True))
    unclosed = TOKENIZER.decode(CHATML.suffix_ids(messages, 2, None, closed_turn=False))
    assert closed == "\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    assert unclosed == "<|im_end|>" + closed


def test_suffix_refuses_a_template_that_rewrote_the_stored_prefix():
    rewriting = ModelFamily(
        "rewriting",
        "{% for m in messages %}{{ m['content'] if loop.last else 'x' }}<|im_end|>{% endfor %}",
        "<|im_end|>",
    )
    tito = TitoTokenizer(rewriting, TOKENIZER)
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    with pytest.raises(NotAppendOnly, match="differently"):
        tito.suffix_ids(messages, 2, None, closed_turn=True)


def test_resolve_family_by_name_or_path_and_refuse_others():
    assert resolve_family("chatml") is FAMILIES["chatml"]
    with pytest.raises(ValueError, match="not a registered family"):
        resolve_family("qwen9")
    with pytest.raises(ValueError, match="not a miles.agent.families.ModelFamily"):
        resolve_family("miles.agent.families:FAMILIES")


# ---------------------------------------------------------------- parsing a reply


def test_hermes_calls_become_openai_tool_calls_and_text_stays_content():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    content, calls = parse_hermes_tool_calls(text)
    assert content == "Let me compute."
    assert [c["function"]["name"] for c in calls] == ["calculator"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "2*3"}
    assert calls[0]["id"].startswith("call_")


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>{"name": "calculator"',
        "plain answer",
    ],
)
def test_text_that_is_not_a_call_stays_text(text: str):
    assert parse_hermes_tool_calls(text) == (text, [])


def test_parse_reply_drops_the_end_of_turn_token():
    ids = CHATML.encode('<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>') + [CHATML.end_of_turn_id]
    message = CHATML.parse_reply(ids)
    assert message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == "{}"
    assert CHATML.parse_reply(CHATML.encode("Answer: 4") + [CHATML.end_of_turn_id])["content"] == "Answer: 4"


# ---------------------------------------------------------------- matchers

STORED = {"role": "assistant", "content": None, "tool_calls": [call("c1", '{"expression": "2 * 3"}')]}


@pytest.mark.parametrize(
    ("replayed", "expect"),
    [
        (STORED, (True, True, True)),
        ({**STORED, "tool_calls": [call("c1", '{"expression":"2 * 3"}')]}, (False, True, True)),  # re-serialised
        ({**STORED, "content": ""}, (True, True, True)),  # null and empty content render alike
        ({**STORED, "tool_calls": [call("c2", '{"expression": "2 * 3"}')]}, (False, False, True)),  # another id
        ({**STORED, "tool_calls": [call("c1", '{"expression": "2 * 4"}')]}, (False, False, True)),  # another call
        ({**STORED, "tool_calls": [call("c1", '{"expression": "2 * 3"}', "search")]}, (False, False, True)),
        ({"role": "assistant", "content": "hm"}, (False, False, False)),
        ({**STORED, "annotations": [], "refusal": None}, (True, True, True)),  # fields no template reads
    ],
)
def test_matchers_from_strict_to_loosest(replayed: dict, expect: tuple[bool, bool, bool]):
    assert (strict(STORED, replayed), loose_tool_call(STORED, replayed), role_content_only(STORED, replayed)) == expect


def test_absent_arguments_match_an_empty_object_only_when_lenient():
    absent = {**STORED, "tool_calls": [call("c1", "")]}
    empty = {**STORED, "tool_calls": [call("c1", "{}")]}
    assert loose_tool_call(absent, empty) and strict(absent, empty)  # both render as {}
    assert not strict({**STORED, "tool_calls": [call("c1", "{ }")]}, empty)
    assert loose_tool_call({**STORED, "tool_calls": [call("c1", "{ }")]}, empty)


def test_matcher_by_path_and_refusal():
    assert resolve_matcher("miles.agent.matchers:strict") is strict
    with pytest.raises(ValueError, match="strict"):
        resolve_matcher("exactish")


# ---------------------------------------------------------------- session rules

USER = {"role": "user", "content": "q"}


def turn(session: Session, messages: list[dict], reply: str, *, finish: str = "stop", tools=None) -> Checkpoint:
    """Attach like the server, then store a checkpoint: one made-up token per new message, two generated."""
    parent = session.attach(messages, tools)
    appended = len(messages) - (len(parent.messages) if parent else 0)
    ids = (parent.token_ids if parent else []) + [7] * appended + [5, 2]
    mask = (parent.loss_mask if parent else []) + [0] * appended + [1, 1]
    lps = (parent.log_probs if parent else []) + [0.0] * appended + [-0.5, -0.25]
    checkpoint = Checkpoint(
        session.next_index(),
        parent,
        messages + [{"role": "assistant", "content": reply}],
        ids,
        mask,
        lps,
        [1] * len(ids),
        finish,
        True,
        len(ids) - 2,
        (parent.turns if parent else 0) + 1,
        tools,
    )
    session.add(checkpoint)
    return checkpoint


def history(checkpoint: Checkpoint, *more: dict) -> list[dict]:
    return checkpoint.messages + list(more)


def test_linear_extends_the_tip_retries_the_last_turn_and_refuses_earlier_divergence():
    s = Session("linear", strict, max_turns=8)
    a = turn(s, [USER], "a")
    b = turn(s, history(a, {"role": "user", "content": "more"}), "b")
    assert b.parent is a and s.leaves() == [b]
    retry = turn(s, history(a, {"role": "user", "content": "more"}), "b2")  # b's prompt again: roll back one turn
    assert retry.parent is a and s.checkpoints == [a, retry]
    with pytest.raises(SessionConflict, match="diverges"):
        s.attach([USER, {"role": "assistant", "content": "not a"}, {"role": "user", "content": "x"}], None)


def test_a_turn_stopped_at_the_length_limit_cannot_be_extended():
    linear = Session("linear", strict, max_turns=8)
    cut = turn(linear, [USER], "a", finish="length")
    with pytest.raises(SessionConflict, match="length limit"):
        linear.attach(history(cut, {"role": "user", "content": "go on"}), None)
    branching = Session("branching", strict, max_turns=8)
    cut = turn(branching, [USER], "a", finish="length")
    assert branching.attach(history(cut, {"role": "user", "content": "go on"}), None) is None  # a fresh branch


def test_branching_attaches_to_the_deepest_match_and_never_deletes():
    s = Session("branching", strict, max_turns=8)
    a = turn(s, [USER], "a")
    b = turn(s, history(a, {"role": "user", "content": "left"}), "b")
    c = turn(s, history(a, {"role": "user", "content": "right"}), "c")  # a fork at a
    d = turn(s, history(b, {"role": "user", "content": "deeper"}), "d")
    e = turn(s, [USER, {"role": "assistant", "content": "other"}, USER], "e")  # diverges at the first reply
    assert (b.parent, c.parent, d.parent, e.parent) == (a, a, b, None)
    assert set(s.leaves()) == {c, d, e} and len(s.checkpoints) == 5


def test_turn_limit_counts_model_turns_along_the_path():
    s = Session("linear", strict, max_turns=2)
    a = turn(s, [USER], "a")
    b = turn(s, history(a, USER), "b")
    with pytest.raises(SessionConflict, match="2 model turns"):
        s.attach(history(b, USER), None)


def test_tools_are_part_of_the_match():
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    linear = Session("linear", strict, max_turns=8)
    first = turn(linear, [USER], "a")
    b = turn(linear, history(first, USER), "b")
    with pytest.raises(SessionConflict, match="tools differ"):
        linear.attach(history(b, USER), tools)
    branching = Session("branching", strict, max_turns=8)
    root = turn(branching, [USER], "a")
    other = turn(branching, history(root, USER), "b", tools=tools)  # another tool set: a branch of its own
    assert other.parent is None
    assert branching.attach(history(other, USER), tools) is other  # and that branch extends
    assert branching.attach(history(root, USER), None) is root


# ---------------------------------------------------------------- assembling a sample


def test_a_checkpoint_becomes_one_sample_masked_where_the_model_did_not_generate():
    s = Session("linear", strict, max_turns=8)
    a = turn(s, [USER], "a")
    b = turn(s, history(a, USER), "b")
    sample = checkpoint_to_sample(b, TOKENIZER)
    assert sample.tokens == b.token_ids and sample.prompt_length == a.input_len
    assert sample.loss_mask == [1, 1, 0, 1, 1] and sample.rollout_log_probs == [-0.5, -0.25, 0, -0.5, -0.25]
    assert sample.status == SampleStatus.COMPLETED and sample.metadata["num_turns"] == 2
    sample.validate()
    cut = checkpoint_to_sample(b, TOKENIZER, max_seq_len=len(b.token_ids) - 2)
    assert cut.status == SampleStatus.TRUNCATED and cut.loss_mask == [1, 1, 0]
    cut.validate()
