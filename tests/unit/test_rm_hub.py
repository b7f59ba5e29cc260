"""Reward hub: rule graders on a table of tricky answer pairs, type resolution, plug-ins, remote RM."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from aiohttp import web

from miles.rollout.rm_hub import RewardFailed, assign_rewards, async_rm, batched_async_rm, grade
from miles.rollout.rm_hub.rules import strip_end_markers
from miles.rollout.sample import Sample, SampleStatus

# (response, label, equivalent?) -- graded with rm_type="math".
MATH_TABLE = [
    # extraction
    (r"We get \boxed{42}.", "42", True),
    (r"\boxed{\frac{1}{\frac{2}{3}}}", r"\frac{3}{2}", True),  # nested braces
    (r"first \boxed{1} then \boxed{2}", "2", True),  # the last boxed answer counts
    (r"first \boxed{1} then \boxed{2}", "1", False),
    ("The answer is 17.", "17", True),
    ("So the final answer is: 3/4", "0.75", True),
    ("Therefore the answer is 5. Then we check it.", "5", True),
    ("#### 72", "72", True),
    ("Final Answer: The final answer is $5$. I hope it is correct.", "5", True),
    ("The answer is 3.5.", "3.5", True),
    (r"\boxed 7", "7", True),
    # fractions
    (r"\boxed{\frac{1}{2}}", "0.5", True),
    (r"\boxed{\dfrac{3}{4}}", r"\frac34", True),
    (r"\boxed{\tfrac{2}{4}}", "1/2", True),
    (r"\boxed{0.5}", "1/2", True),
    (r"\boxed{-\frac{1}{2}}", "-0.5", True),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", True),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", True),
    (r"\boxed{\frac{1}{3}}", "0.333", False),
    # mixed numbers: 2 1/2 = 5/2, not 2 * 1/2 = 1
    (r"\boxed{2\frac{1}{2}}", "2.5", True),
    (r"\boxed{2\frac{1}{2}}", "1", False),
    (r"\boxed{2\frac12}", r"\frac{5}{2}", True),
    (r"\boxed{-3\frac{1}{4}}", "-3.25", True),  # -(3 + 1/4)
    (r"\boxed{12\frac{3}{4}}", "12.75", True),
    (r"\boxed{2\frac{\sqrt{3}}{3}}", r"\frac{2\sqrt{3}}{3}", True),  # not integers: a product
    (r"\boxed{2\cdot\frac{1}{2}}", "1", True),
    # formatting of numbers
    (r"\boxed{1,000}", "1000", True),
    (r"\boxed{1{,}234{,}567}", "1234567", True),
    (r"\boxed{5.0}", "5", True),
    (r"\boxed{5.00}", "5", True),
    (r"\boxed{ 12 }", "12", True),
    (r"\boxed{.5}", "0.5", True),
    (r"\boxed{-3}", "-3", True),
    (r"\boxed{-3}", "3", False),
    # wrappers and units
    (r"The answer is $\frac{1}{2}$.", "1/2", True),
    (r"\boxed{\$18}", "18", True),
    (r"\boxed{5\text{ cm}}", "5", True),
    (r"\boxed{10 \text{ cm}^2}", "10", True),
    (r"\boxed{12 \mbox{ meters}}", "12", True),
    (r"\boxed{90^\circ}", "90", True),
    (r"\boxed{50\%}", "50", True),
    ("The answer is 50%.", "50", True),
    (r"\boxed{x = 5}", "5", True),
    (r"\boxed{\text{(B)}}", "B", True),
    (r"\boxed{\text{(B)}}", "C", False),
    # tuples and intervals
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", True),
    (r"\boxed{(1, 2)}", "(1,2.0)", True),
    (r"\boxed{(1, 2)}", "(2,1)", False),
    (r"\boxed{[1, 2)}", "(1,2)", False),
    (r"\boxed{(-\infty, 2]}", r"(-\infty,2]", True),
    (r"\boxed{(1,2,3)}", "(1,2)", False),
    # near misses
    (r"\boxed{12}", "1.2", False),
    (r"\boxed{1/2}", "2", False),
    (r"\boxed{3}", "33", False),
    (r"\boxed{0.05}", "0.5", False),
    (r"\boxed{2m}", "2", False),  # a variable, not metres
    (r"\boxed{2^{10}}", "1024", True),
    (r"\boxed{9^{9^{9}}}", "1", False),  # too large to evaluate: compared as text, no hang
    ("The answer is 7 apples.", "7", True),
    (r"\boxed{1000}", "100", False),
    (r"\boxed{\frac{2}{1}}", "1/2", False),
    (r"\boxed{3\pi}", r"3\pi", True),
    (r"\boxed{\pi}", "3.14", False),
    ("I am not sure.", "4", False),
    ("", "4", False),
]


@pytest.mark.parametrize(("response", "label", "equivalent"), MATH_TABLE)
def test_math_table(response: str, label: str, equivalent: bool) -> None:
    assert grade("math", response, label) == (1.0 if equivalent else 0.0)


def test_table_is_large_and_balanced() -> None:
    assert len(MATH_TABLE) >= 40
    assert sum(eq for *_, eq in MATH_TABLE) >= 15 and sum(not eq for *_, eq in MATH_TABLE) >= 15


def test_label_with_worked_solution() -> None:
    assert grade("math", r"\boxed{72}", "She has 48 + 24 = 72 apples.\n#### 72") == 1.0
    assert grade("math", "answer: 9", r"so it is \boxed{9}") == 1.0


# (answer, label, equivalent?) -- only sympy can tell these; without it none of them match.
SYMBOLIC_TABLE = [
    ("x+1", "1+x", True),
    ("2(x+1)", "2x+2", True),
    (r"\frac{x^2-1}{x-1}", "x+1", True),  # (x-1)(x+1)/(x-1)
    ("(a+b)^2", "a^2+2ab+b^2", True),
    (r"\frac{3x}{2}", "1.5x", True),
    (r"2\sqrt{2}x", r"\sqrt{8}x", True),
    (r"\frac{\pi r^2}{2}", r"\frac{1}{2}\pi r^2", True),
    ("x^2", "2x", False),  # equal at x = 2 only
    ("x+1", "y+1", False),
    ("(x+1)^2", "x^2+1", False),
    ("yes", "sey", False),  # words are not products of one-letter variables
    (r"x^{9^{9}}", "x", False),  # exponent too large: refused, not expanded
]


@pytest.mark.parametrize(("answer", "label", "equivalent"), SYMBOLIC_TABLE)
def test_symbolic_equivalence_with_sympy(answer: str, label: str, equivalent: bool) -> None:
    pytest.importorskip("sympy")
    assert grade("math", rf"\boxed{{{answer}}}", label) == (1.0 if equivalent else 0.0)


def test_without_sympy_expressions_match_only_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.rollout.rm_hub import math_symbolic

    monkeypatch.setattr(math_symbolic, "_sympy", lambda: None)
    assert all(grade("math", rf"\boxed{{{a}}}", b) == 0.0 for a, b, _ in SYMBOLIC_TABLE)
    assert grade("math", r"\boxed{x+1}", "x+1") == 1.0
    assert grade("math", r"\boxed{2\frac{1}{2}}", "2.5") == 1.0  # numbers need no sympy


def test_prose_is_not_handed_to_sympy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small model's early answers are prose; graded against a number, or read as a product of a dozen
    letters, they cost sympy ~10 ms each (256 a step) and can never match."""
    pytest.importorskip("sympy")
    from miles.rollout.rm_hub import math_symbolic, math_utils

    prose = "This classic problem involves understanding the sum of 16 and 11 when"
    calls = []
    real = math_symbolic.symbolically_equal
    monkeypatch.setattr(math_utils, "symbolically_equal", lambda a, b: calls.append((a, b)) or real(a, b))
    assert grade("math", prose, "27") == 0.0 and grade("math", "x + 1", "3") == 0.0
    assert calls == []  # a number against anything else is not symbolic work
    assert grade("math", prose, "x+1") == 0.0 and calls  # asked, but refused before parsing:
    sp = math_symbolic._sympy()
    assert math_symbolic._parse(math_utils.normalize_answer(prose), sp) is None
    assert math_symbolic._parse("2ab+3cd-efg", sp) is not None  # seven variables are still an expression
    assert grade("math", r"\boxed{2\sqrt{x}+\pi}", r"\pi+2\sqrt{x}") == 1.0  # known words do not count


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("48/2 = 24 so 24 + 48 = 72\n#### 72", "72", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("#### 72.0", "72", 1.0),
        ("#### 27", "72", 0.0),
        ("so she pays 3 + 4 = 7 dollars", "7", 1.0),  # last-number fallback
        ("so she pays 7 dollars, not 3", "7", 0.0),
        ("no numbers here", "7", 0.0),
    ],
)
def test_gsm8k(response: str, label: str, expected: float) -> None:
    assert grade("gsm8k", response, label) == expected


