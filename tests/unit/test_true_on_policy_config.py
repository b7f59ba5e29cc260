"""--true-on-policy-mode: what it implies, what it refuses, and how both sides' workers are set up."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, load_config
from miles.controller.placement import plan_placement

from harness import installed  # isort: skip

BASE = (
    "--hf-checkpoint /m --prompt-data /p.jsonl --rm-type math --num-rollout 2 --rollout-batch-size 4 "
    "--n-samples-per-prompt 2 --true-on-policy-mode"
).split()


def errors_of(*argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config([*BASE, *argv])
    return str(info.value)


def test_the_mode_rescores_every_sample_by_prefill():
    assert load_config(BASE).rollout.recompute_logprobs_via_prefill


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--engine", "sglang"], "needs the embedded engine"),
        (["--rollout-external-engine-addrs", "http://h:1"], "needs the embedded engine"),
        (["--fully-async"], "drop --fully-async"),
        (["--compile"], "drop --compile"),
        (["--rollout-function-path", "m.f"], "which --rollout-function-path replaces"),
        (["--lora-rank", "4"], "add --lora-merged-forward (the trainer then computes with the merged weight)"),
        (["--loss-type", "sft_loss"], "SFT has no rollout"),
        (["--sglang-dtype", "float32"], "runs the engine in the trainer's --dtype=auto; drop --sglang-dtype=float32"),
        (["--sglang-kv-cache-dtype", "fp8_e4m3"], "--sglang-kv-cache-dtype=fp8_e4m3 with --true-on-policy-mode"),
        (["--sglang-kv-cache-dtype", "fp8_e5m2"], "--sglang-kv-cache-dtype=fp8_e5m2 with --true-on-policy-mode"),
        (
            ["--actor-num-gpus-per-node", "2", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"],
            "fixed --micro-batch-size",
        ),
    ],
)
def test_what_the_mode_cannot_make_exact_is_refused(argv, needle):
    assert needle in errors_of(*argv)


@pytest.mark.skipif(not installed("peft"), reason="--lora-rank needs peft")
def test_lora_is_accepted_where_the_trainer_computes_on_the_merged_weight():
    cfg = load_config([*BASE, "--lora-rank", "4", "--lora-merged-forward"])
    assert cfg.train.true_on_policy_mode and cfg.train.lora_merged_forward


def test_a_kv_cache_in_the_models_dtype_is_accepted():
    assert load_config([*BASE, "--sglang-kv-cache-dtype", "auto"]).engine.sglang_args == {"kv_cache_dtype": "auto"}


def test_one_rank_may_keep_dynamic_micro_batches():
    cfg = load_config([*BASE, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"])
    assert cfg.train.use_dynamic_batch_size


@pytest.mark.parametrize(("device", "dtype"), [("cpu", "float32"), ("cuda", "bfloat16")])
def test_workers_of_both_sides_get_the_mode(device, dtype, monkeypatch):
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)  # the default, as a controller that set none
    cfg = load_config(BASE)
    gpus = {"num_nodes": 1, "gpus_per_node": 2} if device == "cuda" else {}
    plan = plan_placement(cfg, device=device, master_port=29500, **gpus)
    (trainer,), (engine,) = plan.trainer_specs, plan.rollout_specs
    assert engine.init_kwargs["true_on_policy"] and engine.init_kwargs["dtype"] == dtype
    cublas = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CUBLASLT_WORKSPACE_SIZE": "32768"} if device == "cuda" else {}
    for spec in (trainer, engine):  # cuBLAS deterministic, and cuBLASLt choosing within the same workspace
        assert {k: v for k, v in spec.env.items() if k.startswith("CUBLAS")} == cublas
    explicit = plan_placement(load_config([*BASE, "--dtype", "float16"]), device=device, master_port=29500, **gpus)
    assert explicit.rollout_specs[0].init_kwargs["dtype"] == "float16"
