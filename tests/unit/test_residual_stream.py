"""--fp32-residual-connection: a bf16 transformers decoder with an fp32 residual stream scores tokens exactly as
the embedded engine's bf16 forward (whose stream is fp32) on the same weights, where its own bf16 stream does
not; the stream between the layers really is fp32; decoders of another layout are refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from miles.engines.embedded.model import CausalLM
from miles.models.tiny import make_tiny_model
from miles.trainer.residual_stream import keep_fp32_residual

from bench_modules import load_bench  # isort: skip  (same folder, rootdir on sys.path)

engine_logprobs = load_bench("residual_stream").token_logprobs  # teacher-forced, the engine's eager forward


@torch.no_grad()
def hf_logprobs(model: nn.Module, seqs: torch.Tensor) -> torch.Tensor:
    logits = model(seqs).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)


@pytest.fixture(params=["qwen2", "qwen3", "qwen3_moe"])
def tiny(request, tmp_path):
    torch.manual_seed(0)
    return request.param, make_tiny_model(
        tmp_path / request.param, arch=request.param, layers=6, hidden=128, heads=4, kv_heads=2,
        intermediate=256, init_std=0.02, seed=0,
    )  # fmt: skip


def test_a_bf16_decoder_with_an_fp32_stream_scores_as_the_engine_does(tiny):
    from transformers import AutoModelForCausalLM

    arch, path = tiny
    torch.set_num_threads(1)
    engine = CausalLM.from_pretrained(path, torch.device("cpu"), torch.bfloat16)
    assert engine.fp32_residual  # the engine's default for a bf16 model
    seqs = torch.randint(3, engine.spec.vocab_size, (4, 40), generator=torch.Generator().manual_seed(1))
    reference = engine_logprobs(engine, seqs)

    def load():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()

    plain = (hf_logprobs(load(), seqs) - reference).abs()
    assert plain.max() > 0, f"{arch}: a bf16 stream should round differently from the engine's fp32 one"

    model = load()
    keep_fp32_residual(model, torch.bfloat16)
    streams = []
    model.model.layers[2].register_forward_hook(
        lambda _m, _a, out: streams.append(out[0] if isinstance(out, tuple) else out)
    )
    model.train()  # transformers resets kernel-hooked forwards on a mode change: the stream must survive it
    model.eval()
    matched = (hf_logprobs(model, seqs) - reference).abs()
    assert streams and streams[0].dtype == torch.float32  # between the layers the stream is fp32
    assert matched.max() == 0, f"{arch}: {matched.max():.3e} (bf16 stream: {plain.max():.3e})"
    assert model.lm_head.weight.dtype == torch.bfloat16  # the parameters and their GEMMs stay bf16


def test_fp32_compute_is_left_as_it_is_and_other_layouts_are_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "m", arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hooks = len(model.model.embed_tokens._forward_hooks)
    keep_fp32_residual(model, torch.float32)
    assert len(model.model.embed_tokens._forward_hooks) == hooks and type(model.model.norm).__name__ == "Qwen2RMSNorm"

    model.model.layers[1].post_attention_layernorm = nn.LayerNorm(64)  # not an RMSNorm of a known decoder
    with pytest.raises(ValueError, match="--fp32-residual-connection supports .* has LayerNorm"):
        keep_fp32_residual(model, torch.bfloat16)


def test_the_flag_is_refused_beside_the_true_on_policy_mode():
    from miles.config import ConfigError, load_config

    from harness import minimal_train_args  # isort: skip

    assert load_config([*minimal_train_args(), "--fp32-residual-connection"]).train.fp32_residual_connection
    with pytest.raises(ConfigError, match="--fp32-residual-connection with --true-on-policy-mode"):
        load_config([*minimal_train_args(), "--fp32-residual-connection", "--true-on-policy-mode"])
