"""Checkpoints: save -> fresh processes -> load -> next step equals an uninterrupted run.

Run A trains rollouts 0 and 1, saving after rollout 0 and exporting HF safetensors. Run B is a
new pair of processes that auto-resumes from the latest *complete* checkpoint (a later directory
without its COMPLETE marker is planted and must be skipped) and trains rollout 1. On CPU fp32
the same ops run in the same order, so loss, lr and every parameter must be bit-identical.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from _trainer_harness import configs, make_batch, make_tiny_model, run_ranks, shard  # isort: skip

from miles.trainer.checkpoint import COMPLETE_MARKER, checkpoint_dir, latest_complete_checkpoint

N = 8
CFG = dict(
    algo=dict(advantage_estimator="grpo", entropy_coef=0.01),
    train=dict(micro_batch_size=2, clip_grad=1.0, lr_warmup_iters=3, lr_decay_style="cosine", lr_decay_iters=10),
    rollout=dict(global_batch_size=4),
)  # 2 optimizer steps per rollout


def _backend(model_dir: str):
    from miles.trainer.backend import create_backend

    be = create_backend("fsdp", **configs(model_dir, **CFG))
    be.setup()
    return be


def _params(be) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in be.named_hf_tensors()}


def _run_a(rank: int, world: int, model_dir: str, root: str) -> None:
    be = _backend(model_dir)
    be.train(shard(make_batch(N, seed=10), rank, world, 4), rollout_id=0)
    save_dir = os.path.join(root, "save")
    be.save(checkpoint_dir(save_dir, 1), {"next_rollout_id": 1, "data_source": {"epoch": 0, "offset": 8}})
    be.finish_saves()  # written in the background (--async-save): complete from here on
    be.export_hf(os.path.join(root, "hf_export"))
    exported_params = _params(be)
    m1 = be.train(shard(make_batch(N, seed=11), rank, world, 4), rollout_id=1)
    if rank == 0:
        # a later save that crashed before its marker: must be ignored by auto-resume
        partial = checkpoint_dir(save_dir, 2)
        shutil.copytree(checkpoint_dir(save_dir, 1), partial)
        os.remove(os.path.join(partial, COMPLETE_MARKER))
    torch.save({"metrics": m1, "params": _params(be), "exported": exported_params}, os.path.join(root, f"a{rank}.pt"))


def _run_b(rank: int, world: int, model_dir: str, root: str) -> None:
    be = _backend(model_dir)
    path = latest_complete_checkpoint(os.path.join(root, "save"))
    extra = be.load(path)
    m1 = be.train(shard(make_batch(N, seed=11), rank, world, 4), rollout_id=1)
    torch.save({"metrics": m1, "params": _params(be), "path": path, "extra": extra}, os.path.join(root, f"b{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model_dir = make_tiny_model(str(root / "model"))
    run_ranks(_run_a, 2, model_dir, str(root))
    run_ranks(_run_b, 2, model_dir, str(root))
    load = lambda name: torch.load(root / name, weights_only=False)  # noqa: E731
    return root, [load(f"a{r}.pt") for r in range(2)], [load(f"b{r}.pt") for r in range(2)]


def test_resume_gives_identical_next_step(runs):
    root, a, b = runs
    assert b[0]["path"] == checkpoint_dir(str(root / "save"), 1)  # iter_0000002 had no marker
    assert b[0]["extra"] == {"next_rollout_id": 1, "data_source": {"epoch": 0, "offset": 8}}
    for key in ("train/loss", "train/pg_loss", "train/lr", "train/grad_norm", "train/entropy"):
        assert b[0]["metrics"][key] == a[0]["metrics"][key], key
    assert a[0]["metrics"]["train/lr"] != pytest.approx(1e-2 / 3)  # schedule advanced past step 0
    for name, p in a[0]["params"].items():
        assert torch.equal(b[0]["params"][name], p), name
        assert torch.equal(b[1]["params"][name], p), name


def test_hf_export_round_trips(runs):
    from transformers import AutoModelForCausalLM

    root, a, _ = runs
    model = AutoModelForCausalLM.from_pretrained(str(root / "hf_export"), dtype=torch.float32)
    loaded = dict(model.named_parameters())
    assert set(loaded) == set(a[0]["exported"])
    for name, p in a[0]["exported"].items():
        assert torch.equal(loaded[name].detach(), p), name


def test_latest_complete_checkpoint_ignores_unmarked(tmp_path):
    assert latest_complete_checkpoint(str(tmp_path / "missing")) is None
    for step, complete in ((3, True), (7, True), (12, False)):
        d = checkpoint_dir(str(tmp_path), step)
        os.makedirs(d)
        if complete:
            open(os.path.join(d, COMPLETE_MARKER), "w").close()
    os.makedirs(tmp_path / "not_a_checkpoint")
    assert latest_complete_checkpoint(str(tmp_path)) == checkpoint_dir(str(tmp_path), 7)
