"""Training steps/s: fully async vs sync on a workload with long-tailed response lengths.

Every prompt carries its own `max_new_tokens` (with `ignore_eos`) drawn from a Pareto
distribution, so most responses are short and a few are many times longer, like reasoning or
agentic rollouts. An engine step delay (`MILES_ENGINE_STEP_DELAY_S`) makes generation dominate
the step, as on a GPU. Both modes use the same config, seeds, prompts and samples per step; the
sync loop waits for each batch's slowest trajectory, the async loop trains on whatever groups are
done while the stragglers keep generating.

Steps/s is measured after the first step (start-up and the first fill excluded):
(num_rollout - 1) / sum(step_time of steps 1..). Sync and async runs alternate for --reps
repetitions; the medians are compared.

    python bench/async_speedup.py            # ~3-4 min on 2 CPU cores
Ends with one JSON line: sync_steps_per_s, async_steps_per_s, speedup (+ the workload figures, and
the mean trained response length per mode with `token_speedup`, the ratio of trained response
tokens per second: a short async run trains on the groups that finish first, i.e. shorter ones).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np
from miles_runs import metrics_rows

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2, help="runs per mode (alternating); medians are compared")
    p.add_argument("--num-rollout", type=int, default=8, help="training steps per run")
    p.add_argument("--batch-groups", type=int, default=8, help="rollout_batch_size (groups per step)")
    p.add_argument("--n-samples", type=int, default=4, help="n_samples_per_prompt")
    p.add_argument("--min-tokens", type=int, default=2, help="shortest response (Pareto scale)")
    p.add_argument("--max-tokens", type=int, default=48, help="longest response (tail cut)")
    p.add_argument("--pareto-shape", type=float, default=1.1, help="smaller = heavier tail")
    p.add_argument("--step-delay-s", type=float, default=0.08, help="engine sleep per decode step")
    p.add_argument(
        "--concurrency-factor", type=int, default=2, help="async: trajectories in flight = factor x batch samples"
    )
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def long_tailed_lengths(n: int, *, shape: float, lo: int, hi: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(min(hi, lo * (1.0 + rng.pareto(shape)))) for _ in range(n)]


def write_prompts(path: Path, lengths: list[int]) -> None:
    with path.open("w") as f:
        for i, n in enumerate(lengths):
            meta = {"sampling_params": {"max_new_tokens": n, "ignore_eos": True}}
            f.write(json.dumps({"input": f"copy {i % 10} :", "label": str(i % 10), "metadata": meta}) + "\n")


def train_args(a: argparse.Namespace, data: Path, out: Path, *, fully_async: bool) -> list[str]:
    args = [
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
        "--rollout-seed",
        str(a.seed),
        "--seed",
        str(a.seed),
        "--num-rollout",
        str(a.num_rollout),
        "--rollout-batch-size",
        str(a.batch_groups),
        "--n-samples-per-prompt",
        str(a.n_samples),
        "--global-batch-size",
        str(a.batch_groups * a.n_samples),
        "--rollout-max-response-len",
        str(a.max_tokens),
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-engines",
        "1",
        "--max-running-requests",
        "256",
        "--output-dir",
        str(out),
    ]
    if fully_async:
        args += [
            "--fully-async",
            "--async-max-concurrent-samples",
            str(a.concurrency_factor * a.batch_groups * a.n_samples),
        ]
    return args


def measure(run_dir: Path) -> tuple[float, float]:
    """(steps/s after the first step, mean response length of the trained samples)."""
    rows = metrics_rows(run_dir)
    steps = [r for r in rows if r["step"] >= 1]
    return len(steps) / sum(r["perf/step_time"] for r in steps), statistics.mean(
        r["rollout/response_len_mean"] for r in rows if r["step"] >= 0
    )


def run_once(a: argparse.Namespace, data: Path, out: Path, *, fully_async: bool) -> tuple[float, float]:
    from miles.config import load_config
    from miles.controller import loop_async, loop_sync
    from miles.models.resolve import resolve_model_paths

    cfg = load_config(train_args(a, data, out, fully_async=fully_async))
    resolve_model_paths(cfg.model, seed=cfg.train.seed)  # as `miles train` does
    loop = loop_async if fully_async else loop_sync
    return measure(Path(asyncio.run(loop.train(cfg))))


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    os.environ.setdefault("MILES_TORCH_THREADS", "1")
    os.environ["MILES_ENGINE_STEP_DELAY_S"] = str(a.step_delay_s)  # read by the engine workers at start
    logging.basicConfig(level=logging.WARNING)
    lengths = long_tailed_lengths(
        a.num_rollout * a.batch_groups * 4, shape=a.pareto_shape, lo=a.min_tokens, hi=a.max_tokens, seed=a.seed
    )
    results: dict[str, list[float]] = {"sync": [], "async": []}
    lengths_trained: dict[str, list[float]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="miles-async-bench-") as tmp:
        data = Path(tmp) / "prompts.jsonl"
        write_prompts(data, lengths)
        for rep in range(a.reps):
            for mode in ("sync", "async"):
                sps, trained_len = run_once(a, data, Path(tmp) / f"{mode}{rep}", fully_async=mode == "async")
                results[mode].append(sps)
                lengths_trained[mode].append(trained_len)
                print(f"rep {rep} {mode:5s}: {sps:.3f} steps/s, trained response length {trained_len:.2f}", flush=True)
    sync, fully = statistics.median(results["sync"]), statistics.median(results["async"])
    out = {
        "sync_steps_per_s": round(sync, 4),
        "async_steps_per_s": round(fully, 4),
        "speedup": round(fully / sync, 3),
        "reps": a.reps,
        "num_rollout": a.num_rollout,
        "samples_per_step": a.batch_groups * a.n_samples,
        "response_len_median": float(np.median(lengths)),
        "response_len_p99": float(np.percentile(lengths, 99)),
        "response_len_max": max(lengths),
        "engine_step_delay_s": a.step_delay_s,
        # async trains on whatever finished first: a shorter mean here is the fast-rollout bias
        "sync_trained_response_len": round(statistics.median(lengths_trained["sync"]), 3),
        "async_trained_response_len": round(statistics.median(lengths_trained["async"]), 3),
        "token_speedup": round(
            fully * statistics.median(lengths_trained["async"]) / (sync * statistics.median(lengths_trained["sync"])),
            3,
        ),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
