"""Training tokens/s: the FSDP backend vs a plain transformers + AdamW loop, side by side (and, with
`--backend megatron`, the megatron-core backend beside both).

Both train the same randomly initialised Qwen2-shaped model on the same batch (next-token
NLL over every token, token mean), alternating one timed step each per repetition; medians are
reported. The plain loop is what one would write by hand: fp32 master weights, bf16 autocast on
GPU, fused AdamW, gradient checkpointing when asked. The FSDP side runs as a 1-rank
process group through the public backend API (`train()` with the SFT loss); on GPU its model is
wrapped by fully_shard (bf16 compute, fp32 reduce), on CPU (one rank, fp32) the backend leaves it
a plain module, since fully_shard would have nothing to shard or cast.

    python bench/train_throughput.py                      # CPU, small model
    python bench/train_throughput.py --device cuda --model qwen2-0.5b --seq-len 2048 --batch-size 8 \
        --gradient-checkpointing
    python bench/train_throughput.py --device cuda --backend megatron   # + megatron_tok_s, megatron_mfu
    python bench/train_throughput.py --device cuda --compile --fp32-residual  # + what --fp32-residual-connection costs
    python bench/train_throughput.py --device cuda --compile --fp8-forward    # + what --fp8-format e4m3 costs with it

MFU (GPU) = tokens/s x (6 N + 12 L d s) / peak, N = parameters (embeddings included),
L layers, d hidden size, s sequence length; peak 989 TFLOP/s (H200/H100 dense bf16).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from miles.config import AlgoConfig, ModelConfig, RolloutConfig, TrainConfig  # noqa: E402
from miles.rollout.train_data import TrainBatch  # noqa: E402

SHAPES = {
    # Qwen2-0.5B: 24 layers, d=896, 14 heads (2 KV), MLP 4864, vocab 151936, tied embeddings
    "qwen2-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=8192,
    ),
}
PEAK_FLOPS = {"cuda": 989e12}


def build_model_dir(shape: str, root: str, seq_len: int) -> tuple[str, object]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        **SHAPES[shape], max_position_embeddings=max(seq_len, 4096), tie_word_embeddings=True, dtype="bfloat16"
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    path = os.path.join(root, shape)
    model.save_pretrained(path)
    return path, cfg


def make_batch(batch_size: int, seq_len: int, vocab: int) -> TrainBatch:
    rng = np.random.default_rng(0)
    n = batch_size
    resp = seq_len - 1  # every token after the first is trained on, as in the plain loop
    return TrainBatch.unscored(rng.integers(0, vocab, size=n * seq_len), np.full(n, seq_len), np.full(n, resp))


class PlainLoop:
    def __init__(self, path: str, device: torch.device, args: argparse.Namespace) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(
            device
        )
        self.model.config.use_cache = False
        if args.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        # fused AdamW on both devices: the same optimizer kernel the FSDP backend uses for unsharded params
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=True)

    def step(self, input_ids: torch.Tensor) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def build_backend(name: str, path: str, batch_size: int, args: argparse.Namespace, **train: object):
    """A 1-rank trainer backend (`fsdp` or `megatron`) training with the SFT loss through `train()`; `train`: more
    TrainConfig fields (the alignment flags timed beside the plain backend)."""
    from miles.trainer.backend import create_backend

    be = create_backend(
        name,
        model=ModelConfig(hf_checkpoint=path),
        train=TrainConfig(
            lr=1e-5,
            clip_grad=1.0,
            micro_batch_size=args.micro_batch_size or batch_size,
            gradient_checkpointing=args.gradient_checkpointing,
            compile=args.compile and name == "fsdp",
            train_backend=name,
            **train,
        ),
        algo=AlgoConfig(loss_type="sft_loss", calculate_per_token_loss=True),
        rollout=RolloutConfig(global_batch_size=batch_size),
    )
    be.setup()
    return be


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def init_single_rank(device: torch.device) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def profile_steps(out_dir: str, device: torch.device, steps: dict) -> None:
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for name, fn in steps.items():
        with profile(activities=activities) as prof:
            for _ in range(2):
                fn()
            sync(device)
        with open(os.path.join(out_dir, f"profile_{name}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by=sort_key, row_limit=40, max_name_column_width=80))
            f.write("\n\n")
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=80))


def flops_per_token(cfg, n_params: int, seq_len: int) -> float:
    return 6.0 * n_params + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default=None, choices=list(SHAPES), help="default: small on CPU, qwen2-0.5b on CUDA")
    ap.add_argument("--seq-len", type=int, default=None, help="default: 256 on CPU, 2048 on CUDA")
    ap.add_argument("--batch-size", type=int, default=None, help="default: 4 on CPU, 8 on CUDA")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="FSDP micro-batch (default: whole batch)")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--compile", action="store_true", help="FSDP side: torch.compile each transformer block")
    ap.add_argument(
        "--backend",
        default="fsdp",
        choices=["fsdp", "megatron"],
        help="megatron: also time the megatron-core backend (CUDA, megatron extra) beside FSDP in the same run",
    )
    ap.add_argument(
        "--fp32-residual",
        action="store_true",
        help="also time the FSDP backend with --fp32-residual-connection, side by side (fsdp_fp32_residual_tok_s)",
    )
    ap.add_argument(
        "--fp8-forward",
        action="store_true",
        help="also time it with --fp8-format e4m3 --fp32-residual-connection, the FP8 rollouts' forward contract "
        "(fsdp_fp8_forward_tok_s)",
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument(
        "--profile-dir", default=None, help="also write torch.profiler tables of 2 steps of each side here"
    )
    return ap.parse_args(argv)


def time_steps(steps: dict, args: argparse.Namespace, device: torch.device) -> dict[str, list[float]]:
    """--warmup untimed steps of each side, then --reps timed ones alternating side by side (and the
    profiler tables of --profile-dir)."""
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.reps):  # one timed step of each side per repetition, alternating
        for name, step in steps.items():
            times[name].append(timed(step, device))
    if args.profile_dir:
        profile_steps(args.profile_dir, device, steps)
    return times


def result_line(args: argparse.Namespace, tok_s: dict[str, float], cfg: object, run: dict) -> dict:
    """The closing JSON line: tokens/s of each side timed and their ratios to FSDP's, MFU on CUDA; `run`:
    the call's cuda, shape, params, seq_len, batch_size and the FSDP side's attention implementation."""
    cuda, n_params, seq_len = run["cuda"], run["params"], run["seq_len"]
    plain_tok_s, fsdp_tok_s = tok_s["plain"], tok_s["fsdp"]
    result = {
        "fsdp_tok_s": round(fsdp_tok_s, 1),
        "plain_tok_s": round(plain_tok_s, 1),
        "ratio": round(fsdp_tok_s / plain_tok_s, 3),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "model": run["shape"],
        "params": n_params,
        "seq_len": seq_len,
        "batch_size": run["batch_size"],
        "gradient_checkpointing": args.gradient_checkpointing,
        "compile": args.compile,
        "reps": args.reps,
        "attn": run["attn"],
    }
    if cuda:
        fpt = flops_per_token(cfg, n_params, seq_len)
        result["mfu"] = round(fsdp_tok_s * fpt / PEAK_FLOPS["cuda"], 4)
        result["plain_mfu"] = round(plain_tok_s * fpt / PEAK_FLOPS["cuda"], 4)
        result["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if args.fp32_residual:
        result["fsdp_fp32_residual_tok_s"] = round(tok_s["fsdp_fp32_residual"], 1)
        result["fp32_residual_vs_fsdp"] = round(tok_s["fsdp_fp32_residual"] / fsdp_tok_s, 3)
    if args.fp8_forward:
        result["fsdp_fp8_forward_tok_s"] = round(tok_s["fsdp_fp8_forward"], 1)
        result["fp8_forward_vs_fsdp"] = round(tok_s["fsdp_fp8_forward"] / fsdp_tok_s, 3)
    if "megatron" in tok_s:  # megatron trains on CUDA only, so fpt is set
        result["megatron_tok_s"] = round(tok_s["megatron"], 1)
        result["megatron_vs_fsdp"] = round(tok_s["megatron"] / fsdp_tok_s, 3)
        result["megatron_mfu"] = round(tok_s["megatron"] * fpt / PEAK_FLOPS["cuda"], 4)
    return result


def main() -> None:
    args = parse_args()
    cuda = args.device == "cuda"
    if args.backend == "megatron" and not cuda:
        raise SystemExit("--backend megatron needs --device cuda (megatron-core trains on GPUs with NCCL)")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = args.model or ("qwen2-0.5b" if cuda else "small")
    seq_len = args.seq_len or (2048 if cuda else 256)
    batch_size = args.batch_size or (8 if cuda else 4)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    init_single_rank(device)

    with tempfile.TemporaryDirectory() as root:
        path, cfg = build_model_dir(shape, root, seq_len)
        batch = make_batch(batch_size, seq_len, cfg.vocab_size)
        input_ids = torch.from_numpy(batch.tokens.reshape(batch_size, seq_len)).to(device)
        plain = PlainLoop(path, device, args)
        fsdp = build_backend("fsdp", path, batch_size, args)
        mega = build_backend("megatron", path, batch_size, args) if args.backend == "megatron" else None
        n_params = sum(p.numel() for p in plain.model.parameters())
        tokens = batch_size * seq_len
        rid = iter(range(10**6))
        steps = {"plain": lambda: plain.step(input_ids), "fsdp": lambda: fsdp.train(batch, next(rid))}
        if mega is not None:
            steps["megatron"] = lambda: mega.train(batch, next(rid))
        if args.fp32_residual:
            fsdp32 = build_backend("fsdp", path, batch_size, args, fp32_residual_connection=True)
            steps["fsdp_fp32_residual"] = lambda: fsdp32.train(batch, next(rid))
        if args.fp8_forward:  # the FP8 rollouts' forward contract, as the FP8 A/B trains it (both flags)
            fsdp8 = build_backend("fsdp", path, batch_size, args, fp32_residual_connection=True, fp8_format="e4m3")
            steps["fsdp_fp8_forward"] = lambda: fsdp8.train(batch, next(rid))
        times = time_steps(steps, args, device)
    tok_s = {name: tokens / statistics.median(t) for name, t in times.items()}
    run = {
        "cuda": cuda,
        "shape": shape,
        "params": n_params,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "attn": fsdp.attn_impl,
    }
    result = result_line(args, tok_s, cfg, run)
    plain_tok_s, fsdp_tok_s = tok_s["plain"], tok_s["fsdp"]
    print(
        f"plain {plain_tok_s:,.0f} tok/s | fsdp {fsdp_tok_s:,.0f} tok/s | ratio {result['ratio']:.3f}"
        + (f" | mfu {result['mfu']:.1%} (plain {result['plain_mfu']:.1%})" if cuda else "")
        + (
            f" | megatron {result['megatron_tok_s']:,.0f} tok/s, {result['megatron_vs_fsdp']:.3f}x fsdp"
            if mega
            else ""
        ),
        file=sys.stderr,
    )
    dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
