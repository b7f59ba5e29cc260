"""Config: YAML + CLI merging, the four-knob invariant, derived defaults and start-up validation."""

from __future__ import annotations

import re

import pytest
import yaml

from miles.config import (
    FIELD_SECTIONS,
    FIELDS,
    ConfigError,
    MilesConfig,
    derive_num_rollout,
    engine_dtype,
    load_config,
)

from harness import minimal_train_args  # isort: skip

REQUIRED = minimal_train_args(rollout_batch_size=None)


def cfg_of(*argv: str, **kw) -> MilesConfig:
    return load_config([*REQUIRED, *argv], **kw)


def errors_of(*argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        cfg_of(*argv)
    return str(info.value)


def knobs(cfg: MilesConfig) -> tuple:
    r = cfg.rollout
    return r.rollout_batch_size, r.n_samples_per_prompt, r.global_batch_size, r.num_steps_per_rollout


# ---------------------------------------------------------------- four-knob invariant


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # (rbs, n, gbs, steps); the missing one is derived, checked by hand: 8*4 = 16*2, 6*4 = 8*3
        (["--n-samples-per-prompt", "4", "--global-batch-size", "16", "--num-steps-per-rollout", "2"], (8, 4, 16, 2)),
        (["--rollout-batch-size", "8", "--global-batch-size", "16", "--num-steps-per-rollout", "2"], (8, 4, 16, 2)),
        (["--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2"], (8, 4, 16, 2)),
        (["--rollout-batch-size", "6", "--n-samples-per-prompt", "4", "--global-batch-size", "8"], (6, 4, 8, 3)),
    ],
    ids=["rollout_batch_size", "n_samples_per_prompt", "global_batch_size", "num_steps_per_rollout"],
)
def test_three_knobs_derive_the_fourth(argv, expected):
    assert knobs(cfg_of(*argv)) == expected


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--rollout-batch-size", "8"], (8, 1, 8, 1)),  # n defaults to 1, one step per rollout
        (["--rollout-batch-size", "8", "--n-samples-per-prompt", "4"], (8, 4, 32, 1)),
        (["--rollout-batch-size", "8", "--global-batch-size", "4"], (8, 1, 4, 2)),
        (["--global-batch-size", "16", "--n-samples-per-prompt", "4"], (4, 4, 16, 1)),
    ],
)
def test_fewer_than_three_knobs_use_defaults_then_derive(argv, expected):
    assert knobs(cfg_of(*argv)) == expected


def test_four_inconsistent_knobs_name_all_values_and_the_equation():
    text = errors_of(
        "--rollout-batch-size",
        "7",
        "--n-samples-per-prompt",
        "5",
        "--global-batch-size",
        "11",
        "--num-steps-per-rollout",
        "3",
    )
    for piece in (
        "rollout_batch_size=7",
        "n_samples_per_prompt=5",
        "global_batch_size=11",
        "num_steps_per_rollout=3",
        "35",
        "33",
    ):
        assert piece in text
    assert "rollout_batch_size × n_samples_per_prompt = global_batch_size × num_steps_per_rollout" in text


def test_four_consistent_knobs_are_accepted():
    assert knobs(
        cfg_of(
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "6",
            "--global-batch-size",
            "8",
            "--num-steps-per-rollout",
            "3",
        )
    ) == (4, 6, 8, 3)


def test_indivisible_derivation_reports_the_numbers():
    text = errors_of("--rollout-batch-size", "5", "--n-samples-per-prompt", "3", "--num-steps-per-rollout", "4")
    assert "15" in text and "num_steps_per_rollout=4" in text and "global_batch_size" in text


def test_non_positive_knob_is_rejected():
    assert "--rollout-batch-size=0" in errors_of("--rollout-batch-size", "0")


def test_derive_num_rollout_from_epochs():
    cfg = load_config(
        [
            "--hf-checkpoint",
            "/m",
            "--prompt-data",
            "/p",
            "--rm-type",
            "math",
            "--num-epoch",
            "3",
            "--rollout-batch-size",
            "8",
        ]
    )
    assert cfg.rollout.num_rollout is None
    assert derive_num_rollout(cfg, dataset_len=100) == 37  # 3 * 100 // 8 = 300 // 8
    assert cfg.rollout.num_rollout == 37
    cfg.rollout.num_rollout = None
    with pytest.raises(ConfigError, match="0 rollout steps"):
        derive_num_rollout(cfg, dataset_len=2)


