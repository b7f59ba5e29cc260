"""TRL's side of `bench/e2e_vs_trl.py`: one `GRPOTrainer` run a seed in its own process, and TRL's stored
per-seed lines for a miles-only call to pair with.

The run's process is the bench script again, `e2e_vs_trl.py --trl-worker SPEC` (its start-up is measured
from that launch, as miles' is from `miles train`'s); it reads the job from the spec file and writes its step
times, rewards and generation phase to the spec's `out`, and the curve so far beside it as it goes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from e2e_job import REPO, STREAM_STRIDE, TEMPERATURE, learning_rate, max_new_tokens

# the script a worker runs: the bench's own, so that its start-up imports what the recorded runs imported
DRIVER = Path(__file__).resolve().with_name("e2e_vs_trl.py")


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
        "static_cache": args.trl_static_cache,
        # TRL's default cache takes half the free memory; runs sharing the GPU split that half between them
        "cb_memory_percent": 0.5 / max(1, args.concurrent),
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
                [sys.executable, str(DRIVER), "--trl-worker", str(spec_path)],
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
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    rewards: list[float] = []
    timings: dict[str, list[float]] = {"steps": [], "generate": []}
    first_step_start: list[float] = []
    config = _grpo_config(spec)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    partial = Path(spec["out"]).with_suffix(".partial.json")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_reward_func(spec, rewards),
        args=config,
        train_dataset=_dataset(spec),
        processing_class=tokenizer,
        callbacks=[_step_clock(spec["device"] == "cuda", timings, rewards, first_step_start, partial)],
    )
    _time_generation(trainer, timings["generate"])
    trainer.train()
    Path(spec["out"]).write_text(json.dumps(_worker_result(spec, timings, rewards, first_step_start)))
    return 0


def _dataset(spec: dict):
    """The seed's prompts in the order seed_data wrote them, as TRL's conversational dataset."""
    from datasets import Dataset

    rows = [json.loads(x) for x in Path(spec["data"]).read_text().splitlines() if x.strip()]
    return Dataset.from_list([{"prompt": r["messages"], "label": r["label"]} for r in rows])


def _reward_func(spec: dict, rewards: list[float]):
    """The job's grader as TRL calls it; appends each step's mean reward to `rewards`."""
    from miles.recipes.arith import score, score_steps
    from miles.recipes.gsm_symbolic import score as gsm_score

    # the name stays arith_reward: TRL names its logged reward metrics after the function
    def arith_reward(completions, label, **_):
        grade = gsm_score if spec.get("job") == "gsm" else score_steps if spec["force"] else score
        out = [grade(c[0]["content"], lab) for c, lab in zip(completions, label, strict=True)]
        rewards.append(sum(out) / len(out))
        return out

    return arith_reward


STATIC_PROMPT_MULTIPLE = 256


def _grpo_config(spec: dict):
    """GRPOConfig of the job: the miles side's batch, sampling, learning rate and seeds, TRL's loss defaults."""
    from trl import GRPOConfig

    cuda = spec["device"] == "cuda"
    return GRPOConfig(
        output_dir=str(Path(spec["out"]).with_suffix(".d")),
        per_device_train_batch_size=spec["prompts"] * spec["samples"],
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
        generation_kwargs={"min_new_tokens": spec["max_new"]} if spec["force"] else None,
        cache_implementation="static" if spec.get("static_cache") else None,
        # a static cache is compiled for its shape: prompts padded to one length (the gsm job's are under 256
        # tokens) keep the batch's cache one shape from step to step; the padding is masked
        pad_to_multiple_of=STATIC_PROMPT_MULTIPLE if spec.get("static_cache") else "auto",
        use_transformers_continuous_batching=spec.get("continuous_batching", False),
        transformers_continuous_batching_config=(
            {"max_memory_percent": spec["cb_memory_percent"]} if spec.get("continuous_batching") else None
        ),
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def _step_clock(cuda: bool, timings: dict, rewards: list[float], first_step_start: list[float], partial: Path):
    """A callback timing each step into timings['steps'] (the wall clock of the first step's start into
    `first_step_start`) and writing the curve so far to `partial`."""
    import torch
    from transformers import TrainerCallback

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

    return StepClock()


def _time_generation(trainer, times: list[float]) -> None:
    """Wraps the trainer's generation phase (sampling with the training model) to append its time to `times`."""
    generate = trainer._generate

    def timed_generate(*a, **k):
        t = time.perf_counter()
        out = generate(*a, **k)
        times.append(time.perf_counter() - t)
        return out

    trainer._generate = timed_generate


def _worker_result(spec: dict, timings: dict, rewards: list[float], first_step_start: list[float]) -> dict:
    """What a finished worker writes to spec['out']."""
    import torch

    cuda = spec["device"] == "cuda"
    return {
        "steps": timings["steps"],
        "rewards": rewards,
        "startup_s": first_step_start[0] - spec["launched"] if first_step_start else None,
        "phases": {"generate": timings["generate"]},
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
        "continuous_batching": bool(spec.get("continuous_batching")),
        "static_cache": bool(spec.get("static_cache")),
        "command": f"GRPOTrainer {json.dumps({k: v for k, v in spec.items() if k not in ('out', 'launched')})}",
    }


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
