"""On-policy distillation: the top-K estimate by hand, teacher routing, the flags' checks, the teacher's placement."""

from __future__ import annotations

import math

import pytest

from miles.algo.opd import candidates, topk_reverse_kl
from miles.config import ConfigError, load_config, parse_teacher_urls
from miles.controller.placement import TEACHER_ROLE, plan_placement
from miles.rollout.opd_teacher import teacher_name, unroutable_prompt

L = math.log
# one position: the student's top-2 {1, 2}, the teacher's top-2 {2, 3}; each side's log-probs of the other's
S_TOP = {1: L(0.6), 2: L(0.3)}
T_TOP = {2: L(0.5), 3: L(0.4)}
T_ON_S = {1: L(0.05), 2: L(0.5)}
S_ON_T = {2: L(0.3), 3: L(0.02)}


def kl(strategy: str, mode: str = "student_p") -> float:
    (value,) = topk_reverse_kl([S_TOP], [T_TOP], [T_ON_S], [S_ON_T], strategy, mode)
    return value


def softmax_weights(ps: list[float]) -> list[float]:
    return [p / sum(ps) for p in ps]


def test_candidate_sets():
    assert candidates("only-student", [1, 2], [2, 3]) == [1, 2]
    assert candidates("only-teacher", [1, 2], [2, 3]) == [2, 3]
    assert candidates("intersection", [1, 2], [2, 3]) == [2]
    assert candidates("union", [1, 2], [2, 3]) == [1, 2, 3]
    assert candidates("xor", [1, 2], [2, 3]) == [1, 3]
    with pytest.raises(ValueError, match="opd-top-k-strategy"):
        candidates("both", [1], [1])


def test_only_student_weights_by_the_renormalised_student():
    w = softmax_weights([0.6, 0.3])
    want = w[0] * L(0.6 / 0.05) + w[1] * L(0.3 / 0.5)
    assert kl("only-student") == pytest.approx(want, rel=1e-12)


def test_only_teacher_reads_the_student_on_the_teachers_tokens():
    w = softmax_weights([0.3, 0.02])  # student_p over the teacher's set
    want = w[0] * L(0.3 / 0.5) + w[1] * L(0.02 / 0.4)
    assert kl("only-teacher") == pytest.approx(want, rel=1e-12)
    w = softmax_weights([0.5, 0.4])  # teacher_p
    assert kl("only-teacher", "teacher_p") == pytest.approx(w[0] * L(0.3 / 0.5) + w[1] * L(0.02 / 0.4), rel=1e-12)


def test_intersection_union_and_uniform_weights():
    assert kl("intersection") == pytest.approx(L(0.3 / 0.5), rel=1e-12)  # one token: weight 1
    terms = [L(0.6 / 0.05), L(0.3 / 0.5), L(0.02 / 0.4)]
    assert kl("union", "none") == pytest.approx(sum(terms) / 3, rel=1e-12)
    w = softmax_weights([0.6, 0.3, 0.02])
    assert kl("union") == pytest.approx(sum(a * b for a, b in zip(w, terms, strict=True)), rel=1e-12)


def test_xor_weights_are_not_renormalised():
    want = 0.6 * L(0.6 / 0.05) + 0.02 * L(0.02 / 0.4)  # the raw student probabilities of {1, 3}
    assert kl("xor") == pytest.approx(want, rel=1e-12)


def test_empty_set_and_missing_log_probs():
    assert topk_reverse_kl([{1: -1.0}], [{2: -1.0}], [{}], [{}], "intersection") == [0.0]
    with pytest.raises(ValueError, match="no teacher log-prob for candidate token 1 at response position 0"):
        topk_reverse_kl([{1: -1.0}], [{}], [{}], [{}], "only-student")
    with pytest.raises(ValueError, match="different lengths"):
        topk_reverse_kl([{}, {}], [{}], [{}], [{}], "only-student")


def test_teacher_urls_parse_and_route():
    urls = parse_teacher_urls(["math=http://h1:1/generate", "default=https://h2:2/"])
    assert urls == {"math": "http://h1:1", "default": "https://h2:2"}
    for bad in (["math"], ["=http://h"], ["m=ftp://h"]):
        with pytest.raises(ValueError, match="NAME=URL"):
            parse_teacher_urls(bad)
    with pytest.raises(ValueError, match="twice"):
        parse_teacher_urls(["a=http://x", "a=http://y"])
    names = ["math", "default"]
    assert teacher_name({"opd_teacher": "math"}, names, "opd_teacher") == "math"
    assert teacher_name({"opd_teacher": "code"}, names, "opd_teacher") == "default"
    assert teacher_name({}, names, "opd_teacher") == "default"
    assert teacher_name({"opd_teacher": "code"}, ["math"], "opd_teacher") is None
    assert unroutable_prompt([{"opd_teacher": "math"}], ["math"], "opd_teacher") is None
    error = unroutable_prompt([{"opd_teacher": "math"}, {"opd_teacher": "code"}], ["math"], "opd_teacher")
    assert error.startswith("prompt row 2 names the teacher 'code'") and "default" in error


