"""How good the first rollout is, by who samples it: the embedded engine against `transformers` generate.

    python bench/sampling_fidelity.py                         # SmolLM2 on CUDA, 512 prompts x 8 samples
    python bench/sampling_fidelity.py --device cpu --prompts 4 --samples 2 --sides engine-fp32 hf-fp32

Every side samples the same prompts (`launch/data/arith_train.jsonl`, chat template) from the same
weights, at temperature 0.8 with no truncation and at most --max-new tokens, and every response is scored
by `miles.recipes.arith.score`: the reward the e2e bench's step 0 measures. A gap between sides is a gap in
what the samplers compute, not in learning. Sides:

    engine-bf16, engine-fp32   the embedded engine computing in that dtype (what `--sglang-dtype` picks)
    hf-autocast                fp32 weights under bf16 autocast: what TRL's GRPOTrainer samples with
    hf-bf16, hf-fp32           the weights cast to that dtype

Ends with one JSON line: per side the mean reward, its 95% t-interval half-width over prompts (the samples
of one prompt are not independent), the share of responses that ended on the end-of-turn token and their
mean length, the microseconds `score` took per response; and each side's difference from hf-autocast with that difference's paired interval.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_job import SHORT_DATA as DATA  # noqa: E402 - the e2e bench's prompts and interval, shared
from e2e_stats import half_width  # noqa: E402

SIDES = ("engine-bf16", "engine-fp32", "hf-autocast", "hf-bf16", "hf-fp32")
BASELINE = "hf-autocast"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--model", default=None, help="model spec or directory (default: smollm2: on cuda, tiny on cpu)")
    p.add_argument("--prompts", type=int, default=512, help="the first N prompts of the data")
    p.add_argument("--samples", type=int, default=8, help="samples a prompt")
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--batch", type=int, default=512, help="sequences a transformers generate call")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_prompts(tokenizer, n: int) -> tuple[list[list[int]], list[str]]:
    rows = [json.loads(x) for x in DATA.read_text().splitlines() if x.strip()][:n]
    ids = [
        list(
            tokenizer.apply_chat_template(r["messages"], tokenize=True, add_generation_prompt=True, return_dict=False)
        )
        for r in rows
    ]
    return ids, [r["label"] for r in rows]


def engine_side(
    model: str, device: str, dtype: str, prompts: list[list[int]], args
) -> list[list[tuple[str, bool, int]]]:
    """(text, ended on end-of-turn, tokens) of --samples responses a prompt, from the embedded engine."""
    from miles.engines.embedded.engine import EmbeddedEngine

    longest = max(len(p) for p in prompts) + args.max_new + 8
    engine = EmbeddedEngine(
        model,
        device=device,
        dtype=dtype,
        max_running_requests=min(args.batch, len(prompts) * args.samples),
        max_total_tokens=min(args.batch, len(prompts) * args.samples) * longest,
        seed=args.seed,
    )
    params = {
        "temperature": args.temperature,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": args.max_new,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "n": args.samples,
    }

    async def run() -> list:
        await engine.start()
        try:
            return await asyncio.gather(*(engine.generate(input_ids=p, sampling_params=params) for p in prompts))
        finally:
            await engine.shutdown()

    outs = asyncio.run(run())
    return [
        [
            (o["text"], o["meta_info"]["finish_reason"].get("type") == "stop", o["meta_info"]["completion_tokens"])
            for o in group
        ]
        for group in outs
    ]


def hf_side(
    model: str, device: str, mode: str, prompts: list[list[int]], tokenizer, args
) -> list[list[tuple[str, bool, int]]]:
    """The same from `transformers` generate: weights in fp32 under bf16 autocast, or cast to bf16 / fp32."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    flat = [p for p in prompts for _ in range(args.samples)]
    results: list[tuple[str, bool, int]] = []
    autocast = (
        torch.autocast(device_type=device, dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
    )
    for start in range(0, len(flat), args.batch):
        chunk = flat[start : start + args.batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with torch.inference_mode(), autocast:
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=args.max_new,
                do_sample=True,
                temperature=args.temperature,
                top_p=1.0,
                top_k=0,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        for row in out[:, width:].tolist():
            ended = eos in row
            row = row[: row.index(eos) + 1] if ended else row
            results.append((tokenizer.decode(row, skip_special_tokens=True), ended, len(row)))
    return [results[i : i + args.samples] for i in range(0, len(results), args.samples)]


def summarise(groups: list[list[tuple[str, bool, int]]], labels: list[str]) -> tuple[dict, list[float]]:
    from miles.recipes.arith import score

    start = time.perf_counter()
    per_prompt = [
        statistics.fmean(score(text, label) for text, _, _ in g) for g, label in zip(groups, labels, strict=True)
    ]
    graded_s = time.perf_counter() - start
    flat = [r for g in groups for r in g]
    return {
        "reward": round(statistics.fmean(per_prompt), 4),
        "grade_us_per_response": round(1e6 * graded_s / len(flat), 1),
        "reward_ci95": None if half_width(per_prompt) is None else round(half_width(per_prompt), 4),
        "ended": round(sum(e for _, e, _ in flat) / len(flat), 4),
        "tokens": round(statistics.fmean(n for _, _, n in flat), 2),
    }, per_prompt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from miles.models.resolve import resolve_spec

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = resolve_spec(args.model or ("smollm2:" if device == "cuda" else "tiny:llama:2x64"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts, labels = load_prompts(tokenizer, args.prompts)
    line: dict = {"model": Path(model).name, "device": device, "prompts": len(prompts), "samples": args.samples}
    per_prompt: dict[str, list[float]] = {}
    for side in args.sides:
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        kind, precision = side.split("-")
        if kind == "engine":
            groups = engine_side(model, device, {"bf16": "bfloat16", "fp32": "float32"}[precision], prompts, args)
        else:
            groups = hf_side(model, device, precision, prompts, tokenizer, args)
        line[side], per_prompt[side] = summarise(groups, labels)
        line[side]["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps({"side": side, **line[side]}), flush=True)
    if BASELINE in per_prompt:
        for side, values in per_prompt.items():
            if side != BASELINE:
                diffs = [a - b for a, b in zip(values, per_prompt[BASELINE], strict=True)]
                line[side]["minus_" + BASELINE.replace("-", "_")] = round(statistics.fmean(diffs), 4)
                line[side]["minus_ci95"] = None if half_width(diffs) is None else round(half_width(diffs), 4)
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
