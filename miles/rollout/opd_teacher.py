"""On-policy distillation: the teacher scores each finished sample by prefill, over the SGLang protocol.

A teacher is anything that answers SGLang's `/generate`: an SGLang server, `miles engine serve`, or
the engine this run starts for `--opd-teacher-load`. Each sample goes to one teacher, named by its
prompt's `metadata[--opd-teacher-key]`; a missing or unknown name goes to the teacher `default`
(a prompt no teacher can take is refused at start-up, see `unroutable_prompt`). Scoring is one
prefill of the student's own tokens (`max_new_tokens` 0, `return_logprob`, `logprob_start_len` just
before the response), at the rollout temperature, the distribution the student's log-probs are taken
at, so every teacher must share the student's tokenizer.

Sampled-token OPD stores the teacher's log-prob of every response token (`Sample.teacher_log_probs`);
the trainer subtracts `--opd-kl-coef` x (student − teacher) from the advantage. Top-K OPD
(`--opd-log-prob-top-k K`) also asks the teacher for its top-K tokens and/or its log-probs of the
student's top-K (recorded while sampling, `STUDENT_TOP_KEY`), asks the student's engines for their
log-probs of the teacher's top-K when the strategy needs them, and stores the estimate of
`miles.algo.opd.topk_reverse_kl` per token (`Sample.opd_reverse_kl`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any, Protocol

from miles.algo.opd import (
    NEEDS_STUDENT_ON_TEACHER,
    NEEDS_STUDENT_TOP,
    NEEDS_TEACHER_ON_STUDENT,
    NEEDS_TEACHER_TOP,
    LogProbs,
    topk_reverse_kl,
)
from miles.config import DEFAULT_TEACHER
from miles.rollout.generate import STUDENT_TOP_KEY
from miles.rollout.sample import Sample


class Scorer(Protocol):
    async def generate(self, payload: dict) -> Any: ...


class TeacherRoutingError(ValueError):
    """A sample names no known teacher and there is no `default` one: the run's data and flags disagree."""


def teacher_name(metadata: dict | None, names: Iterable[str], key: str) -> str | None:
    """The teacher a prompt's samples go to: its metadata[key] when known, else 'default' (None: none)."""
    names = set(names)
    name = (metadata or {}).get(key)
    if name is not None and str(name) in names:
        return str(name)
    return DEFAULT_TEACHER if DEFAULT_TEACHER in names else None


def unroutable_prompt(metadatas: Iterable[dict | None], names: Iterable[str], key: str) -> str | None:
    """Why some prompt has no teacher (the first such one), or None when every prompt routes."""
    names = sorted(names)
    for i, metadata in enumerate(metadatas):
        if teacher_name(metadata, names, key) is None:
            given = (metadata or {}).get(key)
            what = f"names the teacher {given!r}" if given is not None else f"has no metadata[{key!r}]"
            return (
                f"prompt row {i + 1} {what}, but the teachers are {names} and none is 'default'; add "
                f"default=URL to --opd-teacher-urls, or name one of {names} in every row's metadata"
            )
    return None


def _last(meta: dict, field: str, n: int) -> list:
    values = meta.get(field)
    if values is None or len(values) < n:
        got = "none" if values is None else len(values)
        raise ValueError(f"the teacher's reply has {got} meta_info.{field} entries for {n} response tokens")
    return values[len(values) - n :] if n else []


def _maps(positions: list) -> list[LogProbs]:
    return [{int(e[1]): float(e[0]) for e in (pos or []) if e is not None} for pos in positions]


def _ids_of(maps: list[LogProbs]) -> list[int]:
    return sorted({t for m in maps for t in m})


