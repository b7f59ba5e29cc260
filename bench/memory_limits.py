"""How large a model one GPU can RL-train: peak memory per phase and step time under each memory lever.

For each shape (Qwen2.5 1.5B / 7B / 14B, from config dicts: random weights built on the meta device and
materialised on the GPU, nothing downloaded) and each lever, a 1-rank FSDP trainer (the real backend,
in-process) runs one colocated GRPO step on `--samples` x `--seq-len` random tokens:

  rollout  the trainer offloaded (`offload()`, as colocated runs do while engines generate) and the
           engine's resident memory allocated at its real size: bf16 weights (the push's bytes) and a
           KV cache for every sample's full sequence. No tokens are generated (random weights).
  train    onload, then `train()`: old log-probs, forward/backward over micro-batches, the optimizer
           step (peaks recorded per sub-phase), one optimizer step for the whole batch.
  push     the weights streamed out in bf16 (`named_hf_tensors`), as a weight push reads them.

Levers: resident (torch's AdamW on the GPU), offload-optimizer-states, stream-disk (fp32 moments),
stream-disk-bf16, optimizer-cpu-offload. A lever that runs out of memory is reported as "oom".
`--trl` adds the update TRL's GRPOTrainer runs (a transformers model, torch AdamW on the GPU, gradient
checkpointing: the HF Trainer's memory model, no DeepSpeed) on the same batch: a TRL-equivalent
measurement, not GRPOTrainer itself (which would also generate with the policy).
`--save-bench` times a checkpoint written during a step: asynchronous (the default) vs synchronous.

    python bench/memory_limits.py --shapes 1.5b --levers resident offload-optimizer-states --trl --save-bench
    python bench/memory_limits.py --shapes 7b --levers offload-optimizer-states optimizer-cpu-offload --trl
    python bench/memory_limits.py --shapes 14b --levers stream-disk-bf16 --disk-dir /dev/shm/miles-optim \\
        --samples 64

Ends with one JSON line (every row).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.train_throughput import init_single_rank  # noqa: E402
from miles.config import AlgoConfig, ModelConfig, RolloutConfig, TrainConfig  # noqa: E402
from miles.rollout.train_data import TrainBatch  # noqa: E402

QWEN25 = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)
SHAPES = {  # Qwen2.5 configs (config.json of the released models)
    "1.5b": dict(QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
    "14b": dict(QWEN25, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, tie_word_embeddings=False),
}  # fmt: skip
LEVERS = {
    "resident": {},
    "offload-optimizer-states": {"offload_optimizer_states": True},
    "stream-disk": {"stream_optimizer_state_to_disk": True},
    "stream-disk-bf16": {"stream_optimizer_state_to_disk": True, "stream_optimizer_state_moment_dtype": "bf16"},
    "optimizer-cpu-offload": {"optimizer_cpu_offload": True},
}
GIB = 2**30


def random_model(shape: str, device: torch.device):
    """A Qwen2 of `shape` with N(0, 0.02) weights: built on meta, materialised straight on `device` in fp32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SHAPES[shape], dtype="float32")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=gen)
    with torch.device(device):  # its inv_freq buffer (not persistent) was left empty by to_empty
        model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    model.config.use_cache = False
    return model


def grpo_batch(samples: int, seq_len: int, prompt_len: int, vocab: int, group: int = 8) -> TrainBatch:
    rng = np.random.default_rng(0)
    resp = seq_len - prompt_len
    return TrainBatch(
        tokens=rng.integers(0, vocab, size=samples * seq_len),
        seq_lens=np.full(samples, seq_len),
        response_lengths=np.full(samples, resp),
        loss_masks=np.ones(samples * resp, np.float32),
        rewards=rng.normal(size=samples).astype(np.float32),
        raw_rewards=np.zeros(samples, np.float32),
        group_index=np.arange(samples) // group,
        sample_index=np.arange(samples),
        truncated=np.zeros(samples, np.int8),
        rollout_log_probs=(-rng.random(samples * resp) * 3).astype(np.float32),
    )


class Peaks:
    """Peak GPU memory (GiB) and seconds of named phases: reset before, read after."""

    def __init__(self) -> None:
        self.peak: dict[str, float] = {}
        self.secs: dict[str, float] = {}

    def run(self, name: str, fn, *a, **kw):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            torch.cuda.synchronize()
            self.secs[name] = self.secs.get(name, 0.0) + time.perf_counter() - t0
            self.peak[name] = max(self.peak.get(name, 0.0), torch.cuda.max_memory_allocated() / GIB)

    def wrap(self, obj, method: str, name: str) -> None:
        real = getattr(obj, method)
        setattr(obj, method, lambda *a, **kw: self.run(name, real, *a, **kw))