# ---------------------------------------------------------------- derived defaults


def test_derived_defaults():
    cfg = cfg_of("--rollout-batch-size", "4", "--eps-clip", "0.3", "--use-kl-loss", "--kl-loss-coef", "0.01")
    assert cfg.algo.eps_clip_high == 0.3
    assert cfg.rollout.over_sampling_batch_size == 4
    assert cfg.algo.disable_grpo_std_normalization is True  # n_samples_per_prompt == 1
    assert cfg.rollout.rollout_submission_granularity == "group"
    assert cfg.train.offload_train is False
    assert cfg.algo.loss_aggregation == "sample_mean"
    assert cfg.model.ref_load == "/m"
    assert re.fullmatch(r"runs/miles-\d{8}-\d{6}", cfg.runtime.output_dir)


def test_derived_defaults_other_branch():
    cfg = cfg_of(
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--fully-async",
        "--calculate-per-token-loss",
        "--run-name",
        "exp",
        "--rollout-max-context-len",
        "100",
    )
    assert cfg.algo.disable_grpo_std_normalization is False
    assert cfg.rollout.rollout_submission_granularity == "sample"
    assert cfg.algo.loss_aggregation == "token_mean"
    assert cfg.model.ref_load is None  # no KL term
    assert cfg.data.rollout_max_prompt_len == 99
    assert cfg.runtime.output_dir.startswith("runs/exp-")
    assert cfg_of("--rollout-batch-size", "4", "--colocate").train.offload_train is None  # decided at start-up


def test_explicit_values_are_not_overwritten_by_derivations():
    cfg = cfg_of(
        "--rollout-batch-size",
        "4",
        "--eps-clip-high",
        "0.28",
        "--over-sampling-batch-size",
        "6",
        "--no-offload-train",
        "--colocate",
        "--output-dir",
        "/tmp/x",
    )
    assert (cfg.algo.eps_clip_high, cfg.rollout.over_sampling_batch_size) == (0.28, 6)
    assert cfg.train.offload_train is False and cfg.runtime.output_dir == "/tmp/x"


def test_offload_rollout_defaults_to_colocate_and_levels_map_to_engine_tags():
    from miles.config import engine_memory_tags

    colocated = cfg_of("--rollout-batch-size", "4", "--colocate")
    assert colocated.train.offload_rollout is None  # colocated: decided from the GPUs' memory at start-up
    assert engine_memory_tags(colocated.train.offload_rollout_level) == ["kv_cache", "weights"]
    assert cfg_of("--rollout-batch-size", "4").train.offload_rollout is False
    kv_only = cfg_of("--rollout-batch-size", "4", "--colocate", "--offload-rollout-level", "kv_cache")
    assert engine_memory_tags(kv_only.train.offload_rollout_level) == ["kv_cache"]
    assert "--offload-rollout-level weights_and_kv" in errors_of("--offload-rollout-level", "weights_and_kv")


# ---------------------------------------------------------------- validation


