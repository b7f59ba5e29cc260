"""The job `bench/e2e_vs_trl.py` runs on both sides: its prompts, reward, sampling and learning settings.

Both miles and TRL's `GRPOTrainer` read these, so that the two sides of a call train on the same prompts in
the same order, sample at the same temperature and learn at the same rate from the same seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHORT_DATA = REPO / "launch/data/arith_train.jsonl"
GSM_DATA = REPO / "launch/data/gsm_symbolic/train.jsonl"
REWARD = {
    "short": "miles.recipes.arith.reward",
    "long": "miles.recipes.arith.reward_steps",
    "gsm": "miles.recipes.gsm_symbolic.reward",
}
TEMPERATURE = {"short": 0.8, "long": 0.8, "gsm": 1.0}
STREAM_STRIDE = 7919  # --stream K adds STREAM_STRIDE * K to every random seed of both sides


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
