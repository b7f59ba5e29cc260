"""FSDP backend on one GPU (NCCL, 1 rank): bf16 compute, offload frees GPU memory and restores bits.

Reference log-probs come from the fp32 HF model on CPU; bf16 compute over 2 tiny layers stays
within 0.05 nats per token.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from _trainer_harness import configs, free_port, make_batch, make_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    import torch.distributed as dist

    from miles.trainer.backend import create_backend

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    model_dir = make_tiny_model(str(tmp_path_factory.mktemp("gpu") / "model"))
    be = create_backend(
        "fsdp",
        **configs(
            model_dir,
            algo=dict(advantage_estimator="grpo"),
            train=dict(use_dynamic_batch_size=True, max_tokens_per_gpu=64),
            rollout=dict(global_batch_size=8),
        ),
    )
    be.setup()
    yield be, model_dir
    dist.destroy_process_group()


def _reference_log_probs(model_dir: str, batch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = []
    for i, seq in enumerate(batch.sequences()):
        r = int(batch.response_lengths[i])
        ids = torch.from_numpy(seq).unsqueeze(0)
        logp = torch.log_softmax(model(input_ids=ids).logits[0, -r - 1 : -1], -1)
        ref.append(logp.gather(-1, ids[0, -r:, None]).squeeze(-1))
    return torch.cat(ref).detach()


def test_log_probs_close_to_fp32_reference(backend):
    be, model_dir = backend
    batch = make_batch(8, seed=5)
    lp, _ = be.compute_log_probs(batch)
    torch.testing.assert_close(torch.from_numpy(lp), _reference_log_probs(model_dir, batch), atol=5e-2, rtol=0)


def test_train_then_offload_onload_bit_exact(backend):
    be, _ = backend
    m = be.train(make_batch(8, seed=6), rollout_id=0)
    assert m["perf/peak_mem_gb"] > 0 and m["train/grad_norm"] > 0
    snap = [p._local_tensor.detach().clone() for p in be.actor.parameters()]
    states = [v._local_tensor.clone() for s in be.optimizer.state.values() for v in s.values() if v.dim() > 0]
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated()
    be.offload()
    assert torch.cuda.memory_allocated() < used
    be.onload()
    for p, s in zip(be.actor.parameters(), snap, strict=True):
        assert torch.equal(p._local_tensor, s)
    after = [v._local_tensor for s in be.optimizer.state.values() for v in s.values() if v.dim() > 0]
    for a, b in zip(after, states, strict=True):
        assert torch.equal(a, b)
    be.train(make_batch(8, seed=7), rollout_id=1)


def test_compiled_blocks_on_packed_rows(backend):
    """--compile (dynamic shapes): packed rows of varying length give the fp32 reference log-probs."""
    from miles.trainer.backend import create_backend

    _, model_dir = backend
    be = create_backend(
        "fsdp",
        **configs(
            model_dir,
            algo=dict(advantage_estimator="grpo"),
            train=dict(use_dynamic_batch_size=True, max_tokens_per_gpu=64, compile=True),
            rollout=dict(global_batch_size=8),
        ),
    )
    be.setup()
    for seed in (11, 12):  # two different packings: new lengths must not break the compiled blocks
        batch = make_batch(8, seed=seed)
        got, _ = be.compute_log_probs(batch)
        want = _reference_log_probs(model_dir, batch)
        torch.testing.assert_close(torch.from_numpy(got), want, atol=5e-2, rtol=0)
    m = be.train(make_batch(8, seed=13), rollout_id=0)
    assert m["train/grad_norm"] > 0
