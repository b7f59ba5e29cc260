"""LoRA on the FSDP trainer, 2 gloo ranks: only the adapter trains, is streamed to the engines and is
checkpointed; a resumed run continues bit-identically; the HF export is the merged model plus a
peft adapter that peft itself loads to the same outputs.

The ranks train rollouts 0 and 1, saving and exporting after rollout 0; then a fresh backend loads
that checkpoint and trains rollout 1 again. The references (base weights, the merge) are computed
here from the files on disk, not by the code under test.
"""

from __future__ import annotations

import os

import pytest
import torch

from _trainer_harness import configs, make_batch, make_tiny_model, run_ranks, shard  # isort: skip

from miles.trainer.checkpoint import checkpoint_dir

pytest.importorskip("peft")
N = 8
RANK, ALPHA = 4, 8
CFG = dict(
    algo=dict(advantage_estimator="grpo"),
    train=dict(micro_batch_size=2, clip_grad=1.0, lr=0.05, lora_rank=RANK, lora_alpha=ALPHA),
    rollout=dict(global_batch_size=4),
)  # 2 optimizer steps per rollout


def _backend(model_dir: str):
    from miles.trainer.backend import create_backend

    be = create_backend("fsdp", **configs(model_dir, **CFG))
    be.setup()
    return be


def _full(be) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in be.actor.named_parameters()
    }


def _run(rank: int, world: int, model_dir: str, root: str) -> None:
    """Train rollouts 0 and 1, saving and exporting in between; then a fresh backend loads the checkpoint
    and trains rollout 1 again."""
    be = _backend(model_dir)
    initial = _full(be)
    streamed = [n for n, _ in be.named_hf_tensors()]
    be.train(shard(make_batch(N, seed=10), rank, world, 4), rollout_id=0)
    be.save(checkpoint_dir(os.path.join(root, "save"), 1), {"next_rollout_id": 1})
    be.export_hf(os.path.join(root, "hf_export"))
    saved = _full(be)
    m1 = be.train(shard(make_batch(N, seed=11), rank, world, 4), rollout_id=1)
    a = {"initial": initial, "saved": saved, "final": _full(be), "metrics": m1, "streamed": streamed}
    be.finish_saves()  # the checkpoint is written in the background (--async-save)
    del be
    resumed = _backend(model_dir)
    resumed.load(checkpoint_dir(os.path.join(root, "save"), 1))
    loaded = _full(resumed)
    m1 = resumed.train(shard(make_batch(N, seed=11), rank, world, 4), rollout_id=1)
    b = {"loaded": loaded, "final": _full(resumed), "metrics": m1}
    torch.save({"a": a, "b": b}, os.path.join(root, f"r{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model_dir = make_tiny_model(str(root / "model"))
    run_ranks(_run, 2, model_dir, str(root))
    out = torch.load(root / "r0.pt", weights_only=False)
    return root, model_dir, out["a"], out["b"]


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def test_only_the_adapter_trains_and_streams(runs):
    _, _, a, _ = runs
    assert a["streamed"] and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in a["streamed"])
    assert len(a["streamed"]) == 2 * 2 * 7  # 2 layers x q,k,v,o,gate,up,down (all-linear leaves lm_head out)
    for name, t in a["initial"].items():
        if _is_adapter(name):
            if ".lora_B." in name:
                assert not torch.equal(a["final"][name], t), f"{name} did not train"
        else:
            assert torch.equal(a["final"][name], t), f"frozen {name} changed"


def test_checkpoint_holds_the_adapter_only_and_resumes_identically(runs):
    from torch.distributed.checkpoint import FileSystemReader

    root, _, a, b = runs
    keys = FileSystemReader(str(checkpoint_dir(str(root / "save"), 1)) + "/model").read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("actor.model.")]
    assert model_keys and all(_is_adapter(k) for k in model_keys), model_keys[:5]
    assert all(_is_adapter(k) for k in keys if k.startswith("actor.optim.state."))
    for name, t in a["saved"].items():
        assert torch.equal(b["loaded"][name], t), name
    for key in ("train/loss", "train/pg_loss", "train/grad_norm"):
        assert b["metrics"][key] == a["metrics"][key], key
    for name, t in a["final"].items():
        assert torch.equal(b["final"][name], t), name


def test_export_is_the_merged_model_and_a_peft_adapter(runs):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, model_dir, a, _ = runs
    export = str(root / "hf_export")
    merged = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    adapter = load_file(os.path.join(export, "adapter", "adapter_model.safetensors"))
    state = merged.state_dict()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().state_dict()
    q = "model.layers.0.self_attn.q_proj"
    a_, b_ = adapter[f"base_model.model.{q}.lora_A.weight"], adapter[f"base_model.model.{q}.lora_B.weight"]
    torch.testing.assert_close(state[f"{q}.weight"], base[f"{q}.weight"] + (ALPHA / RANK) * b_ @ a_)
    assert torch.equal(state["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert torch.equal(a_, a["saved"][f"{q}.lora_A.default.weight"])
    ids = torch.arange(1, 30).unsqueeze(0) % 60
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), os.path.join(export, "adapter")
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, merged(ids).logits, rtol=0, atol=1e-5)
