"""--fp8-format e4m3: the trainer's decoder projections compute as the FP8 engine's GEMMs, with the engine's own
quantizer: with the fp32 residual stream too, a bf16 decoder scores tokens bit-equal to the FP8-served engine
(whole and partial 128-blocks); the backward is straight through; where it cannot act it is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_residual_stream import engine_logprobs, hf_logprobs
from torch import nn

from miles.engines.embedded import fp8
from miles.engines.embedded.model import CausalLM
from miles.models.tiny import make_tiny_model
from miles.trainer.fp8_forward import Fp8BlockwiseLinear, use_fp8_forward
from miles.trainer.residual_stream import keep_fp32_residual


@pytest.mark.parametrize("hidden,intermediate", [(128, 256), (192, 320)])  # 192, 320: partial blocks
def test_the_trainer_scores_as_the_fp8_engine(tmp_path, hidden, intermediate):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path = make_tiny_model(
        tmp_path / "m", arch="qwen2", layers=3, hidden=hidden, heads=4, kv_heads=2, intermediate=intermediate,
        init_std=0.02, seed=0,
    )  # fmt: skip
    engine = CausalLM.from_pretrained(path, torch.device("cpu"), torch.bfloat16)
    engine.quantize_fp8()
    seqs = torch.randint(3, engine.spec.vocab_size, (3, 32), generator=torch.Generator().manual_seed(2))
    reference = engine_logprobs(engine, seqs)

    def gap(*setups) -> float:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
        for setup in setups:
            setup(model)
        return float((hf_logprobs(model, seqs) - reference).abs().max())

    bf16 = gap()
    quantized = gap(use_fp8_forward)
    assert 0 < quantized < bf16  # the quantized forward is closer; the bf16 stream still rounds differently
    assert gap(use_fp8_forward, lambda m: keep_fp32_residual(m, torch.bfloat16)) == 0


def test_the_backward_is_straight_through():
    torch.manual_seed(0)
    layer = nn.Linear(200, 136, bias=True)  # neither dimension whole 128-blocks
    layer.__class__ = Fp8BlockwiseLinear
    x = torch.randn(5, 200, requires_grad=True)
    out = layer(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    xq, xs = fp8.quantize_activation(x.detach())
    xd = xq.float() * xs.repeat_interleave(fp8.BLOCK, 1)[:, :200]
    wd = fp8.dequantize_weight(*fp8.quantize_weight(layer.weight.detach()))
    assert torch.equal(out.detach(), F.linear(xd, wd) + layer.bias.detach())  # the engine's product
    torch.testing.assert_close(x.grad, grad @ wd)  # the quantizer's gradient taken as the identity
    torch.testing.assert_close(layer.weight.grad, grad.t() @ xd)
    torch.testing.assert_close(layer.bias.grad, grad.sum(0))


def test_a_bf16_layer_keeps_only_its_input_and_weight_for_the_backward():
    """No fp32 copy of the weight or the activation waits for the backward (a plain linear keeps the same
    two), and the bf16 gradients are the straight-through ones to bf16 precision."""
    torch.manual_seed(0)
    layer = nn.Linear(256, 384, bias=False).to(torch.bfloat16)
    layer.__class__ = Fp8BlockwiseLinear
    x = torch.randn(7, 256, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    assert sorted((tuple(t.shape), t.dtype) for t in saved) == [
        ((7, 256), torch.bfloat16),
        ((384, 256), torch.bfloat16),
    ]
    grad = torch.randn_like(out)
    out.backward(grad)
    xd = fp8.dequantize_activation(x.detach())
    wd = fp8.dequantize_weight(*fp8.quantize_weight(layer.weight.detach()))
    torch.testing.assert_close(x.grad.float(), grad.float() @ wd, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(layer.weight.grad.float(), grad.float().t() @ xd, rtol=2e-2, atol=2e-2)


def test_refusals():
    from miles.config import ConfigError, load_config

    from harness import minimal_train_args  # isort: skip

    with pytest.raises(ValueError, match="none of the projections"):
        use_fp8_forward(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="--fp8-recipe 'tensorwise'"):
        use_fp8_forward(nn.Sequential(nn.Linear(4, 4)), "tensorwise")
    base = [*minimal_train_args(), "--fp8-format", "e4m3"]
    with pytest.raises(ConfigError, match="the engines serve the model's dtype"):
        load_config(base)
    with pytest.raises(ConfigError, match="--fp8-format e4m3 with --train-backend megatron"):
        load_config([*base, "--sglang-quantization", "fp8", "--train-backend", "megatron"])
    cfg = load_config([*base, "--sglang-quantization", "fp8"])
    assert (cfg.train.fp8_format, cfg.train.fp8_recipe) == ("e4m3", "blockwise")
