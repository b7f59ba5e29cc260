"""Memory levers and asynchronous saves on one GPU (NCCL, 1 rank, bf16 compute, fused AdamW).

Host moments and fp32 moments on disk run torch's fused CUDA AdamW on each bucket: the weights after
two RL steps equal resident AdamW's bit for bit. The CPU step (fused CPU AdamW on fp32 masters in host
memory) leaves bf16 weights on the device: they equal resident AdamW's fp32 weights rounded to bf16, within
one bf16 step (the CPU and CUDA kernels may round the masters' last bit differently). An asynchronous checkpoint taken before a step and loaded afterwards holds the weights of the
save, not of the step that ran during the write.
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

LEVERS = {
    "resident": {},
    "host": {"offload_optimizer_states": True},
    "disk": {"stream_optimizer_state_to_disk": True},
    "cpu": {"optimizer_cpu_offload": True},
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import torch.distributed as dist

    from miles.trainer.backend import create_backend

    root = tmp_path_factory.mktemp("levers_gpu")
    own_group = not dist.is_initialized()
    if own_group:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    model_dir = make_tiny_model(str(root / "model"))

    def backend(**lever):
        train = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=64, **lever)
        if lever.get("stream_optimizer_state_to_disk"):
            train["offload_train_disk_dir"] = str(root)
        cfg = configs(model_dir, algo=dict(advantage_estimator="grpo"), train=train, rollout=dict(global_batch_size=8))
        be = create_backend("fsdp", **cfg)
        be.setup()
        return be

    out = {}
    for name, lever in LEVERS.items():
        be = backend(**lever)
        for rid in range(2):
            be.train(make_batch(8, seed=40 + rid), rollout_id=rid)
        out[name] = {n: t.float().cpu() for n, t in be.named_hf_tensors()}
        del be
    be = backend()
    be.train(make_batch(8, seed=40), rollout_id=0)
    out["at_save"] = {n: t.float().cpu() for n, t in be.named_hf_tensors()}
    with torch.cuda.stream(be._saver._copy_stream):
        torch.cuda._sleep(400_000_000)  # the snapshot's copies start ~0.2 s late: the next step must wait for them
    before = torch.cuda.memory_allocated()
    be.save(os.path.join(root, "save", "iter_0000001"), {"rollout_id": 0})
    out["save_gpu_bytes"] = torch.cuda.memory_allocated() - before
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in be.actor.parameters())
    be.train(make_batch(8, seed=41), rollout_id=1)  # while the checkpoint is written
    be.finish_saves()
    fresh = backend()
    fresh.load(os.path.join(root, "save", "iter_0000001"))
    out["loaded"] = {n: t.float().cpu() for n, t in fresh.named_hf_tensors()}
    yield out
    if own_group:
        dist.destroy_process_group()


@pytest.mark.parametrize("lever", ["host", "disk"])
def test_streamed_moments_equal_resident_bit_for_bit(trained, lever):
    want, got = trained["resident"], trained[lever]
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_cpu_step_equals_resident_rounded_to_bf16(trained):
    want, got = trained["resident"], trained["cpu"]
    for k in want:
        # one bf16 ulp is 2**-8..2**-7 of the value; a step lost or applied twice moves weights by ~lr = 1e-2
        torch.testing.assert_close(got[k], want[k].to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6)


def test_async_checkpoint_holds_the_weights_of_its_step(trained):
    want, got = trained["at_save"], trained["loaded"]
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_async_checkpoint_snapshot_takes_no_gpu_memory(trained):
    """The snapshot lives in host memory: no copy of the state is left on the GPU while it is written."""
    assert trained["save_gpu_bytes"] < trained["param_bytes"] / 4, trained["save_gpu_bytes"]
