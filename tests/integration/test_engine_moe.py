"""The embedded engine on a tiny qwen3_moe: either expert naming loads, and routed experts (R3) come back
as SGLang returns them, equal to the experts `transformers`' router picks for the same tokens."""

import asyncio
import json
import os

import numpy as np
import pytest
import torch
from harness import with_engine
from safetensors.torch import load_file, save_file

from miles.models.tiny import make_tiny_model
from miles.utils.routing import decode_sglang

torch.set_num_threads(1)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("moe")), arch="qwen3_moe", init_std=0.2, seed=0)


def _fused_copy(src: str, dst: str) -> str:
    """The same model saved with transformers 5's fused expert names."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts"
        n = cfg["num_local_experts"]
        out[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]]) for e in range(n)]
        )
        out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(n)])
    save_file(out, os.path.join(dst, "model.safetensors"))
    return dst


def run(model_path, body):
    return with_engine(body, model_path=model_path)


def test_fused_and_per_expert_checkpoints_serve_the_same_tokens(moe_dir, tmp_path):
    fused_dir = _fused_copy(moe_dir, str(tmp_path / "fused"))
    prompt = [5, 17, 42, 9, 3]

    async def body(engine):
        out = await engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 12})
        names = sorted(n for n, _ in engine.named_weights())
        # a push under the fused names lands in the per-expert views
        gu = engine.model.storage["model.layers.1.mlp.experts.gate_up_proj"]
        engine.load_weights([("model.layers.1.mlp.experts.gate_up_proj", torch.ones_like(gu))])
        ones = engine.model.params["model.layers.1.mlp.experts.3.up_proj.weight"]
        return out["output_ids"], names, bool((ones == 1).all())

    ids_a, names_a, _ = run(moe_dir, body)
    ids_b, names_b, pushed = run(fused_dir, body)
    assert ids_a == ids_b and names_a == names_b and pushed
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names_a
    assert not any(n.endswith("gate_up_proj") for n in names_a)  # published under checkpoint names


def _hf_routing(model_dir: str, ids: list[int]) -> np.ndarray:
    """[len(ids), layers, k] top-k ids `transformers`' routers choose, teacher-forced."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    picked = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: picked.append(out[2])) for layer in hf.model.layers
    ]
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(picked, dim=1).numpy()


def test_routed_experts_equal_the_hf_routers_choice(moe_dir):
    prompts = [[5, 17, 42, 9, 3], [7, 7, 100, 2, 64, 31, 8, 11]]

    async def body(engine):
        return await asyncio.gather(
            *(
                engine.generate(
                    input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 10}, return_routed_experts=True
                )
                for p in prompts
            ),
            engine.generate(
                input_ids=prompts[0],
                sampling_params={**GREEDY, "max_new_tokens": 4},
                return_routed_experts=True,
                routed_experts_start_len=3,
            ),
        )

    *outs, tail = run(moe_dir, body)
    for prompt, out in zip(prompts, outs, strict=True):
        seq = prompt + out["output_ids"]
        got = decode_sglang(out["meta_info"]["routed_experts"], 2, 2, 4)
        assert got.dtype == np.uint8 and got.shape == (len(seq) - 1, 2, 2)
        want = _hf_routing(moe_dir, seq[:-1])
        np.testing.assert_array_equal(np.sort(got, -1), np.sort(want, -1))
    got_tail = decode_sglang(tail["meta_info"]["routed_experts"], 2, 2, 4)
    assert got_tail.shape == (len(prompts[0]) + 4 - 1 - 3, 2, 2)
    np.testing.assert_array_equal(got_tail, decode_sglang(outs[0]["meta_info"]["routed_experts"], 2, 2, 4)[3:8])


def test_routed_experts_refused_for_a_dense_model(tmp_path):
    dense = make_tiny_model(str(tmp_path / "dense"), arch="qwen2")

    async def body(engine):
        with pytest.raises(ValueError, match="no MoE layers"):
            await engine.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2}, return_routed_experts=True)

    run(dense, body)
