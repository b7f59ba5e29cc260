"""LoRA on one GPU: the embedded engine serves a merged adapter through CUDA graphs and fused kernels,
and the FSDP backend (NCCL, bf16 compute) trains the adapter alone.

The engine reference is transformers with the adapter injected by peft, in fp32 on the same GPU.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("peft")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from _trainer_harness import configs, free_port, make_batch, make_tiny_model  # noqa: E402

from miles.engines.embedded.engine import EmbeddedEngine  # noqa: E402
from miles.models.tiny import make_tiny_model as make_engine_model  # noqa: E402

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 24}


def _peft_model(path: str):
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    inject_adapter_in_model(LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"), hf)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return hf


@pytest.mark.parametrize("fused", [False, True])
def test_graphed_engine_serves_the_merged_adapter(tmp_path, fused):
    """Graphs captured on the base weights replay the adapter after it is merged in place."""
    from miles.trainer.lora import adapter_tensors

    path = make_engine_model(
        str(tmp_path / "llama"), arch="llama", hidden=128, layers=3, intermediate=256, init_std=0.2
    )
    hf = _peft_model(path)
    prompts = [list(range(3 + i, 12 + 2 * i)) for i in range(4)]
    engine = EmbeddedEngine(path, device="cuda", dtype="float32", cuda_graphs=True, fused_kernels=fused)

    async def main():
        await engine.start()
        try:
            base = await asyncio.gather(*(engine.generate(input_ids=p, sampling_params=GREEDY) for p in prompts))
            engine.load_lora_adapter(list(adapter_tensors(hf)), {"r": 8, "lora_alpha": 16}, "a")
            adapted = await asyncio.gather(*(engine.generate(input_ids=p, sampling_params=GREEDY) for p in prompts))
            return base, adapted
        finally:
            await engine.shutdown()

    base, adapted = asyncio.run(main())
    for prompt, a in zip(prompts, adapted, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt], device="cuda"),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert a["output_ids"] == ref
    assert any(a["output_ids"] != b["output_ids"] for a, b in zip(adapted, base, strict=True))


def _full(be) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in be.actor.named_parameters()
    }


def test_fsdp_bf16_trains_only_the_adapter(tmp_path):
    import torch.distributed as dist

    from miles.trainer.backend import create_backend

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        be = create_backend(
            "fsdp",
            **configs(
                make_tiny_model(str(tmp_path / "model")),
                algo=dict(advantage_estimator="grpo"),
                train=dict(use_dynamic_batch_size=True, max_tokens_per_gpu=64, lora_rank=4, lora_alpha=8, lr=1e-2),
                rollout=dict(global_batch_size=8),
            ),
        )
        be.setup()
        before = _full(be)
        metrics = be.train(make_batch(8, seed=1), rollout_id=0)
        assert torch.isfinite(torch.tensor(metrics["train/loss"]))
        for name, t in _full(be).items():
            if ".lora_B." in name:  # lora_A gets no gradient while B is still zero (its first step)
                assert not torch.equal(t, before[name]), f"{name} did not train"
            elif ".lora_A." not in name:
                assert torch.equal(t, before[name]), f"frozen {name} changed"
        pushed = list(be.named_hf_tensors(torch.bfloat16))
        assert pushed and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n, _ in pushed)
        assert all(t.dtype == torch.bfloat16 and t.is_cuda for _, t in pushed)
    finally:
        dist.destroy_process_group()
