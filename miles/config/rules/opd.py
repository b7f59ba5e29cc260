"""On-policy distillation: a teacher, named consistently, with settings that take effect."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.fields import FIELDS, flag

if TYPE_CHECKING:
    from miles.config.sections import MilesConfig

DEFAULT_TEACHER = "default"  # the teacher a prompt without a known teacher name goes to


def parse_teacher_urls(entries: list[str]) -> dict[str, str]:
    """`--opd-teacher-urls NAME=URL ...` as {name: base URL}; a trailing /generate (Miles' form) is dropped."""
    urls: dict[str, str] = {}
    for entry in entries:
        name, sep, url = (part.strip() for part in entry.partition("="))
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"--opd-teacher-urls entry {entry!r} is not NAME=URL with an http(s) URL, "
                "e.g. default=http://127.0.0.1:30000"
            )
        if name in urls:
            raise ValueError(f"--opd-teacher-urls names the teacher {name!r} twice; give each name once")
        urls[name] = url.rstrip("/").removesuffix("/generate")
    return urls


_OPD_FLAGS = (
    "opd_type",
    "opd_kl_coef",
    "opd_log_prob_top_k",
    "opd_top_k_strategy",
    "opd_reward_weight_mode",
    "opd_teacher_urls",
    "opd_teacher_key",
    "opd_teacher_load",
)


def check_opd(cfg: MilesConfig) -> list[str]:
    """On-policy distillation: a teacher, named consistently, with settings that take effect."""
    a = cfg.algo
    if not a.use_opd:
        given = [flag(n) for n in _OPD_FLAGS if cfg.get(n) != FIELDS[n].default]
        return (
            [f"{', '.join(given)}: distillation settings without --use-opd take no effect; add --use-opd or drop them"]
            if given
            else []
        )
    e: list[str] = []
    try:
        urls = parse_teacher_urls(a.opd_teacher_urls)
    except ValueError as exc:
        e.append(str(exc))
        urls = {"?": ""}
    r = cfg.rollout
    if r.rollout_function_path and (urls or a.opd_teacher_load):
        e.append(
            "--opd-teacher-urls / --opd-teacher-load score samples in the built-in rollout, which "
            "--rollout-function-path replaces: fill Sample.teacher_log_probs in the rollout function and drop them"
        )
    elif not r.rollout_function_path and not urls and not a.opd_teacher_load:
        e.append(
            "--use-opd needs a teacher: --opd-teacher-urls default=http://HOST:PORT (a served teacher) or "
            "--opd-teacher-load DIR (a checkpoint this run serves)"
        )
    custom_generate = r.custom_generate_function_path or r.custom_agent_function_path
    if a.opd_log_prob_top_k > 0 and custom_generate and a.opd_top_k_strategy != "only-teacher":
        e.append(
            f"--opd-top-k-strategy {a.opd_top_k_strategy} reads the student's top-K log-probs, which the built-in "
            "generate records and a custom generate or agent function does not; use --opd-top-k-strategy "
            "only-teacher, or sampled-token OPD (--opd-log-prob-top-k 0)"
        )
    if a.opd_teacher_load and DEFAULT_TEACHER in urls:
        e.append(
            "--opd-teacher-load is served as the teacher 'default' and --opd-teacher-urls names a 'default' "
            "too; rename the URL's teacher"
        )
    if a.opd_type == "sglang" and a.opd_teacher_load:
        e.append(
            "--opd-type sglang scores with served teachers (--opd-teacher-urls); --opd-teacher-load is "
            "--opd-type megatron's: drop one"
        )
    if a.opd_type == "megatron" and (urls or not a.opd_teacher_load):
        e.append(
            "--opd-type megatron scores with the --opd-teacher-load checkpoint alone: give it, and drop "
            "--opd-teacher-urls"
        )
    if a.opd_log_prob_top_k < 0:
        e.append(f"--opd-log-prob-top-k={a.opd_log_prob_top_k} must be >= 0 (0: the sampled token alone)")
    if a.opd_log_prob_top_k == 0 and (a.opd_top_k_strategy, a.opd_reward_weight_mode) != ("only-student", "student_p"):
        e.append(
            "--opd-top-k-strategy / --opd-reward-weight-mode shape the top-K estimate; add "
            "--opd-log-prob-top-k K (e.g. 16) or drop them"
        )
    if a.loss_type == "sft_loss":
        e.append("--use-opd shapes the policy-gradient advantage, which --loss-type sft_loss has none of; drop one")
    return e
