"""The update over packed rows (varlen attention, no padding) against padded rows (SDPA): same model, same batch.

A GRPO batch of mixed lengths, drawn with a seed like the GSM job's (prompts ~N(150, 35) tokens clipped to
[60, 300], answers ~N(294, 110) clipped to [20, 512]: that run's mean answer and cap), is planned into
micro-batches of at most --max-tokens-per-gpu tokens as the trainer plans each layout (padded bins of similar
lengths, padding counted; packed rows first-fit). Each side runs the trainer's forward (`forward_micro_batch`:
response log-probs and entropy in fp32) and a backward over every micro-batch, the two sides alternating;
medians over --reps after a warm-up. The padded side is the model loaded with SDPA, the packed side with
`miles_varlen` (torch's flash kernel on CUDA; one SDPA call per sequence on CPU, where the figure says
nothing about GPUs).

Prints what the padded layout computes beyond the batch (padding tokens, LM-head rows that predict nothing,
and the FLOPs those cost, by `miles.trainer.flops`), both sides' seconds, their ratio and, on a GPU with a
known peak, each side's MFU under the same useful-FLOP count. Ends with one JSON line.

    python bench/packed_rows.py --device cuda --shape qwen2-0.5b --samples 256      # the GSM job's shape
    python bench/packed_rows.py --samples 24 --max-tokens-per-gpu 4096 --reps 2     # CPU smoke
    python bench/packed_rows.py --shape qwen2-0.5b --samples 256 --count-only       # the counts alone
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train_throughput import SHAPES, build_model_dir  # noqa: E402

from miles.rollout.train_data import TrainBatch  # noqa: E402
from miles.trainer.flops import model_shape, peak_flops, train_flops  # noqa: E402
from miles.trainer.forward import forward_micro_batch, model_layout  # noqa: E402
from miles.trainer.hf_io import load_causal_lm  # noqa: E402
from miles.trainer.packing import pack_sequences, plan_micro_batches  # noqa: E402
from miles.trainer.varlen_attention import NAME as VARLEN  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--samples", type=int, default=256, help="sequences in the batch (the GSM job: 32 x 8)")
    p.add_argument("--max-tokens-per-gpu", type=int, default=32768)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count-only", action="store_true", help="count the padded layout's extra work; time nothing")
    return p.parse_args(argv)


def gsm_like_batch(samples: int, vocab: int, seed: int) -> TrainBatch:
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.normal(150, 35, samples), 60, 300).astype(np.int64)
    answers = np.clip(rng.normal(294, 110, samples), 20, 512).astype(np.int64)
    seq_lens = prompts + answers
    return TrainBatch.unscored(rng.integers(0, vocab, size=int(seq_lens.sum())), seq_lens, answers, group_size=8)


def padded_work(batch: TrainBatch, plan: list[list[int]], shape) -> tuple[int, int, float]:
    """(tokens, LM-head rows, FLOPs) the padded layout computes over `plan`'s micro-batches: every row at its
    micro-batch's width, the head over every row's span of response columns."""
    tokens = rows = 0
    flops = 0.0
    for idx in plan:
        packed = pack_sequences(batch.select(idx), "padded")
        n, width = packed.input_ids.shape
        tokens += n * width
        rows += n * packed.logits_index.numel()
        flops += train_flops([width] * n, shape, head_rows=[packed.logits_index.numel()] * n)
    return tokens, rows, flops


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def update_s(model, batch: TrainBatch, plan: list[list[int]], device: torch.device) -> float:
    """Seconds of one forward + backward over every micro-batch of `plan` (gradients dropped after)."""
    sync(device)
    start = time.perf_counter()
    for idx in plan:
        lp, _, _ = forward_micro_batch(model, batch.select(idx), device, 1.0, entropy="detached")
        (-lp.float().mean()).backward()
    sync(device)
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


LAYOUTS = {"padded": "padded", "packed": "row"}  # side -> the layout its attention gets (model_layout)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        path, cfg = build_model_dir(args.shape, tmp, 1024)
        shape = model_shape(path)
        models = {} if args.count_only else {
            "padded": load_causal_lm(path, attn_implementation="sdpa").to(device, dtype),
            "packed": load_causal_lm(path, attn_implementation=VARLEN).to(device, dtype),
        }  # fmt: skip
    assert all(model_layout(m) == LAYOUTS[name] for name, m in models.items())
    batch = gsm_like_batch(args.samples, cfg.vocab_size, args.seed)
    plans = {
        name: plan_micro_batches(
            batch.seq_lens,
            micro_batch_size=1,
            use_dynamic_batch_size=True,
            max_tokens_per_gpu=args.max_tokens_per_gpu,
            layout=layout,
        )
        for name, layout in LAYOUTS.items()
    }
    real_tokens = int(batch.seq_lens.sum())
    pad_tokens, head_rows, padded_flops = padded_work(batch, plans["padded"], shape)
    useful = train_flops(batch.seq_lens, shape, head_rows=batch.response_lengths)
    result = {
        "shape": args.shape,
        "device": args.device,
        "samples": args.samples,
        "max_tokens_per_gpu": args.max_tokens_per_gpu,
        "micro_batches": {name: len(plan) for name, plan in plans.items()},
        "tokens": real_tokens,
        "padded_tokens": pad_tokens,
        "padding_share": round(1 - real_tokens / pad_tokens, 4),
        "head_rows_over_answers": round(head_rows / int(batch.response_lengths.sum()), 3),
        "padded_flops_waste": round(1 - useful / padded_flops, 4),
    }
    summary = (
        f"padded layout: {result['padding_share']:.1%} padding, LM head on {result['head_rows_over_answers']:.2f}x "
        f"the answer tokens, {result['padded_flops_waste']:.1%} of its FLOPs predict nothing"
    )
    if models:
        times: dict[str, list[float]] = {name: [] for name in models}
        for rep in range(args.reps + 1):  # the first round warms up (kernels, allocator)
            for name, model in models.items():
                t = update_s(model, batch, plans[name], device)
                if rep:
                    times[name].append(t)
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        result.update(
            padded_s=round(medians["padded"], 4),
            packed_s=round(medians["packed"], 4),
            packed_over_padded=round(medians["packed"] / medians["padded"], 3),
        )
        peak = peak_flops(device)
        if peak:
            result.update({f"{name}_mfu": round(useful / (s * peak), 4) for name, s in medians.items()})
        summary += (
            f"; update {medians['padded']:.3f} s padded vs {medians['packed']:.3f} s packed: "
            f"{result['packed_over_padded']:.2f}x"
        )
    print(summary)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
