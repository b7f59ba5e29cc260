"""MoE on one device: the engine's grouped-expert decode against the per-expert loop, and R3's effect on the
train/rollout mismatch, on a random qwen3_moe of real proportions (built in memory, no checkpoint).

Decode: one engine decode step (all layers, batch B, KV of `--context` tokens) with the grouped expert path
against the same step with the per-expert loop (`CausalLM.moe_impl = "loop"`, the HF experts' loop);
medians of `--reps` timed steps each, side by side. Prints the ratio.

Mismatch: the engine (in `--engine-dtype`) prefills random prompts and samples `--new-tokens` tokens each,
recording the experts of every token (what `return_routed_experts` returns) and each sampled token's
log-prob. The trainer's model (transformers' Qwen3MoeForCausalLM in `--trainer-dtype`, the same weights; its
residual stream in fp32 with `--trainer-residual-dtype float32`, as `--fp32-residual-connection` keeps it)
scores the sequences through the FSDP trainer's own forward (`forward_micro_batch`) with routing replay off,
then with R3 (`RoutingReplay`, the engine's routing). Reported per mode: the share of routed tokens whose
experts in the trainer's forward differ from the engine's (any MoE layer), and mean / max |Δ log-prob| over
the sampled tokens. `--router-noise` adds relative noise to the trainer's router weights only (a stand-in for
kernels that disagree more than dtype alone). `--engine-moe-rounding fused|transformers` makes the engine's
grouped expert kernels round once on store, or where transformers' experts do (`moe_triton.ROUND_AS_TRANSFORMERS`,
the engine's default). `--gemm-split-reduction fp32` keeps cuBLAS from summing split-K partial products in bf16
(torch's default allows it), on both sides. `--engine-rescore` also scores the sampled sequences with the
engine's own prefill: its decode against that prefill, and the trainer (R3 off / on) against it, which splits
what R3 leaves into the engine's two paths and the trainer's distance from the engine.

    python bench/moe.py                                    # H200: 24 layers, 128 experts, top-8, bf16 engine
    python bench/moe.py --device cpu --layers 2 --hidden 64 --experts 8 --topk 2 --moe-intermediate 32 \\
        --heads 4 --kv-heads 2 --batch 8 --skip-decode         # the CPU smoke the tests run

Ends with one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from miles.engines.embedded import moe_triton
from miles.engines.embedded.checkpoint import ModelSpec
from miles.engines.embedded.model import CausalLM
from miles.engines.embedded.moe import Routing
from miles.engines.embedded.runner import ModelRunner
from miles.rollout.train_data import TrainBatch
from miles.trainer.forward import forward_micro_batch, model_layout
from miles.trainer.residual_stream import keep_fp32_residual
from miles.trainer.routing_replay import RoutingReplay
from miles.utils.routing import routing_bytes_per_token


def hf_config(a: argparse.Namespace):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads, intermediate_size=4 * a.moe_intermediate,
        moe_intermediate_size=a.moe_intermediate, num_experts=a.experts, num_experts_per_tok=a.topk,
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=1e6,
    )  # fmt: skip


def random_weights(cfg, device: torch.device, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weights under transformers 5's names (fused experts), std 0.02 as HF initialises; norms at 1.

    Drawn in the engine's dtype: the engine serves them as they are (no copy) and the trainer's wider copy holds
    exactly the same values, so the only differences left are the two forwards' arithmetic and routing."""
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Qwen3MoeForCausalLM(cfg).named_parameters()}
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, device=device, dtype=dtype)
        else:
            out[name] = (torch.randn(shape, generator=gen, device=device) * 0.02).to(dtype)
    return out


