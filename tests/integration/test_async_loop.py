"""Fully async runs on a deliberately slow engine with a tiny staleness limit.

Drop policy: groups that age past the limit are dropped at collection and counted; pace policy:
new generation is throttled so no group goes stale. In both runs a group is aborted by the
engine mid-generation (dropped on arrival, its prompt retried) and the filter rejects some groups
(never regenerated). The pace run also evaluates on the shared engines.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from miles.config import load_config
from miles.controller import group_runner, loop_async
from miles.models.resolve import resolve_model_paths
from miles.rollout.filters import DynamicFilterOutput

REPO = Path(__file__).resolve().parents[2]
NUM_PROMPTS = 40
BATCH_GROUPS = 4
NUM_STEPS = 4
ABORT_GROUP = 1  # the first attempt of this prompt is aborted by the engine mid-generation
KEYS = (
    "queue_size",
    "avg_staleness",
    "max_staleness",
    "buffer_avg_staleness",
    "buffer_max_staleness",
    "aborted_groups_filtered",
    "stale_groups_filtered",
)

FILTER_LOG_ENV = "MILES_TEST_FILTER_LOG"
abort_attempts: Counter[int] = Counter()


def reject_some(args, group) -> DynamicFilterOutput:
    """The test's dynamic filter: rejects every group whose index is 3 mod 7; logs every call to a file."""
    index = group[0].group_index
    with open(os.environ[FILTER_LOG_ENV], "a") as f:  # the run imports this module under another name
        f.write(f"{index}\n")
    return DynamicFilterOutput(keep=index % 7 != 3, reason="test_rejects")


def filter_calls(run_dir: Path) -> Counter[int]:
    path = run_dir.parent / "filter_calls.txt"
    return Counter(int(x) for x in path.read_text().split()) if path.exists() else Counter()


def write_prompts(path: Path, num_prompts: int, *, metadata=None) -> Path:
    with path.open("w") as f:
        for i in range(num_prompts):
            row = {"input": f"copy {i % 10} :", "label": str(i % 10)}
            if metadata is not None:
                row["metadata"] = metadata(i)
            f.write(json.dumps(row) + "\n")
    return path


def base_args(tmp: Path, *, num_prompts: int = NUM_PROMPTS, num_rollout: int = NUM_STEPS) -> list[str]:
    data = write_prompts(tmp / "prompts.jsonl", num_prompts)
    return [
        "--hf-checkpoint",
        "tiny:qwen2:2x64",
        "--prompt-data",
        str(data),
        "--input-key",
        "input",
        "--label-key",
        "label",
        "--custom-rm-path",
        "miles.recipes.digit_copy.reward",
        "--fully-async",
        "--num-rollout",
        str(num_rollout),
        "--rollout-batch-size",
        str(BATCH_GROUPS),
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        str(2 * BATCH_GROUPS),
        "--rollout-max-response-len",
        "4",
        "--rollout-temperature",
        "1.0",
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-engines",
        "1",
        "--output-dir",
        str(tmp / "run"),
    ]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def trained_indices(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines() if line.strip()]
    return [i for r in rows for i in r["group_index"]]


def _abort_first_attempt(monkeypatch) -> None:
    """Wrap generation so the engine aborts the first attempt of ABORT_GROUP's first sample."""
    real = group_runner.generate_sample

    async def generate(router, sample, tokenizer, sampling, *, seed=None):
        if sample.group_index != ABORT_GROUP or sample.index % 2 or abort_attempts[ABORT_GROUP]:
            return await real(router, sample, tokenizer, sampling, seed=seed)
        abort_attempts[ABORT_GROUP] += 1
        sample.metadata.pop("rid", None)
        task = asyncio.ensure_future(real(router, sample, tokenizer, sampling, seed=seed))
        while "rid" not in sample.metadata:
            await asyncio.sleep(0)
        # an abort that reaches the engine before the request is a no-op, so repeat it until the
        # request ends; it cannot finish first (four decode steps of >= 0.05 s each)
        rid = sample.metadata["rid"]
        while not task.done():
            await asyncio.gather(*(e.abort_request(rid=rid) for e in router.engines))
            await asyncio.wait([task], timeout=0.01)
        return task.result()

    monkeypatch.setattr(group_runner, "generate_sample", generate)
    # one request per sample, so the wrapper above sees (and aborts) the chosen one
    monkeypatch.setattr(group_runner.GroupRunner, "_batchable", lambda self, group: False)