class TeacherScorer:
    """Scores samples with the teachers (name -> SGLang client); `student` answers the student's top-K queries."""

    def __init__(
        self,
        teachers: dict[str, Scorer],
        *,
        key: str,
        temperature: float,
        top_k: int = 0,
        strategy: str = "only-student",
        weight_mode: str = "student_p",
        student: Scorer | None = None,
    ) -> None:
        if not teachers:
            raise ValueError("TeacherScorer needs at least one teacher")
        self.teachers, self.key, self.temperature = teachers, key, temperature
        self.top_k, self.strategy, self.weight_mode = top_k, strategy, weight_mode
        self.student = student
        if top_k and strategy in NEEDS_STUDENT_ON_TEACHER and student is None:
            raise ValueError(
                f"--opd-top-k-strategy {strategy} needs the student's engines to score the teacher's top-K"
            )
        self.time_s = 0.0
        self.counts: Counter[str] = Counter()
        self._kl_sum, self._kl_tokens = 0.0, 0

    @property
    def student_top_k(self) -> int:
        """Top-K log-probs the student's engines must record with every sampled token (0: none)."""
        return self.top_k if self.top_k and self.strategy in NEEDS_STUDENT_TOP else 0

    def route(self, sample: Sample) -> str:
        name = teacher_name(sample.metadata, self.teachers, self.key)
        if name is None:
            raise TeacherRoutingError(unroutable_prompt([sample.metadata], self.teachers, self.key))
        return name

    def _payload(self, sample: Sample, top_k: int = 0, token_ids: list[int] | None = None) -> dict:
        payload = {
            "input_ids": list(sample.tokens),
            "sampling_params": {"temperature": self.temperature, "max_new_tokens": 0, "skip_special_tokens": False},
            "return_logprob": True,
            "logprob_start_len": max(sample.prompt_length - 1, 0),  # the response's log-probs are the last ones
        }
        if top_k:
            payload["top_logprobs_num"] = top_k
        if token_ids:
            payload["token_ids_logprob"] = token_ids
        return payload

    async def score(self, sample: Sample) -> None:
        """Fill `sample.teacher_log_probs` (and, top-K, `sample.opd_reverse_kl`) from its teacher."""
        start = time.perf_counter()
        name = self.route(sample)
        n = sample.response_length
        student_top = self._student_top(sample) if self.top_k and self.strategy in NEEDS_STUDENT_TOP else None
        wants_on_student = self.top_k and self.strategy in NEEDS_TEACHER_ON_STUDENT
        out = await self.teachers[name].generate(
            self._payload(
                sample,
                top_k=self.top_k if self.top_k and self.strategy in NEEDS_TEACHER_TOP else 0,
                token_ids=_ids_of(student_top) if wants_on_student else None,
            )
        )
        meta = out["meta_info"]
        entries = _last(meta, "input_token_logprobs", n)
        response = sample.tokens[sample.prompt_length :]
        if [int(e[1]) for e in entries] != list(response):
            raise ValueError(f"the teacher {name!r} scored other tokens than sample {sample.index}'s response")
        sample.teacher_log_probs = [float(e[0]) for e in entries]
        if self.top_k:
            sample.opd_reverse_kl = await self._topk(sample, meta, student_top)
        self._account(name, sample, time.perf_counter() - start)

    def _student_top(self, sample: Sample) -> list[LogProbs]:
        tops = sample.metadata.get(STUDENT_TOP_KEY)
        if tops is None or len(tops) != sample.response_length:
            got = "none" if tops is None else len(tops)
            raise ValueError(
                f"top-K OPD: sample {sample.index} has {got} recorded student top-K positions for "
                f"{sample.response_length} response tokens (the engine must return output_top_logprobs)"
            )
        return _maps(tops)

    async def _topk(self, sample: Sample, meta: dict, student_top: list[LogProbs] | None) -> list[float]:
        n, s = sample.response_length, self.strategy
        empty: list[LogProbs] = [{} for _ in range(n)]
        teacher_top = _maps(_last(meta, "input_top_logprobs", n)) if s in NEEDS_TEACHER_TOP else empty
        on_student = _maps(_last(meta, "input_token_ids_logprobs", n)) if s in NEEDS_TEACHER_ON_STUDENT else empty
        on_teacher = empty
        if s in NEEDS_STUDENT_ON_TEACHER:
            reply = await self.student.generate(self._payload(sample, token_ids=_ids_of(teacher_top)))
            on_teacher = _maps(_last(reply["meta_info"], "input_token_ids_logprobs", n))
        return topk_reverse_kl(student_top or empty, teacher_top, on_student, on_teacher, s, self.weight_mode)

    def _account(self, name: str, sample: Sample, seconds: float) -> None:
        self.time_s += seconds
        self.counts[name] += 1
        if sample.opd_reverse_kl is not None:
            kl = sample.opd_reverse_kl
        else:
            kl = [s - t for s, t in zip(sample.rollout_log_probs or [], sample.teacher_log_probs, strict=False)]
        self._kl_sum += sum(kl)
        self._kl_tokens += len(kl)

    def pop_metrics(self) -> dict[str, float]:
        """Since the last call: the rollout-side reverse-KL estimate, samples per teacher, scoring time summed."""
        m = {"perf/rollout/teacher_time_sum": self.time_s}
        if self._kl_tokens:
            m["rollout/opd_reverse_kl"] = self._kl_sum / self._kl_tokens
        m.update({f"rollout/opd_teacher_samples/{name}": float(c) for name, c in self.counts.items()})
        self.time_s, self._kl_sum, self._kl_tokens = 0.0, 0.0, 0
        self.counts.clear()
        return m