def test_deepscaler_needs_closed_reasoning_block() -> None:
    assert grade("deepscaler", r"<think>maybe \boxed{3}</think> The answer is \boxed{4}", "4") == 1.0
    assert grade("deepscaler", r"<think>it is \boxed{4}</think> I give up", "4") == 0.0  # only the tail counts
    assert grade("deepscaler", r"<think>unfinished \boxed{4}", "4") == 0.0


def test_f1_and_exact() -> None:
    # pred tokens {paris, france}, gold {paris}: P = 1/2, R = 1 -> F1 = 2/3.
    assert grade("f1", "Paris, France", "the Paris") == pytest.approx(2 / 3)
    assert grade("f1", "The Eiffel tower!", "eiffel Tower") == 1.0
    assert grade("f1", "London", "Paris") == 0.0
    assert grade("exact", "  hello   world ", "hello world") == 1.0
    assert grade("exact", "Hello world", "hello world") == 0.0


def test_boxed_prefix_extracts_first() -> None:
    assert grade("boxed_exact", r"reasoning... \boxed{yes}", "yes") == 1.0
    assert grade("boxed_exact", "yes", "yes") == 0.0  # nothing boxed -> 0
    assert grade("boxed_f1", r"\boxed{New York City}", "new york") == pytest.approx(0.8)