BASE = "--hf-checkpoint /m --prompt-data /p.jsonl --rm-type math --num-rollout 2 --rollout-batch-size 4".split()


def errors_of(*argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config([*BASE, *argv])
    return str(info.value)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--use-opd"], "--use-opd needs a teacher"),
        (["--opd-teacher-urls", "default=http://h:1"], "without --use-opd take no effect"),
        (["--use-opd", "--opd-teacher-urls", "oops"], "is not NAME=URL"),
        (["--use-opd", "--opd-teacher-load", "/t", "--opd-teacher-urls", "default=http://h:1"], "rename the URL's"),
        (["--use-opd", "--opd-type", "sglang", "--opd-teacher-load", "/t"], "--opd-type megatron's"),
        (["--use-opd", "--opd-type", "megatron", "--opd-teacher-urls", "a=http://h:1"], "alone"),
        (["--use-opd", "--opd-teacher-load", "/t", "--opd-top-k-strategy", "union"], "add --opd-log-prob-top-k"),
        (["--use-opd", "--opd-teacher-load", "/t", "--opd-top-k-strategy", "unoin"], "did you mean 'union'"),
        (["--use-opd", "--opd-teacher-load", "/t", "--opd-log-prob-top-k", "-1"], "must be >= 0"),
        (["--use-opd", "--opd-teacher-load", "/t", "--loss-type", "sft_loss"], "sft_loss"),
        (["--use-opd", "--opd-teacher-load", "/t", "--rollout-function-path", "m.f"], "fill Sample.teacher_log_probs"),
        (
            [
                "--use-opd",
                "--opd-teacher-load",
                "/t",
                "--opd-log-prob-top-k",
                "4",
                "--custom-generate-function-path",
                "m.g",
            ],
            "a custom generate or agent function does not",
        ),
    ],
)
def test_opd_flags_are_checked(argv, needle):
    assert needle in errors_of(*argv)


def test_a_rollout_function_may_fill_the_teacher_log_probs_itself():
    cfg = load_config([*BASE, "--use-opd", "--rollout-function-path", "m.f"])
    assert cfg.algo.use_opd and not cfg.algo.opd_teacher_urls


def test_a_complete_opd_config_loads():
    cfg = load_config(
        [
            *BASE,
            "--use-opd",
            "--opd-teacher-urls",
            "math=http://h:1",
            "default=http://h:2",
            "--opd-log-prob-top-k",
            "8",
            "--opd-top-k-strategy",
            "union",
        ]
    )
    assert cfg.algo.opd_teacher_urls == ["math=http://h:1", "default=http://h:2"]


def test_the_teacher_engine_is_planned_once_and_takes_a_free_gpu_else_shares_engine_0():
    cfg = load_config([*BASE, "--use-opd", "--opd-teacher-load", "/teacher"])
    cpu = plan_placement(cfg, device="cpu", master_port=29500)
    (teacher,) = cpu.teacher_specs
    assert teacher.role == TEACHER_ROLE and teacher.init_kwargs["model_path"] == "/teacher"
    assert teacher in cpu.specs and not teacher.init_kwargs["true_on_policy"]
    free = plan_placement(cfg, device="cuda", num_nodes=1, gpus_per_node=3, master_port=29500)
    assert [(w["role"], w["gpus"]) for w in free.summary()["workers"]] == [
        ("trainer", [0]),
        ("rollout", [1]),
        (TEACHER_ROLE, [2]),
    ]
    full = plan_placement(cfg, device="cuda", num_nodes=1, gpus_per_node=2, master_port=29500)
    assert [(w["role"], w["gpus"]) for w in full.summary()["workers"]][-1] == (TEACHER_ROLE, [1])
    urls_only = load_config([*BASE, "--use-opd", "--opd-teacher-urls", "default=http://h:1"])
    assert plan_placement(urls_only, device="cpu", master_port=29500).teacher_specs == []
