"""FP8 serving on CPU: `miles convert fp8`, the engine on its output (W8A8 emulated), a weight push into
it checked within the quantization error, and the config's FP8 defaults."""

import json
import os

import pytest
import torch
from harness import with_engine

from miles.cli import main as miles_main
from miles.config import ConfigError, load_config
from miles.engines.embedded import fp8
from miles.engines.embedded.checkpoint import iter_safetensors
from miles.models.tiny import make_tiny_model
from miles.weights import verify
from miles.weights.receiver import WeightReceiver
from miles.workers.rollout_worker import embedded_options

torch.set_num_threads(1)
SHAPES = {
    # every projection a whole number of 128-row blocks (k/v: 2 heads x 64), as in most real checkpoints
    "whole_blocks": {"hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 256, "layers": 2},
    # SmolLM2's kind: q 192 rows, k and v 64, gate and up 320, hidden 192 (no part and no K in whole blocks)
    "partial_blocks": {"hidden": 192, "heads": 3, "kv_heads": 1, "intermediate": 320, "layers": 2},
}


@pytest.fixture(scope="module", params=list(SHAPES))
def dirs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    shape = SHAPES[request.param]
    bf16 = make_tiny_model(str(root / "bf16"), arch="qwen2", init_std=0.02, seed=0, **shape)
    other = make_tiny_model(str(root / "other"), arch="qwen2", init_std=0.02, seed=1, **shape)
    assert miles_main(["convert", "fp8", bf16, str(root / "fp8")]) == 0
    return {"bf16": bf16, "other": other, "fp8": str(root / "fp8"), "shape": shape}


def _run(path: str, body, **kwargs):
    return with_engine(body, model_path=path, max_running_requests=4, max_total_tokens=4 * 256, **kwargs)


def test_the_converted_checkpoint_holds_e4m3_blocks_and_its_config_says_so(dirs):
    config = json.load(open(os.path.join(dirs["fp8"], "config.json")))
    assert config["quantization_config"] == fp8.QUANT_CONFIG
    tensors = dict(iter_safetensors(dirs["fp8"]))
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    blocks = -(-dirs["shape"]["hidden"] // 128)  # q is [hidden, hidden]: its blocks, partial ones included
    assert q.dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (blocks, blocks)
    assert tensors["model.embed_tokens.weight"].dtype != torch.float8_e4m3fn  # not a linear layer: kept
    assert os.path.exists(os.path.join(dirs["fp8"], "tokenizer.json"))


def test_the_fp8_engine_scores_and_decodes_close_to_bf16(dirs):
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(0)).tolist()

    async def body(engine):
        scored = await engine.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": 0, "temperature": 1.0},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=1,
        )
        greedy = await engine.generate(
            input_ids=ids[:8], sampling_params={"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 8}
        )
        meta = scored["meta_info"]
        lps = torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"][1:]])
        top1 = [top[0][1] for top in meta["input_top_logprobs"][1:]]  # the greedy pick after each prefix
        return lps, top1, greedy["output_ids"], engine.fp8, engine.model.storage

    lp8, top8, greedy8, is_fp8, storage = _run(dirs["fp8"], body)
    lp16, top16, greedy16, _, _ = _run(dirs["bf16"], body)
    lp_other, _, _, _, _ = _run(dirs["other"], body)
    lp_online, _, _, online, _ = _run(dirs["bf16"], body, quantization="fp8")  # SGLang's --quantization fp8
    assert is_fp8 and isinstance(storage["model.layers.0.self_attn.[qkv].weight"], fp8.Fp8Weight)
    fp8_gap, model_gap = (lp8 - lp16).abs().mean(), (lp_other - lp16).abs().mean()
    assert 0 < fp8_gap < model_gap / 10, (fp8_gap, model_gap)  # quantized, yet far closer than another model
    agree = sum(a == b for a, b in zip(top8, top16, strict=True)) / len(top16)
    assert agree >= 0.85, agree  # the greedy pick after 39 prefixes
    assert greedy8 == greedy16
    assert online and (lp_online - lp8).abs().max() < fp8_gap / 10  # the same blocks as the converted checkpoint


def test_a_push_into_the_fp8_engine_passes_the_check_within_quant_error_and_a_wrong_tensor_fails(dirs):
    pushed = [(n, t.to(torch.bfloat16)) for n, t in iter_safetensors(dirs["other"])]
    sketches: dict = {}
    stream = verify.sketching(pushed, sketches)

    async def body(engine):
        receiver = WeightReceiver(engine)
        await receiver.weights_checker("fill_noise", seed=3)
        noisy = await receiver.weights_checker("compare", sketches=sketches or {"x": []})
        engine.load_weights(stream)  # quantized per block on the engine's device, tensor by tensor
        ok = await receiver.weights_checker("compare", sketches=sketches)
        wrong = "model.layers.1.mlp.down_proj.weight"
        engine.load_weights([(wrong, dict(pushed)[wrong] * 1.5)])
        bad = await receiver.weights_checker("compare", sketches=sketches)
        return noisy, ok, bad, wrong

    noisy, ok, bad, wrong = _run(dirs["fp8"], body)
    assert noisy["not_sent"]  # before the push: no sketch yet for any tensor
    assert ok == {"mismatched": [], "not_sent": [], "missing": []}
    assert bad["mismatched"] == [wrong]


def test_noise_left_by_a_transport_that_skipped_a_tensor_is_caught(dirs):
    pushed = [(n, t) for n, t in iter_safetensors(dirs["other"])]
    skipped = "model.layers.0.self_attn.o_proj.weight"
    sketches: dict = {}
    sent = list(verify.sketching(pushed, sketches))

    async def body(engine):
        receiver = WeightReceiver(engine)
        await receiver.weights_checker("fill_noise", seed=3)
        engine.load_weights([(n, t) for n, t in sent if n != skipped])
        return await receiver.weights_checker("compare", sketches=sketches)

    assert _run(dirs["fp8"], body)["mismatched"] == [skipped]


def test_fp8_serving_turns_tis_on_unless_set_and_the_quant_error_flag_needs_the_check(dirs, tmp_path):
    base = ["--prompt-data", "/p.jsonl", "--rm-type", "math", "--num-rollout", "3"]
    assert load_config(["--hf-checkpoint", dirs["fp8"], *base], for_train=False).algo.use_tis is True
    assert load_config(["--hf-checkpoint", dirs["bf16"], *base], for_train=False).algo.use_tis is False
    (tmp_path / "no_tis.yaml").write_text("use-tis: false\n")  # bool flags are bare on the command line
    off = load_config(
        ["--config", str(tmp_path / "no_tis.yaml"), "--hf-checkpoint", dirs["fp8"], *base], for_train=False
    )
    assert off.algo.use_tis is False
    assert load_config(["--hf-checkpoint", dirs["fp8"], "--no-use-tis", *base], for_train=False).algo.use_tis is False
    with pytest.raises(ConfigError, match="--check-weight-update-allow-quant-error"):
        load_config(["--hf-checkpoint", dirs["bf16"], "--check-weight-update-allow-quant-error", *base])
    online = load_config(["--hf-checkpoint", dirs["bf16"], "--sglang-quantization", "fp8", *base], for_train=False)
    assert online.algo.use_tis is True and embedded_options(online.engine.sglang_args) == {"quantization": "fp8"}
    with pytest.raises(ConfigError, match="serves fp8 only"):
        load_config(["--hf-checkpoint", dirs["bf16"], "--sglang-quantization", "awq", *base], for_train=False)


def _stored(engine) -> dict[str, torch.Tensor]:
    """The engine's weight bytes: each FP8 weight's e4m3 values and scales, every other tensor as it is."""
    out = {}
    for key, t in engine.model.storage.items():
        if isinstance(t, fp8.Fp8Weight):
            out[key + ".q"], out[key + ".scale_inv"] = t.q.view(torch.uint8).clone(), t.scale_inv.clone()
        else:
            out[key] = t.clone()
    return out


def test_a_direct_colocated_write_stores_what_a_push_stores(dirs):
    """The trainer quantizes each FP8 name per block and writes values and scales into the engine's buffer:
    the same bytes `load_weights` (the per-bucket handoff) leaves, fused parts laid out from block boundaries
    included; the KV computed before is dropped."""
    import asyncio

    from miles.engines.embedded.engine import EmbeddedEngine
    from miles.weights.arena import FP8_BLOCK128
    from miles.weights.buffer_writer import BufferWriter, open_export

    pushed = [(n, t.to(torch.bfloat16)) for n, t in iter_safetensors(dirs["other"])]
    engine = EmbeddedEngine(dirs["fp8"])
    try:
        export = engine.export_weight_buffer()
        names = export["quantized"]["names"]
        assert export["quantized"]["format"] == FP8_BLOCK128
        assert len(names) == 7 * dirs["shape"]["layers"] and all(n + "_scale_inv" in export["tensors"] for n in names)
        epoch = engine.runner.kv_epoch
        with open_export(export) as flat:
            count, _ = BufferWriter(flat, export).write(pushed)
        engine.install_weight_buffer(export["generation"], 2)
        assert count == len(pushed) and engine.runner.kv_epoch > epoch
        direct = _stored(engine)
        engine.load_weights(pushed)
        bucketed = _stored(engine)
        assert direct.keys() == bucketed.keys()
        for key in direct:
            assert torch.equal(direct[key], bucketed[key]), key
        served = {n: (value, bound) for n, value, bound in engine.dequantized_weights()}
        for name, t in pushed:
            value, bound = served[engine.model.canonical_name(name)]
            assert bound is None or (value - t.float()).abs().le(bound).all(), name
    finally:
        asyncio.run(engine.shutdown())


def test_a_writer_refuses_a_storage_format_it_does_not_know(dirs):
    from miles.weights.buffer_writer import BufferWriter

    export = {"tensors": {}, "quantized": {"format": "int4_awq", "names": ["x"]}}
    with pytest.raises(ValueError, match="'int4_awq', which this trainer cannot write"):
        BufferWriter(torch.zeros(8, dtype=torch.uint8), export)


def test_a_colocated_fp8_run_writes_its_pushes_directly(tmp_path):
    """The CPU demo colocated with FP8 serving: every push goes through the direct path (no per-bucket
    `load_weights` on the engine) and passes the weight check within the quantization error."""
    from harness import SMALL_RUN, run_train

    out = tmp_path / "run"
    rows = run_train(out, *SMALL_RUN, "--num-rollout", "2", "--colocate", "--sglang-quantization", "fp8",
                     "--check-weight-update-equal", "--check-weight-update-allow-quant-error")  # fmt: skip
    assert [r["step"] for r in rows if r.get("step", -1) >= 0] == [0, 1]
    engine_log = (out / "logs" / "rollout_0.log").read_text()
    assert "weight_version 2" in engine_log and "loaded " not in engine_log
    assert "per-bucket" not in (out / "logs" / "trainer_0.log").read_text()


def test_a_moe_checkpoint_is_refused_for_fp8_serving_before_any_worker(tmp_path):
    from miles.controller.preflight import PreflightError, check_fp8_model

    moe = make_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe", layers=1, hidden=64, heads=4, kv_heads=2)
    base = {
        "hf_checkpoint": moe,
        "prompt_data": "p.jsonl",
        "rm_type": "math",
        "num_rollout": 1,
        "rollout_batch_size": 2,
    }
    with pytest.raises(PreflightError, match="mixture-of-experts qwen3_moe model .* dense models only"):
        check_fp8_model(load_config(["--sglang-quantization", "fp8"], base=base))
    check_fp8_model(load_config([], base=base))  # bf16 serving: fine