VALIDATIONS = [
    (["--fully-async", "--colocate"], ["--fully-async", "--colocate"]),
    (
        ["--pause-generation-mode", "abort", "--use-session-server"],
        ["--pause-generation-mode", "abort", "--use-session-server"],
    ),
    (["--fully-async", "--pause-generation-mode", "abort"], ["--fully-async", "abort"]),
    (["--fully-async", "--partial-rollout"], ["--fully-async", "--partial-rollout"]),
    (["--update-weight-transfer-mode", "disk-delta", "--colocate"], ["disk-delta", "--colocate"]),
    (["--update-weight-transfer-mode", "p2p", "--colocate"], ["p2p", "--colocate"]),
    (["--global-batch-size", "2", "--actor-num-gpus-per-node", "4"], ["--global-batch-size=2", "4"]),
    (
        ["--global-batch-size", "6", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2"],
        ["--global-batch-size=6", "multiple of 4"],
    ),
    (["--advantage-estimator", "reinforce_plus_plus"], ["reinforce_plus_plus", "--normalize-advantages"]),
    (
        ["--advantage-estimator", "reinforce_plus_plus_baseline"],
        ["reinforce_plus_plus_baseline", "--normalize-advantages"],
    ),
    (["--use-rollout-logprobs", "--use-tis"], ["--use-rollout-logprobs", "--use-tis"]),
    (["--kl-coef", "0.1", "--kl-loss-coef", "0.1"], ["--kl-coef=0.1", "--kl-loss-coef=0.1"]),
    (["--use-dynamic-batch-size"], ["--use-dynamic-batch-size", "--max-tokens-per-gpu"]),
    (["--over-sampling-batch-size", "4"], ["--over-sampling-batch-size=4", "--rollout-batch-size=8"]),
    (["--eps-clip-c", "1.0"], ["--eps-clip-c=1.0"]),
    (["--advantage-estimator", "ppo", "--kl-coef", "0.05"], ["--advantage-estimator=ppo", "--kl-coef=0.05"]),
    (
        ["--rollout-max-prompt-len", "100", "--rollout-max-context-len", "100"],
        ["--rollout-max-prompt-len=100", "--rollout-max-context-len=100", "99"],
    ),
    (["--loss-type", "custom_loss"], ["--custom-loss-function-path"]),
    (["--group-rm"], ["--group-rm", "--custom-rm-path"]),
    (["--eval-prompt-data", "gsm8k"], ["--eval-prompt-data"]),
    (
        ["--calculate-per-token-loss", "--loss-aggregation", "sample_mean"],
        ["--calculate-per-token-loss", "sample_mean"],
    ),
]


@pytest.mark.parametrize(("argv", "needles"), VALIDATIONS, ids=[" ".join(a) for a, _ in VALIDATIONS])
def test_invalid_combination_is_named(argv, needles):
    text = errors_of("--rollout-batch-size", "8", *argv)
    for needle in needles:
        assert needle in text, f"{needle!r} missing from: {text}"


ENUMS = [
    "advantage_estimator",
    "loss_type",
    "kl_loss_type",
    "pause_generation_mode",
    "update_weight_transfer_mode",
    "tis_mode",
    "engine",
    "train_backend",
    "reward_phase",
    "eval_mode",
    "async_unused_samples_handler",
    "async_staleness_policy",
    "loss_aggregation",
    "rollout_submission_granularity",
]


@pytest.mark.parametrize("name", ENUMS)
def test_unknown_enum_value_is_named(name):
    text = errors_of("--rollout-batch-size", "8", FIELDS[name].flag, "bogus_value")
    assert f"{FIELDS[name].flag}='bogus_value'" in text


def test_enum_suggests_the_closest_value():
    assert "did you mean 'grpo'" in errors_of("--rollout-batch-size", "8", "--advantage-estimator", "grp")


def test_lora_rank_check_is_keyed_on_the_field(monkeypatch):
    from miles.config import check_modes

    cfg = cfg_of("--rollout-batch-size", "8", "--update-weight-transfer-mode", "disk-delta")
    assert check_modes(cfg) == []
    # Until LoRA adds a `lora_rank` field the check is dormant; once a section has one, it applies.
    monkeypatch.setitem(FIELDS, "lora_rank", FIELDS["seed"])  # any train-section spec: only .section is read
    monkeypatch.setitem(FIELD_SECTIONS, "lora_rank", "train")
    cfg.train.lora_rank = 8
    assert any("--lora-rank" in e and "disk-delta" in e for e in check_modes(cfg))
    cfg.train.lora_rank = 0
    assert check_modes(cfg) == []


def test_missing_train_inputs_are_all_listed_at_once():
    with pytest.raises(ConfigError) as info:
        load_config([])
    text = str(info.value)
    for needle in (
        "--hf-checkpoint",
        "--prompt-data",
        "--rm-type",
        "--custom-rm-path",
        "--rollout-batch-size",
        "--num-rollout",
        "--num-epoch",
    ):
        assert needle in text
    assert len(info.value.errors) == 5
    load_config([], for_train=False)  # the same settings are fine outside training


def test_all_problems_are_collected_in_one_error():
    with pytest.raises(ConfigError) as info:
        cfg_of(
            "--rollout-batch-size",
            "8",
            "--fully-async",
            "--colocate",
            "--use-rollout-logprobs",
            "--use-tis",
            "--eps-clip-c",
            "0.5",
        )
    assert len(info.value.errors) == 3


# ---------------------------------------------------------------- YAML and command line


def test_yaml_flat_nested_and_cli_precedence(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "hf-checkpoint": "/yaml-model",
                "prompt_data": "/yaml.jsonl",
                "rollout": {"rollout_batch_size": 8, "n-samples-per-prompt": 4},
                "algo": {"eps_clip": 0.1},
                "async": {"max_weight_staleness": 2},
                "engine": "embedded",
                "rm_type": "math",
                "num_rollout": 2,
                "lr": "1e-5",  # PyYAML reads this as a string; it must still become a float
            }
        )
    )
    cfg = load_config(["--config", str(path), "--eps-clip", "0.3", "--hf-checkpoint", "/cli-model"])
    assert cfg.model.hf_checkpoint == "/cli-model"  # CLI wins
    assert cfg.data.prompt_data == "/yaml.jsonl"
    assert knobs(cfg) == (8, 4, 32, 1)
    assert cfg.algo.eps_clip == 0.3
    assert cfg.async_.max_weight_staleness == 2
    assert cfg.train.lr == 1e-5 and isinstance(cfg.train.lr, float)


