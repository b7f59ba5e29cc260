"""The FSDP trainer under each optimizer-memory lever: the same weights after RL steps as resident AdamW.

One gloo rank, fp32 on CPU. Host moments, fp32 moments on disk and the CPU step must give every
parameter bit for bit what torch's resident AdamW gives (with the same kernel); a checkpoint saved
under the CPU step and loaded into a fresh trainer continues exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

from _trainer_harness import configs, make_batch, make_tiny_model, run_ranks  # isort: skip

CFG = dict(
    algo=dict(advantage_estimator="grpo"),
    train=dict(micro_batch_size=2, clip_grad=1.0),
    rollout=dict(global_batch_size=4),
)
LEVERS = {
    "resident": {},
    "host": {"offload_optimizer_states": True},
    "disk": {"stream_optimizer_state_to_disk": True, "offload_train_disk_chunk_mb": 1},
    "cpu": {"optimizer_cpu_offload": True},
    "disk-bf16": {"stream_optimizer_state_to_disk": True, "stream_optimizer_state_moment_dtype": "bf16"},
    "offload-to-disk": {"offload_train_target": "disk"},  # offloaded to files and back between the rollouts
}


def _backend(model_dir: str, lever: dict, disk_dir: str, dtype: str = "auto"):
    from miles.config import ModelConfig
    from miles.trainer.backend import create_backend

    train = dict(CFG["train"], **lever)
    if lever.get("stream_optimizer_state_to_disk") or lever.get("offload_train_target") == "disk":
        train["offload_train_disk_dir"] = disk_dir
    cfg = configs(model_dir, **{**CFG, "train": train})
    cfg["model"] = ModelConfig(hf_checkpoint=model_dir, dtype=dtype)
    be = create_backend("fsdp", **cfg)
    be.setup()
    return be


def _params(be) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in be.named_hf_tensors()}


def _train_each(rank: int, world: int, model_dir: str, root: str) -> None:
    out = {}
    for name, lever in LEVERS.items():
        be = _backend(model_dir, lever, root)
        for rid in range(2):
            be.train(make_batch(8, seed=20 + rid), rollout_id=rid)
            if rid == 0 and name == "offload-to-disk":
                be.offload()
                out["released"] = all(p.untyped_storage().nbytes() == 0 for p in be.actor.parameters())
                out["files"] = sum(
                    len(files) for _, _, files in os.walk(root) if any(f.endswith(".bin") for f in files)
                )
                be.onload()
        out[name] = _params(be)
        if name == "cpu":  # save under the CPU step; a fresh trainer resumes it below
            be.save(os.path.join(root, "ckpt", "iter_0000002"), {"rollout_id": 1})
            be.train(make_batch(8, seed=22), rollout_id=2)
            out["cpu-continued"] = _params(be)
        del be
    be = _backend(model_dir, LEVERS["cpu"], root)
    be.load(os.path.join(root, "ckpt", "iter_0000002"))
    be.train(make_batch(8, seed=22), rollout_id=2)
    out["cpu-resumed"] = _params(be)
    del be
    be = _backend(model_dir, LEVERS["cpu"], root, dtype="bfloat16")  # weights kept in the compute dtype
    out["bf16-dtypes"] = (
        {p.dtype for p in be.actor.parameters()},
        {n: b.dtype for n, b in be.actor.named_buffers()},
        {n: b.dtype for n, b in _backend(model_dir, {}, root, dtype="bfloat16").actor.named_buffers()},
    )
    torch.save(out, os.path.join(root, "out.pt"))


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("levers")
    model_dir = make_tiny_model(str(root / "model"))
    run_ranks(_train_each, 1, model_dir, str(root))
    return torch.load(root / "out.pt", weights_only=False)


@pytest.mark.parametrize("lever", ["host", "disk", "cpu", "offload-to-disk"])
def test_lever_trains_bit_identically_to_resident_adamw(weights, lever):
    want, got = weights["resident"], weights[lever]
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]


def test_bf16_moments_differ_but_stay_close(weights):
    want, got = weights["resident"], weights["disk-bf16"]
    assert any(not torch.equal(want[k], got[k]) for k in want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-3)


def test_checkpoint_under_cpu_step_resumes_bit_identically(weights):
    want, got = weights["cpu-continued"], weights["cpu-resumed"]
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert any(not torch.equal(want[k], weights["cpu"][k]) for k in want)  # the resumed step did move weights


def test_offload_to_disk_releases_the_storages_into_files(weights):
    assert weights["released"] and weights["files"] > 0


def test_cpu_step_keeps_buffers_as_resident_does(weights):
    """Under bf16 compute the CPU step holds bf16 weights on the device, but buffers (the rotary inv_freq)
    stay as resident AdamW's mixed precision leaves them: cast, they would move every position's angle."""
    param_dtypes, cpu_buffers, resident_buffers = weights["bf16-dtypes"]
    assert param_dtypes == {torch.bfloat16}
    assert cpu_buffers and cpu_buffers == resident_buffers
    assert torch.float32 in set(cpu_buffers.values())