# What chat templates close a turn with; the engines' text keeps it (no stop trim, special tokens kept).
END_MARKERS = [
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end|>",
    "<｜end▁of▁sentence｜>",
    "</s>",
    "<end_of_turn>\n<eos>",
]


@pytest.mark.parametrize("marker", END_MARKERS)
@pytest.mark.parametrize(
    ("rm_type", "response", "label"),
    [
        ("math", "The answer is 23.", "23"),
        ("math", "23", "23"),
        ("math", r"\boxed{23}", "23"),
        ("gsm8k", "so 23", "23"),
        ("exact", "yes", "yes"),
        ("f1", "Paris", "Paris"),
        ("boxed_exact", r"\boxed{yes}", "yes"),
        ("deepscaler", "<think>hm</think> 23", "23"),
    ],
)
def test_a_closed_turn_scores_as_the_answer_alone(rm_type: str, response: str, label: str, marker: str) -> None:
    assert grade(rm_type, response, label) == 1.0
    assert grade(rm_type, response + marker, label) == 1.0
    assert grade(rm_type, response + " " + marker + "\n", label) == 1.0


def test_only_trailing_end_markers_are_stripped() -> None:
    assert strip_end_markers("a<|im_end|>b") == "a<|im_end|>b"  # a marker inside the text stays
    assert strip_end_markers("x = 1 <|eot_id|><|endoftext|>") == "x = 1"  # a run of them goes
    assert strip_end_markers("  23  ") == "  23  "  # nothing to strip: the text is untouched
    assert strip_end_markers("<|im_end|>") == ""
    assert strip_end_markers("a <b>") == "a <b>"  # HTML is not a special token
    assert grade("exact", "no<|im_end|>", "yes") == 0.0


def test_async_rm_grades_an_engine_response_without_its_end_token() -> None:
    args = SimpleNamespace(custom_rm_path=None, rm_type="exact", reward_key=None)
    sample = Sample(index=0, prompt="p", response="yes<|im_end|>", label="yes")
    assert asyncio.run(async_rm(args, sample)) == 1.0


def test_unknown_type_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown rm_type 'mathh'"):
        grade("mathh", "1", "1")
    with pytest.raises(ValueError, match="boxed_nope"):
        grade("boxed_nope", "1", "1")


# ---- async_rm resolution and plug-ins --------------------------------------------------------