def engine_model(cfg, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> CausalLM:
    spec = ModelSpec.from_config(cfg.to_dict())
    return CausalLM(spec, {n: t.to(dtype) for n, t in weights.items()}, device, dtype)


def trainer_model(cfg, weights: dict[str, torch.Tensor], dtype: torch.dtype, router_noise: float, seed: int):
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM._from_config(cfg, attn_implementation="sdpa")
    gen = torch.Generator(device=next(iter(weights.values())).device).manual_seed(seed + 1)
    state = {}
    for name, t in weights.items():
        if router_noise and name.endswith("mlp.gate.weight"):
            t = t + router_noise * t.abs().mean() * torch.randn(t.shape, generator=gen, device=t.device)
        state[name] = t.to(dtype)  # a copy when the dtype widens; shared (read-only here) when it does not
    hf.load_state_dict(state, assign=True, strict=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg).to(next(iter(weights.values())).device)
    return hf.eval()


@torch.no_grad()
def rollout(model: CausalLM, a: argparse.Namespace, seed: int) -> tuple[list[list[int]], np.ndarray, list]:
    """Sampled sequences [B][prompt + new], the engine's log-prob of each new token [B, new], routing per seq."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, a.vocab, (a.batch, a.prompt_len), generator=gen).tolist()
    runner = ModelRunner(
        model, max_running_requests=a.batch, max_seq_len=a.prompt_len + a.new_tokens + 1, use_cuda_graphs=False
    )
    runner.kv.allocate()
    prefill_routing = Routing()
    res = runner.prefill(prompts, 0, [False] * a.batch, routing=prefill_routing)
    stacked = prefill_routing.stacked()  # [B * prompt_len, layers, k]
    rows = [stacked.view(a.batch, a.prompt_len, *stacked.shape[1:]).cpu()]
    logits, seqs, lps = res.last_logits, [list(p) for p in prompts], []
    sample_gen = torch.Generator(device=model.device).manual_seed(seed + 7)
    for step in range(a.new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=sample_gen).squeeze(1)
        lps.append(logp.gather(1, tok[:, None]).squeeze(1).cpu())
        for s, t in zip(seqs, tok.tolist(), strict=True):
            s.append(t)
        if step + 1 == a.new_tokens:
            break
        routing = Routing()
        logits = runner.decode(tok, [a.prompt_len + step] * a.batch, routing)
        rows.append(routing.stacked().unsqueeze(1).cpu())
    routed = torch.cat(rows, dim=1).numpy()  # [B, len - 1, layers, k]
    return seqs, torch.stack(lps, dim=1).numpy(), routed


@torch.no_grad()
def rescore(model: CausalLM, seqs: list[list[int]], prompt_len: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """The engine's own prefill over the sampled sequences (`chunk` at a time, as the trainer scores them): the
    log-prob of each token after the first `prompt_len` [B, len - prompt_len] and the experts of every token but
    the last [B, len - 1, ...], the arrays `rollout` returns from decoding, so the two can be compared (and the
    trainer against either)."""
    width = len(seqs[0])  # the whole sequence, as the trainer scores it
    runner = ModelRunner(model, max_running_requests=chunk, max_seq_len=width + 1, use_cuda_graphs=False)
    runner.kv.allocate()
    lps, rows = [], []
    for lo in range(0, len(seqs), chunk):
        part = seqs[lo : lo + chunk]
        routing = Routing()
        res = runner.prefill(part, 0, [True] * len(part), routing=routing)
        for logits, s in zip(res.all_logits, part, strict=True):
            logp = torch.log_softmax(logits[prompt_len - 1 : -1].float(), dim=-1)
            sampled = torch.as_tensor(s[prompt_len:], device=logp.device)
            lps.append(logp.gather(1, sampled[:, None]).squeeze(1).cpu())
        stacked = routing.stacked()
        rows.append(stacked.view(len(part), width, *stacked.shape[1:])[:, :-1].cpu())
    runner.kv.release()
    return torch.stack(lps).numpy(), torch.cat(rows).numpy()


def self_mismatch(routed: np.ndarray, lps: np.ndarray, rescored_routed: np.ndarray, rescored_lps: np.ndarray) -> dict:
    """The engine's decode against its own prefill: the share of tokens whose experts differ in any MoE layer (as
    sets: the order of a top-k is not a routing difference), and mean / max |Δ log-prob| of the sampled tokens."""
    differ = (np.sort(routed, axis=-1) != np.sort(rescored_routed, axis=-1)).any(axis=(-1, -2))
    diff = np.abs(lps - rescored_lps)
    return {
        "routing_mismatch": float(differ.mean()),
        "logprob_abs_diff_mean": float(diff.mean()),
        "logprob_abs_diff_max": float(diff.max()),
    }


def train_batch(seqs, routed: np.ndarray, new_tokens: int, num_experts: int) -> TrainBatch:
    from miles.utils.routing import routing_dtype

    return TrainBatch.unscored(
        np.concatenate([np.asarray(s, np.int64) for s in seqs]),
        [len(s) for s in seqs],
        np.full(len(seqs), new_tokens),
        routed_experts=routed.reshape(-1, *routed.shape[2:]).astype(routing_dtype(num_experts)),
    )


def mismatch(
    hf, seqs, routed: np.ndarray, engine_lps: np.ndarray, a: argparse.Namespace, device: torch.device
) -> dict[str, dict[str, float]]:
    """R3 off and on: routing mismatch share and |Δ log-prob| of the trainer's forward against the engine's.

    The trainer scores `--train-micro-batch` sequences per forward (as its dynamic batching would), so the
    activations of a real-proportion model fit beside its weights."""
    replay = RoutingReplay(hf, mode="measure")
    out = {}
    for mode in ("off", "on"):
        replay.begin_step()
        replay.mode = "rollout" if mode == "on" else "measure"
        diffs = []
        for lo in range(0, len(seqs), a.train_micro_batch):
            hi = min(lo + a.train_micro_batch, len(seqs))
            batch = train_batch(seqs[lo:hi], routed[lo:hi], a.new_tokens, a.experts)
            with torch.no_grad(), replay.scope(batch, model_layout(hf), first_pass=True):
                lp, _, _ = forward_micro_batch(hf, batch, device, 1.0, entropy="none")
            diffs.append(np.abs(lp.float().cpu().numpy() - engine_lps[lo:hi].reshape(-1)))
        diff = np.concatenate(diffs)
        n, used, own = replay.counts
        out[mode] = {
            "routing_mismatch": used / n,
            "router_rollout_mismatch": own / n,
            "logprob_abs_diff_mean": float(diff.mean()),
            "logprob_abs_diff_max": float(diff.max()),
        }
    return out


def decode_speed(model: CausalLM, a: argparse.Namespace) -> dict[str, float]:
    """Median seconds of one decode step at batch a.batch with the grouped path and with the loop."""
    runner = ModelRunner(model, max_running_requests=a.batch, max_seq_len=a.context + 2, use_cuda_graphs=False)
    runner.kv.allocate()
    tokens = torch.randint(0, a.vocab, (a.batch,), device=model.device)
    positions = [a.context] * a.batch
    times: dict[str, list[float]] = {"grouped": [], "loop": []}
    for rep in range(a.reps + 1):
        for impl in ("grouped", "loop"):
            model.moe_impl = impl
            _sync(model.device)
            t0 = time.perf_counter()
            runner.decode(tokens, positions)
            _sync(model.device)
            if rep:  # the first round warms up
                times[impl].append(time.perf_counter() - t0)
    model.moe_impl = "grouped"
    grouped, loop = statistics.median(times["grouped"]), statistics.median(times["loop"])
    return {"decode_grouped_s": grouped, "decode_loop_s": loop, "decode_speedup": loop / grouped}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for name, default in (("layers", 24), ("hidden", 2048), ("heads", 32), ("kv-heads", 4), ("experts", 128),
                          ("topk", 8), ("moe-intermediate", 768), ("vocab", 32768), ("batch", 256),
                          ("context", 512), ("reps", 5), ("prompt-len", 64), ("new-tokens", 32), ("seed", 0)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--engine-dtype", default="bfloat16")
    p.add_argument("--trainer-dtype", default="float32")
    p.add_argument("--router-noise", type=float, default=0.0)
    p.add_argument(
        "--residual-dtype",
        choices=("float32", "model"),
        default="float32",
        help="the engine's residual stream: fp32 (the engine's default for bf16 models) or "
        "the model dtype (as before; for the side-by-side)",
    )
    p.add_argument(
        "--trainer-residual-dtype",
        choices=("float32", "model"),
        default="model",
        help="the trainer's residual stream: fp32 (--fp32-residual-connection; with a bf16 --trainer-dtype) or "
        "the model dtype (transformers' own, the default)",
    )
    p.add_argument(
        "--engine-moe-rounding",
        choices=("transformers", "fused"),
        default=None,
        help="where the engine's grouped expert kernels round in bf16: as transformers' experts do (the engine's "
        "default, moe_triton.ROUND_AS_TRANSFORMERS) or once, on store (fused); refused where those kernels "
        "do not run (off CUDA without Triton's interpreter: the torch path there rounds as transformers does)",
    )
    p.add_argument(
        "--gemm-split-reduction",
        choices=("torch", "fp32"),
        default="torch",
        help="how cuBLAS may sum a bf16 GEMM's split-K partial products, both sides: as torch allows by default "
        "(in bf16, allow_bf16_reduced_precision_reduction) or in fp32 only; the engine's decode GEMMs (M = the "
        "batch) split K where the trainer's (M = its tokens) do not, so a bf16 sum rounds on one side only",
    )
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-mismatch", action="store_true")
    p.add_argument("--train-micro-batch", type=int, default=32, help="sequences per trainer forward")
    p.add_argument(
        "--engine-rescore",
        action="store_true",
        help="also score the sampled sequences with the engine's own prefill: its decode against its prefill "
        "(routing and log-probs), and the trainer (R3 off / on) against that prefill, what R3 cannot remove "
        "split into the engine's two paths and the trainer's distance from them",
    )
    return p.parse_args(argv)


def set_engine_moe_rounding(rounding: str | None, device: torch.device) -> None:
    """`--engine-moe-rounding`: where the grouped expert kernels round (None: the engine's default); refused where
    those kernels do not run."""
    if rounding is None:
        return
    if not moe_triton.usable(torch.empty(0, device=device)):
        raise SystemExit(
            f"--engine-moe-rounding {rounding}: the grouped expert kernels do not run on {device} "
            "(the engine's torch path rounds as transformers' experts do); drop the flag, or run on CUDA"
        )
    moe_triton.ROUND_AS_TRANSFORMERS = rounding == "transformers"


def run(a: argparse.Namespace) -> dict:
    device = torch.device(a.device)
    set_engine_moe_rounding(a.engine_moe_rounding, device)
    if a.engine_rescore and a.skip_mismatch:
        raise SystemExit("--engine-rescore splits the mismatch that --skip-mismatch skips; drop one of them")
    if a.gemm_split_reduction == "fp32":
        if device.type != "cuda":
            raise SystemExit(
                f"--gemm-split-reduction fp32: cuBLAS's split-K sums only, none on {device}; drop the flag"
            )
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    cfg = hf_config(a)
    weights = random_weights(cfg, device, a.seed, getattr(torch, a.engine_dtype))
    engine = engine_model(cfg, weights, device, getattr(torch, a.engine_dtype))
    engine.fp32_residual = a.residual_dtype == "float32" and engine.dtype != torch.float32
    figures: dict = {"config": {k: v for k, v in vars(a).items() if k != "device"}, "device": a.device}
    carried, miles_int32 = routing_bytes_per_token(a.layers, a.topk, a.experts)
    figures.update(routing_bytes_per_token=carried, int32_bytes_per_token=miles_int32)
    if not a.skip_decode:
        figures.update(decode_speed(engine, a))
        print(
            f"decode step, batch {a.batch}: grouped {figures['decode_grouped_s'] * 1e3:.2f} ms, "
            f"per-expert loop {figures['decode_loop_s'] * 1e3:.2f} ms, ratio {figures['decode_speedup']:.2f}x",
            flush=True,
        )  # before the mismatch half, which needs the most memory
    if not a.skip_mismatch:
        seqs, lps, routed = rollout(engine, a, a.seed)
        rescored = rescore(engine, seqs, a.prompt_len, a.train_micro_batch) if a.engine_rescore else None
        del engine  # free the engine's weights and KV before the trainer's copy is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hf = trainer_model(cfg, weights, getattr(torch, a.trainer_dtype), a.router_noise, a.seed)
        if a.trainer_residual_dtype == "float32":
            keep_fp32_residual(hf, getattr(torch, a.trainer_dtype))
        figures["mismatch"] = mismatch(hf, seqs, routed, lps, a, device)
        if rescored is not None:
            figures["engine_decode_vs_prefill"] = self_mismatch(routed, lps, rescored[1], rescored[0])
            figures["mismatch_vs_engine_prefill"] = mismatch(hf, seqs, rescored[1], rescored[0], a, device)
    return figures


def main(argv: list[str] | None = None) -> None:
    figures = run(parse(argv))
    for mode, m in figures.get("mismatch", {}).items():
        print(f"R3 {mode}: routing mismatch {m['routing_mismatch']:.4%}, |dlogp| mean {m['logprob_abs_diff_mean']:.3e} "
              f"max {m['logprob_abs_diff_max']:.3e}")  # fmt: skip
    if "engine_decode_vs_prefill" in figures:
        m = figures["engine_decode_vs_prefill"]
        print(f"engine decode vs its prefill: routing mismatch {m['routing_mismatch']:.4%}, |dlogp| mean "
              f"{m['logprob_abs_diff_mean']:.3e} max {m['logprob_abs_diff_max']:.3e}")  # fmt: skip
        for mode, m in figures["mismatch_vs_engine_prefill"].items():
            print(f"against the engine's prefill, R3 {mode}: routing mismatch {m['routing_mismatch']:.4%}, |dlogp| "
                  f"mean {m['logprob_abs_diff_mean']:.3e} max {m['logprob_abs_diff_max']:.3e}")  # fmt: skip
    print(
        f"routing bytes/token: {figures['routing_bytes_per_token']} (int32 layout: {figures['int32_bytes_per_token']})"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
