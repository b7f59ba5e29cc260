"""HF <-> Megatron weight conversion (miles/trainer/mcore_convert.py), plain torch, no megatron-core.

The fused layouts are checked against hand-written expectations; whole tiny models of each family
go HF -> Megatron shards (every tensor- and pipeline-parallel rank) -> gathered -> HF bit-exact.
"""

from __future__ import annotations

import pytest
import torch

from miles.trainer import mcore_convert as mc


def _shape(**kw) -> mc.ModelShape:
    base = dict(
        model_type="llama",
        num_layers=2,
        hidden_size=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=1,
        ffn_hidden_size=4,
        vocab_size=5,
        tied_embeddings=False,
        qkv_bias=False,
        qk_norm=False,
        norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=64,
    )
    return mc.ModelShape(**(base | kw))


def test_qkv_rows_are_grouped_by_kv_head():
    s = _shape()  # 4 query heads in 2 groups, head_dim 1: rows are heads
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = mc.fuse_qkv(q, k, v, s)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert [t.flatten().tolist() for t in mc.split_qkv(fused, s)] == [[10, 11, 12, 13], [20, 21], [30, 31]]


def test_fc1_shard_holds_its_gate_rows_then_its_up_rows():
    s = _shape()
    gate = torch.arange(4.0).unsqueeze(1) + 100
    up = torch.arange(4.0).unsqueeze(1) + 200
    hf = {"model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up}
    hf |= {f"model.layers.0.self_attn.{p}_proj.weight": torch.zeros(n, 2) for p, n in (("q", 4), ("k", 2), ("v", 2))}
    hf |= {"model.layers.0.self_attn.o_proj.weight": torch.zeros(2, 2)}
    hf |= {"model.layers.0.mlp.down_proj.weight": torch.zeros(2, 4)}
    hf |= {f"model.layers.0.{n}.weight": torch.ones(2) for n in ("input_layernorm", "post_attention_layernorm")}
    shard = mc.to_mcore(hf, s, layers=range(1), pre=False, post=False, tp_rank=1, tp_size=2)
    assert shard["decoder.layers.0.mlp.linear_fc1.weight"].flatten().tolist() == [102, 103, 202, 203]


def test_vocab_is_padded_to_a_multiple_of_tp():
    assert mc.padded_vocab_size(5, 2) == 6
    assert mc.padded_vocab_size(6, 2) == 6
    assert mc.padded_vocab_size(7, 1) == 7


def test_unsupported_configs_are_refused():
    from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig

    with pytest.raises(ValueError, match="model_type='mixtral'"):
        mc.model_shape(MixtralConfig())
    with pytest.raises(ValueError, match="mlp_only_layers"):
        mc.model_shape(Qwen3MoeConfig(mlp_only_layers=[0]))
    with pytest.raises(ValueError, match="rope type 'llama3'"):
        mc.model_shape(
            LlamaConfig(
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 5e5,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                }
            )
        )
    with pytest.raises(ValueError, match="does not divide the model's 2 layers"):
        mc.stage_layers(2, 3, 0)
    with pytest.raises(ValueError, match="must divide the model's 2 KV heads"):
        mc.to_mcore({}, _shape(), layers=range(0), pre=False, post=False, tp_rank=0, tp_size=4)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def hf_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import make_tiny_model

    # an odd vocabulary, so two tensor-parallel ranks need a padding row
    path = make_tiny_model(str(tmp_path_factory.mktemp(request.param)), arch=request.param, vocab=515)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _round_trip(hf: dict[str, torch.Tensor], s: mc.ModelShape, tp: int, pp: int) -> dict[str, torch.Tensor]:
    stages = []
    for pp_rank in range(pp):
        layers = mc.stage_layers(s.num_layers, pp, pp_rank)
        kw = dict(layers=layers, pre=pp_rank == 0, post=pp_rank == pp - 1)
        stages.append([mc.to_mcore(hf, s, tp_rank=r, tp_size=tp, **kw) for r in range(tp)])
    out = {}
    for pp_rank, mname, hnames in mc.hf_export_names(s, pp):
        full = mc.gather_shards(mname, [shard[mname] for shard in stages[pp_rank]])
        for name, t in mc.to_hf(mname, full, hnames, s):
            assert name not in out, f"{name} exported twice"
            out[name] = t
    return out


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_bit_exact(hf_model, tp, pp):
    s = mc.model_shape(hf_model.config)
    hf = {n: p.detach() for n, p in hf_model.named_parameters()}  # tied weights appear once, as in HF files
    back = _round_trip(hf, s, tp, pp)
    assert sorted(back) == sorted(hf), "exported names differ from the HF model's"
    for name, t in hf.items():
        assert back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name


def test_shapes_per_family(hf_model):
    s = mc.model_shape(hf_model.config)
    family = hf_model.config.model_type
    assert s.qkv_bias == (family == "qwen2")
    assert s.qk_norm == (family == "qwen3")
    assert s.tied_embeddings == (family != "llama")
    shard = mc.to_mcore(
        {n: p.detach() for n, p in hf_model.named_parameters()},
        s,
        layers=range(2),
        pre=True,
        post=True,
        tp_rank=0,
        tp_size=2,
    )
    qkv_rows = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    assert shard["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (qkv_rows // 2, s.hidden_size)
    assert shard["embedding.word_embeddings.weight"].shape == (516 // 2, s.hidden_size)
    assert ("output_layer.weight" in shard) == (family == "llama")
    assert ("decoder.layers.1.self_attention.q_layernorm.weight" in shard) == (family == "qwen3")


def test_hf_shape_knows_every_exported_tensor(hf_model):
    s = mc.model_shape(hf_model.config)
    params = dict(hf_model.named_parameters())
    names = [h for _, _, hnames in mc.hf_export_names(s, 2) for h in hnames]
    assert sorted(names) == sorted(params)
    for name in names:
        assert mc.hf_shape(name, s) == tuple(params[name].shape), name
