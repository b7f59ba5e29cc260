"""Evaluation under fully async training, in three modes (`--eval-mode`).

- `shared`: the rollout fleet evaluates the weights it holds; new generation pauses while it
  runs (in-flight trajectories finish). Scores arrive at once (delay 0).
- `dedicated`: `--eval-num-engines` extra engines (role `eval_rollout`, never part of weight
  updates; `miles.controller.placement` plans them, on GPUs after the rollout engines') load an
  HF snapshot exported by the trainer; every engine must report the snapshot's version before
  the eval starts, so no score mixes two versions. Runs in the background.
- `external`: `--eval-external-command` (a template with `{checkpoint_dir}` and `{step}`) runs
  on the snapshot in a subprocess and prints a JSON object of scores on its last stdout line.

Every score is logged at the step it finishes with `eval/<name>/weight_version` (the weights it
measured) and `eval/<name>/delay_steps`, and appended to `<run_dir>/eval_results.jsonl`. A
failure (export, version check, backend error, or more than `--eval-max-in-flight` evals
outstanding) is logged and marked `eval/<name>/skipped`; training goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass

from miles.config import MilesConfig
from miles.controller.eval import Evaluator, Pausable
from miles.controller.router import Router
from miles.controller.run import MilesRun

logger = logging.getLogger(__name__)

EXTERNAL_NAME = "external"
MODES = ("shared", "dedicated", "external")


@dataclass(slots=True)
class _Pending:
    step: int  # the step whose weights are measured
    weight_version: int
    names: list[str]
    task: asyncio.Task


class AsyncEval:
    """Owns eval for the async loop; every background eval task is awaited or cancelled in `close`."""

    def __init__(self, cfg: MilesConfig, run: MilesRun, producer: Pausable | None) -> None:
        e = cfg.eval
        if e.eval_mode not in MODES:
            raise ValueError(f"--eval-mode={e.eval_mode!r}; choose one of {', '.join(MODES)}")
        if e.eval_mode == "dedicated" and e.eval_interval and e.eval_prompt_data and not run.eval_fleet:
            raise ValueError("--eval-mode=dedicated needs --eval-num-engines >= 1 (engines reserved for eval)")
        if e.eval_mode == "external" and e.eval_interval and not e.eval_external_command:
            raise ValueError(
                "--eval-mode=external needs --eval-external-command, e.g. "
                "'python my_eval.py --ckpt {checkpoint_dir} --step {step}'"
            )
        self.cfg = cfg
        self.mode = e.eval_mode
        self.run = run
        self.producer = producer
        self.evaluator = Evaluator(cfg, run)
        self.max_in_flight = max(1, e.eval_max_in_flight)
        self._pending: list[_Pending] = []
        self._ready: dict[str, float] = {}
        self._fleet_lock = asyncio.Lock()  # one snapshot on the dedicated fleet at a time
        self._router = Router(run.eval_fleet.engines) if run.eval_fleet else None
        self._results_path = os.path.join(cfg.runtime.output_dir, "eval_results.jsonl")

    # ---- the loop's calls ----------------------------------------------------------------
    def _names(self) -> list[str]:
        if self.mode == "external":
            return [EXTERNAL_NAME]
        return [name for name, _ in self.evaluator.datasets]

    def due(self, step: int, *, before_train: bool = False) -> bool:
        e = self.cfg.eval
        if not e.eval_interval or not self._names():
            return False
        if before_train:
            return not e.skip_eval_before_train
        return step % e.eval_interval == 0 or step == self.cfg.rollout.num_rollout

    async def before_train(self, step: int) -> None:
        if self.mode == "shared":
            await self.evaluator.maybe_eval(step, before_train=True, pause=self.producer)
        elif self.due(step, before_train=True):
            await self._submit(step)

    async def after_push(self, step: int, *, last: bool = False) -> dict[str, float]:
        """Eval the weights just pushed (`step` = their version) when due; the scores that finished."""
        if self.mode == "shared":
            out = await self.evaluator.maybe_eval(step, pause=self.producer)
            for name in self._names():
                if f"eval/{name}/reward_mean" in out:
                    out[f"eval/{name}/delay_steps"] = 0.0
                    self._record(name, step, step, self.run.weight_version, out)
            return out
        if self.due(step):
            await self._submit(step)
        if last:  # the run ends here: wait for what is outstanding so no score is lost
            await asyncio.gather(*(p.task for p in self._pending), return_exceptions=True)
        return self._collect(step, last=last)

    async def close(self) -> None:
        for p in self._pending:
            p.task.cancel()
        await asyncio.gather(*(p.task for p in self._pending), return_exceptions=True)
        self._pending.clear()

    # ---- snapshot modes -----------------------------------------------------------------
    async def _submit(self, step: int) -> None:
        outstanding = [p for p in self._pending if not p.task.done()]
        if len(outstanding) >= self.max_in_flight:
            self._skip(step, f"{len(outstanding)} evals outstanding (--eval-max-in-flight={self.max_in_flight})")
            return
        version = self.run.weight_version
        snapshot = os.path.join(self.cfg.runtime.output_dir, "eval_snapshots", f"step_{step:07d}")
        try:  # collective over the trainer ranks: the trainer waits for the export
            await self.run.timed("eval_export_time", self.run.trainers.export_hf(snapshot))
        except Exception as e:  # noqa: BLE001 - eval never stops training
            self._skip(step, f"snapshot export to {snapshot} failed: {e}")
            return
        task = asyncio.create_task(self._snapshot_eval(snapshot, version, step), name=f"miles-eval-step-{step}")
        self._pending.append(_Pending(step, version, self._names(), task))
        logger.info("eval of step %d (weight version %d) started in the background (%s)", step, version, self.mode)

    async def _snapshot_eval(self, snapshot: str, version: int, step: int) -> dict[str, float]:
        try:
            if self.mode == "dedicated":
                return await self._eval_dedicated(snapshot, version)
            return await self._eval_external(snapshot, step)
        finally:
            shutil.rmtree(snapshot, ignore_errors=True)

    async def _eval_dedicated(self, snapshot: str, version: int) -> dict[str, float]:
        fleet = self.run.eval_fleet
        async with self._fleet_lock:
            await fleet.update_weights_from_disk(snapshot, version)
            held = await fleet.weight_versions()
            if any(v != version for v in held):
                raise RuntimeError(
                    f"eval engines hold weight versions {held}, expected {version} on every one; "
                    "not evaluating a mix of versions"
                )
            out: dict[str, float] = {}
            for name, path in self.evaluator.datasets:
                out.update(await self.evaluator.evaluate(name, path, router=self._router, version=version))
            return out

    async def _eval_external(self, snapshot: str, step: int) -> dict[str, float]:
        # literal substitution: a shell command may hold other braces (JSON, ${VAR})
        command = self.cfg.eval.eval_external_command.replace("{checkpoint_dir}", snapshot).replace(
            "{step}", str(step)
        )
        proc = await asyncio.create_subprocess_shell(
            command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        try:
            stdout, stderr = await proc.communicate()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            tail = stderr.decode(errors="replace").strip()[-500:]
            raise RuntimeError(f"external eval {command!r} exited with {proc.returncode}: {tail}")
        return parse_external_scores(stdout.decode(errors="replace"), command)

    # ---- results ----------------------------------------------------------------------------
    def _collect(self, step: int, *, last: bool = False) -> dict[str, float]:
        """Scores of the evals that finished, for this step's metrics row. A row holds one score per eval
        set: when two evals of one set finished together, the later waits for the next row; at the last
        step the newest is the row's and the others are in eval_results.jsonl only (with a warning)."""
        out, self._ready = self._ready, {}
        still: list[_Pending] = []
        taken: dict[str, int] = {}  # eval set -> the step whose score this row holds
        for p in sorted(self._pending, key=lambda q: q.step):
            if not p.task.done():
                still.append(p)
                continue
            if not last and taken.keys() & set(p.names):
                still.append(p)  # this row already holds an earlier score of the same set
                continue
            if p.task.cancelled() or p.task.exception() is not None:
                reason = "cancelled" if p.task.cancelled() else repr(p.task.exception())
                logger.warning("eval of step %d skipped: %s", p.step, reason)
                out.update({f"eval/{name}/skipped": 1.0 for name in p.names})
                continue
            scores = p.task.result()
            for name in {k.split("/")[1] for k in scores}:
                scores[f"eval/{name}/weight_version"] = float(p.weight_version)
                scores[f"eval/{name}/delay_steps"] = float(step - p.step)
                self._record(name, p.step, step, p.weight_version, scores)
                if name in taken:
                    logger.warning(
                        "evals of steps %d and %d of %r both finished at the last step; the metrics row "
                        "keeps step %d's, both are in %s",
                        taken[name],
                        p.step,
                        name,
                        p.step,
                        self._results_path,
                    )
                taken[name] = p.step
            out.update(scores)
        self._pending = still
        return out

    def _skip(self, step: int, reason: str) -> None:
        logger.warning("eval of step %d skipped: %s", step, reason)
        self._ready.update({f"eval/{name}/skipped": 1.0 for name in self._names()})

    def _record(
        self, name: str, measured_step: int, finished_step: int, version: int, scores: dict[str, float]
    ) -> None:
        prefix = f"eval/{name}/"
        row = {
            "name": name,
            "measured_step": measured_step,
            "finished_step": finished_step,
            "weight_version": version,
            "time": time.time(),
            "scores": {k[len(prefix) :]: v for k, v in scores.items() if k.startswith(prefix)},
        }
        with open(self._results_path, "a") as f:
            f.write(json.dumps(row) + "\n")


def parse_external_scores(stdout: str, command: str) -> dict[str, float]:
    """The JSON object on the last non-empty stdout line -> `eval/external/<key>` (or `eval/<key>/<sub>`)."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"external eval {command!r} printed nothing; it must print a JSON object of scores last")
    try:
        scores = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise ValueError(
            f"external eval {command!r}: last stdout line is not JSON ({e.msg}): {lines[-1][:200]!r}"
        ) from e
    if not isinstance(scores, dict):
        raise ValueError(f"external eval {command!r}: last line must be a JSON object, got {type(scores).__name__}")
    out: dict[str, float] = {}
    for key, value in scores.items():
        if isinstance(value, dict):
            out.update({f"eval/{key}/{k}": float(v) for k, v in value.items()})
        else:
            out[f"eval/{EXTERNAL_NAME}/{key}"] = float(value)
    return out
