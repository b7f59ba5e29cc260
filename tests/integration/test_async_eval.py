"""Async eval: a dedicated engine fleet on HF snapshots, an external backend (one call fails on
purpose), the version check of the dedicated fleet and the in-flight limit. The shared mode runs in
test_async_loop.py (pace run)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_async_loop import base_args, read_metrics, write_prompts  # same folder (rootdir on sys.path)

from miles.config import load_config
from miles.controller import loop_async
from miles.controller.async_eval import AsyncEval, parse_external_scores
from miles.controller.router import EngineFleet
from miles.models.resolve import resolve_model_paths

NUM_STEPS = 4


def _run(monkeypatch, args: list[str]) -> tuple[Path, list[dict]]:
    monkeypatch.setenv("MILES_TORCH_THREADS", "1")
    cfg = load_config(args)
    resolve_model_paths(cfg.model, seed=cfg.train.seed)  # as `miles train` does
    run_dir = Path(asyncio.run(loop_async.train(cfg)))
    return run_dir, read_metrics(run_dir)


def _results(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "eval_results.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_dedicated_fleet_evaluates_exported_snapshots(tmp_path, monkeypatch) -> None:
    evals = write_prompts(tmp_path / "eval.jsonl", 6)
    run_dir, rows = _run(
        monkeypatch,
        base_args(tmp_path, num_rollout=NUM_STEPS)
        + [
            "--eval-mode",
            "dedicated",
            "--eval-num-engines",
            "1",
            "--eval-interval",
            "2",
            "--eval-prompt-data",
            "digits",
            str(evals),
            "--skip-eval-before-train",
        ],
    )
    assert [r["step"] for r in rows] == list(range(NUM_STEPS))
    scored = [r for r in rows if "eval/digits/reward_mean" in r]
    measured = sorted(r["step"] + 1 - r["eval/digits/delay_steps"] for r in scored)
    # both evals arrived (the last one is awaited at the end); a row holds one score of a set, so when the
    # step-2 eval is slow enough to finish with the last one, the last row shows step 4's only
    assert measured in ([2, 4], [4]), measured
    for r in scored:
        assert r["eval/digits/num_samples"] == 6
        assert r["eval/digits/mixed_version_frac"] == 0  # every token from the snapshot's version
        assert r["eval/digits/weight_version"] == r["step"] + 1 - r["eval/digits/delay_steps"]
    assert sorted(x["measured_step"] for x in _results(run_dir)) == [2, 4]
    assert not any(k.endswith("/skipped") for r in rows for k in r)
    assert not list((run_dir / "eval_snapshots").glob("step_*"))  # snapshots removed after use


EXTERNAL = (
    f'{sys.executable} -c "import json, os, sys; d, s = sys.argv[1], int(sys.argv[2]); '
    "sys.exit(3) if s == 2 else print('log line'); "
    "print(json.dumps({'score': s, 'has_config': float(os.path.exists(os.path.join(d, 'config.json')))}))\" "
    "{checkpoint_dir} {step}"
)


@pytest.mark.slow
def test_external_backend_failure_is_skipped_and_training_continues(tmp_path, monkeypatch) -> None:
    run_dir, rows = _run(
        monkeypatch,
        base_args(tmp_path, num_rollout=NUM_STEPS)
        + [
            "--eval-mode",
            "external",
            "--eval-external-command",
            EXTERNAL,
            "--eval-interval",
            "2",
            "--skip-eval-before-train",
        ],
    )
    assert [r["step"] for r in rows] == list(range(NUM_STEPS))  # the failing backend did not stop training
    assert sum(r.get("eval/external/skipped", 0) for r in rows) == 1  # the step-2 eval (exit code 3)
    scored = [r for r in rows if "eval/external/score" in r]
    assert len(scored) == 1
    r = scored[0]
    assert r["eval/external/score"] == 4 and r["eval/external/weight_version"] == 4
    assert r["eval/external/has_config"] == 1.0  # the backend saw an HF directory
    assert r["eval/external/delay_steps"] == r["step"] + 1 - 4


# ---- without processes: fleet version check and the in-flight limit -------------------------------------------


class FakeEngine:
    def __init__(self, reports: int | None = None) -> None:
        self.reports = reports
        self.version = 0

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        self.version = int(weight_version)

    async def get_weight_version(self) -> int:
        return self.version if self.reports is None else self.reports


def _fake(tmp: Path, *, mode: str, engines=(), command: str | None = None, max_in_flight: int = 2):
    cfg = SimpleNamespace(
        eval=SimpleNamespace(
            eval_mode=mode,
            eval_interval=1,
            eval_prompt_data=["d", "unused.jsonl"],
            eval_external_command=command,
            eval_max_in_flight=max_in_flight,
            skip_eval_before_train=True,
            eval_temperature=None,
            eval_top_p=None,
            eval_top_k=None,
            eval_max_response_len=None,
            n_samples_per_eval_prompt=1,
        ),
        rollout=SimpleNamespace(
            num_rollout=10,
            rollout_temperature=1.0,
            rollout_top_p=1.0,
            rollout_top_k=-1,
            rollout_min_p=0.0,
            rollout_max_response_len=4,
            rollout_max_context_len=None,
            rollout_stop=None,
            rollout_stop_token_ids=None,
            rollout_skip_special_tokens=False,
        ),
        runtime=SimpleNamespace(output_dir=str(tmp), rpc_timeout_s=10),
    )

    async def export_hf(path):
        os.makedirs(path, exist_ok=True)

    async def wait(name, aw):
        return await aw

    run = SimpleNamespace(
        eval_fleet=EngineFleet(list(engines)),
        weight_version=7,
        trainers=SimpleNamespace(export_hf=export_hf),
        timed=wait,
    )
    return AsyncEval(cfg, run, producer=None)


def test_dedicated_fleet_refuses_an_engine_on_another_version(tmp_path) -> None:
    async def main():
        ev = _fake(tmp_path, mode="dedicated", engines=[FakeEngine(), FakeEngine(reports=6)])
        with pytest.raises(RuntimeError, match=r"hold weight versions \[7, 6\], expected 7"):
            await ev._eval_dedicated(str(tmp_path), 7)

    asyncio.run(main())


def test_too_many_outstanding_evals_are_skipped_and_logged(tmp_path, caplog) -> None:
    async def main():
        ev = _fake(tmp_path, mode="external", command="sleep 30", max_in_flight=1)
        await ev._submit(1)
        await ev._submit(2)  # the first is still running
        out = ev._collect(2)
        assert out == {"eval/external/skipped": 1.0}
        await ev.close()  # cancels the outstanding eval and kills its process
        assert all(p.task.done() for p in ev._pending) or not ev._pending

    asyncio.run(main())
    assert "evals outstanding" in caplog.text


def test_two_evals_finishing_together_take_one_row_each(tmp_path) -> None:
    """Two finished evals of one set: the earlier goes into this row, the later waits for the next (it
    would overwrite the earlier's keys); at the last step the later is the row's, both are recorded."""
    from miles.controller.async_eval import _Pending

    async def main():
        ev = _fake(tmp_path, mode="external", command="true")

        async def scores(value: float) -> dict[str, float]:
            return {"eval/external/score": value}

        ev._pending = [
            _Pending(4, 4, ["external"], asyncio.create_task(scores(4.0))),
            _Pending(2, 2, ["external"], asyncio.create_task(scores(2.0))),
        ]
        await asyncio.sleep(0)
        first = ev._collect(5)
        assert first["eval/external/score"] == 2.0 and first["eval/external/delay_steps"] == 3
        second = ev._collect(6)
        assert second["eval/external/score"] == 4.0 and second["eval/external/delay_steps"] == 2
        ev._pending = [
            _Pending(8, 8, ["external"], asyncio.create_task(scores(8.0))),
            _Pending(6, 6, ["external"], asyncio.create_task(scores(6.0))),
        ]
        await asyncio.sleep(0)
        assert ev._collect(9, last=True)["eval/external/score"] == 8.0
        assert ev._pending == []

    asyncio.run(main())
    recorded = [json.loads(x)["measured_step"] for x in (tmp_path / "eval_results.jsonl").read_text().splitlines()]
    assert recorded == [2, 4, 6, 8]


def test_external_scores_parse_last_line() -> None:
    assert parse_external_scores('noise\n{"acc": 0.5, "gsm": {"pass1": 1}}\n\n', "cmd") == {
        "eval/external/acc": 0.5,
        "eval/gsm/pass1": 1.0,
    }
    with pytest.raises(ValueError, match="not JSON"):
        parse_external_scores("done\n", "cmd")