def test_yaml_errors_name_key_and_suggestion(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout_bach_size: 8\nrollout:\n  lr: 0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config(["--config", str(path)])
    text = str(info.value)
    assert "rollout_bach_size" in text and "--rollout-batch-size" in text
    assert "'lr'" in text and "'train'" in text
    path.write_text("rollout_batch_size: many\n")
    with pytest.raises(ConfigError, match="rollout_batch_size expects int, got 'many'"):
        load_config(["--config", str(path)])


def test_unknown_flag_names_the_closest_valid_one():
    text = errors_of("--rollout-batch-size", "8", "--n-sample-per-prompt", "4")
    assert "--n-sample-per-prompt" in text and "closest valid flag: --n-samples-per-prompt" in text


def test_bad_value_on_the_command_line_is_a_config_error():
    assert "--rollout-batch-size" in errors_of("--rollout-batch-size", "eight")


def test_bool_and_list_flags():
    cfg = cfg_of(
        "--rollout-batch-size",
        "8",
        "--rollout-shuffle",
        "--no-use-tensorboard",
        "--rollout-stop-token-ids",
        "1",
        "2",
        "--rollout-stop",
        "</s>",
        "--ref-load",
        "none",
    )
    assert cfg.data.rollout_shuffle is True and cfg.logging.use_tensorboard is False
    assert cfg.rollout.rollout_stop_token_ids == [1, 2] and cfg.rollout.rollout_stop == ["</s>"]
    assert cfg.model.ref_load is None


def test_sglang_passthrough_from_cli_and_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("sglang:\n  log_level: warning\n  context_length: 1024\nsglang-chunked-prefill-size: 512\n")
    cfg = cfg_of(
        "--config",
        str(path),
        "--rollout-batch-size",
        "8",
        "--sglang-mem-fraction-static",
        "0.7",
        "--sglang-enable-dp-attention",
        "--sglang-log-level=info",
        "--sglang-server-concurrency",
        "16",
        "--engine",
        "sglang",
    )
    assert cfg.engine.sglang_args == {
        "log_level": "info",  # CLI over YAML
        "context_length": 1024,
        "chunked_prefill_size": 512,
        "mem_fraction_static": 0.7,
        "enable_dp_attention": True,
    }
    assert cfg.rollout.sglang_server_concurrency == 16  # a Miles flag, not passed through


def test_sglang_flags_miles_sets_itself_are_rejected():
    text = errors_of("--rollout-batch-size", "8", "--sglang-port", "30000", "--sglang-tp-size", "2")
    assert "--sglang-port" in text and "--sglang-tp-size" in text and "--rollout-num-gpus-per-engine" in text


def test_the_embedded_engine_refuses_sglang_flags_it_does_not_read():
    text = errors_of("--rollout-batch-size", "8", "--sglang-mem-fraction-static", "0.7", "--sglang-log-level", "info")
    assert "--sglang-mem-fraction-static, --sglang-log-level: the embedded engine reads no such SGLang flag" in text
    assert "--sglang-kv-cache-dtype and --sglang-dtype" in text  # the flags it does read
    assert "--engine sglang" in text
    cfg = cfg_of("--rollout-batch-size", "8", "--sglang-disable-cuda-graph", "--sglang-dtype", "float32")
    assert cfg.engine.sglang_args == {"disable_cuda_graph": True, "dtype": "float32"}


@pytest.mark.parametrize("value", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_the_embedded_engine_reads_sglang_kv_cache_dtype(value):
    from miles.workers.rollout_worker import embedded_options

    cfg = cfg_of("--rollout-batch-size", "8", "--sglang-kv-cache-dtype", value)
    assert cfg.engine.engine == "embedded" and cfg.engine.sglang_args == {"kv_cache_dtype": value}
    assert embedded_options(cfg.engine.sglang_args) == {"kv_cache_dtype": value}


def test_a_kv_cache_dtype_the_embedded_engine_does_not_store_is_refused_with_the_accepted_ones():
    text = errors_of("--rollout-batch-size", "8", "--sglang-kv-cache-dtype", "fp8")
    assert (
        "--sglang-kv-cache-dtype='fp8': the embedded engine stores its KV cache as auto, fp8_e4m3, fp8_e5m2; "
        "use one of them or --engine sglang"
    ) in text
    assert "reads no such SGLang flag" not in text  # it reads the flag; only the value is refused
    # SGLang's own server takes values the embedded engine does not (its check is SGLang's)
    cfg = cfg_of("--rollout-batch-size", "8", "--engine", "sglang", "--sglang-kv-cache-dtype", "fp4_e2m1")
    assert cfg.engine.sglang_args == {"kv_cache_dtype": "fp4_e2m1"}


def test_sglang_flags_are_refused_when_the_run_starts_no_engine():
    external = (
        "--rollout-batch-size",
        "8",
        "--rollout-external-engine-addrs",
        "http://h:1",
        "--rollout-num-engines",
        "0",
    )
    text = errors_of(*external, "--engine", "sglang", "--sglang-mem-fraction-static", "0.5")
    assert "--sglang-mem-fraction-static: this run starts no engine (every engine is external" in text
    # what the external engines compute in still sets the dtype weights travel in
    assert cfg_of(*external, "--engine", "sglang", "--sglang-dtype", "float32").engine.sglang_args == {
        "dtype": "float32"
    }
    mixed = cfg_of("--rollout-batch-size", "8", "--rollout-external-engine-addrs", "http://h:1", "--engine", "sglang",
                   "--sglang-mem-fraction-static", "0.5")  # fmt: skip
    assert mixed.engine.sglang_args == {"mem_fraction_static": 0.5}  # the local engine reads it
    text = errors_of("--rollout-batch-size", "8", "--debug-train-only", "--sglang-dtype", "float32")
    assert "--sglang-dtype: this run starts no engine (it has no engine)" in text


@pytest.mark.parametrize(
    ("given", "expected"),
    [(None, "auto"), ("float", "float32"), ("half", "float16"), ("bfloat16", "bfloat16"), ("auto", "auto")],
)
def test_engine_dtype_is_sglang_dtype_else_the_trainers(given, expected):
    argv = ["--rollout-batch-size", "8"] + (["--sglang-dtype", given] if given else [])
    cfg = cfg_of(*argv)
    assert engine_dtype(cfg.model.dtype, cfg.engine.sglang_args) == expected
    assert engine_dtype("float32", {}) == "float32"


def test_an_unknown_sglang_dtype_is_refused():
    text = errors_of("--rollout-batch-size", "8", "--sglang-dtype", "fp8")
    assert "--sglang-dtype='fp8' is not one of SGLang's: auto, half, float16, bfloat16, float, float32" in text


def test_flat_namespace_has_every_field():
    cfg = cfg_of("--rollout-batch-size", "8")
    args = cfg.flat()
    assert set(vars(args)) == set(FIELDS)
    assert args.rollout_batch_size == 8 and args.hf_checkpoint == "/m" and args.fully_async is False


def test_to_dict_round_trips_through_yaml(tmp_path):
    cfg = cfg_of(
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "2", "--engine", "sglang", "--sglang-log-level", "info"
    )  # fmt: skip
    path = tmp_path / "resolved.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    again = load_config(["--config", str(path)])
    assert again.to_dict() == cfg.to_dict()


def test_indivisible_group_size_derivation_reports_the_numbers():
    text = errors_of("--rollout-batch-size", "8", "--global-batch-size", "6", "--num-steps-per-rollout", "1")
    assert "cannot derive n_samples_per_prompt" in text and "= 6 is not divisible by rollout_batch_size=8" in text
