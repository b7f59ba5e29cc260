"""Generated tokens/s: embedded engine vs `transformers` generate, same model, prompts, lengths, batch.

Both sides sample (temperature 1, no truncation), ignore eos and generate exactly --new-tokens per
request; each round is timed end to end (prefill included); after one warm-up each (the engine's after two
one-token rounds of the same prompts, which with prefix sharing build the extend path's kernels, and an emptied
cache; with sharing, then full rounds until one evicts no cached page), engine and HF rounds
alternate for --reps repetitions (both see the same machine load) and the medians are compared. On CUDA
it also reports the decode roofline: HBM bandwidth / bytes read per decode step (all weights once + the
batch's KV at the mean context length) x batch, and the fraction of it the decode phase reaches (decode
tok/s = the tokens after the first over a full round's time minus a prefill-plus-one-token round's).
The scheduler's own timeline of the timed rounds gives the decode steps directly (`decode_steps`): the wall
time from one full-batch decode step to the next, the host's wait for the device within it, the rest
(host work the device waited for, when it is the longer side) and the share served by a lookahead.
--sync-debug (CUDA) runs one more round with torch's sync debug mode and counts the operations that made
the host wait for the device, by source line. --kv-cache-dtype fp8_e4m3 stores the KV cache in FP8 (the
roofline then counts its bytes at one a value), with bf16 weights or, beside --quantization fp8, FP8 ones.

CPU:  python bench/engine_throughput.py --batch 32
GPU:  python bench/engine_throughput.py --device cuda --batch 256 --prompt-len 128 --new-tokens 256 \
          --hidden 896 --layers 24 --heads 14 --kv-heads 2 --intermediate 4864 --vocab 151936
      (+ --profile-step: where the graphed decode step's GPU time goes, kernel by kernel;
       + --sync-debug: which lines synchronized with the device during a round)
Ends with one JSON line: engine_tok_s, hf_tok_s, ratio, batch, device (+ roofline figures on CUDA).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

import torch
from engine_profile import graph_step_ms, profile_graph_step, profile_round, sync_census

from miles.config import EMBEDDED_KV_CACHE_DTYPES
from miles.engines.embedded.engine import EmbeddedEngine
from miles.engines.embedded.engine_setup import kv_bytes_per_token
from miles.engines.embedded.request import StepTime, decode_step_summary
from miles.models.tiny import make_tiny_model
from miles.utils.gc_freeze import freeze_heap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--arch", default="qwen2")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--model-path", default=None, help="use this HF directory instead of a random model")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="capture decode steps in CUDA graphs (CUDA only)",
    )
    p.add_argument(
        "--fused-kernels",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Triton decode/sampling kernels (default: where they run, i.e. CUDA with triton)",
    )
    p.add_argument("--profile", action="store_true", help="after timing, profile one engine round (top kernels)")
    p.add_argument(
        "--profile-step",
        action="store_true",
        help="CUDA: profile replays of the graphed decode step at the mean context and print where its time goes "
        "(kernels by category: GEMM, attention, norms, RoPE/KV write, activation, other; and the idle gap)",
    )
    p.add_argument(
        "--sync-debug",
        action="store_true",
        help="CUDA: one more engine round under torch.cuda.set_sync_debug_mode('warn'); prints the lines that "
        "synchronized with the device and how often (a decode step should have none but its result copy)",
    )
    p.add_argument("--quantization", default=None, choices=[None, "fp8"], help="serve the model in FP8 (fp8.py)")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn prefix sharing off (prefix_cache.py)")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=EMBEDDED_KV_CACHE_DTYPES,
        help="what the KV cache stores (kv_cache.py): auto (the model's dtype), fp8_e4m3 or fp8_e5m2",
    )
    p.add_argument(
        "--residual-dtype",
        choices=("float32", "model"),
        default="float32",
        help="the engine's residual stream in a bf16 model: fp32 (its default) or bf16 (what it cost, side by side)",
    )
    p.add_argument(
        "--hbm-gbps",
        type=float,
        default=None,
        help="HBM bandwidth (GB/s) for the roofline; default: the device's own, from its name (H200 4800, H100 SXM "
        "3350, ...), refused for a device not in the table",
    )
    p.add_argument("--skip-hf", action="store_true", help="engine only (ratio reported as null)")
    p.add_argument(
        "--hf-cache-implementation",
        choices=("dynamic", "static"),
        default="dynamic",
        help="the KV cache of the transformers side's generate: dynamic (its default) or static, with which "
        "transformers compiles the decode step on a GPU (TRL's cache_implementation='static')",
    )
    args = p.parse_args(argv)
    refuse_idle_flags(p, args)
    return args


def refuse_idle_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with one line for a flag that would have nothing to act on in this call."""
    if args.profile_step and args.device == "cpu":
        p.error("--profile-step profiles the CUDA-graphed decode step; run it with --device cuda")
    if args.sync_debug and args.device == "cpu":
        p.error("--sync-debug counts host waits for a CUDA device; run it with --device cuda")
    if args.hbm_gbps is not None and args.device == "cpu":
        p.error(
            "--hbm-gbps sets the decode roofline, which is reported on CUDA only; drop it or run with --device cuda"
        )
    if args.hf_cache_implementation != "dynamic" and args.skip_hf:
        p.error("--hf-cache-implementation sets the transformers side's cache, which --skip-hf leaves out; drop one")


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, prompt_len), generator=g).tolist()  # ids 0-2 are special