def _run(monkeypatch, args: list[str]) -> Path:
    monkeypatch.setenv("MILES_TORCH_THREADS", "1")
    monkeypatch.setenv("MILES_ENGINE_STEP_DELAY_S", "0.05")
    monkeypatch.setenv(FILTER_LOG_ENV, str(Path(args[args.index("--output-dir") + 1]).parent / "filter_calls.txt"))
    abort_attempts.clear()
    _abort_first_attempt(monkeypatch)
    cfg = load_config(args)
    resolve_model_paths(cfg.model, seed=cfg.train.seed)  # as `miles train` does
    return Path(asyncio.run(loop_async.train(cfg)))


def _check_common(run_dir: Path) -> list[dict]:
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(NUM_STEPS))
    for r in rows:
        for k in KEYS:
            assert f"rollout/fully_async/{k}" in r, (k, r["step"])
        assert r["rollout/fully_async/max_staleness"] == 0  # the limit (0) holds for every trained group
        # backpressure: no more groups alive than generating (32 samples / 2) plus the buffer (2 x 4)
        assert r["rollout/fully_async/unresolved_groups"] <= 16 + 2 * BATCH_GROUPS
    trained = trained_indices(run_dir)
    assert len(trained) == NUM_STEPS * BATCH_GROUPS
    assert len(set(trained)) == len(trained), "a prompt was trained twice"
    # the aborted group was dropped on arrival and its prompt retried
    assert sum(r["rollout/fully_async/aborted_groups_filtered"] for r in rows) >= 1
    assert abort_attempts[ABORT_GROUP] == 1
    # filter-rejected groups: judged exactly once (never regenerated) and never trained
    calls = filter_calls(run_dir)
    rejected = [i for i in calls if i % 7 == 3]
    assert rejected, "the run never produced a group the filter rejects"
    assert all(calls[i] == 1 for i in rejected), dict(calls)
    assert not set(rejected) & set(trained)
    # counted once each: in a step's metrics, or (judged during the last step) in the run's tail file
    tail = json.loads((run_dir / "async_tail_metrics.json").read_text())
    key = "rollout/fully_async/filter_rejected_groups"
    assert sum(r[key] for r in rows) + tail[key] == len(rejected)
    return rows


FILTER = "tests.integration.test_async_loop:reject_some"


@pytest.mark.slow
def test_drop_policy_drops_and_counts_stale_groups(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    run_dir = _run(
        monkeypatch,
        base_args(tmp_path)
        + [
            "--max-weight-staleness",
            "0",
            "--async-max-concurrent-samples",
            "32",
            "--async-unused-samples-handler",
            "retry",
            "--dynamic-sampling-filter-path",
            FILTER,
        ],
    )
    rows = _check_common(run_dir)
    assert sum(r["rollout/fully_async/stale_groups_filtered"] for r in rows) >= 1
    assert max(r["rollout/fully_async/queue_size"] for r in rows) > 0  # generation outran the trainer
    # the aborted prompt came back: judged by the filter after its retry (trained unless stale again)
    assert filter_calls(run_dir)[ABORT_GROUP] >= 1


@pytest.mark.slow
def test_pace_policy_keeps_groups_fresh_and_shared_eval(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    evals = write_prompts(tmp_path / "eval.jsonl", 6)
    run_dir = _run(
        monkeypatch,
        base_args(tmp_path)
        + [
            "--max-weight-staleness",
            "0",
            "--async-max-concurrent-samples",
            "32",
            "--async-staleness-policy",
            "pace",
            "--async-unused-samples-handler",
            "retry",
            "--dynamic-sampling-filter-path",
            FILTER,
            "--eval-prompt-data",
            "digits",
            str(evals),
            "--eval-interval",
            "2",
            "--skip-eval-before-train",
        ],
    )
    rows = _check_common(run_dir)
    assert sum(r["rollout/fully_async/stale_groups_filtered"] for r in rows) == 0
    assert sum(r["rollout/fully_async/paced_time"] for r in rows) > 0
    evaluated = [r for r in rows if "eval/digits/reward_mean" in r]
    assert [r["step"] for r in evaluated] == [1, 3]  # after the pushes of versions 2 and 4
    for r in evaluated:
        assert r["eval/digits/weight_version"] == r["step"] + 1
        assert r["eval/digits/delay_steps"] == 0
        assert r["eval/digits/mixed_version_frac"] == 0
