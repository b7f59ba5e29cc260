"""Where the FSDP trainer's forward first leaves the engine's, layer by layer, teacher-forced.

On the random qwen3_moe of bench/moe.py (the same builders and flags), random sequences are scored twice: by
the engine's own prefill (its eager forward, the path MoE models take) and by the trainer's forward
(`forward_micro_batch` on transformers' model, `--trainer-dtype`, with `--trainer-residual-dtype float32` the
fp32 stream of `--fp32-residual-connection`). The residual stream is read where each RMSNorm takes it (before
each layer's attention and MoE blocks, and the final norm), on both sides, and each point prints the share of
its values that differ and the largest difference; then the first point that differs, the share of tokens routed
apart and the log-prob gap. With `--replay` the trainer replays the engine's routing (R3), so a difference is
arithmetic alone. `bench/moe.py --engine-rescore` says how much of R3's leftover is the engine's decode against its
own prefill; this says where, inside one forward, the trainer and that prefill part.

    python bench/stream_diff.py --device cuda --trainer-dtype bfloat16 --trainer-residual-dtype float32 --replay
    python bench/stream_diff.py --device cpu --layers 6 --hidden 128 --heads 4 --kv-heads 2 --experts 16 \\
        --topk 4 --moe-intermediate 64 --vocab 1024 --trainer-dtype bfloat16 --trainer-residual-dtype float32

Reads the engine's stream by wrapping `rms_norm` in miles/engines/embedded/model.py for the prefill (the eager
forward calls it by that name). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import moe
import numpy as np
import torch

import miles.engines.embedded.model as engine_model_module
from miles.rollout.train_data import TrainBatch
from miles.trainer.forward import forward_micro_batch, model_layout
from miles.trainer.residual_stream import keep_fp32_residual
from miles.trainer.routing_replay import RoutingReplay


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for name, default in (("layers", 24), ("hidden", 2048), ("heads", 32), ("kv-heads", 4), ("experts", 128),
                          ("topk", 8), ("moe-intermediate", 768), ("vocab", 32768), ("batch", 32),
                          ("seq-len", 96), ("seed", 0)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--engine-dtype", default="bfloat16")
    p.add_argument("--trainer-dtype", default="bfloat16")
    p.add_argument("--trainer-residual-dtype", choices=("float32", "model"), default="float32")
    p.add_argument("--engine-moe-rounding", choices=("transformers", "fused"), default=None)
    p.add_argument("--replay", action="store_true", help="the trainer replays the engine's routing (R3)")
    return p.parse_args(argv)


@contextlib.contextmanager
def reading_the_engines_stream(hidden: int, into: list[torch.Tensor]):
    """Every fp32 input of width `hidden` the engine's `rms_norm` takes (the residual stream) appended to `into`."""
    original = engine_model_module.rms_norm

    def reading(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.shape[-1] == hidden and x.dtype == torch.float32:
            into.append(x.detach().reshape(-1, hidden).clone())
        return original(x, weight, eps)

    engine_model_module.rms_norm = reading
    try:
        yield
    finally:
        engine_model_module.rms_norm = original


def engine_pass(model, seqs: list[list[int]], hidden: int) -> tuple[list[torch.Tensor], np.ndarray, np.ndarray]:
    """The engine's prefill of `seqs` (bench/moe.py's `rescore`, in one call): its stream at every norm, the
    log-prob of each next token [B, T - 1] and the experts of every token but the last [B, T - 1, layers, k]."""
    stream: list[torch.Tensor] = []
    with reading_the_engines_stream(hidden, stream):
        lps, routed = moe.rescore(model, seqs, 1, len(seqs))
    return stream, lps, routed


def point_names(layers: int) -> list[str]:
    """The norms' inputs in forward order: each layer's stream before its attention and before its MoE block."""
    names = [f"layer {i} {where}" for i in range(layers) for where in ("input", "after attention")]
    return [*names, "final norm's input"]


@torch.no_grad()
def trainer_pass(hf, seqs, routed: np.ndarray, engine_stream: list[torch.Tensor], a: argparse.Namespace) -> dict:
    """The trainer's forward over `seqs`, each norm's input compared with the engine's at the same point."""
    norms = [n for layer in hf.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    norms.append(hf.model.norm)
    points: list[dict] = []

    def compare(_module, args) -> None:
        ours = args[0].detach().reshape(-1, a.hidden)
        theirs = engine_stream[len(points)]
        diff = (ours.float() - theirs).abs()
        points.append({"differing": float((diff > 0).float().mean()), "max_abs_diff": float(diff.max())})

    hooks = [n.register_forward_pre_hook(compare) for n in norms]
    replay = RoutingReplay(hf, mode="rollout" if a.replay else "measure")
    replay.begin_step()
    batch = TrainBatch.unscored(
        np.concatenate([np.asarray(s, np.int64) for s in seqs]),
        [len(s) for s in seqs],
        np.full(len(seqs), len(seqs[0]) - 1),
        routed_experts=routed.reshape(-1, *routed.shape[2:]).astype(np.int64),
    )
    try:
        with replay.scope(batch, model_layout(hf), first_pass=True):
            lp, _, _ = forward_micro_batch(hf, batch, torch.device(a.device), 1.0, entropy="none")
    finally:
        for h in hooks:
            h.remove()
    n, used, _ = replay.counts
    return {"points": points, "log_probs": lp.float().cpu().numpy(), "routing_mismatch": used / n}


def run(a: argparse.Namespace) -> dict:
    device = torch.device(a.device)
    moe.set_engine_moe_rounding(a.engine_moe_rounding, device)
    cfg = moe.hf_config(a)
    weights = moe.random_weights(cfg, device, a.seed, getattr(torch, a.engine_dtype))
    engine = moe.engine_model(cfg, weights, device, getattr(torch, a.engine_dtype))
    gen = torch.Generator().manual_seed(a.seed + 3)
    seqs = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=gen).tolist()
    stream, engine_lps, routed = engine_pass(engine, seqs, a.hidden)
    del engine
    hf = moe.trainer_model(cfg, weights, getattr(torch, a.trainer_dtype), 0.0, a.seed)
    if a.trainer_residual_dtype == "float32":
        keep_fp32_residual(hf, getattr(torch, a.trainer_dtype))
    trained = trainer_pass(hf, seqs, routed, stream, a)
    names = point_names(a.layers)
    points = [{"point": name, **p} for name, p in zip(names, trained["points"], strict=True)]
    first = next((p["point"] for p in points if p["max_abs_diff"] > 0), None)
    diff = np.abs(trained["log_probs"] - engine_lps.reshape(-1))
    return {
        "config": {k: v for k, v in vars(a).items() if k != "device"},
        "device": a.device,
        "points": points,
        "first_difference": first,
        "routing_mismatch": trained["routing_mismatch"],
        "logprob_abs_diff_mean": float(diff.mean()),
        "logprob_abs_diff_max": float(diff.max()),
    }


def main(argv: list[str] | None = None) -> dict:
    result = run(parse(argv))
    for p in result["points"]:
        print(f"{p['point']:>26}: {p['differing']:.4%} of the stream differs, max {p['max_abs_diff']:.3e}")
    print(f"first difference: {result['first_difference'] or 'none'}; routing apart {result['routing_mismatch']:.4%}; "
          f"|dlogp| mean {result['logprob_abs_diff_mean']:.3e} max {result['logprob_abs_diff_max']:.3e}")  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