SETTLE_ROUNDS = 6  # full rounds at most after the warm-up, until the prefix cache evicts nothing


class EngineSide:
    """Engine rounds on a persistent event loop, so they can interleave with HF rounds."""

    def __init__(self, engine: EmbeddedEngine, prompts: list[list[int]]):
        self.engine, self.prompts = engine, prompts
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(engine.start())
        freeze_heap("bench engine ready")  # as the rollout worker does once its engine serves
        self.timeline: list[StepTime] | None = None  # a list: the scheduler's steps are recorded into it

    async def _round(self, n_new: int) -> float:
        params = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": n_new, "ignore_eos": True}
        start = time.perf_counter()
        outs = await asyncio.gather(*(self.engine.generate(input_ids=p, sampling_params=params) for p in self.prompts))
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()
        return sum(o["meta_info"]["completion_tokens"] for o in outs) / (time.perf_counter() - start)

    def round(self, n_new: int) -> float:
        self.engine.scheduler.timeline = self.timeline
        try:
            return self.loop.run_until_complete(self._round(n_new))
        finally:
            self.engine.scheduler.timeline = None

    def seconds(self, n_new: int) -> float:
        """Wall time of one round of n_new tokens per prompt."""
        return len(self.prompts) * n_new / self.round(n_new)

    def warm_extend(self) -> None:
        """Two one-token rounds of the prompts, the second hitting the first's pages, so the extend path builds
        its kernels before any timed round; then the cache is emptied, so the full warm-up round and the timed
        rounds share pages as they would without these. (One such round after the full warm-up, its pages
        kept, left the timed rounds evicting 1,100 pages and at 110K tok/s against 142K before it, on an H100
        at the 0.5B shape; in this order they are at 140-141K again: bench/results/engine_throughput.md.)"""
        for _ in range(2):
            self.seconds(1)
        self.engine.flush_cache()

    def settle_cache(self, n_new: int) -> int:
        """Full rounds until one evicts no shared page (at most SETTLE_ROUNDS), so the timed rounds start from the
        cache's steady state: where the pool cannot hold every prompt, the rounds after the first evict and
        replace pages for a few rounds while the pool's set of prompts settles (on CPU, 64 prompts of 64 tokens
        over 104 pages: 26, 6, 1, then 0 pages evicted a round; on an H100 at the 0.5B shape the first timed
        round ran at 116K tok/s and the next at 141-143K before this). Returns the rounds run."""
        for rounds in range(1, SETTLE_ROUNDS + 1):
            evicted = self.evicted()
            self.round(n_new)
            if self.evicted() == evicted:
                return rounds
        return SETTLE_ROUNDS

    def evicted(self) -> int:
        """Shared pages evicted since the engine started (0 without prefix sharing)."""
        return self.engine.prefix_cache_stats()["evicted_pages"]

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.shutdown())
        self.loop.close()


