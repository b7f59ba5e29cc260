"""How far the FSDP trainer's forward sits from the embedded engine's, teacher-forced, with and without the flags
that make it compute as the engine does (`--fp32-residual-connection`, `--fp8-format e4m3`).

For each model spec, random sequences are scored by the engine's own forward in bf16 and, quantized, in FP8,
and by the transformers model in bf16 three ways: as it is, with the fp32 residual stream, and with the stream
plus the FP8 forward. Prints the mean and max |log-prob difference| of each against the FP8 engine (and the mean
against the bf16 engine), then for one projection of layer 0 whether the engine's stored e4m3 codes and block
scales equal the trainer's quantization and how far the two products are apart.

    python bench/forward_alignment.py --device cuda --specs tiny:qwen2:4x256 smollm2:

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import glob
import json

import torch
import torch.nn.functional as F
from residual_stream import token_logprobs

from miles.engines.embedded import fp8
from miles.engines.embedded.checkpoint import layer_names
from miles.engines.embedded.model import CausalLM
from miles.models.resolve import resolve_spec
from miles.trainer.fp8_forward import use_fp8_forward
from miles.trainer.residual_stream import keep_fp32_residual


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, seqs: torch.Tensor) -> torch.Tensor:
    logits = model(seqs).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)


def forms(path: str, device: torch.device, seqs: torch.Tensor, ref_fp8: torch.Tensor, ref_bf16: torch.Tensor) -> dict:
    from transformers import AutoModelForCausalLM

    stream = (lambda m: keep_fp32_residual(m, torch.bfloat16),)  # noqa: E731
    out = {}
    for name, setups in (("plain", ()), ("stream", stream), ("fp8+stream", (use_fp8_forward, *stream))):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
        model = model.to(device).eval()
        for setup in setups:
            setup(model)
        lp = hf_logprobs(model, seqs)
        out[name] = {
            "vs_fp8_mean": float((lp - ref_fp8).abs().mean()),
            "vs_fp8_max": float((lp - ref_fp8).abs().max()),
            "vs_bf16_mean": float((lp - ref_bf16).abs().mean()),
        }
    return out


def layer0_projection(engine: CausalLM, path: str, device: torch.device) -> dict:
    """Layer 0's q projection: the engine's stored FP8 weight against the trainer's quantization, and the products."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in glob.glob(f"{path}/*.safetensors"):
        tensors.update(load_file(f))
    w = tensors["model.layers.0.self_attn.q_proj.weight"].to(device, torch.bfloat16)
    stored = engine.storage[layer_names(0)["qkv"]]  # fused q/k/v: q's rows come first
    trainer = fp8.dequantize_weight(*fp8.quantize_weight_torch(w), torch.float32)
    x = torch.randn(64, w.shape[1], device=device, dtype=torch.bfloat16)
    served = fp8.linear(x, stored)[:, : w.shape[0]].float()
    computed = F.linear(fp8.dequantize_activation(x), trainer).to(torch.bfloat16).float()
    return {
        "weights_max_diff": float((stored.dequantize()[: w.shape[0]] - trainer).abs().max()),
        "product_max_diff": float((served - computed).abs().max()),
        "product_mean_diff": float((served - computed).abs().mean()),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--specs", nargs="+", default=["tiny:qwen2:4x256"], help="model specs `miles train` takes")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=48)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    result: dict = {"device": args.device}
    for spec in args.specs:
        path = resolve_spec(spec)
        engine = CausalLM.from_pretrained(path, device, torch.bfloat16)
        gen = torch.Generator().manual_seed(2)
        seqs = torch.randint(3, engine.spec.vocab_size, (args.batch, args.seq_len), generator=gen).to(device)
        ref_bf16 = token_logprobs(engine, seqs)
        engine.quantize_fp8()
        ref_fp8 = token_logprobs(engine, seqs)
        result[spec] = {
            "forms": forms(path, device, seqs, ref_fp8, ref_bf16),
            "layer0": layer0_projection(engine, path, device),
        }
        for name, f in result[spec]["forms"].items():
            print(f"{spec:18s} {name:11s} vs FP8 engine: mean {f['vs_fp8_mean']:.3e} max {f['vs_fp8_max']:.3e}"
                  f" | vs bf16 engine: mean {f['vs_bf16_mean']:.3e}")  # fmt: skip
        print(f"{spec:18s} layer 0 q: {result[spec]['layer0']}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