def build_backend(shape: str, lever: str, args: argparse.Namespace, **train):
    from miles.trainer.backend import create_backend

    device = torch.device("cuda", 0)
    t = dict(
        lr=1e-6,
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=args.max_tokens_per_gpu,
        gradient_checkpointing=True,
        train_backend="fsdp",
        **LEVERS[lever],
        **train,
    )
    if t.get("stream_optimizer_state_to_disk"):
        t["offload_train_disk_dir"] = args.disk_dir
    be = create_backend(
        "fsdp",
        model=ModelConfig(hf_checkpoint="random:" + shape),
        train=TrainConfig(**t),
        algo=AlgoConfig(advantage_estimator="grpo"),
        rollout=RolloutConfig(global_batch_size=args.samples, rollout_temperature=1.0),
    )
    be._load = lambda path, critic=False: random_model(shape, device)  # no checkpoint: random weights
    be.setup()
    return be


def engine_resident(be, shape: str, args: argparse.Namespace) -> None:
    """What a colocated engine holds while it generates: bf16 weights and the KV cache of every sequence
    (allocated at their sizes; the trainer is offloaded meanwhile, as in the colocated loop)."""
    c = SHAPES[shape]
    weights = [torch.empty(p.shape, dtype=torch.bfloat16, device="cuda") for p in be.actor.parameters()]
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    kv = torch.empty(
        (c["num_hidden_layers"], 2, args.samples * args.seq_len, c["num_key_value_heads"], head_dim),
        dtype=torch.bfloat16,
        device="cuda",
    )
    del weights, kv


def push_bf16(be) -> None:
    """Read every weight as a push does (full bf16 tensors, one at a time)."""
    for _, t in be.named_hf_tensors(torch.bfloat16):
        del t


def one_lever(shape: str, lever: str, args: argparse.Namespace) -> dict:
    row: dict = {"shape": shape, "lever": lever}
    peaks = Peaks()
    be = None
    try:
        be = peaks.run("build", build_backend, shape, lever, args)
        row["params_b"] = round(sum(p.numel() for p in be.actor.parameters()) / 1e9, 3)
        batch = grpo_batch(args.samples, args.seq_len, args.prompt_len, SHAPES[shape]["vocab_size"])
        phases = (
            ("compute_log_probs", "old_logprobs"),
            ("forward_backward", "fwd_bwd"),
            ("optimizer_step", "optim_step"),
        )
        for method, name in phases:
            peaks.wrap(be, method, name)
        step_keys = ("offload", "onload", "train", "push")
        for rid in range(args.steps):
            before = sum(peaks.secs.get(k, 0.0) for k in step_keys)
            if not args.train_only:
                peaks.run("offload", be.offload)
                peaks.run("rollout", engine_resident, be, shape, args)
                peaks.run("onload", be.onload)
            peaks.run("train", be.train, batch, rid)
            peaks.run("push", push_bf16, be)
        total = sum(peaks.secs.get(k, 0.0) for k in step_keys)
        row["step_s"] = round(total / args.steps, 2)
        row["last_step_s"] = round(total - before, 2)  # host buffers of the offload exist from the second step
        row["status"] = "ok"
    except torch.OutOfMemoryError as e:
        row["status"] = "oom"
        row["error"] = str(e).splitlines()[0][:160]
    row["peak_gib"] = {k: round(v, 1) for k, v in peaks.peak.items()}
    row["secs"] = {k: round(v, 2) for k, v in peaks.secs.items()}
    be = None
    torch.cuda.empty_cache()
    return row


def trl_equivalent(shape: str, args: argparse.Namespace) -> dict:
    """The update of TRL's GRPOTrainer on one GPU without DeepSpeed: HF model, AdamW on the GPU, checkpointing."""
    row: dict = {"shape": shape, "lever": "trl-equivalent"}
    peaks = Peaks()
    try:
        model = peaks.run("build", random_model, shape, torch.device("cuda", 0))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
        micro = max(1, args.max_tokens_per_gpu // args.seq_len)
        ids = torch.randint(0, SHAPES[shape]["vocab_size"], (args.samples, args.seq_len), device="cuda")

        def step() -> None:
            for i in range(0, args.samples, micro):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids[i : i + micro], labels=ids[i : i + micro]).loss
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        peaks.run("train", step)
        row["step_s"], row["status"] = round(peaks.secs["train"], 2), "ok"
    except torch.OutOfMemoryError as e:
        row["status"], row["error"] = "oom", str(e).splitlines()[0][:160]
    row["peak_gib"] = {k: round(v, 1) for k, v in peaks.peak.items()}
    model = opt = None
    torch.cuda.empty_cache()
    return row


def _phase_times(metrics: dict) -> dict:
    """The train step's phase timings (`perf/train/*_time`, each read after the device's queue drained)."""
    return {
        k.split("/")[-1]: round(v, 2)
        for k, v in metrics.items()
        if k.startswith("perf/train/") and k.endswith("_time")
    }