class HFSide:
    def __init__(
        self,
        model_path: str,
        device: torch.device,
        dtype: torch.dtype,
        prompts: list[list[int]],
        cache_implementation: str = "dynamic",
    ):
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        self.device = device
        # "static": a fixed-shape KV cache, with which transformers compiles the decode step on a GPU (what TRL's
        # GRPOConfig(cache_implementation="static") hands its generate); "dynamic" is generate's default
        self.cache = {} if cache_implementation == "dynamic" else {"cache_implementation": cache_implementation}
        self.ids = torch.tensor(prompts, device=device)
        self.mask = torch.ones_like(self.ids)

    @torch.inference_mode()
    def round(self, n_new: int) -> float:
        start = time.perf_counter()
        out = self.hf.generate(
            self.ids,
            attention_mask=self.mask,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            eos_token_id=None,
            pad_token_id=0,
            **self.cache,
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == self.ids.shape[1] + n_new
        return self.ids.shape[0] * n_new / (time.perf_counter() - start)


def measure(sides: dict, new_tokens: int, reps: int) -> tuple[dict[str, float], dict[str, list[StepTime]]]:
    """Warm every side up, then alternate their rounds so both see the same machine load: the medians, and
    each engine side's scheduler steps in the timed rounds."""
    engines = {name: side for name, side in sides.items() if isinstance(side, EngineSide)}
    for side in engines.values():
        side.warm_extend()
    evicted = {name: side.evicted() for name, side in engines.items()}
    for side in sides.values():
        side.round(new_tokens)  # a full-length round each: allocations, graph capture, GEMM heuristics
    for name, side in engines.items():
        if side.evicted() > evicted[name]:  # the pool could not hold the round's pages: let it settle
            side.settle_cache(new_tokens)
        side.timeline = []
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(reps):
        for name, side in sides.items():
            rates[name].append(side.round(new_tokens))
    timelines = {name: side.timeline for name, side in engines.items()}
    for side in engines.values():
        side.timeline = None
    for name, values in rates.items():
        print(f"{name} tok/s per rep: {[round(r) for r in values]}")
    return {name: statistics.median(values) for name, values in rates.items()}, timelines


# HBM bandwidth by device name (GB/s, the makers' figures), longest match first
HBM_GBPS = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM, HBM3
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40 GB
)


def device_hbm_gbps(name: str) -> float:
    """The HBM bandwidth of a device by its name (torch.cuda.get_device_name); ValueError if not known."""
    for key, gbps in HBM_GBPS:
        if key in name:
            return gbps
    raise ValueError(f"no HBM bandwidth known for {name!r}: pass --hbm-gbps (GB/s) for its roofline")


def decode_roofline(engine: EmbeddedEngine, batch: int, prompt_len: int, new_tokens: int, hbm_gbps: float) -> float:
    """Tokens/s if each decode step only had to read every weight once plus the batch's KV from HBM."""
    s = engine.model.spec
    weight_bytes = sum(t.numel() * t.element_size() for _, t in engine.named_weights())
    kv_token_bytes = kv_bytes_per_token(s, engine.runner.kv.storage_dtype)  # in what the cache stores
    step_bytes = weight_bytes + batch * (prompt_len + new_tokens / 2) * kv_token_bytes
    return batch * hbm_gbps * 1e9 / step_bytes


