"""Fused <-> per-expert MoE weight names: the split the trainer streams and the stack the engine stores."""

import pytest
import torch

from miles.engines.embedded.checkpoint import ModelSpec
from miles.engines.embedded.moe import fuse_experts
from miles.utils.moe_names import per_expert_tensors, split_fused_experts

P = "model.layers.3.mlp.experts"
E, INTER, D = 3, 4, 5


def _spec() -> ModelSpec:
    return ModelSpec(
        model_type="qwen3_moe", vocab_size=8, hidden_size=D, num_layers=4, num_heads=1, num_kv_heads=1, head_dim=D,
        intermediate_size=8, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=16, tie_word_embeddings=False,
        qk_norm=True, num_experts=E, num_experts_per_tok=2, moe_layers=(3,),
    )  # fmt: skip


def _fused() -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = torch.arange(E * 2 * INTER * D, dtype=torch.float32).view(E, 2 * INTER, D)
    down = -torch.arange(E * D * INTER, dtype=torch.float32).view(E, D, INTER)
    return gate_up, down


def test_split_gives_gate_rows_first_then_up_and_each_experts_down():
    gate_up, down = _fused()
    out = dict(split_fused_experts([(f"{P}.gate_up_proj", gate_up), (f"{P}.down_proj", down), ("other", down[0])]))
    assert len(out) == 3 * E + 1 and torch.equal(out["other"], down[0])
    for e in range(E):
        assert torch.equal(out[f"{P}.{e}.gate_proj.weight"], gate_up[e, :INTER])
        assert torch.equal(out[f"{P}.{e}.up_proj.weight"], gate_up[e, INTER:])
        assert torch.equal(out[f"{P}.{e}.down_proj.weight"], down[e])
        assert out[f"{P}.{e}.up_proj.weight"].is_contiguous()


def test_split_refuses_a_tensor_that_is_not_3d():
    with pytest.raises(ValueError, match="3-D"):
        list(per_expert_tensors(f"{P}.down_proj", torch.zeros(2, 3)))


@pytest.mark.parametrize("naming", ["fused", "per_expert"])
def test_engine_storage_is_the_same_from_either_naming(naming):
    gate_up, down = _fused()
    named = [(f"{P}.gate_up_proj", gate_up), (f"{P}.down_proj", down)]
    params = dict(named if naming == "fused" else split_fused_experts(named))
    params["keep"] = torch.zeros(1)
    storage, views = fuse_experts(params, f"{P}.gate_up_proj", f"{P}.down_proj", _spec())
    assert list(params) == ["keep"]  # the expert tensors were taken
    assert torch.equal(storage[f"{P}.gate_up_proj"], gate_up) and torch.equal(storage[f"{P}.down_proj"], down)
    # every per-expert name views the stored block the split gives it
    for name, want in split_fused_experts(named):
        key, index = views[name]
        assert torch.equal(storage[key][index], want)


def test_engine_storage_names_the_missing_expert():
    gate_up, down = _fused()
    params = dict(split_fused_experts([(f"{P}.gate_up_proj", gate_up), (f"{P}.down_proj", down)]))
    del params[f"{P}.1.up_proj.weight"]
    with pytest.raises(ValueError, match=r"experts\.1\.up_proj"):
        fuse_experts(params, f"{P}.gate_up_proj", f"{P}.down_proj", _spec())