def save_bench(shape: str, args: argparse.Namespace) -> dict:
    """A checkpoint written during a step: the step's added time, asynchronous vs synchronous."""
    from miles.trainer.checkpoint import checkpoint_dir

    out: dict = {"shape": shape, "lever": "save-bench"}
    batch = grpo_batch(args.samples, args.seq_len, args.prompt_len, SHAPES[shape]["vocab_size"])
    root = tempfile.mkdtemp(prefix="miles-save-", dir=args.save_dir)
    modes = [(m, m == "async") for m in args.save_modes]
    for mode, flag in modes:
        be = build_backend(shape, "resident", args, async_save=flag)
        be.train(batch, 0)  # warm-up, and the optimizer state exists
        t0 = time.perf_counter()
        be.save(checkpoint_dir(os.path.join(root, mode), 1), {"rollout_id": 0})  # a run's first save
        first_blocked = time.perf_counter() - t0
        be.finish_saves()
        t0 = time.perf_counter()
        plain_phases = _phase_times(be.train(batch, 1))
        plain = time.perf_counter() - t0
        prof = cProfile.Profile() if args.save_profile else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        be.save(checkpoint_dir(os.path.join(root, mode), 2), {"rollout_id": 1})
        blocked = time.perf_counter() - t0
        if prof:
            prof.disable()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            print(f"{mode}: save returned after {blocked:.2f} s; the GPU's queue drained {time.perf_counter() - t1:.2f} s later",
                  file=sys.stderr)  # fmt: skip
            pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(14)
        during_phases = _phase_times(be.train(batch, 2))  # the step during which the checkpoint is written
        during = time.perf_counter() - t0
        t1 = time.perf_counter()
        be.finish_saves()
        out[mode] = {
            "plain_step_s": round(plain, 2),
            "first_save_blocked_s": round(first_blocked, 2),
            "save_blocked_s": round(blocked, 2),
            "step_with_save_s": round(during, 2),
            "added_pct": round(100 * (during - plain) / plain, 1),
            "wait_after_s": round(time.perf_counter() - t1, 2),
            "phases_plain_s": plain_phases,  # where the step with the write in flight loses its time
            "phases_with_save_s": during_phases,
        }
        be = None
        torch.cuda.empty_cache()
        shutil.rmtree(os.path.join(root, mode), ignore_errors=True)  # two 12-byte-per-parameter checkpoints a mode
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["1.5b"], choices=list(SHAPES))
    ap.add_argument("--levers", nargs="*", default=list(LEVERS), choices=list(LEVERS))
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (prompt + response)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens-per-gpu", type=int, default=16384, help="tokens per packed micro-batch")
    ap.add_argument("--steps", type=int, default=1, help="colocated steps per lever (the step time is their mean)")
    ap.add_argument("--disk-dir", default=tempfile.gettempdir(), help="--offload-train-disk-dir for stream-disk*")
    ap.add_argument(
        "--train-only", action="store_true", help="no colocated offload/rollout phases: the trainer alone on the GPU"
    )
    ap.add_argument("--trl", action="store_true", help="also the TRL-equivalent update on each shape")
    ap.add_argument("--save-bench", action="store_true", help="also time an async vs sync save (first shape)")
    ap.add_argument("--save-profile", action="store_true", help="--save-bench: profile the save's blocking part")
    ap.add_argument("--save-modes", nargs="+", default=["async", "sync"], choices=["async", "sync"])
    ap.add_argument("--save-dir", default=tempfile.gettempdir(), help="where --save-bench writes checkpoints")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # SHAPE/LEVER|trl|save: one job, in this process
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("memory_limits needs a CUDA GPU (it measures GPU memory)")
    if args.one:
        init_single_rank(torch.device("cuda", 0))
        print(json.dumps(run_job(args.one, args)), flush=True)
        return
    jobs = [f"{shape}/{lever}" for shape in args.shapes for lever in args.levers + (["trl"] if args.trl else [])]
    jobs += [f"{args.shapes[0]}/save"] if args.save_bench else []
    rows = []
    for job in jobs:
        rows.append(run_in_child(job))
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(0), "samples": args.samples, "seq_len": args.seq_len,
                      "rows": rows}))  # fmt: skip


def run_job(job: str, args: argparse.Namespace) -> dict:
    shape, lever = job.split("/")
    if lever == "trl":
        return trl_equivalent(shape, args)
    if lever == "save":
        return save_bench(shape, args)
    return one_lever(shape, lever, args)


def run_in_child(job: str) -> dict:
    """One job in a fresh process: each starts with the host's memory and CUDA's pinned-memory cache empty
    (a lever that offloads 90 GB to host memory would otherwise leave it cached for the next)."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--one", job],
        stdout=subprocess.PIPE,
        text=True,
    )
    last = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and last:
        return json.loads(last[-1])
    shape, lever = job.split("/")
    why = "killed (host memory)" if proc.returncode in (-9, 137) else f"exit code {proc.returncode}"
    return {"shape": shape, "lever": lever, "status": why}


if __name__ == "__main__":
    main()
