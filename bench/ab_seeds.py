"""One recipe, two sets of flags, several seeds: does B learn as A does, seed by seed?

    python bench/ab_seeds.py --config launch/configs/smollm2_arith_gpu.yaml --extra "--colocate" \
        --b "--sglang-quantization fp8" --seeds 3 --out-dir runs/fp8-ab        # FP8 rollouts (TIS on) vs BF16, one GPU
    python bench/ab_seeds.py --config launch/configs/demo_cpu.yaml --a "--lr 1e-3" --b "--lr 2e-3" \
        --seeds 2 --extra "--num-rollout 2"                                     # CPU smoke

Seed k of both arms runs `miles train --config CONFIG --seed 1234+k --rollout-seed 42+k`, so both take
the same prompts in the same order and start from the same trainer state; they differ by the arm's flags
(`--a`, `--b`; `--extra` goes to both) and by their samples, which are independent draws unless the
engine is made deterministic. From each run's metrics.jsonl: the mean rollout reward of the first and the
last five steps, the first evaluation (when the run evaluates before training) and the last one (every
`eval/*/reward_mean` of an evaluated step, averaged over the eval sets), the gains (last minus first), and
the train/rollout mismatch (`train/train_rollout_logprob_abs_diff`, `train/train_rollout_kl`, means over the
steps). Prints one line per run as it ends, then one JSON line: each arm's means, and B minus A seed by
seed for each figure with the mean and the half-width of its 95% t-interval: B learns within noise of A
where the interval holds 0, or where it lies above it. Both arms' rewards and evaluations come from their
own serving, so where B serves differently (FP8) `b_minus_a_eval_first` is what that costs before any
training, and `b_minus_a_eval_gain` / `b_minus_a_reward_gain` compare what the two arms learnt.

`--concurrent N` runs up to N runs at once (their step times then say nothing; none are compared).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from e2e_stats import half_width
from miles_runs import metrics_rows, train_command

REPO = Path(__file__).resolve().parents[1]
# per run; B minus A of each, seed by seed. Each arm's rewards and evaluations come from its own serving:
# the first evaluation (before training) is what B's serving costs untrained, the gains are what each learnt.
FIELDS = ("reward_last5", "eval_last", "eval_first", "reward_gain", "eval_gain")
MISMATCH = {"logprob_abs_diff": "train/train_rollout_logprob_abs_diff", "kl": "train/train_rollout_kl"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the recipe both arms run")
    p.add_argument("--a", default="", help="arm A's extra `miles train` flags, one shell string (default: none)")
    p.add_argument("--b", required=True, help="arm B's extra `miles train` flags, one shell string")
    p.add_argument("--extra", default="", help="flags for both arms, one shell string")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--concurrent", type=int, default=1, metavar="N", help="runs at once (default 1)")
    p.add_argument("--out-dir", default=None, help="run directories a-K and b-K (default: a temporary one)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    return p.parse_args(argv)


def command(args: argparse.Namespace, arm: str, seed: int, out_dir: Path) -> list[str]:
    flags = args.a if arm == "a" else args.b
    seeds = ["--seed", str(1234 + seed), "--rollout-seed", str(42 + seed)]
    return train_command(["--config", args.config, *seeds, *shlex.split(args.extra), *shlex.split(flags)], out_dir)


def _eval_mean(row: dict) -> float:
    return statistics.fmean(v for k, v in row.items() if k.startswith("eval/") and k.endswith("/reward_mean"))


def _gain(last: float | None, first: float | None) -> float | None:
    return None if last is None or first is None else last - first


def read_run(out_dir: Path) -> dict:
    """The figures of one finished run, from its metrics.jsonl."""
    rows = metrics_rows(out_dir)
    steps = [r for r in rows if "rollout/reward_mean" in r]
    evals = [r for r in rows if any(k.startswith("eval/") and k.endswith("/reward_mean") for k in r)]
    rewards = [r["rollout/reward_mean"] for r in steps]
    out = {
        "steps": len(steps),
        "rewards": rewards,
        "reward_first5": statistics.fmean(rewards[:5]) if rewards else None,
        "reward_last5": statistics.fmean(rewards[-5:]) if rewards else None,
        # the first evaluation is the one before training when the run makes it (the served model untrained)
        "eval_first": _eval_mean(evals[0]) if evals and evals[0].get("step", 0) < 0 else None,
        "eval_last": _eval_mean(evals[-1]) if evals else None,
    }
    out["reward_gain"] = _gain(out["reward_last5"], out["reward_first5"])
    out["eval_gain"] = _gain(out["eval_last"], out["eval_first"])
    for name, key in MISMATCH.items():
        values = [r[key] for r in steps if key in r]
        out[name] = statistics.fmean(values) if values else None
    return out


def run_one(args: argparse.Namespace, arm: str, seed: int, work: Path) -> dict:
    out_dir = work / f"{arm}-{seed}"
    cmd = command(args, arm, seed, out_dir)
    log = work / f"{arm}-{seed}.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout_s).returncode
    if rc != 0 or not (out_dir / "metrics.jsonl").is_file():
        raise SystemExit(f"arm {arm}, seed {seed}: miles train exited {rc}; log {log}:\n" + log.read_text()[-3000:])
    result = read_run(out_dir) | {"arm": arm, "seed": seed, "command": shlex.join(["miles", *cmd[3:]])}
    print(json.dumps({k: v for k, v in result.items() if k != "command"}), flush=True)
    return result


def paired(a: list[dict], b: list[dict], field: str) -> dict | None:
    """B minus A seed by seed for `field`, their mean and the half-width of its 95% t-interval."""
    pairs = [(x[field], y[field]) for x, y in zip(a, b, strict=True) if x[field] is not None and y[field] is not None]
    if not pairs:
        return None
    diffs = [y - x for x, y in pairs]
    half = half_width(diffs)
    return {
        "diff": [round(d, 4) for d in diffs],
        "mean": round(statistics.fmean(diffs), 4),
        "ci95": None if half is None else round(half, 4),
    }


def summary(args: argparse.Namespace, a: list[dict], b: list[dict]) -> dict:
    def mean(runs: list[dict], field: str) -> float | None:
        values = [r[field] for r in runs if r[field] is not None]
        return float(f"{statistics.fmean(values):.4g}") if values else None

    arms = {
        arm: {f: mean(runs, f) for f in (*FIELDS, *MISMATCH)} | {"flags": flags}
        for arm, runs, flags in (("a", a, args.a), ("b", b, args.b))
    }
    return {
        "config": args.config,
        "seeds": [r["seed"] for r in a],
        "steps": a[0]["steps"] if a else None,
        "arms": arms,
        **{f"b_minus_a_{f}": paired(a, b, f) for f in FIELDS},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.out_dir or tempfile.mkdtemp(prefix="ab-seeds-"))
    work.mkdir(parents=True, exist_ok=True)
    jobs = [(arm, seed) for seed in range(args.first_seed, args.first_seed + args.seeds) for arm in ("a", "b")]
    with ThreadPoolExecutor(max_workers=max(1, args.concurrent)) as pool:
        results = list(pool.map(lambda job: run_one(args, *job, work), jobs))
    a = [r for r in results if r["arm"] == "a"]
    b = [r for r in results if r["arm"] == "b"]
    print(json.dumps(summary(args, a, b)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
