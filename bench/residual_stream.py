"""How far a bf16 engine's log-probs sit from fp32 ones of the same weights, with its residual stream in fp32
(the engine's default) and in bf16, side by side in one run.

A random model (`make_tiny_model`, the given shape) scores random sequences teacher-forced through the engine's
own forward, once in fp32 (the reference) and twice in bf16 (`CausalLM.fp32_residual` on and off); prints the
mean and max |log-prob - reference| of each. Dense or MoE (`--arch qwen3_moe`).

    python bench/residual_stream.py --layers 24 --hidden 256 --heads 4 --kv-heads 2 --intermediate 512

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from miles.engines.embedded.kv_cache import KVCache
from miles.engines.embedded.model import CausalLM
from miles.models.tiny import make_tiny_model


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--arch", default="qwen2")
    for name, default in (("layers", 24), ("hidden", 256), ("heads", 4), ("kv-heads", 2), ("intermediate", 512),
                          ("batch", 8), ("seq-len", 48), ("seed", 0)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    return p.parse_args(argv)


@torch.no_grad()
def token_logprobs(model: CausalLM, seqs: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) of every sequence, [B, T - 1], through the engine's eager forward."""
    s = model.spec
    B, T = seqs.shape
    kv = KVCache(
        num_layers=s.num_layers, num_slots=B, max_seq_len=T + 2, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
        dtype=model.dtype, device=model.device,
    )  # fmt: skip
    pos = torch.arange(T, device=model.device)[None].expand(B, T)
    hidden = model.forward(seqs, pos, kv, 0, pos, kv_len=None)
    logits = model.logits(hidden.reshape(B * T, -1)).float().view(B, T, -1)
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    device = torch.device(a.device)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(
            tmp, arch=a.arch, layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
            intermediate=a.intermediate, init_std=0.02, seed=a.seed,
        )  # fmt: skip
        reference = CausalLM.from_pretrained(path, device, torch.float32)
        model = CausalLM.from_pretrained(path, device, torch.bfloat16)
    gen = torch.Generator().manual_seed(a.seed)
    seqs = torch.randint(3, reference.spec.vocab_size, (a.batch, a.seq_len), generator=gen).to(device)
    ref = token_logprobs(reference, seqs)
    result: dict = {"arch": a.arch, "layers": a.layers, "hidden": a.hidden, "tokens": int(ref.numel())}
    for stream, fp32 in (("fp32", True), ("bf16", False)):
        model.fp32_residual = fp32
        gap = (token_logprobs(model, seqs) - ref).abs()
        result[f"{stream}_stream"] = {"mean": float(gap.mean()), "max": float(gap.max())}
        print(f"bf16 engine, {stream} residual stream: |dlogp| mean {gap.mean():.3e} max {gap.max():.3e}")
    result["mean_ratio"] = result["bf16_stream"]["mean"] / result["fp32_stream"]["mean"]
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
