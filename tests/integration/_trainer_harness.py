"""Helpers for the trainer integration tests: a tiny HF model, batches, and 2-rank gloo jobs.

Rank functions run in fresh processes started by torch.multiprocessing and report through files in a
result directory (torch.save of plain tensors), so the test process holds no process group.

The rank processes fork from multiprocessing's fork server, which imports torch, transformers and the
FSDP backend once a test session (the preload list in tests/conftest.py): a spawned rank spent seconds of
CPU on those imports before its first line of work, and the suite starts dozens. Each rank is still a new
process that has run no test code and holds no state of an earlier rank; it gets the test process's
current environment, working directory and `sys.path`, as a spawned one does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles.config import AlgoConfig, ModelConfig, RolloutConfig, TrainConfig
from miles.rollout.train_data import TrainBatch
from miles.wire.ports import free_port

VOCAB = 64


def make_tiny_model(path: str, seed: int = 0) -> str:
    """A 2-layer Qwen2 with random weights, saved as a HF directory (tied embeddings)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init so log-probs vary visibly
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else None
    model.save_pretrained(path)
    return path


def make_batch(num_samples: int, seed: int, *, min_len: int = 5, max_len: int = 20) -> TrainBatch:
    """Random sequences of varied lengths, responses of >= 1 token, some masked-out tokens."""
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(min_len, max_len + 1, size=num_samples)
    resp = np.array([rng.integers(1, s) for s in seq_lens])
    n_resp = int(resp.sum())
    mask = (rng.random(n_resp) > 0.2).astype(np.float32)
    return TrainBatch(
        tokens=rng.integers(0, VOCAB, size=int(seq_lens.sum())).astype(np.int64),
        seq_lens=seq_lens.astype(np.int64),
        response_lengths=resp.astype(np.int64),
        loss_masks=mask,
        rewards=rng.normal(size=num_samples).astype(np.float32),
        raw_rewards=np.zeros(num_samples, np.float32),
        group_index=np.arange(num_samples),
        sample_index=np.arange(num_samples),
        truncated=np.zeros(num_samples, np.int8),
        rollout_log_probs=(-rng.random(n_resp) * 3).astype(np.float32),
    )


def shard(batch: TrainBatch, rank: int, world: int, per_step: int) -> TrainBatch:
    """Rank r's shard: for each optimizer step of `per_step` samples, its contiguous per_step/world slice."""
    per_rank = per_step // world
    idx = [s + rank * per_rank + i for s in range(0, len(batch), per_step) for i in range(per_rank)]
    return batch.select(idx)


def configs(model_dir: str, *, algo: dict | None = None, train: dict | None = None, rollout: dict | None = None):
    t = {"lr": 1e-2, "clip_grad": 0.0, "adam_beta2": 0.99, "micro_batch_size": 2} | (train or {})
    return dict(
        model=ModelConfig(hf_checkpoint=model_dir),
        train=TrainConfig(**t),
        algo=AlgoConfig(**(algo or {})),
        rollout=RolloutConfig(**(rollout or {})),
    )


def _fresh(rank: int, fn: Callable, env: dict[str, str], args: tuple) -> None:
    os.environ.clear()  # the test process's environment now, not the fork server's from its start
    os.environ.update(env)
    fn(rank, *args)


def start_ranks(fn: Callable, args: tuple, nprocs: int, *, join: bool = True):
    """`torch.multiprocessing.start_processes(fn, args, nprocs, join)` with each process forked from the
    fork server (module docstring); with join=False, the context to join."""
    return mp.start_processes(
        _fresh, args=(fn, dict(os.environ), args), nprocs=nprocs, join=join, start_method="forkserver"
    )


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # A rank that finished leaves without the interpreter's teardown, as the workers do
    # (miles/workers/main.py): a library thread still joinable at exit can abort the process
    # ("terminate called without an active exception", SIGABRT) after its work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable, world: int, *args) -> None:
    """Run fn(rank, world, *args) in `world` new gloo rank processes; raises if any rank fails."""
    start_ranks(_entry, (world, free_port(), fn, args), world)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded gradients by HF name (collective)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def capture_grads_at_step(be) -> dict[str, torch.Tensor]:
    """A dict that `be`'s next optimizer steps fill with the unsharded gradients they apply (by HF name)."""
    captured: dict[str, torch.Tensor] = {}
    step = be.optimizer.step

    def capture_then_step(*a, **kw):
        captured.update(full_grads(be.actor))
        return step(*a, **kw)

    be.optimizer.step = capture_then_step
    return captured
