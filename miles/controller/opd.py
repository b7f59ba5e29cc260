"""Start-up of on-policy distillation and of true-on-policy mode: their checks and the teacher's clients.

`check_modes_before_start` refuses, before any worker starts, what `miles.config.checks` could not see
without reading files: a teacher checkpoint that is missing or has another tokenizer than the
student, prompts whose metadata names no teacher, and a model true-on-policy mode cannot cover.
`start_teacher` builds the `TeacherScorer` over the served teachers (`--opd-teacher-urls`) and the
engine this run started for `--opd-teacher-load`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from miles.config import DEFAULT_TEACHER, parse_teacher_urls
from miles.controller.placement import TEACHER_ROLE
from miles.controller.preflight import PreflightError
from miles.controller.router import Router, engine_clients
from miles.engines.client import EngineClient
from miles.rollout.opd_teacher import TeacherScorer, unroutable_prompt

logger = logging.getLogger(__name__)


def teacher_names(cfg) -> list[str]:
    names = list(parse_teacher_urls(cfg.algo.opd_teacher_urls))
    return names + ([DEFAULT_TEACHER] if cfg.algo.opd_teacher_load else [])


def check_modes_before_start(cfg, tokenizer: Any, prompts: Any) -> None:
    """PreflightError naming the problem and its fix; nothing when OPD and true-on-policy mode are off."""
    if cfg.train.true_on_policy_mode:
        from miles.engines.embedded.reference import coverage_error

        error = coverage_error(cfg.model.hf_checkpoint)
        if error:
            raise PreflightError(error)
    if not cfg.algo.use_opd:
        return
    if cfg.algo.opd_teacher_load:
        _check_teacher_dir(cfg.algo.opd_teacher_load, tokenizer)
    rows = getattr(prompts, "rows", None)  # a custom data source's prompts are routed as they come
    if rows is not None:
        error = unroutable_prompt((r.metadata for r in rows), teacher_names(cfg), cfg.algo.opd_teacher_key)
        if error:
            raise PreflightError(f"--use-opd: {error}")


def _check_teacher_dir(path: str, tokenizer: Any) -> None:
    from transformers import AutoTokenizer

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise PreflightError(
            f"--opd-teacher-load {path!r} is not a HF model directory (no config.json); "
            "pass the teacher checkpoint's directory"
        )
    teacher = AutoTokenizer.from_pretrained(path)
    if teacher.get_vocab() != tokenizer.get_vocab():
        raise PreflightError(
            f"--opd-teacher-load {path!r} has another tokenizer than --hf-checkpoint; the teacher "
            "scores the student's token ids, so both must share one tokenizer"
        )


async def start_teacher(cfg, runtime: Any, router: Router | None) -> TeacherScorer | None:
    """The teachers' clients (served URLs, then this run's teacher engine as 'default') in a scorer."""
    a = cfg.algo
    if not a.use_opd or router is None:
        return None
    teachers: dict[str, EngineClient] = {
        name: EngineClient(url, api_key=cfg.engine.api_key, name=f"teacher {name}")
        for name, url in parse_teacher_urls(a.opd_teacher_urls).items()
    }
    if a.opd_teacher_load:
        (served,) = await engine_clients(runtime, TEACHER_ROLE, api_key=cfg.engine.api_key)
        teachers[DEFAULT_TEACHER] = served
    logger.info("on-policy distillation from %s", {name: c.base_url for name, c in teachers.items()})
    return TeacherScorer(
        teachers,
        key=a.opd_teacher_key,
        temperature=cfg.rollout.rollout_temperature,
        top_k=a.opd_log_prob_top_k,
        strategy=a.opd_top_k_strategy,
        weight_mode=a.opd_reward_weight_mode,
        student=router,
    )
