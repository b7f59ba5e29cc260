"""HF <-> Megatron conversion of Qwen3-MoE (miles/trainer/mcore_convert.py + mcore_moe_convert.py), no megatron-core.

A tiny random qwen3_moe (4 experts, top-2) goes HF -> Megatron shards of every (pipeline stage,
tensor-parallel rank, expert-parallel rank, expert-tensor-parallel rank) -> gathered the way the
megatron backend gathers them for export -> HF, bit-exact, from both HF expert layouts: transformers'
fused in-memory `experts.gate_up_proj` / `down_proj` and the per-expert names of the checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from miles.trainer import mcore_convert as mc
from miles.trainer import mcore_moe_convert as moe
from miles.utils.moe_names import split_fused_experts


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp("qwen3_moe")), arch="qwen3_moe", vocab=515)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _export(stages: dict, s: mc.ModelShape, pp: int, tp: int, ep: int, etp: int) -> dict[str, torch.Tensor]:
    """What `named_hf_tensors` streams: TP shards gathered; each expert stack built from the local experts,
    gathered over expert-TP, then concatenated over EP ranks in rank order."""
    out = {}
    for pp_rank, mname, hnames in mc.hf_export_names(s, pp):
        if mc.parallel_kind(mname).startswith("expert"):
            local = moe.local_expert_names(mname, s.num_experts // ep)
            per_ep = [
                mc.gather_shards(
                    mname, [torch.stack([stages[pp_rank, 0, e, j][n] for n in local]) for j in range(etp)]
                )
                for e in range(ep)
            ]
            full = torch.cat(per_ep)
        else:
            full = mc.gather_shards(mname, [stages[pp_rank, r, 0, 0][mname] for r in range(tp)])
        for name, t in mc.to_hf(mname, full, hnames, s):
            assert name not in out, f"{name} exported twice"
            out[name] = t
    return out


def _round_trip(hf: dict, s: mc.ModelShape, pp: int, tp: int, ep: int, etp: int) -> dict[str, torch.Tensor]:
    stages = {}
    for pp_rank in range(pp):
        kw = dict(layers=mc.stage_layers(s.num_layers, pp, pp_rank), pre=pp_rank == 0, post=pp_rank == pp - 1)
        for r in range(tp):
            for e in range(ep):
                for j in range(etp):
                    ranks = dict(tp_rank=r, tp_size=tp, ep_rank=e, ep_size=ep, etp_rank=j, etp_size=etp)
                    stages[pp_rank, r, e, j] = mc.to_mcore(hf, s, **kw, **ranks)
    return _export(stages, s, pp, tp, ep, etp)


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@pytest.mark.parametrize("pp,tp,ep,etp", [(1, 1, 1, 1), (1, 1, 2, 1), (1, 2, 4, 2), (2, 2, 2, 1)])
def test_round_trip_is_bit_exact(hf_moe, layout, pp, tp, ep, etp):
    s = mc.model_shape(hf_moe.config)
    fused = {n: p.detach() for n, p in hf_moe.named_parameters()}
    assert any(".experts.gate_up_proj" in n for n in fused)  # transformers' fused in-memory layout
    per_expert = dict(split_fused_experts(fused.items()))
    back = _round_trip(fused if layout == "fused" else per_expert, s, pp, tp, ep, etp)
    assert sorted(back) == sorted(per_expert), "exported names differ from the per-expert HF names"
    for name, t in per_expert.items():
        assert torch.equal(back[name], t), name


def test_shape_and_shards(hf_moe):
    s = mc.model_shape(hf_moe.config)
    assert (s.num_experts, s.moe_topk, s.moe_ffn_hidden_size, s.qk_norm) == (4, 2, 64, True)
    hf = {n: p.detach() for n, p in hf_moe.named_parameters()}
    shard = mc.to_mcore(hf, s, layers=range(2), pre=True, post=True, ep_rank=1, ep_size=2, etp_rank=1, etp_size=2)
    # EP rank 1 of 2 holds experts 2 and 3 as its local experts 0 and 1; expert-TP rank 1 its half of each
    gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"][3]
    fc1 = shard["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate_up[32:64], gate_up[96:128]]))
    fc2 = shard["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert torch.equal(fc2, hf["model.layers.1.mlp.experts.down_proj"][3][:, 32:])
    assert torch.equal(shard["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
    assert not any(".local_experts.2." in n or "mlp.linear_fc1" in n for n in shard)


def test_hf_shape_knows_every_exported_tensor(hf_moe):
    s = mc.model_shape(hf_moe.config)
    params = dict(split_fused_experts((n, p.detach()) for n, p in hf_moe.named_parameters()))
    names = [h for _, _, hnames in mc.hf_export_names(s, 2) for h in hnames]
    assert sorted(names) == sorted(params)
    for name in names:
        assert mc.hf_shape(name, s) == tuple(params[name].shape), name


def test_expert_parallel_sizes_are_refused_by_name(hf_moe):
    s = mc.model_shape(hf_moe.config)
    kw = dict(layers=range(0), pre=False, post=False)
    with pytest.raises(ValueError, match="--expert-model-parallel-size=3 must divide the model's 4 experts"):
        mc.to_mcore({}, s, ep_size=3, **kw)
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size=3 must divide"):
        mc.to_mcore({}, s, etp_size=3, **kw)
