"""Every flag does what it says: each config field is read outside the config code, or refused.

A Miles launch script ported here must never have a flag silently change meaning. The walk below
finds, for every field, a read of it (`.name` or a `"name"` key) in the package outside the config
modules; a field read nowhere must be listed in `NOT_IMPLEMENTED` (refused at start-up) or below.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from miles.config import FIELDS, NOT_IMPLEMENTED, ConfigError, load_config

PACKAGE = Path(__file__).resolve().parents[2] / "miles"
CONFIG_CODE = PACKAGE / "config"
# read by the config code itself, on behalf of the run (not refused, not ignored)
READ_BY_CONFIG = {
    "num_epoch": "derive_num_rollout turns it into --num-rollout once the dataset length is known",
    "rollout_num_gpus": "resolve_rollout_engines turns it into --rollout-num-engines",
    "opd_type": "check_opd holds it to the teacher flags given (sglang: --opd-teacher-urls, megatron: --opd-teacher-load)",
    "dump_details": "RuntimeConfig.derive turns it into --save-debug-rollout-data DIR/rollout_data/{rollout_id}.pt",
}


def _sources() -> str:
    return "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if CONFIG_CODE not in p.parents)


def test_every_field_is_read_outside_the_config_code_or_refused() -> None:
    text = _sources()
    unread = [
        name
        for name in FIELDS
        if not re.search(rf"(\.|[\"']){name}\b", text) and name not in NOT_IMPLEMENTED and name not in READ_BY_CONFIG
    ]
    assert unread == [], f"fields read nowhere and not refused (refuse them in miles/config/rules/): {unread}"


def test_the_refused_list_names_only_fields() -> None:
    assert set(NOT_IMPLEMENTED) <= set(FIELDS)
    assert set(READ_BY_CONFIG) <= set(FIELDS)


BASE = {"hf_checkpoint": "m", "prompt_data": "p.jsonl", "rm_type": "math", "rollout_batch_size": 2, "num_rollout": 1}


def _refused(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv, base=BASE)
    return str(info.value)


@pytest.mark.parametrize("name", sorted(NOT_IMPLEMENTED))
def test_each_unimplemented_flag_is_refused_by_name(name: str) -> None:
    spec = FIELDS[name]
    argv = [spec.flag] if spec.base is bool else [spec.flag, "7" if spec.base is int else "x"]
    assert spec.flag in _refused(argv)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--fully-async", "--recompute-logprobs-via-prefill"], ["--recompute-logprobs-via-prefill", "--fully-async"]),
        (["--fully-async", "--reward-phase", "separate"], ["--reward-phase=separate", "--fully-async"]),
        (
            ["--fully-async", "--rollout-sample-filter-path", "a.b:c"],
            ["--rollout-sample-filter-path", "--fully-async"],
        ),
        (
            ["--fully-async", "--update-weights-interval", "2"],
            ["--update-weights-interval=2", "--max-weight-staleness"],
        ),
        (["--eval-mode", "dedicated"], ["--eval-mode=dedicated", "--fully-async"]),
        (["--eval-mode", "external"], ["--eval-mode=external", "--fully-async"]),
        (["--eval-num-engines", "1"], ["--eval-num-engines=1", "--eval-mode dedicated"]),
        (["--fully-async", "--eval-num-engines", "1"], ["--eval-num-engines=1"]),
        (["--rollout-num-gpus-per-engine", "2"], ["--rollout-num-gpus-per-engine=2", "--engine sglang"]),
        (["--tensor-model-parallel-size", "2"], ["--tensor-model-parallel-size", "--train-backend megatron"]),
        (["--sequence-parallel"], ["--sequence-parallel", "--train-backend megatron"]),
        (
            ["--train-backend", "megatron", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "3"],
            ["--tensor-model-parallel-size=2", "must divide the 3 trainer GPUs"],
        ),
        (
            ["--train-backend", "megatron", "--context-parallel-size", "2", "--actor-num-gpus-per-node", "2"],
            ["--context-parallel-size=2", "Transformer Engine"],
        ),
        (["--train-backend", "megatron", "--sequence-parallel"], ["--sequence-parallel", "> 1"]),
        (["--train-backend", "megatron", "--advantage-estimator", "ppo"], ["ppo", "--train-backend fsdp"]),
        (["--use-wandb"], ["--use-wandb", "--wandb-project"]),
        (
            ["--train-backend", "megatron", "--use-rollout-routing-replay", "--gradient-checkpointing"],
            ["--use-rollout-routing-replay", "--gradient-checkpointing"],
        ),
        (["--use-routing-replay", "--use-rollout-logprobs"], ["--use-routing-replay", "--use-rollout-logprobs"]),
        (["--use-rollout-routing-replay", "--true-on-policy-mode"], ["--true-on-policy-mode"]),
        (["--train-backend", "megatron", "--attn-implementation", "sdpa"], ["--attn-implementation sdpa", "megatron"]),
        (["--true-on-policy-mode", "--attn-implementation", "miles_varlen"], ["--attn-implementation miles_varlen"]),
        (["--sglang-quantization", "fp8", "--lora-rank", "4"], ["--sglang-quantization fp8 with --lora-rank"]),
        (["--sglang-quantization", "fp8", "--true-on-policy-mode"], ["fp8 with --true-on-policy-mode"]),
        (["--update-weights-interval", "0"], ["--update-weights-interval=0"]),
        (
            ["--colocate", "--update-weights-interval", "2"],
            ["--update-weights-interval=2", "--offload-rollout-level kv_cache"],
        ),
        (
            ["--rollout-num-gpus", "3", "--rollout-num-engines", "2"],
            ["--rollout-num-gpus=3", "--rollout-num-engines=2"],
        ),
    ],
)
def test_flags_refused_in_modes_where_they_cannot_work(argv: list[str], words: list[str]) -> None:
    text = _refused(argv)
    for word in words:
        assert word in text


def test_flags_accepted_in_the_modes_where_they_work() -> None:
    load_config(["--fully-async", "--eval-mode", "dedicated", "--eval-num-engines", "1"], base=BASE)
    load_config(["--colocate", "--update-weights-interval", "2", "--offload-rollout-level", "kv_cache"], base=BASE)
    load_config(["--use-wandb", "--wandb-project", "p"], base=BASE)
    cfg = load_config(["--use-rollout-routing-replay", "--use-rollout-logprobs"], base=BASE)
    assert cfg.train.use_routing_replay  # implied, as in Miles
    load_config(["--use-rollout-routing-replay", "--fully-async"], base=BASE)
    load_config(["--engine", "sglang", "--rollout-num-gpus-per-engine", "2"], base=BASE)
    load_config(
        ["--train-backend", "megatron", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--sequence-parallel", "--actor-num-gpus-per-node", "8", "--global-batch-size", "2"],
        base=BASE,
    )  # fmt: skip


def test_rollout_num_gpus_sets_the_engine_count() -> None:
    cfg = load_config(
        ["--engine", "sglang", "--rollout-num-gpus", "6", "--rollout-num-gpus-per-engine", "2"], base=BASE
    )
    assert cfg.engine.rollout_num_engines == 3
    cfg = load_config(["--rollout-num-gpus", "4", "--rollout-num-engines", "4"], base=BASE)  # agreeing: fine
    assert cfg.engine.rollout_num_engines == 4
    text = _refused(["--engine", "sglang", "--rollout-num-gpus", "5", "--rollout-num-gpus-per-engine", "2"])
    assert "multiple of 2" in text


def test_rollout_num_gpus_under_colocate_is_the_trainers_gpu_count() -> None:
    argv = ["--colocate", "--actor-num-gpus-per-node", "2", "--global-batch-size", "2"]
    cfg = load_config([*argv, "--rollout-num-gpus", "2"], base=BASE)
    assert cfg.engine.rollout_num_engines == 2
    assert "drop it or set it to 2" in _refused([*argv, "--rollout-num-gpus", "4"])


def test_rm_retry_backoff_is_a_field_the_reward_reads() -> None:
    cfg = load_config(["--rm-retry-backoff-s", "0.1"], base=BASE)
    assert cfg.flat().rm_retry_backoff_s == 0.1
    assert "--rm-retry-backoff-s" in _refused(["--rm-retry-backoff-s", "-1"])


def test_update_weights_interval_pushes_every_n_steps_before_eval_and_at_the_end() -> None:
    from types import SimpleNamespace

    from miles.controller.loop_sync import weights_due

    cfg = load_config(["--update-weights-interval", "3", "--num-rollout", "8"], base=BASE)
    evaluator = SimpleNamespace(due=lambda step: step == 5)
    pushed = [step for step in range(1, 9) if weights_due(cfg, evaluator, step)]
    assert pushed == [3, 5, 6, 8]  # every 3rd, before the eval at 5, after the last step


def test_wandb_settings_without_use_wandb_are_refused():
    from miles.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="--wandb-mode without --use-wandb"):
        load_config(["--config", str(PACKAGE.parent / "launch/configs/demo_cpu.yaml"), "--wandb-mode", "offline"])
    cfg = load_config(
        [
            "--config",
            str(PACKAGE.parent / "launch/configs/demo_cpu.yaml"),
            "--use-wandb",
            "--wandb-project",
            "p",
            "--wandb-mode",
            "offline",
        ]
    )
    assert cfg.logging.wandb_mode == "offline"