def build_engine(args: argparse.Namespace, tmp: str, dtype_name: str) -> tuple[str, EmbeddedEngine]:
    """The model directory (--model-path, else a random model of the flags' shape in `tmp`) and its engine."""
    model_path = args.model_path or make_tiny_model(
        tmp,
        arch=args.arch,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        vocab=args.vocab,
        dtype=dtype_name,
        init_std=0.02,
        device=args.device,  # a GPU draws large shapes in seconds
    )
    engine = EmbeddedEngine(
        model_path,
        device=args.device,
        dtype=dtype_name,
        max_running_requests=args.batch,
        max_total_tokens=args.batch * (args.prompt_len + args.new_tokens + 8),
        cuda_graphs=args.cuda_graphs,
        fused_kernels=args.fused_kernels,
        quantization=args.quantization,
        prefix_cache=not args.no_prefix_cache,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine.model.fp32_residual = args.residual_dtype == "float32" and engine.model.dtype != torch.float32
    return model_path, engine


def measure_sides(
    args: argparse.Namespace, engine: EmbeddedEngine, model_path: str, device: torch.device, dtype_name: str
) -> dict:
    """Every figure of a call: both sides' tok/s, the decode phase's, the roofline, and the optional
    profiles; the engine side is closed at the end."""
    prompts = make_prompts(args.batch, args.prompt_len, engine.model.spec.vocab_size)
    roofline = None
    if device.type == "cuda":
        roofline = decode_roofline(engine, args.batch, args.prompt_len, args.new_tokens, args.hbm_gbps)
    sides = {"engine": EngineSide(engine, prompts)}
    if not args.skip_hf:
        sides["hf"] = HFSide(model_path, device, getattr(torch, dtype_name), prompts, args.hf_cache_implementation)
    try:
        medians, timelines = measure(sides, args.new_tokens, args.reps)
        prefix = engine.prefix_cache_stats()  # over the warm-up and timed rounds
        # decode phase alone: a full round minus a prefill-plus-one-token round, same prompts
        first_token_s = statistics.median(sides["engine"].seconds(1) for _ in range(3))
        full_s = args.batch * args.new_tokens / medians["engine"]
        decode_tok_s = args.batch * (args.new_tokens - 1) / max(full_s - first_token_s, 1e-9)
        mean_context = args.prompt_len + args.new_tokens // 2
        step_ms = graph_step_ms(engine, args.batch, mean_context) if device.type == "cuda" else None
        if args.profile:
            profile_round(sides["engine"], min(args.new_tokens, 32))
        step_profile = profile_graph_step(engine, args.batch, mean_context) if args.profile_step else None
        syncs = sync_census(sides["engine"], args.new_tokens) if args.sync_debug else None
    finally:
        sides["engine"].close()
    return {
        "engine_tok_s": medians["engine"],
        "hf_tok_s": medians.get("hf"),
        "decode_steps": decode_step_summary(timelines["engine"], args.batch),
        "roofline": roofline,
        "decode_tok_s": decode_tok_s,
        "step_ms": step_ms,
        "step_profile": step_profile,
        "syncs": syncs,
        "prefix": prefix,
    }


def result_line(args: argparse.Namespace, device: torch.device, engine: EmbeddedEngine, m: dict) -> dict:
    """The closing JSON line from measure_sides' figures (the roofline ones on CUDA only)."""
    engine_tok_s, hf_tok_s = m["engine_tok_s"], m["hf_tok_s"]
    result = {
        "engine_tok_s": round(engine_tok_s, 1),
        "hf_tok_s": None if hf_tok_s is None else round(hf_tok_s, 1),
        "hf_cache_implementation": None if hf_tok_s is None else args.hf_cache_implementation,
        "ratio": None if hf_tok_s is None else round(engine_tok_s / hf_tok_s, 2),
        "batch": args.batch,
        "device": str(device),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "quantization": args.quantization,
        "prefix_cache": not args.no_prefix_cache,
        "kv_cache_dtype": args.kv_cache_dtype,
        "residual_dtype": args.residual_dtype,
        "decode_steps": m["decode_steps"],
        "prefix": {k: round(v, 3) if isinstance(v, float) else v for k, v in m["prefix"].items()},
        "shape": {
            "arch": args.arch,
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "intermediate": args.intermediate,
            "vocab": args.vocab,
        },
    }
    if device.type == "cuda":
        roofline, decode_tok_s, step_ms = m["roofline"], m["decode_tok_s"], m["step_ms"]
        result |= {
            "cuda_graphs": args.cuda_graphs,
            "fused_kernels": engine.runner.fused_kernels,
            "hbm_gbps": args.hbm_gbps,
            "roofline_tok_s": round(roofline),
            "decode_tok_s": round(decode_tok_s, 1),
            "roofline_fraction": round(decode_tok_s / roofline, 3),  # decode phase against the decode roofline
            "end_to_end_roofline_fraction": round(engine_tok_s / roofline, 3),  # prefill included
            # GPU time of a graphed decode step at the mean context (sampling excluded) against the
            # measured wall time per decode step
            "graph_step_ms": None if step_ms is None else round(step_ms, 3),
            "decode_step_wall_ms": round(args.batch / decode_tok_s * 1e3, 3),
        }
        if m["step_profile"] is not None:
            result["step_profile_us"] = m["step_profile"]
        if m["syncs"] is not None:
            result["sync_waits"] = m["syncs"]
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and args.hbm_gbps is None:
        try:
            args.hbm_gbps = device_hbm_gbps(torch.cuda.get_device_name(device))
        except ValueError as e:
            raise SystemExit(f"engine_throughput: {e}") from None
    dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    with tempfile.TemporaryDirectory() as tmp:
        model_path, engine = build_engine(args, tmp, dtype_name)
        m = measure_sides(args, engine, model_path, device, dtype_name)
    result = result_line(args, device, engine, m)
    engine_tok_s, hf_tok_s = m["engine_tok_s"], m["hf_tok_s"]
    if hf_tok_s is not None:
        print(
            f"engine {engine_tok_s:,.0f} tok/s vs transformers generate {hf_tok_s:,.0f} tok/s: "
            f"ratio {engine_tok_s / hf_tok_s:.2f}x"
        )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
