"""Offload -> onload restores parameters and optimizer state bit-exactly (2 gloo ranks).

Two backends start from the same weights and take one step. One of them is offloaded (its
storages must really be released) and onloaded; both then take another step. Bits of every
local parameter shard and Adam moment must equal the snapshot, and the second step must match
the never-offloaded twin bit for bit. The frozen reference model moves to host too and gives the
same log-probs when brought back for its forward.
"""

from __future__ import annotations

import os

import pytest
import torch

from _trainer_harness import configs, make_batch, make_tiny_model, run_ranks, shard  # isort: skip

N = 4


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = _local(t).detach()
    return t.clone().view(torch.int32) if t.dtype == torch.float32 else t.clone()


def _snapshot(be) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": _bits(p) for n, p in be.actor.named_parameters()}
    names = {p: n for n, p in be.actor.named_parameters()}
    for p, state in be.optimizer.state.items():
        for k, v in state.items():
            out[f"optim/{names[p]}/{k}"] = _bits(v)
    return out


def _rank_fn(rank: int, world: int, model_dir: str, root: str) -> None:
    from miles.trainer.backend import create_backend

    algo = dict(advantage_estimator="grpo", use_kl_loss=True, kl_loss_coef=0.1)  # with a reference model
    cfg = configs(model_dir, algo=algo, rollout=dict(global_batch_size=N))
    twins = [create_backend("fsdp", **cfg) for _ in range(2)]
    local = shard(make_batch(N, seed=3), rank, world, N)
    for be in twins:
        be.setup()
        be.train(local, rollout_id=0)
    be = twins[0]
    before = _snapshot(be)
    ref_before = be.compute_log_probs(local, "ref")[0]
    be.offload()
    released = all(_local(p).untyped_storage().nbytes() == 0 for p in be.actor.parameters())
    released &= all(_local(p).untyped_storage().nbytes() == 0 for p in be.ref.parameters())
    released &= all(
        _local(v).untyped_storage().nbytes() == 0
        for s in be.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    be.onload()
    after = _snapshot(be)
    # the reference model stays on host and is brought back only for its forward
    ref_same = bool((be.compute_log_probs(local, "ref")[0] == ref_before).all())
    m = [b.train(local, rollout_id=1) for b in twins]
    next_params = [{n: _bits(t) for n, t in b.named_hf_tensors()} for b in twins]
    torch.save(
        {
            "before": before,
            "after": after,
            "released": released,
            "ref_same": ref_same,
            "metrics": m,
            "next": next_params,
        },
        os.path.join(root, f"rank{rank}.pt"),
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    model_dir = make_tiny_model(str(root / "model"))
    run_ranks(_rank_fn, 2, model_dir, str(root))
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_offload_releases_and_restores_bit_exactly(results):
    for r in results:
        assert r["released"]
        assert r["ref_same"]
        assert set(r["before"]) == set(r["after"])
        assert any(k.endswith("exp_avg_sq") for k in r["before"])  # optimizer state was covered
        for k, v in r["before"].items():
            assert torch.equal(r["after"][k], v), k


def test_training_after_onload_matches_never_offloaded_twin(results):
    for r in results:
        assert r["metrics"][0]["train/loss"] == r["metrics"][1]["train/loss"]
        for name, bits in r["next"][1].items():
            assert torch.equal(r["next"][0][name], bits), name