def _args(**kw) -> SimpleNamespace:
    base = dict(
        rm_type=None,
        rm_url=None,
        reward_key=None,
        custom_rm_path=None,
        group_rm=False,
        group_reward_path=None,
        rm_concurrency=4,
        rm_timeout_s=2.0,
        rm_max_retries=3,
        rm_retry_backoff_s=0.001,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def sync_length_rm(args, sample):
    return float(len(sample.response))


async def async_const_rm(args, sample):
    return {"acc": 1.0, "len": 0.5}


def rank_group_rm(args, samples):
    """Rank by response length inside the group: longest gets 1.0, shortest 0.0."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
    ranks = [0.0] * len(samples)
    for r, i in enumerate(order):
        ranks[i] = r / max(len(samples) - 1, 1)
    return ranks


async def list_rm(args, samples):
    return [float(i) for i in range(len(samples))]


def test_metadata_rm_type_overrides_flag() -> None:
    s = Sample(response=r"\boxed{4}", label="4", metadata={"rm_type": "exact"})
    assert asyncio.run(async_rm(_args(rm_type="math"), s)) == 0.0  # exact: "\boxed{4}" != "4"
    s.metadata.clear()
    assert asyncio.run(async_rm(_args(rm_type="math"), s)) == 1.0


def test_custom_rm_wins_sync_and_async() -> None:
    s = Sample(response="abc", label="zzz", metadata={"rm_type": "math"})
    assert asyncio.run(async_rm(_args(rm_type="math", custom_rm_path=f"{__name__}:sync_length_rm"), s)) == 3.0
    out = asyncio.run(async_rm(_args(custom_rm_path=f"{__name__}.async_const_rm"), s))
    assert out == {"acc": 1.0, "len": 0.5}


def test_missing_type_and_missing_label_are_errors() -> None:
    with pytest.raises(ValueError, match="no reward type"):
        asyncio.run(async_rm(_args(), Sample(response="1", label="1")))
    with pytest.raises(ValueError, match="needs a label"):
        asyncio.run(async_rm(_args(rm_type="math"), Sample(response="1")))


def test_group_reward_path_sees_each_whole_group() -> None:
    samples = [Sample(response="x" * n, group_index=g) for g, n in [(0, 3), (1, 1), (0, 1), (1, 5), (0, 2)]]
    out = asyncio.run(batched_async_rm(_args(group_reward_path=f"{__name__}:rank_group_rm"), samples))
    # group 0 lengths 3, 1, 2 -> ranks 1.0, 0.0, 0.5; group 1 lengths 1, 5 -> 0.0, 1.0
    assert out == [1.0, 0.0, 0.0, 1.0, 0.5]


def test_group_rm_calls_custom_path_with_list() -> None:
    samples = [Sample(response=str(i)) for i in range(3)]
    assert asyncio.run(batched_async_rm(_args(group_rm=True, custom_rm_path=f"{__name__}:list_rm"), samples)) == [
        0.0,
        1.0,
        2.0,
    ]


# ---- remote reward model against a local aiohttp server --------------------------------------


class _Server:
    """POST /ok scores len(response); /flaky fails its first `fail_first` calls; /down always 503;
    /bad always 400; /mixed fails only responses equal to "fail"; /slow answers after 0.3 s."""

    def __init__(self, fail_first: int = 0) -> None:
        self.fail_first = fail_first
        self.calls: dict[str, int] = {"ok": 0, "flaky": 0, "down": 0, "bad": 0, "mixed": 0, "slow": 0}
        self.in_flight = 0
        self.max_in_flight = 0
        self.payloads: list[dict] = []

    async def ok(self, request: web.Request) -> web.Response:
        self.calls["ok"] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        body = await request.json()
        self.payloads.append(body)
        await asyncio.sleep(0.01)  # overlap requests so the concurrency bound is exercised
        self.in_flight -= 1
        return web.json_response({"score": float(len(body["response"])), "label_seen": body["label"] is not None})

    async def flaky(self, request: web.Request) -> web.Response:
        self.calls["flaky"] += 1
        if self.calls["flaky"] <= self.fail_first:
            return web.Response(status=500, text="boom")
        return web.json_response(1.5)

    async def down(self, request: web.Request) -> web.Response:
        self.calls["down"] += 1
        return web.Response(status=503, text="unavailable")

    async def mixed(self, request: web.Request) -> web.Response:
        self.calls["mixed"] += 1
        body = await request.json()
        if body["response"] == "fail":
            return web.Response(status=502, text="bad gateway")
        return web.json_response(len(body["response"]))

    async def slow(self, request: web.Request) -> web.Response:
        self.calls["slow"] += 1
        await asyncio.sleep(0.3)
        return web.json_response(1.0)

    async def bad(self, request: web.Request) -> web.Response:
        self.calls["bad"] += 1
        return web.Response(status=400, text="missing field")


async def _with_server(server: _Server, body):
    app = web.Application()
    for name in ("ok", "flaky", "down", "bad", "mixed", "slow"):
        app.router.add_post(f"/{name}", getattr(server, name))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await body(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def test_remote_retries_with_exponential_backoff_then_succeeds(caplog) -> None:
    server = _Server(fail_first=2)

    async def body(base):
        args = _args(rm_type="remote_rm", rm_url=f"{base}/flaky", rm_max_retries=3, rm_retry_backoff_s=0.01)
        return await async_rm(args, Sample(response="a"))

    with caplog.at_level(logging.WARNING, logger="miles.rollout.rm_hub.remote"):
        assert asyncio.run(_with_server(server, body)) == 1.5
    assert server.calls["flaky"] == 3
    delays = [m.split("retrying in ")[1] for m in caplog.messages if "retrying in" in m]
    assert delays == ["0.01s", "0.02s"]


def test_remote_timeout_is_retried_then_fails() -> None:
    server = _Server()

    async def body(base):
        args = _args(rm_type="remote_rm", rm_url=f"{base}/slow", rm_max_retries=1, rm_timeout_s=0.05)
        with pytest.raises(RewardFailed, match="after 2 attempts.*Timeout"):
            await async_rm(args, Sample())

    asyncio.run(_with_server(server, body))
    assert server.calls["slow"] == 2


def test_remote_always_failing_raises_after_last_retry() -> None:
    server = _Server()

    async def body(base):
        with pytest.raises(RewardFailed, match="after 3 attempts") as info:
            await async_rm(_args(rm_type="remote_rm", rm_url=f"{base}/down", rm_max_retries=2), Sample(index=7))
        return info.value

    error = asyncio.run(_with_server(server, body))
    assert server.calls["down"] == 3 and error.sample_index == 7 and error.attempts == 3


def test_remote_client_error_is_not_retried() -> None:
    server = _Server()

    async def body(base):
        with pytest.raises(RewardFailed, match="HTTP 400"):
            await async_rm(_args(rm_type="remote_rm", rm_url=f"{base}/bad"), Sample())

    asyncio.run(_with_server(server, body))
    assert server.calls["bad"] == 1


def test_remote_concurrency_bound_and_payload() -> None:
    server = _Server()
    samples = [Sample(prompt=f"p{i}", response="x" * i, label="L", index=i) for i in range(12)]

    async def body(base):
        return await batched_async_rm(_args(rm_type="remote_rm", rm_url=f"{base}/ok", rm_concurrency=3), samples)

    out = asyncio.run(_with_server(server, body))
    assert [o["score"] for o in out] == [float(i) for i in range(12)]
    assert 1 < server.max_in_flight <= 3
    assert sorted(p["prompt"] for p in server.payloads) == sorted(f"p{i}" for i in range(12))
    assert all(set(p) == {"prompt", "response", "label"} for p in server.payloads)


def test_assign_rewards_marks_only_failed_samples() -> None:
    server = _Server()
    samples = [Sample(response="ab", index=0), Sample(response="fail", index=1), Sample(response="abc", index=2)]

    async def body(base):
        return await assign_rewards(_args(rm_type="remote_rm", rm_url=f"{base}/mixed", rm_max_retries=1), samples)

    assert asyncio.run(_with_server(server, body)) == 1
    assert [s.reward for s in samples] == [2.0, None, 3.0]
    assert [s.status for s in samples] == [SampleStatus.PENDING, SampleStatus.FAILED, SampleStatus.PENDING]
    assert "after 2 attempts" in samples[1].metadata["reward_error"]
    assert server.calls["mixed"] == 4  # 1 + 2 attempts + 1
